# kda-jax: the two commands of the README are `make run` and `make test`.
# Both create .venv with a Python >= 3.12 (found by scripts/find_python.sh) on first use.
VENV := .venv
PY := $(VENV)/bin/python
# Extras installed into .venv; on an NVIDIA GPU machine: make test EXTRAS=test,notebooks,cuda13
EXTRAS ?= test,notebooks
comma := ,
STAMP := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))

.PHONY: setup run test test-gpu lint bench notebooks clean

setup: $(STAMP)

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

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

notebooks: setup
	$(PY) scripts/run_notebooks.py

clean:
	rm -rf $(VENV) .pytest_cache
