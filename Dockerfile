# The canonical image: exactly what the README installs (`make setup`), running the emulator.
#   docker build -t morphling .
#   docker run --ulimit memlock=-1 -p 39000:39000 morphling            # the emulator
#   docker run --ulimit memlock=-1 morphling fleet --server HOST:39000  # any subcommand
# No Docker engine runs in this project's CI; docker-compose.yml puts it behind nginx.
FROM python:3.11-slim-bookworm

# What `make setup` needs: make, a C compiler for the cffi kernels; MKL's OpenMP runtime.
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential make libgomp1 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --create-home --home-dir /var/lib/morphling morphling

WORKDIR /opt/morphling
COPY . .

# `make setup` installs torch==2.13.0 first; this extra index makes that the CPU build
# (2.13.0+cpu satisfies ==2.13.0 and sorts above PyPI's CUDA one), as the README's
# registry does. A build argument: it is not kept in the image.
ARG PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN make setup PYTHON=python3 \
    && .venv/bin/morphling version -v \
    && rm -rf /root/.cache

ENV PATH=/opt/morphling/.venv/bin:$PATH PYTHONUNBUFFERED=1
USER morphling
WORKDIR /var/lib/morphling
# Buffer pools lock what RLIMIT_MEMLOCK allows: run with --ulimit memlock=-1 to lock all.
EXPOSE 39000
ENTRYPOINT ["morphling"]
CMD ["emulator"]
