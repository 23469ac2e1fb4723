# The canonical image: installs what the README installs, then runs the emulator.
# Build: docker build -t morphling .   (no Docker engine runs in this project's CI)
FROM python:3.11-slim-bookworm

RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential libgomp1 make \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/morphling
COPY pyproject.toml setup.py README.md Makefile ./
COPY morphling ./morphling
COPY kernels ./kernels
COPY proxy ./proxy
COPY devices ./devices
COPY scripts ./scripts

# Same order as `make setup`: the CPU torch wheel first, pinned, so nothing pulls a
# CUDA build; then the package, building its cffi kernels.
RUN python -m pip install --no-cache-dir --upgrade pip setuptools wheel cffi \
    && python -m pip install --no-cache-dir torch==2.13.0 \
        --index-url https://download.pytorch.org/whl/cpu \
    && python -m pip install --no-cache-dir --no-build-isolation ".[torch]" \
    && morphling version -v

# Buffer pools mlock what RLIMIT_MEMLOCK allows; run with --ulimit memlock=-1 to lock all.
EXPOSE 39000
ENTRYPOINT ["morphling"]
CMD ["emulator"]
