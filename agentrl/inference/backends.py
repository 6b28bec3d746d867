"""The built-in inference backends: agentrl's embedded server, SGLang and vLLM, one descriptor each.

Registered by name in `agentrl/inference/registry.py`; each descriptor imports its client and
launcher only when used, so SGLang and vLLM (separate environments) stay optional."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from typing import TYPE_CHECKING, Any

from agentrl.inference.registry import InferenceBackend

if TYPE_CHECKING:
    from agentrl.inference.config import InferenceConfig


def _sglang_client(url: str, config: InferenceConfig, **kwargs: Any):
    from agentrl.inference.sglang import SGLangClient

    return SGLangClient(url, routed_experts=config.routed_experts, **kwargs)


def _embedded_client(url: str, config: InferenceConfig, **kwargs: Any):
    from agentrl.inference.embedded_client import EmbeddedClient

    return EmbeddedClient(url, routed_experts=config.routed_experts, **kwargs)


def _vllm_client(url: str, config: InferenceConfig, **kwargs: Any):
    from agentrl.inference.vllm import VLLMClient

    return VLLMClient(url, model=config.served_model_name, routed_experts=config.routed_experts, **kwargs)


def _serve_embedded(model_path: str, host: str, port: int, config: InferenceConfig) -> int:
    from agentrl.inference.server import run_server

    run_server(model_path, host, port, config)
    return 0


def _serve_sglang(model_path: str, host: str, port: int, config: InferenceConfig) -> int:
    from agentrl.inference.sglang_launch import run_sglang

    return run_sglang(model_path, host, port, config)


def _serve_vllm(model_path: str, host: str, port: int, config: InferenceConfig) -> int:
    from agentrl.inference.vllm_launch import exec_server

    try:
        exec_server(model_path, host, port, config)  # returns only on failure
    except (FileNotFoundError, OSError) as exc:
        raise RuntimeError(f"--backend vllm: {exc}") from None
    return 1


def _installed(module: str, absent: str) -> str:
    if importlib.util.find_spec(module) is None:
        return absent
    try:
        return importlib.metadata.version(module)
    except importlib.metadata.PackageNotFoundError:
        return "present"


def _doctor_sglang(config: InferenceConfig) -> str:
    return _installed("sglang", "absent (make sglang on a GPU node: SGLang in its own .venv-sglang)")


def _doctor_vllm(config: InferenceConfig) -> str:
    if importlib.util.find_spec("vllm") is not None:
        return _installed("vllm", "absent")
    from agentrl.inference.vllm_launch import find_python

    try:
        return f"in {find_python(config.vllm.python)}"
    except FileNotFoundError:
        return "absent (make vllm: vLLM in its own .venv-vllm)"


EMBEDDED = InferenceBackend(
    "embedded",
    client=_embedded_client,  # SGLang's native API, plus LoRA adapter loading
    serve=_serve_embedded,
    help="agentrl's own server (torch, any device)",
)
SGLANG = InferenceBackend(
    "sglang",
    client=_sglang_client,
    serve=_serve_sglang,
    doctor=_doctor_sglang,
    help="a real SGLang (GPU, .venv-sglang)",
    names_adapters=True,
)
VLLM = InferenceBackend(
    "vllm",
    client=_vllm_client,
    serve=_serve_vllm,
    startup_timeout_s=lambda config: config.vllm.startup_timeout_s,
    doctor=_doctor_vllm,
    config_field="vllm",
    help="a real vLLM (.venv-vllm)",
    names_adapters=True,
)
