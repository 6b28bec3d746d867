"""Adapter pushes into servers that serve LoRA adapters by name, against the strict SGLang 0.5.23
stand-in (tests/sglang_standin.py, tests/sglang_standin_lora.py name the wheel's files behind each
rule): the disk engine writes each version as a PEFT directory and SGLang loads it by path as
`agentrl-lora-v<v>` (read back from `/v1/models`), the version before the previous one unloaded; the
engine reads the version back through a client that names the adapter, and so does the rollers'
router, whose requests name the newest version; a rank or module the server cannot load is refused
when the engine starts, naming it; the broadcast engine leaves SGLang out of an adapter push, naming
the way out (SGLang 0.5.23 loads adapters from a path only). The real vLLM path is in
tests/integration/test_vllm_lora.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from agentrl.config import BroadcastSyncConfig, DiskSyncConfig, InferenceConfig
from agentrl.inference.lora import AdapterLimitError
from agentrl.inference.registry import adapter_base
from agentrl.inference.router import from_config
from agentrl.inference.sglang import SGLangClient
from agentrl.weight_sync.base import AdapterSpec, AdapterWeights
from agentrl.weight_sync.registry import create
from tests.sglang_standin import StandInSGLang

TARGETS = ("q_proj", "v_proj")
SPEC = AdapterSpec(8, 16.0, TARGETS)


def weights(seed: int, spec: AdapterSpec = SPEC) -> AdapterWeights:
    gen = torch.Generator().manual_seed(seed)
    prefix = "base_model.model.model.layers.0.self_attn"
    pairs = [(f"{prefix}.{m}.lora_{ab}.weight", torch.randn(spec.r, spec.r, generator=gen))
             for m in spec.target_modules for ab in "AB"]  # fmt: skip
    return AdapterWeights(adapter=lambda: iter(pairs), merged=lambda: iter(()), spec=spec)


def sglang(url: str) -> InferenceConfig:
    return InferenceConfig(type="sglang", servers=[url], health_check_interval_s=0.5)


@pytest.fixture
def standin():
    server = StandInSGLang(device="cpu", token_interval_s=0.0, lora={"max_lora_rank": 8}).start()
    yield server
    server.stop()


def test_rollers_name_adapters_only_where_servers_serve_them_by_name() -> None:
    assert adapter_base(InferenceConfig(type="sglang"), SPEC) == "agentrl-lora"
    assert adapter_base(InferenceConfig(type="vllm"), SPEC) == "agentrl-lora"
    assert adapter_base(InferenceConfig(type="embedded"), SPEC) is None  # applied to every request
    assert adapter_base(InferenceConfig(type="sglang"), None) is None  # full or merged weights


def test_the_rollers_router_names_the_adapter_in_a_lora_run() -> None:
    from agentrl.config import AgentRLConfig
    from agentrl.rollers.main import request_adapter

    lora = {"lora": {"rank": 8, "target_modules": list(TARGETS)}}
    assert request_adapter(AgentRLConfig(learner=lora, inference={"type": "vllm"})) == "agentrl-lora"
    assert (
        request_adapter(
            AgentRLConfig(learner=lora, inference={"type": "sglang", "servers": ["http://127.0.0.1:1"]})
        )
        == "agentrl-lora"
    )
    assert request_adapter(AgentRLConfig(learner=lora, inference={"type": "embedded"})) is None
    merged = {"type": "disk", "lora_mode": "merged"}
    assert (
        request_adapter(AgentRLConfig(learner=lora, inference={"type": "vllm"}, weight_sync=merged)) is None
    )
    assert request_adapter(AgentRLConfig(inference={"type": "vllm"})) is None


def test_disk_keeps_the_previous_adapter_directory_for_vllm_and_sglang() -> None:
    from agentrl.config import AgentRLConfig

    lora = {"lora": {"rank": 8, "target_modules": list(TARGETS)}}
    with pytest.raises(ValueError, match=r"weight_sync.keep_last: 1 .*set it to 2 or more"):
        AgentRLConfig(learner=lora, inference={"type": "vllm"}, weight_sync={"type": "disk", "keep_last": 1})
    AgentRLConfig(learner=lora, inference={"type": "embedded"}, weight_sync={"type": "disk", "keep_last": 1})


def test_disk_pushes_serve_each_version_by_name(standin: StandInSGLang, tmp_path: Path) -> None:
    engine = create(DiskSyncConfig(timeout_s=10), sglang(standin.url), run_dir=tmp_path / "run", adapter=SPEC)
    engine.init()
    router = from_config(sglang(standin.url), lora=adapter_base(sglang(standin.url), SPEC))
    loop = asyncio.new_event_loop()  # the router's loop, across the pushes
    try:
        for version in (1, 2, 3):
            stats = engine.push(weights(seed=version), version)
            assert stats.outcomes[standin.url].committed, stats.outcomes
            assert stats.bytes == 2 * len(TARGETS) * 8 * 8 * 4  # the adapter's bytes
            name = f"agentrl-lora-v{version}"
            kept = {name} | ({f"agentrl-lora-v{version - 1}"} if version > 1 else set())
            assert set(standin.adapters) == kept  # the one before the previous was unloaded
            written = (tmp_path / "run" / "weights" / f"v{version}").absolute()
            assert standin.adapters[name]["path"] == str(written)
            result = loop.run_until_complete(
                router.generate([1, 2, 3], {"max_new_tokens": 4, "ignore_eos": True})
            )
            assert result.weight_version == version and standin.generated_with[-1] == name
    finally:
        loop.run_until_complete(router.close())
        loop.close()
        engine.close()


def test_a_load_not_read_back_drops_the_server(standin: StandInSGLang, tmp_path: Path) -> None:
    """SGLang answers the load with success but does not list the adapter: not committed, the reason
    says so, and the server still serves (and reads back) the version before."""
    engine = create(DiskSyncConfig(timeout_s=10), sglang(standin.url), run_dir=tmp_path, adapter=SPEC)
    engine.init()
    try:
        assert engine.push(weights(seed=1), 1).outcomes[standin.url].committed
        standin.lose_loads = 1
        outcome = engine.push(weights(seed=2), 2).outcomes[standin.url]
        assert not outcome.committed, outcome
        assert "answered success, but the server lists 'no such adapter'" in outcome.reason
        assert set(standin.adapters) == {"agentrl-lora-v1"}
        assert engine._read_versions([standin.url], 10) == {standin.url: 1}  # still serving v1
    finally:
        engine.close()


async def test_a_version_above_the_pushed_one_is_unloaded(standin: StandInSGLang, tmp_path: Path) -> None:
    """A learner resumed from an older checkpoint pushes v5 while v6 and v7 are served: both go, so
    requests never name the abandoned versions."""
    from tests.unit.inference.test_sglang_lora import adapter

    async with SGLangClient(standin.url, lora="agentrl-lora") as client:
        for v in (4, 6, 7):
            await client.load_adapter("agentrl-lora", str(adapter(tmp_path / f"a{v}", seed=v)), v)
        await client.load_lora_adapter("agentrl-lora-v5", str(adapter(tmp_path / "a5", seed=5)), 5)
        assert set(await client.served_adapters()) == {"agentrl-lora-v4", "agentrl-lora-v5"}
        assert await client.get_weight_version() == 5


@pytest.mark.parametrize(
    ("limits", "refusal"),
    [
        ({"max_lora_rank": 4}, r"rank 8 is above .*--max-lora-rank 4"),
        ({"max_lora_rank": 8, "lora_target_modules": ["o_proj"]}, r"\['q_proj', 'v_proj'\] are not in"),
    ],
)
def test_an_adapter_the_server_cannot_load_is_refused_at_start(limits: dict, refusal: str, tmp_path) -> None:
    server = StandInSGLang(device="cpu", lora=limits).start()
    try:
        engine = create(DiskSyncConfig(), sglang(server.url), run_dir=tmp_path, adapter=SPEC)
        with pytest.raises(AdapterLimitError, match=refusal):
            engine.init()
        assert server.lora_bodies == []
    finally:
        server.stop()


def test_the_broadcast_engine_leaves_sglang_out_of_an_adapter_push(standin: StandInSGLang) -> None:
    engine = create(BroadcastSyncConfig(backend="gloo", timeout_s=10), sglang(standin.url), adapter=SPEC)
    engine.init()
    try:
        stats = engine.push(weights(seed=1), 1)
        outcome = stats.outcomes[standin.url]
        assert not outcome.committed and "set weight_sync.type: disk" in outcome.reason, outcome
        assert standin.adapters == {}
    finally:
        engine.close()
