# The README's two commands: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU wheel that lies on this disk; GPU users install their own torch into .venv first.
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev,mcp,redis,nixl,docker,search
MODEL_DIR ?= runs/models/mini

.PHONY: setup demo test test-fast lint format clean

setup: $(VENV)/.agentrl-installed

$(VENV)/.agentrl-installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	@touch $@

demo: setup
	$(VENV)/bin/agentrl init-model mini $(MODEL_DIR)
	$(VENV)/bin/agentrl run --config recipes/quickstart.yaml

test: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest

test-fast: setup
	$(PY) -m pytest -m "not slow"

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: setup
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

clean:
	rm -rf $(VENV) runs .pytest_cache
