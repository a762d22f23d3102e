# Two commands do all the set-up on a fresh machine:
#   make train   trains the `tiny` preset on the embedded default corpus
#   make test    runs the whole test suite (2 CPU ranks, gloo, for every strategy)
# Both create .venv on first use with exactly the packages of requirements.lock (the whole tree, pinned),
# so any day's set-up gives what CI tested. `make lock` re-resolves the lock to the newest releases;
# `make test-latest` runs the fast tests against the newest releases in a scratch venv before the lock moves.
#
# torch is the user's choice. The lock pins the CPU wheel CI runs on; TORCH installs another build first and
# keeps the rest of the lock, e.g. on a GPU machine:
#   make setup TORCH="torch==2.11.0 --index-url https://download.pytorch.org/whl/cu128"

VENV   ?= .venv
PY     := $(VENV)/bin/python
LOCK   := requirements.lock
TORCH  ?=
# The torch the lock is resolved with: the CPU wheel CI installs (the oldest and newest supported are tested by
# `make test-floor` and, with TORCH_LATEST=torch, `make test-latest`).
LOCK_TORCH ?= torch==2.13.0
TORCH_LATEST ?= $(LOCK_TORCH)
# The oldest torch supported (training/compat.py, pyproject.toml), and what `make test-floor` runs on it: the model
# (compile included), the sharded builds, a launch of each strategy family, eager and compiled, FSDP2 in bf16, and
# the pipeline warm-up this torch runs (whether a V-shaped schedule is refused on gloo).
FLOOR_TORCH ?= torch==2.11.0
FLOOR_TESTS ?= tests/model tests/training/test_step.py tests/training/test_sharded_construction.py \
	"tests/recipes/test_strategies.py::test_strategy_trains_the_same_model[accelerate-ddp-ddp]" \
	"tests/recipes/test_strategies.py::test_strategy_trains_the_same_model[accelerate-fsdp-fsdp]" \
	"tests/recipes/test_precision.py::test_bf16_trains_as_one_process_in_bf16[fsdp]" \
	"tests/recipes/test_strategies.py::test_strategy_trains_the_same_model[accelerate-zero3-zero3]" \
	"tests/recipes/test_precision.py::test_torch_compile_trains_the_same[fsdp]" \
	"tests/recipes/test_precision.py::test_torch_compile_trains_the_same[zero3]" \
	"tests/training/test_pipeline.py::test_the_installed_torch_is_read_for_its_pipeline_warm_up" \
	"tests/training/test_pipeline.py::test_a_v_shaped_schedule_is_refused_on_gloo_where_torch_sends_to_its_own_rank"
ARGS   ?=
# The suite on both cores: pytest-xdist's 2 workers, every test that launches ranks in one group that one worker runs
# one launch after another (tests/conftest.py), the in-process tests on the other; at the end the slowest tests and
# where the launches' time went.
PARALLEL ?= -n 2 --dist loadgroup --durations=25

.PHONY: setup train test test-matrix test-quick test-latest test-floor test-gpu lock lint presets bench

setup: $(VENV)/.installed

$(VENV)/.installed: $(LOCK) pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
ifeq ($(strip $(TORCH)),)
	@# Exactly the lock: every pinned package with no resolution of its own (--no-deps), then pip-sync (pip-tools,
	@# itself in the lock) removes whatever an older lock installed and this one does not list.
	$(PY) -m pip install -q --no-deps -r $(LOCK)
	$(VENV)/bin/pip-sync -q --pip-args "--no-deps" $(LOCK)
else
	@# The rest of the lock as pinned, then the user's torch with what its build needs (pip changes a pinned
	@# package only where that torch requires another release of it, e.g. torch 2.11's setuptools<82).
	grep -v '^torch==' $(LOCK) > $(VENV)/lock-without-torch.txt
	$(PY) -m pip install -q --no-deps -r $(VENV)/lock-without-torch.txt
	$(PY) -m pip install -q $(TORCH)
endif
	@# setuptools' 'Editable installation' banner warns that folders named like the packages shadow them: here they
	@# are the packages, which the editable install points at.
	PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(PY) -m pip check
	@# DeepSpeed's NVMe offload (async_io op) needs libaio's headers: installed here where we may, else set-up
	@# stops saying how (the NVMe tests would fail without them).
	@if ! test -e /usr/include/libaio.h && command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		apt-get install -y -q libaio-dev >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q libaio-dev >/dev/null; }; fi
	@test -e /usr/include/libaio.h || { echo "error: libaio's headers (/usr/include/libaio.h) are missing; DeepSpeed's NVMe offload needs them: run 'sudo apt-get install libaio-dev' (or install libaio-devel), then 'make setup'" >&2; exit 1; }
	touch $@

# Re-resolve the lock to today's releases (pip-tools), torch held at LOCK_TORCH. Then `make setup test`.
lock: setup
	CUSTOM_COMPILE_COMMAND="make lock" $(VENV)/bin/pip-compile -q --upgrade --extra dev --extra tracking \
		--strip-extras --allow-unsafe --no-emit-index-url --no-emit-find-links -P "$(LOCK_TORCH)" -o $(LOCK) pyproject.toml

# The fast tests against the newest release of every dependency (pyproject.toml's ranges, no lock) in a scratch
# venv, torch held at TORCH_LATEST (TORCH_LATEST=torch: the newest torch too). Prints what it installed.
test-latest:
	rm -rf .venv-latest && python3 -m venv .venv-latest
	@# One resolution: TORCH_LATEST named beside the package holds torch where it pins one (an eager upgrade of the
	@# package alone would move torch to its newest release too).
	.venv-latest/bin/python -m pip install -q --upgrade --upgrade-strategy eager -e ".[dev,tracking]" $(TORCH_LATEST)
	@.venv-latest/bin/python -c "import importlib.metadata as m; print('newest releases:', ', '.join(f'{p} {m.version(p)}' for p in ('torch', 'transformers', 'accelerate', 'deepspeed', 'datasets', 'tokenizers', 'huggingface_hub', 'safetensors')))"
	.venv-latest/bin/python -m pytest -m "not slow" $(ARGS)

# The lock's packages with the oldest supported torch (FLOOR_TORCH) in .venv-floor, and FLOOR_TESTS on it.
test-floor:
	$(MAKE) setup VENV=.venv-floor TORCH="$(FLOOR_TORCH)"
	.venv-floor/bin/python -m pytest -m "" $(PARALLEL) $(FLOOR_TESTS) $(ARGS)  # -m "": the compiled launches are matrix cells

# On a CUDA machine: every config one GPU can run, compile, fp16 loss scaling, the profiler, a resume under another
# strategy (tests marked gpu; they skip without a GPU). Run with the GPU's own torch: make setup TORCH=... first.
test-gpu: setup
	$(PY) -m pytest -m gpu $(ARGS)

train: setup
	$(PY) recipes/train.py $(ARGS)

test: setup
	$(PY) -m pytest $(PARALLEL) $(ARGS)

test-matrix: setup  # the widest cells: every config x bf16 and compile, a second launcher of a config
	$(PY) -m pytest -m matrix $(PARALLEL) $(ARGS)

test-quick: setup
	$(PY) -m pytest -m "not slow" $(PARALLEL) $(ARGS)

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

presets: setup
	$(PY) -m model

bench: setup
	$(PY) recipes/measure/benchmark.py $(ARGS)
