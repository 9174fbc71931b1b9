# facegate developer entry points. `make serve` and `make test` are the README's two commands.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
LFW_DEFAULT := $(abspath ../shared/data/lfw)
export FACEGATE_LFW_ROOT ?= $(if $(wildcard $(LFW_DEFAULT)/pairs.txt),$(LFW_DEFAULT),)

.PHONY: setup serve test lint docs clean

setup: $(VENV)/.facegate-installed

$(VENV)/.facegate-installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh "$(PYTHON)" "$(VENV)"
	touch $@

serve: setup
	$(VENV)/bin/facegate serve

test: setup
	bash scripts/test.sh "$(VENV)"

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	PYTHONPATH=src $(VENV)/bin/lint-imports

# the generated pages: configuration from the Settings class, benchmark tables from benchmarks/results/
docs: setup
	$(PY) scripts/gen_config_docs.py > docs/configuration.md
	$(PY) benchmarks/tables.py > docs/benchmarks.md

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
