# Two commands for a newcomer on a fresh machine (Python 3.11, no GPU needed):
#   make run    set up the environment and run the quickstart notebook headlessly (outputs under runs/)
#   make test   set up the environment and run the whole test suite
# The virtual environment lives outside the clone, keyed by the requirements' hash, so a second call (or a
# second clone) reuses it. Override its location with TPU_HELPERS_VENV_ROOT.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
REQS := requirements-dev.txt
VENV_ROOT ?= $(or $(TPU_HELPERS_VENV_ROOT),$(HOME)/.cache/tpu_helpers)
REQ_HASH := $(shell sha256sum $(REQS) | cut -c1-12)
VENV := $(VENV_ROOT)/venv-$(REQ_HASH)
PY := $(VENV)/bin/python
STAMP := $(VENV)/.complete
TARGET ?= auto
DEVICE ?=
PYTEST_ARGS ?=

.PHONY: setup browser run test lint clean-runs print-venv

setup: $(STAMP)

# The stamp is written last, so an interrupted install never looks complete: the next call rebuilds it.
$(STAMP):
	@echo ">> creating $(VENV) (first run only: torch + torch_xla are large, a few minutes)"
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r $(REQS)
	touch $(STAMP)

# The browser test (tests/memory/test_panel_browser.py) drives Debian's chromium: Playwright cannot download its own
# browser here. Installed once per machine where we are root with apt-get; elsewhere the test skips and says why
# (under CI=true it fails instead).
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && echo ">> installing chromium (browser test)" && \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null; } || \
	echo ">> no chromium: the browser test will skip (install it with: apt-get install -y chromium)"

# The package is installed editable on every call (cheap), so the cached venv always imports this clone.
run: setup
	PYTHONWARNINGS=ignore $(PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(PY) -m tpu_helpers run notebooks/quickstart.ipynb --target $(TARGET) $(if $(DEVICE),-p DEVICE $(DEVICE) -p OUT_DIR runs/quickstart-$(DEVICE))

test: setup browser
	PYTHONWARNINGS=ignore $(PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(PY) -m ruff check tpu_helpers tests benchmarks
	$(PY) -m pytest $(PYTEST_ARGS)

lint: setup
	$(PY) -m ruff check tpu_helpers tests benchmarks

clean-runs:
	rm -rf runs/

print-venv:
	@echo $(VENV)
