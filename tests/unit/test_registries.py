"""Each seam's backends are registered by name beside it, imported only when named; an interface
module imports none of its implementations."""

from __future__ import annotations

import subprocess
import sys

import pytest

from agentrl.plugins import Registry, UnknownName


def test_a_builtin_is_imported_when_named_and_an_unknown_name_lists_the_registered_ones() -> None:
    registry: Registry[object] = Registry("x.type", "agentrl.test_no_such_group", {"path": "pathlib:Path"})
    registry.register("mine", int)
    assert registry.names() == ["path", "mine"] and "mine" in registry and "nope" not in registry
    from pathlib import Path

    assert registry.get("path") is Path and registry.get("mine") is int
    with pytest.raises(
        UnknownName, match=r"x.type: unknown backend 'pth' \(did you mean path\?\); registered: path, mine"
    ):
        registry.get("pth")
    broken: Registry[object] = Registry("x.type", None, {"gone": "agentrl.no_such_module:X"})
    with pytest.raises(ModuleNotFoundError):
        broken.get("gone")


@pytest.mark.parametrize(
    ("interface", "implementations"),
    [
        ("agentrl.inference.base", ["agentrl.inference.sglang", "agentrl.inference.vllm", "agentrl.inference.router"]),
        ("agentrl.inference.registry", ["agentrl.inference.sglang", "agentrl.inference.vllm", "agentrl.inference.backends"]),
        ("agentrl.queue.base", ["agentrl.queue.zmq_producer", "agentrl.queue.zmq_consumer", "agentrl.queue.redis_backend"]),
        ("agentrl.queue", ["agentrl.queue.zmq_producer", "agentrl.queue.zmq_consumer", "agentrl.queue.redis_backend"]),
        ("agentrl.weight_sync.base", ["agentrl.weight_sync.broadcast", "agentrl.weight_sync.membership", "agentrl.weight_sync.disk"]),
        ("agentrl.weight_sync.registry", ["agentrl.weight_sync.broadcast", "agentrl.weight_sync.membership", "agentrl.weight_sync.disk"]),
        ("agentrl.envs.sandbox", ["agentrl.envs.sandbox.local", "agentrl.envs.sandbox.docker", "agentrl.envs.sandbox.remote"]),
    ],
)  # fmt: skip
def test_an_interface_or_registry_imports_none_of_its_implementations(
    interface: str, implementations: list[str]
) -> None:
    code = f"import sys, {interface}; print([m for m in {implementations!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_inference_descriptors_answer_for_their_backends() -> None:
    from agentrl.config import InferenceConfig
    from agentrl.inference.registry import BACKENDS, backend, create_weight_updater
    from agentrl.inference.sglang import SGLangClient
    from agentrl.inference.vllm import VLLMClient

    assert BACKENDS.builtins() == ["embedded", "sglang", "vllm"]
    vllm = InferenceConfig(type="vllm", vllm={"startup_timeout_s": 123})
    assert (
        backend("vllm").startup_timeout_s(vllm) == 123 and backend("embedded").startup_timeout_s(vllm) == 300
    )
    assert backend("vllm").config_field == "vllm" and backend("embedded").doctor is None
    assert type(create_weight_updater(vllm, "http://127.0.0.1:1")) is VLLMClient
    from agentrl.inference.embedded_client import EmbeddedClient

    assert type(create_weight_updater(InferenceConfig(), "http://127.0.0.1:1")) is EmbeddedClient
    assert type(create_weight_updater(InferenceConfig(type="sglang"), "http://127.0.0.1:1")) is SGLangClient
