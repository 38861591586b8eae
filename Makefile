# kda-jax: the two commands of the README are `make run` and `make test`.
# Both create .venv with a Python >= 3.12 (found by scripts/find_python.sh) on first use.
# `make test-fast` runs the tests not marked slow (about 3.5 minutes on 2 CPU cores).
VENV := .venv
PY := $(VENV)/bin/python
# Extras installed into .venv; on an NVIDIA GPU machine: make test EXTRAS=test,notebooks,cuda13
EXTRAS ?= test,notebooks
comma := ,
STAMP := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))

.PHONY: setup run test test-fast lint notebooks clean

setup: $(STAMP)

# Reinstalled when pyproject.toml changes (its dependencies may have).
$(STAMP): pyproject.toml scripts/find_python.sh
	@py=$$(scripts/find_python.sh) || exit 1; \
	  echo "using $$py ($$($$py --version))"; \
	  [ -x $(PY) ] || $$py -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	@touch $(STAMP)

# Main job: build a block, prefill, decode loop, verify, check every stage against the oracle.
run: setup
	$(VENV)/bin/kda-jax $(ARGS)

test: setup
	$(PY) -m pytest -q tests $(PYTEST_ARGS)

# Every test not marked `slow`: one case of each family, the slow parametrizations left to `test`.
test-fast: setup
	$(PY) -m pytest -q -m "not slow" tests $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

notebooks: setup
	$(PY) scripts/run_notebooks.py

clean:
	rm -rf $(VENV) .pytest_cache
