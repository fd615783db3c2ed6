VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
CONFIG ?= hermes-gateway.yaml
CHAT_USER ?= me

.PHONY: install run check test bench clean

# the tested versions (constraints.txt); the cluster extra too, for the PostgreSQL tests
$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PIP) install -q -c constraints.txt -e '.[dev,cluster]'
	touch $@

install: $(VENV)/.installed

# Console chat against the configured endpoint (default: local Ollama).
run: install
	@test -f $(CONFIG) || $(VENV)/bin/hermes-gateway init -c $(CONFIG)
	$(VENV)/bin/hermes-gateway chat -c $(CONFIG) --user $(CHAT_USER)

# Lint, format and types: the same checks CI runs before the suite.
check: install
	$(VENV)/bin/ruff check core gateway adapters tenancy agent tests bench
	$(VENV)/bin/ruff format --check core gateway adapters tenancy agent tests bench
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/vulture --min-confidence 80 core gateway adapters tenancy agent

test: check
	$(VENV)/bin/python -m pytest -q

bench: install
	$(VENV)/bin/python bench/run_suite.py --runs 3 --write BENCHMARKS.md
	$(VENV)/bin/python bench/compression_bench.py

clean:
	rm -rf $(VENV) .pytest_cache
