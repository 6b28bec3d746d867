"""`agentrl bench roller`: how many concurrent episodes one roller process sustains, and
its own CPU overhead per turn, against servers that never make it wait on compute.

    agentrl bench roller [--concurrency 2048] [--delay-s 3] [--groups 768]
    agentrl bench roller --concurrency 8 --delay-s 0.01 --groups 2   # seconds: every path, tiny load

The outside edges run in a child process: a real HTTP server speaking SGLang's `/generate`
that answers after `--delay-s` (standing in for a GPU fleet's latency) with scripted
calculator turns, and a real TransferQueue server whose consumer acks every group. The
roller under test is the real one (toy calculator env, incremental chat rendering,
admission, queue producer). Its CPU time per turn is measured with `process_time`, which
excludes the child. The baseline is the one the issue names: a roller must never limit a
GPU fleet — ≥ 2,000 concurrent episodes and < 1 ms of roller CPU per turn.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from agentrl.bench.common import emit, print_table


def _edge(model_dir: str, http_port: int, queue_address: str, delay_s: float) -> None:
    """Child process: scripted SGLang server + queue server draining into an acking consumer."""
    import threading

    from transformers import AutoTokenizer

    from agentrl.bench.scripted_server import Reply, ScriptedServer
    from agentrl.config import ZmqQueueConfig
    from agentrl.queue import create

    tok = AutoTokenizer.from_pretrained(model_dir)
    response_tag = tok.convert_tokens_to_ids("<tool_response>")
    call = [
        *tok.encode(
            '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 34"}}\n</tool_call>',
            add_special_tokens=False,
        ),
        tok.eos_token_id,
    ]
    answer = [*tok.encode("408", add_special_tokens=False), tok.eos_token_id]

    def script(ids: list[int], params: dict) -> Reply:
        return Reply(answer if response_tag in ids else call, delay_s=delay_s)

    backend = create(ZmqQueueConfig(address=queue_address, auth="none", capacity_groups=1 << 20))
    queue = backend.server(groups_per_step=1 << 20, max_staleness=1 << 20).start()
    consumer = backend.consumer("drain", server=queue)

    def drain() -> None:
        while True:
            try:
                batch = consumer.get_batch(1, 0, 1 << 20, timeout_s=1.0)
            except TimeoutError:
                continue
            consumer.ack(batch.group_ids)

    threading.Thread(target=drain, daemon=True).start()

    async def serve() -> None:
        await ScriptedServer(script, record=False).start(http_port)
        print("ready", flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


async def _run_roller(model_dir: str, url: str, queue_address: str, concurrency: int, groups: int) -> dict:
    from transformers import AutoTokenizer

    from agentrl.config import EnvConfig, RollerConfig, ZmqQueueConfig
    from agentrl.envs.registry import env_factory
    from agentrl.envs.toy import CalculatorEnv
    from agentrl.inference.sglang import SGLangClient
    from agentrl.queue import create
    from agentrl.rollers.chat import ChatRenderer
    from agentrl.rollers.roller import Roller
    from agentrl.rollers.tasks import task_stream

    make_env = env_factory(EnvConfig(name="toy_calculator"))
    config = RollerConfig(group_size=8, max_concurrent_episodes=concurrency, max_groups=groups, log_every_s=5)
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(model_dir), make_env().tool_schemas)
    client = SGLangClient(url, timeout_s=600)
    producer = create(ZmqQueueConfig(address=queue_address, auth="none")).producer()
    roller = Roller(config, make_env, task_stream("builtin", CalculatorEnv, 0), client, renderer, producer)
    wall, cpu = time.perf_counter(), time.process_time()
    stats = await roller.run()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    await client.close()
    producer.close()
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "episodes": stats.episodes,
        "turns": stats.turns,
        "peak_in_flight": stats.peak_in_flight_episodes,
        "groups_put": stats.groups_put,
    }


def main(args: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="agentrl bench roller")
    parser.add_argument("--concurrency", type=int, default=2048)
    parser.add_argument("--delay-s", type=float, default=3.0, help="scripted server latency per turn")
    parser.add_argument("--groups", type=int, default=768)
    parser.add_argument("--edge", nargs=4, help=argparse.SUPPRESS)
    opts = parser.parse_args(args)
    if opts.edge:
        _edge(opts.edge[0], int(opts.edge[1]), opts.edge[2], float(opts.edge[3]))
        return 0

    from agentrl.net import free_port
    from agentrl.tiny_model import init_model

    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM runs the finally that stops the edge
    with tempfile.TemporaryDirectory(prefix="agentrl-bench-roller-") as tmp:
        model_dir = str(init_model("tiny", Path(tmp) / "tiny"))
        http_port = free_port()
        queue_address = f"tcp://127.0.0.1:{free_port()}"
        edge = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "agentrl",
                "bench",
                "roller",
                "--edge",
                model_dir,
                str(http_port),
                queue_address,
                str(opts.delay_s),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        try:
            if edge.stdout.readline().strip() != "ready":
                raise RuntimeError("the scripted edge process failed to start")
            result = asyncio.run(
                _run_roller(
                    model_dir, f"http://127.0.0.1:{http_port}", queue_address, opts.concurrency, opts.groups
                )
            )
        finally:
            os.killpg(edge.pid, 9)
            edge.wait()

    overhead_ms = 1000 * result["cpu_s"] / max(1, result["turns"])
    turns_per_s = result["turns"] / result["wall_s"]
    print_table(
        f"roller against an instant scripted server (latency {opts.delay_s:.1f}s per turn)",
        ["measure", "value", "target"],
        [
            ["peak concurrent episodes", result["peak_in_flight"], ">= 2000"],
            ["roller CPU per turn (ms)", overhead_ms, "< 1"],
            ["turns/s", turns_per_s, ""],
            ["episodes", result["episodes"], ""],
            ["groups put", result["groups_put"], ""],
        ],
    )
    emit(
        "roller",
        {
            "max_concurrent_episodes": result["peak_in_flight"],
            "overhead_ms_per_turn": overhead_ms,
            "turns_per_s": turns_per_s,
            "episodes": result["episodes"],
            "wall_s": result["wall_s"],
        },
        {
            "concurrency_vs_target": result["peak_in_flight"] / 2000,
            "overhead_budget_vs_ours": 1.0 / overhead_ms if overhead_ms else 0.0,
        },
    )
    return 0
