"""`agentrl bench serve`: the embedded server's generation throughput at concurrency 1, 8 and 32.

Starts a real `agentrl serve` process on a free port with a freshly made local model, sends
the same number of requests at each concurrency through the SGLang client (fixed
`max_new_tokens`, `ignore_eos`, so every request generates the same number of tokens), and
reports generated tokens per second (the JSON carries each level's tokens and seconds too). The baseline is concurrency 1 on the same server in the
same run, so the ratios say how much continuous batching buys on this machine. With `--vllm`,
a real vLLM server (`.venv-vllm`, `make vllm`; started by `inference/vllm_launch.py`) is
measured afterwards on the same model and prompts at concurrency 1 and 32 (one server at a
time, so neither slows the other), through agentrl's vLLM client.

    agentrl bench serve                       # tiny model
    agentrl bench serve --preset small --requests 32 --max-new-tokens 32
    agentrl bench serve --preset mini --vllm  # + the vLLM rows
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from agentrl.bench.common import emit, print_table, stop_child
from agentrl.net import free_port


async def _wait_healthy(client, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"agentrl serve exited with {proc.returncode}")
        if await client.health():
            return
        await asyncio.sleep(0.2)
    raise TimeoutError("agentrl serve did not become healthy")


async def _run_level(client, concurrency: int, requests: int, prompt_len: int, max_new_tokens: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    params = {"max_new_tokens": max_new_tokens, "ignore_eos": True, "temperature": 1.0}

    async def one(i: int) -> int:
        prompt = [(7 * i + 13 * k) % 500 + 10 for k in range(prompt_len)]
        async with sem:
            res = await client.generate(prompt, params)
        return len(res.output_ids)

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i) for i in range(requests))))
    elapsed = time.perf_counter() - start
    return {"concurrency": concurrency, "requests": requests, "tokens": tokens, "seconds": elapsed}


async def _bench(url: str, proc: subprocess.Popen, args: argparse.Namespace) -> list[dict]:
    from agentrl.inference.sglang import SGLangClient

    async with SGLangClient(url, timeout_s=600) as client:
        await _wait_healthy(client, proc)
        return await _levels(client, args, (1, 8, 32))


async def _levels(client, args: argparse.Namespace, levels: tuple[int, ...]) -> list[dict]:
    await _run_level(client, 4, 4, args.prompt_len, 4)  # warm-up
    return [
        await _run_level(client, c, max(c, args.requests), args.prompt_len, args.max_new_tokens)
        for c in levels
    ]


def _bench_vllm(model: str, args: argparse.Namespace) -> list[dict]:
    """The same levels 1 and 32 against a real vLLM server on `model`, started and stopped here."""
    from agentrl.inference.config import InferenceConfig
    from agentrl.inference.vllm import VLLMClient
    from agentrl.inference.vllm_launch import VLLMServer

    async def go(url: str) -> list[dict]:
        async with VLLMClient(url, timeout_s=600) as client:
            return await _levels(client, args, (1, 32))

    with VLLMServer(model, free_port(), InferenceConfig(type="vllm")) as server:
        return asyncio.run(go(server.url))


def main(args: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="agentrl bench serve", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--preset", default="tiny", help="model preset made by agentrl.tiny_model (tiny|small)"
    )
    parser.add_argument("--requests", type=int, default=64, help="requests per concurrency level (≥ level)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--model", default=None, help="serve this checkpoint instead of a fresh preset")
    parser.add_argument("--vllm", action="store_true", help="also measure a real vLLM server (make vllm)")
    ns = parser.parse_args(args)

    from agentrl.tiny_model import init_model

    with tempfile.TemporaryDirectory(prefix="agentrl-bench-serve-") as tmp:
        model = ns.model or str(init_model(ns.preset, Path(tmp) / ns.preset))
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "agentrl", "serve", "--model", model, "--port", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
            env={**os.environ},
        )
        try:
            results = asyncio.run(_bench(f"http://127.0.0.1:{port}", proc, ns))
        finally:
            stop_child(proc, 30)
        vllm = _bench_vllm(model, ns) if ns.vllm else []  # after the embedded server is gone
    tps = {r["concurrency"]: r["tokens"] / r["seconds"] for r in results}
    rows = [
        [server, r["concurrency"], r["requests"], r["tokens"], r["seconds"], r["tokens"] / r["seconds"]]
        for server, runs in (("agentrl serve", results), ("vLLM", vllm))
        for r in runs
    ]
    print_table(
        f"inference server throughput ({ns.model or ns.preset}, {ns.max_new_tokens} new tokens/request)",
        ["server", "concurrency", "requests", "tokens", "seconds", "tokens/s"],
        rows,
    )
    metrics = {f"tokens_per_s_c{c}": v for c, v in tps.items()}
    for r in results:  # the raw figures behind each rate (every level on the same server, this run)
        metrics.update({f"{key}_c{r['concurrency']}": r[key] for key in ("tokens", "seconds", "requests")})
    metrics.update({f"vllm_tokens_per_s_c{r['concurrency']}": r["tokens"] / r["seconds"] for r in vllm})
    metrics.update(model=ns.model or ns.preset, max_new_tokens=ns.max_new_tokens, requests=ns.requests)
    emit("serve", metrics, {"c8_vs_c1": tps[8] / tps[1], "c32_vs_c1": tps[32] / tps[1]})
    return 0
