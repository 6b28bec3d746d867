"""Weight sync against real `agentrl serve` processes: broadcast (gloo) and disk.

After each push every server reports the learner's version and its log-probs on a fixed
probe prompt equal the learner's within 1e-4 (fp32). A server killed before a push is
dropped and the push completes for the others; restarted, it rejoins at the next push."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from agentrl.config import BroadcastSyncConfig, DiskSyncConfig, InferenceConfig
from agentrl.inference.sglang import SGLangClient
from agentrl.weight_sync.registry import create
from tests.conftest import find_free_port

pytestmark = [pytest.mark.slow, pytest.mark.integration]

PROBE = [692, 353, 198, 54, 71, 272, 428, 220, 18, 10, 19, 30, 693, 198, 692, 661, 198]


def start_server(processes, model: Path, port: int):
    return processes.agentrl("serve", "--model", str(model), "--port", str(port))


def wait_healthy(urls: list[str], timeout_s: float = 60) -> None:
    async def check() -> bool:
        clients = [SGLangClient(u, timeout_s=2, connect_timeout_s=1) for u in urls]
        try:
            return all([await c.health() for c in clients])
        finally:
            for c in clients:
                await c.close()

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if asyncio.run(check()):
            return
        time.sleep(0.3)
    raise TimeoutError(f"servers {urls} not healthy after {timeout_s}s")


def server_probe(url: str) -> tuple[int, list[int], list[float]]:
    async def go():
        client = SGLangClient(url)
        try:
            result = await client.generate(
                PROBE, {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True}
            )
            return result.weight_version, result.output_ids, result.logprobs
        finally:
            await client.close()

    return asyncio.run(go())


def learner_logprobs(model, output_ids: list[int]) -> list[float]:
    ids = torch.tensor([PROBE + output_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
    n = len(PROBE)
    return [logp[n - 1 + i, t].item() for i, t in enumerate(output_ids)]


def perturb(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)


def assert_in_sync(model, urls: list[str], version: int) -> None:
    for url in urls:
        server_version, output_ids, logprobs = server_probe(url)
        assert server_version == version, url
        ours = learner_logprobs(model, output_ids)
        assert max(abs(a - b) for a, b in zip(ours, logprobs, strict=True)) < 1e-4, (url, ours, logprobs)


@pytest.fixture
def two_servers(processes, tiny_model: Path):
    ports = [find_free_port(), find_free_port()]
    procs = [start_server(processes, tiny_model, p) for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    wait_healthy(urls)
    return procs, urls, ports


def test_broadcast_push_updates_every_server_and_survives_a_dead_one(
    processes, tiny_model, two_servers
) -> None:
    procs, urls, ports = two_servers
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    engine = create(BroadcastSyncConfig(bucket_mb=1, timeout_s=20), InferenceConfig(servers=urls))
    engine.init()
    try:
        perturb(model, 1)
        stats = engine.push(model.named_parameters, 1)
        assert stats.servers_updated == 2 and stats.buckets >= 1
        assert stats.peak_bucket_bytes <= max(1 << 20, max(p.numel() * 4 for p in model.parameters()))
        assert_in_sync(model, urls, 1)

        # a server dies: the next push drops it and still completes for the other
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait()
        perturb(model, 2)
        stats = engine.push(model.named_parameters, 2)
        assert stats.servers_updated == 1 and stats.servers_dropped == [urls[1]]
        assert_in_sync(model, urls[:1], 2)

        # it comes back on the same port: the next push takes it in again
        start_server(processes, tiny_model, ports[1])
        wait_healthy(urls[1:])
        perturb(model, 3)
        stats = engine.push(model.named_parameters, 3)
        assert stats.servers_updated == 2 and stats.servers_dropped == []
        assert_in_sync(model, urls, 3)
    finally:
        engine.close()


def test_disk_push_updates_every_server(tiny_model, two_servers, tmp_path: Path) -> None:
    _, urls, _ = two_servers
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    engine = create(DiskSyncConfig(keep_last=1), InferenceConfig(servers=urls), run_dir=tmp_path)
    engine.init()
    try:
        for version in (1, 2):
            perturb(model, version)
            stats = engine.push(model.named_parameters, version)
            assert stats.servers_updated == 2
            assert_in_sync(model, urls, version)
        assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v2"]  # keep_last=1
    finally:
        engine.close()
