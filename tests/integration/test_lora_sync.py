"""LoRA weight sync into a real `agentrl serve` process, from a real LoRA learner (FSDP2 + PEFT, one
rank): after each adapter push (broadcast over gloo, or a PEFT adapter directory from disk) the
server reports the version and its log-probs on a fixed prompt equal the learner's PEFT forward
within 1e-4 (fp32) and differ from the previous version's, so the test fails if the adapter did not
arrive; the push moves the adapter's bytes only; a merged push (`lora_mode: merged`, the full-weight
path) serves the same log-probs as the adapter, after which the server refuses adapters (its base
is no longer the one they were trained on). One server for the module; the merged test runs last."""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from agentrl.config import BroadcastSyncConfig, DiskSyncConfig, InferenceConfig
from agentrl.inference.base import BadRequestError
from agentrl.inference.sglang import SGLangClient
from agentrl.learner.loop import build_learner
from agentrl.weight_sync.registry import create
from tests.conftest import Processes, find_free_port
from tests.integration.test_weight_sync import PROBE, wait_healthy
from tests.unit.learner.source import learner_config

pytestmark = [pytest.mark.slow, pytest.mark.integration]

LORA = {"rank": 8, "alpha": 16.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"]}


@pytest.fixture(scope="module")
def rig(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """One embedded server and one LoRA learner; `versions` hands out the next version to push."""
    logs = tmp_path_factory.mktemp("lora_server")
    procs = Processes()
    port = find_free_port()
    url = f"http://127.0.0.1:{port}"
    with open(logs / "server.log", "wb") as out:
        procs.agentrl("serve", "--model", str(tiny_model), "--port", str(port), stdout=out, stderr=out)
    try:
        wait_healthy([url])
        cfg = learner_config(model_path=str(tiny_model), lora=LORA)
        learner = build_learner(cfg, logs / "run")
        learner.model.eval()
        yield url, learner, itertools.count(1), logs
    finally:
        procs.stop_all()


def probe(url: str) -> tuple[int, list[int], list[float], dict]:
    async def go():
        client = SGLangClient(url)
        try:
            result = await client.generate(
                PROBE, {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True}
            )
            return result.weight_version, result.output_ids, result.logprobs, await client.get_model_info()
        finally:
            await client.close()

    return asyncio.run(go())


def generate_naming(url: str, adapter: str) -> dict:
    """A raw `/generate` that names the adapter (SGLang's `lora_path`)."""

    async def go():
        client = SGLangClient(url)
        try:
            body = {"input_ids": PROBE, "sampling_params": {"max_new_tokens": 2}, "lora_path": adapter}
            return await client.http.request("POST", "/generate", body)
        finally:
            await client.close()

    return asyncio.run(go())


def learner_logprobs(model, output_ids: list[int], adapter: bool = True) -> list[float]:
    ids = torch.tensor([PROBE + output_ids])
    with torch.no_grad():
        if adapter:
            logits = model(input_ids=ids).logits
        else:
            with model.disable_adapter():
                logits = model(input_ids=ids).logits
    logp = torch.log_softmax(logits[0].float(), -1)
    n = len(PROBE)
    return [logp[n - 1 + i, t].item() for i, t in enumerate(output_ids)]


def move_adapter(learner, seed: int) -> None:
    """Stand-in for a training step (the learner's own steps are tested in test_lora.py): new
    values in every lora_A / lora_B shard."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in learner.model.named_parameters():
            if ".lora_" in name:
                local = p.to_local() if hasattr(p, "to_local") else p
                local.copy_(torch.randn(local.shape, generator=gen) * 0.2)


def adapter_bytes(learner) -> int:
    return sum(p.numel() * p.element_size() for n, p in learner.model.named_parameters() if ".lora_" in n)


def gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def assert_serves_learner(url: str, learner, version: int) -> list[int]:
    served_version, output_ids, served, _ = probe(url)
    assert served_version == version
    assert gap(served, learner_logprobs(learner.model, output_ids)) < 1e-4
    return output_ids


def test_adapter_broadcast_serves_the_learners_peft_forward(rig) -> None:
    url, learner, versions, _ = rig
    engine = create(BroadcastSyncConfig(bucket_mb=1, timeout_s=20), InferenceConfig(servers=[url]))
    engine.init()
    try:
        previous = None
        for _ in range(2):
            version = next(versions)
            move_adapter(learner, seed=version)
            stats = engine.push(learner.weights(), version)
            assert stats.servers_updated == 1, stats.outcomes
            assert stats.bytes == adapter_bytes(learner)  # the adapter's bytes only
            assert stats.tensors == 2 * len(LORA["target_modules"]) * learner.model.config.num_hidden_layers
            output_ids = assert_serves_learner(url, learner, version)
            assert probe(url)[3]["lora_adapter"] == f"agentrl-lora-v{version}"
            assert generate_naming(url, f"agentrl-lora-v{version}")["meta_info"]["weight_version"] == str(
                version
            )
            with pytest.raises(BadRequestError, match="serves agentrl's adapter"):
                generate_naming(url, "someone-elses-adapter")
            # the served policy is not the base's, nor the previous adapter's
            served = probe(url)[2]
            assert gap(served, learner_logprobs(learner.model, output_ids, adapter=False)) > 1e-3
            if previous is not None:
                assert gap(served, previous(output_ids)) > 1e-3
            snapshot = {n: p.detach().clone() for n, p in learner.model.named_parameters() if ".lora_" in n}
            previous = _logprobs_with(learner, snapshot)
    finally:
        engine.close()


def _logprobs_with(learner, snapshot: dict):
    """The learner's log-probs under the adapter values in `snapshot` (a closed-over copy)."""

    def compute(output_ids: list[int]) -> list[float]:
        params = dict(learner.model.named_parameters())
        now = {n: params[n].detach().clone() for n in snapshot}
        with torch.no_grad():
            for n, t in snapshot.items():
                params[n].copy_(t)
            try:
                return learner_logprobs(learner.model, output_ids)
            finally:
                for n, t in now.items():
                    params[n].copy_(t)

    return compute


def test_adapter_from_disk_is_a_peft_directory_the_server_loads(rig, tmp_path: Path) -> None:
    url, learner, versions, _ = rig
    engine = create(DiskSyncConfig(keep_last=1), InferenceConfig(servers=[url]), run_dir=tmp_path)
    engine.init()
    try:
        for _ in range(2):
            version = next(versions)
            move_adapter(learner, seed=200 + version)
            stats = engine.push(learner.weights(), version)
            assert stats.servers_updated == 1, stats.outcomes
            assert stats.bytes == adapter_bytes(learner)
            assert_serves_learner(url, learner, version)
        written = tmp_path / "weights" / f"v{version}"
        assert sorted(p.name for p in written.iterdir()) == [
            "adapter_config.json",
            "adapter_model.safetensors",
        ]
        assert json.loads((written / "adapter_config.json").read_text())["r"] == LORA["rank"]
        # the directory is PEFT's format: PEFT itself loads it and computes the learner's forward
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(learner.cfg.model_path, dtype=torch.float32)
        loaded = PeftModel.from_pretrained(base, written).eval()
        ids = torch.tensor([PROBE])
        with torch.no_grad():
            torch.testing.assert_close(loaded(input_ids=ids).logits, learner.model(input_ids=ids).logits,
                                       rtol=0, atol=1e-5)  # fmt: skip
    finally:
        engine.close()


def test_merged_push_serves_what_the_adapter_serves(rig) -> None:
    url, learner, versions, _ = rig
    adapter_engine = create(BroadcastSyncConfig(bucket_mb=1, timeout_s=20), InferenceConfig(servers=[url]))
    adapter_engine.init()
    try:
        version = next(versions)
        move_adapter(learner, seed=100 + version)
        assert adapter_engine.push(learner.weights(), version).servers_updated == 1
        by_adapter_ids = assert_serves_learner(url, learner, version)
    finally:
        adapter_engine.close()
    merged = create(
        BroadcastSyncConfig(bucket_mb=1, timeout_s=20, lora_mode="merged"), InferenceConfig(servers=[url])
    )
    merged.init()
    try:
        version = next(versions)  # the same learner weights, merged
        stats = merged.push(learner.weights(), version)
        assert stats.servers_updated == 1, stats.outcomes
        plain = sum(
            p.numel() * p.element_size() for n, p in learner.model.named_parameters() if ".lora_" not in n
        )
        assert stats.bytes == plain  # the full weights went, no adapter tensor
        served_version, output_ids, by_merged, info = probe(url)
        assert served_version == version and info["lora_adapter"] is None  # the adapter was replaced
        # both equal the learner's PEFT forward within 1e-4, so each other's within 2e-4
        assert gap(by_merged, learner_logprobs(learner.model, output_ids)) < 1e-4
        assert gap(by_merged, learner_logprobs(learner.model, output_ids, adapter=False)) > 1e-3
        assert by_adapter_ids
    finally:
        merged.close()
    # the base is now merged weights: an adapter push is refused, the server stays as it was
    engine = create(BroadcastSyncConfig(bucket_mb=1, timeout_s=20), InferenceConfig(servers=[url]))
    engine.init()
    try:
        stats = engine.push(learner.weights(), next(versions))
        assert stats.servers_updated == 0
        assert "replaced by a full-weight push" in stats.outcomes[url].reason
        assert probe(url)[0] == version
    finally:
        engine.close()
