# Two commands matter: `make demo` and `make test`. Both create .venv and install on first use;
# a second run skips the install unless pyproject.toml changed. `make test-fast` leaves out the tests marked slow.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TORCH   := torch==2.13.0
export FACTORY_HOME ?= $(CURDIR)/.factory
export DAGSTER_HOME ?= $(FACTORY_HOME)/dagster

.PHONY: demo test test-fast ui install lint clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first, pinned: the CPU wheel is on disk here, and an unpinned torch would pull CUDA packages.
$(STAMP): $(BIN)/python pyproject.toml
	@echo "installing into $(VENV) (log: $(VENV)/install.log)"
	@$(BIN)/pip install $(TORCH) > $(VENV)/install.log 2>&1 || (cat $(VENV)/install.log; exit 1)
	@$(BIN)/pip install -e ".[dev,megatron,real,kernels]" >> $(VENV)/install.log 2>&1 || (cat $(VENV)/install.log; exit 1)
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	@mkdir -p $(DAGSTER_HOME)
	$(BIN)/python -m jobs.demo

# pytest-xdist workers, each given whole modules (--dist loadfile: a module's fixtures are made once), the longest
# first (tests/conftest.py orders them by tests/module_seconds.json; --no-loadscope-reorder keeps that order instead
# of xdist's most-tests-first). Three on a 2-core machine: many tests wait on subprocesses and servers, and a third
# worker keeps both cores busy then. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 3
PYTEST  := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: $(STAMP)
	$(PYTEST)

# Every package, without the tests marked slow (pyproject.toml's markers; tests/test_tiers.py keeps every package in).
test-fast: $(STAMP)
	$(PYTEST) -m "not slow"

ui: $(STAMP)
	@# the Dagster UI (with Factory's instance settings, factory/ops/instance.py) and the MLflow UI beside it
	$(BIN)/python -m factory.ops.cockpit

# ruff, the import contracts in pyproject.toml ([tool.importlinter]: the layers, no cycles), and the function-level
# imports left in factory/ (each with its `# noqa: PLC0415 <reason>`; at most 60): tools/late_imports.py
lint: $(STAMP)
	$(BIN)/ruff check .
	PYTHONPATH=$(CURDIR) $(BIN)/lint-imports
	$(BIN)/python tools/late_imports.py

clean:
	rm -rf .factory
