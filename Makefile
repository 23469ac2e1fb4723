# The README's two commands are `make demo` and `make test`; both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.morphling-installed
SOURCES := pyproject.toml setup.py $(wildcard kernels/_cffi_src/*.py kernels/_cffi_src/c/*.c kernels/_cffi_src/c/*.h)

.PHONY: setup system-deps demo test bench lint install-service clean

setup: $(STAMP)

# torch first, pinned: it is the local CPU wheel, and with it installed nothing
# else can pull a newer (CUDA) torch. --no-build-isolation builds the cffi
# extension with the venv's own setuptools and cffi.
$(STAMP): $(SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel cffi
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-build-isolation -e '.[dev]'
	touch $(STAMP)

demo: setup
	$(PY) scripts/demo.py

# nginx with its stream module, for tests/test_nginx.py (skipped, saying why, without it).
system-deps:
	sh scripts/install-system-deps.sh

# Two workers, each a whole test file at a time: most tests wait on child processes
# (start-up, heartbeats, deadlines), so two overlap well on two cores; a file's module
# fixtures still run once. `pytest -n 0` (or plain pytest) runs one at a time.
test: setup system-deps
	$(PY) -m pytest -q -n 2 --dist loadfile

bench: setup
	$(PY) scripts/bench_kernels.py
	$(PY) scripts/bench_net.py
	$(PY) scripts/bench_verify.py
	$(PY) scripts/bench_train.py
	$(PY) scripts/bench_ranks.py
	$(PY) scripts/bench_vtime.py
	$(PY) scripts/bench_host.py
	$(PY) scripts/bench_gpu.py
	$(PY) scripts/calibrate_boards.py --check --json bench-results/calibration.json
	$(PY) scripts/bench_report.py

# The import contracts and the type checker read the package as installed, laid out in
# links by scripts/package_tree.py; they run from there, where no top-level folder of this
# repository (kernels/, devices/, ...) can pass for a module of that name.
TREE := build/package-tree
BIN := $(abspath $(VENV))/bin

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(PY) scripts/package_tree.py $(TREE) > /dev/null
	cd $(TREE) && PYTHONPATH=. $(BIN)/lint-imports --no-logo $(CURDIR)/pyproject.toml
	cd $(TREE) && $(BIN)/mypy --config-file $(CURDIR)/pyproject.toml

# The systemd units and example settings (docs/DEPLOY.md); DESTDIR stages them elsewhere.
install-service: setup
	sh scripts/install-service.sh $(DESTDIR)

clean:
	rm -rf $(VENV) build *.egg-info kernels/_native*.so
