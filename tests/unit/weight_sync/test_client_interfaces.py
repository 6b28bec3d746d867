"""Each engine drives servers through the client interface it needs: the disk engine through the
small `WeightUpdateClient`, the broadcast engine through `DistributedWeightUpdateClient`, and it
refuses a server whose client lacks it, naming the server and the disk engine.

`DiskOnlyClient` stands in for a third-party backend's client (an `agentrl.inference_backends`
entry point) whose server loads checkpoints from disk and joins no weight group; it loads the
learner's `model.safetensors` as such a server would, into a dict."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agentrl.config import BroadcastSyncConfig, DiskSyncConfig, InferenceConfig
from agentrl.inference import registry
from agentrl.inference.base import DistributedWeightUpdateClient, InferenceClient, WeightUpdateClient
from agentrl.weight_sync.registry import create

URL = "http://127.0.0.1:1"


class DiskOnlyClient(WeightUpdateClient):
    def __init__(self, url: str) -> None:
        self.url = url
        self.version = 0
        self.weights: dict[str, torch.Tensor] = {}
        self.calls: list[str] = []

    async def alive(self) -> bool:
        return True

    async def get_weight_version(self) -> int:
        return self.version

    async def pause_generation(self) -> None:
        self.calls.append("pause")

    async def continue_generation(self) -> None:
        self.calls.append("continue")

    async def update_weights_from_disk(self, model_path: str, weight_version: int | None = None) -> None:
        from safetensors.torch import load_file

        self.calls.append("load")
        self.weights = load_file(str(Path(model_path) / "model.safetensors"))
        self.version = weight_version if weight_version is not None else self.version

    async def close(self) -> None:
        self.calls.append("close")


@pytest.fixture
def disk_only(monkeypatch: pytest.MonkeyPatch) -> dict[str, DiskOnlyClient]:
    made: dict[str, DiskOnlyClient] = {}

    def build(config: object, url: str, lora: str | None = None) -> DiskOnlyClient:
        made[url] = DiskOnlyClient(url)
        return made[url]

    monkeypatch.setattr(registry, "create_weight_updater", build)
    return made


def test_the_broadcast_engine_refuses_a_client_without_a_weight_group(disk_only) -> None:
    engine = create(BroadcastSyncConfig(backend="gloo", timeout_s=5), InferenceConfig(servers=[URL]))
    with pytest.raises(TypeError) as refused:
        engine.init()
    message = str(refused.value)
    assert URL in message and "DiskOnlyClient" in message and "weight_sync.type: disk" in message
    assert engine._bridge is None  # the refusal closed what init had started


def test_the_disk_engine_pushes_through_the_small_interface(disk_only, tmp_path: Path) -> None:
    engine = create(
        DiskSyncConfig(directory=str(tmp_path / "weights"), timeout_s=5), InferenceConfig(servers=[URL])
    )
    engine.init()
    try:
        weights = {"a.weight": torch.arange(6.0).reshape(2, 3), "b.bias": torch.ones(4)}
        stats = engine.push(lambda: iter(weights.items()), 3)
        assert stats.servers_updated == 1 and stats.outcomes[URL].committed
        client = disk_only[URL]
        assert client.calls == ["pause", "load", "continue"] and client.version == 3
        assert client.weights.keys() == weights.keys()
        assert all(torch.equal(client.weights[k], v) for k, v in weights.items())
    finally:
        engine.close()


def test_the_client_interfaces_are_split_by_their_users() -> None:
    from agentrl.inference.embedded_client import EmbeddedClient
    from agentrl.inference.router import Router
    from agentrl.inference.sglang import SGLangClient
    from agentrl.inference.vllm import VLLMClient

    assert WeightUpdateClient.__abstractmethods__ == {
        "alive", "get_weight_version", "pause_generation", "continue_generation",
        "update_weights_from_disk", "close",
    }  # fmt: skip
    assert DistributedWeightUpdateClient.__abstractmethods__ - WeightUpdateClient.__abstractmethods__ == {
        "init_weights_update_group", "destroy_weights_update_group", "begin_weight_update",
        "update_weights_from_distributed", "end_weight_update", "abort_weight_update",
    }  # fmt: skip
    for cls in (SGLangClient, EmbeddedClient, VLLMClient):
        assert issubclass(cls, DistributedWeightUpdateClient) and issubclass(cls, InferenceClient), cls
        assert not cls.__abstractmethods__, cls
    assert not issubclass(Router, WeightUpdateClient)  # generation only: weight sync talks to each server
