# Two commands do all the set-up on a fresh machine:
#   make train   trains the `tiny` preset on the embedded default corpus
#   make test    runs the whole test suite (2 CPU ranks, gloo, for every strategy)
# Both create .venv on first use. TORCH picks the torch build: the default pin takes the CPU wheel
# where one is on disk; on a GPU machine use e.g. `make setup TORCH="torch==2.13.0 --index-url ..."`.

VENV  ?= .venv
PY    := $(VENV)/bin/python
TORCH ?= torch==2.13.0
ARGS  ?=

.PHONY: setup train test test-matrix test-quick lint presets bench

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[dev,tracking]"
	@# DeepSpeed's NVMe offload (async_io op) needs libaio's headers: installed here where we may, else set-up
	@# stops saying how (the NVMe tests would fail without them).
	@if ! test -e /usr/include/libaio.h && command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		apt-get install -y -q libaio-dev >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q libaio-dev >/dev/null; }; fi
	@test -e /usr/include/libaio.h || { echo "error: libaio's headers (/usr/include/libaio.h) are missing; DeepSpeed's NVMe offload needs them: run 'sudo apt-get install libaio-dev' (or install libaio-devel), then 'make setup'" >&2; exit 1; }
	touch $@

train: setup
	$(PY) recipes/train.py $(ARGS)

test: setup
	$(PY) -m pytest $(ARGS)

test-matrix: setup  # the widest cells of tests/recipes/test_precision.py (every config x bf16, compile)
	$(PY) -m pytest -m matrix $(ARGS)

test-quick: setup
	$(PY) -m pytest -m "not slow" $(ARGS)

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

presets: setup
	$(PY) -m model

bench: setup
	$(PY) recipes/benchmark.py $(ARGS)
