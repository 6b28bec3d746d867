"""`agentrl serve` as real processes: generate over HTTP, weight updates, and losing a server mid-run.

Two servers are started with the real command line on free loopback ports. The test process
plays the roller (router + SGLang client) and the trainer (rank 0 of a gloo weight group)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from agentrl.inference.base import RequestLostError
from agentrl.inference.router import Router
from agentrl.inference.sglang import SGLangClient
from tests.conftest import Processes, find_free_port, run_agentrl

pytestmark = [pytest.mark.slow, pytest.mark.integration]

PROMPT = [5, 17, 42, 99, 3]
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


async def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    async with SGLangClient(url, connect_timeout_s=2) as client:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(
                    f"agentrl serve exited {proc.returncode}: {proc.stderr.read().decode()[-2000:]}"
                )
            if await client.health():
                return
            await asyncio.sleep(0.2)
    raise AssertionError("agentrl serve did not become healthy")


@pytest.fixture(scope="module")
def servers(tiny_model: Path):
    procs = Processes()
    urls = []
    try:
        for _ in range(2):
            port = find_free_port()
            proc = procs.agentrl(
                "serve", "--model", str(tiny_model), "--port", str(port), stdout=subprocess.DEVNULL
            )
            urls.append((f"http://127.0.0.1:{port}", proc))
        for url, proc in urls:
            asyncio.run(_wait_healthy(url, proc))
        yield urls
    finally:
        procs.stop_all()


async def test_generate_logprobs_match_a_fresh_forward(servers, tiny_model: Path):
    from transformers import AutoModelForCausalLM

    url, _ = servers[0]
    async with SGLangClient(url) as client:
        res = await client.generate(PROMPT, {"max_new_tokens": 12, "ignore_eos": True, "temperature": 1.0})
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = model(input_ids=torch.tensor([PROMPT + res.output_ids])).logits[0].log_softmax(-1)
    ref = logp[len(PROMPT) - 1 : -1].gather(1, torch.tensor(res.output_ids)[:, None]).squeeze(1)
    assert len(res.output_ids) == 12 and res.finish_reason == "length"
    assert torch.allclose(torch.tensor(res.logprobs), ref, atol=1e-4)


async def test_weight_updates_from_disk_and_from_a_gloo_trainer(servers, tiny_model: Path, tmp_path: Path):
    from safetensors.torch import load_file, save_file

    from agentrl.inference.weight_group import dtype_name, join_group

    url, _ = servers[1]
    base = load_file(str(tiny_model / "model.safetensors"))
    gen = torch.Generator().manual_seed(3)
    changed = {k: (v + 5 * torch.randn(v.shape, generator=gen)).contiguous() for k, v in base.items()}
    (tmp_path / "v1").mkdir()
    save_file(changed, str(tmp_path / "v1" / "model.safetensors"))
    async with SGLangClient(url) as client:
        before = await client.generate(PROMPT, GREEDY)
        await client.update_weights_from_disk(str(tmp_path / "v1"), weight_version=1)
        after_disk = await client.generate(PROMPT, GREEDY)
        assert after_disk.weight_version == 1 and after_disk.output_ids != before.output_ids

        # push the original weights back over a real gloo group; this process is rank 0
        port, box = find_free_port(), {}
        joiner = threading.Thread(
            target=lambda: box.update(g=join_group("127.0.0.1", port, 0, 2, "wg", "gloo", 60))
        )
        joiner.start()
        await client.init_weights_update_group("127.0.0.1", port, 1, 2, "wg", "gloo")
        joiner.join(60)
        names = sorted(base)
        await client.begin_weight_update()  # SGLang 0.5.23: updates only inside a session
        call = asyncio.create_task(
            client.update_weights_from_distributed(
                names,
                [dtype_name(base[n].dtype) for n in names],
                [list(base[n].shape) for n in names],
                "wg",
                2,
            )
        )
        for n in names:
            await asyncio.to_thread(box["g"].broadcast, base[n].clone(), 0)
        await asyncio.wait_for(call, 60)
        await client.end_weight_update()
        restored = await client.generate(PROMPT, GREEDY)
        assert restored.weight_version == 2 and restored.output_ids == before.output_ids
        await client.destroy_weights_update_group("wg")
        box["g"].close()


async def test_killing_one_of_two_servers_loses_no_request_silently(servers):
    (url_a, proc_a), (url_b, _) = servers
    router = Router([SGLangClient(url_a), SGLangClient(url_b)], max_retries=2, request_timeout_s=120)
    params = {"max_new_tokens": 100, "ignore_eos": True}

    async def one(i: int):
        try:
            return await router.generate([10 + i, 20, 30], params)
        except RequestLostError as exc:
            return exc

    try:
        tasks = [asyncio.create_task(one(i)) for i in range(16)]
        deadline = time.monotonic() + 60
        while router.outstanding[0] < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert router.outstanding[0] >= 3, "server A never got in-flight requests"
        os.killpg(proc_a.pid, signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 300)
    finally:
        await router.close()
    lost = [r for r in results if isinstance(r, RequestLostError)]
    done = [r for r in results if not isinstance(r, Exception)]
    assert len(done) + len(lost) == 16 and router.stats["lost"] == len(lost)
    assert router.stats["retries"] >= 1  # the requests in flight on A moved to B
    assert all(len(r.output_ids) == 100 for r in done)
    assert not lost  # B stayed up, so every request was retried there and completed


def test_serve_refuses_a_missing_model(tmp_path: Path):
    out = run_agentrl("serve", "--model", str(tmp_path / "nope"), "--port", str(find_free_port()))
    assert out.returncode == 2 and "not a checkpoint directory" in out.stderr
