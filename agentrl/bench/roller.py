"""`agentrl bench roller`: how many concurrent episodes one roller process sustains, and
its own CPU overhead per turn, against servers that never make it wait on compute.

    agentrl bench roller [--concurrency 2048] [--delay-s 3] [--groups 768]
    agentrl bench roller --concurrency 8 --delay-s 0.01 --groups 2   # seconds: every path, tiny load

The outside edges run in a child process: a real HTTP server speaking SGLang's `/generate`
that answers after `--delay-s` (standing in for a GPU fleet's latency) with scripted
calculator turns, and a real TransferQueue server whose consumer acks every group. The
roller under test is the real one (toy calculator env, incremental chat rendering,
admission, queue producer). Its CPU time per turn is measured with `process_time`, which
excludes the child. The targets: a roller must never limit a GPU fleet — ≥ 2,000 concurrent
episodes and < 1 ms of roller CPU per turn.

The baseline, measured in the same run against the same edge: the same episodes (the same
tasks, `group_size` each, through the same `run_episode`, env, renderer and client, at the same
concurrency) driven by a minimal asyncio loop — a semaphore and `gather`, no queue, no admission,
no accounting. It is what running the episodes costs with nothing of the roller's machinery
around them, so `ratios.cpu_per_turn_bare_vs_ours` (bare CPU per turn / ours) is the share of the
roller's CPU the episodes themselves take, and `ratios.concurrency_vs_bare` compares the peak
episodes in flight. The JSON carries both sides' CPU seconds, turns and peaks.

Two more runs in the same process, against the same edge, play the same calculator task through
the OpenAI-compatible endpoint (`env.name: agent`), with the agent in the roller's process so its
client's CPU counts with the endpoint's: `calculator_agent_http` with a bare aiohttp client (what
the endpoint itself costs over the built-in loop: serving the request, checking it's an
extension, rendering the new turns, the response), and `calculator_agent`, written only with
the `openai` SDK (what an SDK agent costs: the SDK builds each request through its typed-param
transform and its httpx pool, and parses each answer into models, ~4 ms of CPU per turn here,
most of the column). Episodes/s and CPU per turn of the three runs, side by side, are what
plugging an existing agent in costs. Without the `openai` package (a dev extra) the SDK column is
left out, and the table says so.
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
    from agentrl.queue import create
    from agentrl.queue.config import ZmqQueueConfig

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


_clients: dict = {}  # one client per event loop (its connection pool belongs to that loop)


async def calculator_agent(base_url: str, api_key: str, task: dict) -> str | None:
    """The calculator task as an `openai`-SDK agent: it runs the model's calculator calls itself."""
    from openai import AsyncOpenAI

    loop = asyncio.get_running_loop()
    if (loop, "sdk") not in _clients:
        _clients[loop, "sdk"] = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    llm = _clients[loop, "sdk"].with_options(base_url=base_url, api_key=api_key)

    async def ask(messages: list[dict], tools: list[dict]) -> dict:
        reply = await llm.chat.completions.create(model="policy", messages=messages, tools=tools)
        return reply.choices[0].message.model_dump(exclude_none=True)

    return await _calculator_turns(task, ask)


async def calculator_agent_http(base_url: str, api_key: str, task: dict) -> str | None:
    """The same agent with a bare HTTP client (aiohttp) instead of the SDK: what the endpoint
    costs without the SDK's request building and response models."""
    import aiohttp

    loop = asyncio.get_running_loop()
    if (loop, "http") not in _clients:
        _clients[loop, "http"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    http = _clients[loop, "http"]

    async def ask(messages: list[dict], tools: list[dict]) -> dict:
        body = {"model": "policy", "messages": messages, "tools": tools}
        headers = {"Authorization": f"Bearer {api_key}"}
        async with http.post(f"{base_url}/chat/completions", json=body, headers=headers) as response:
            message = (await response.json())["choices"][0]["message"]
        return {k: v for k, v in message.items() if v is not None}

    return await _calculator_turns(task, ask)


async def _calculator_turns(task: dict, ask) -> str | None:
    import json

    from agentrl.envs.toy import CalculatorEnv, safe_eval

    env = CalculatorEnv()
    messages, tools = env.prompt(task), env.tool_schemas
    for _ in range(4):
        message = await ask(messages, tools)
        messages.append(message)
        if not message.get("tool_calls"):
            return message.get("content")
        for call in message["tool_calls"]:
            expression = json.loads(call["function"]["arguments"]).get("expression", "")
            messages.append(
                {"role": "tool", "tool_call_id": call["id"], "content": str(safe_eval(expression))}
            )
    return None


def calculator_reward(transcript, result) -> float:
    return float(result is not None and result.strip() == transcript.task["answer"])


async def _run_roller(
    model_dir: str, url: str, queue_address: str, concurrency: int, groups: int, agent: str = ""
) -> dict:
    """One roller run; `agent` (`calculator_agent` or `calculator_agent_http`): through the
    endpoint with that agent, else the built-in env."""
    from transformers import AutoTokenizer

    from agentrl.envs.config import EnvConfig
    from agentrl.envs.registry import env_factory
    from agentrl.envs.toy import CalculatorEnv
    from agentrl.inference.sglang import SGLangClient
    from agentrl.queue import create
    from agentrl.queue.config import ZmqQueueConfig
    from agentrl.rollers.chat import ChatRenderer
    from agentrl.rollers.config import RollerConfig
    from agentrl.rollers.roller import Roller
    from agentrl.rollers.tasks import task_stream

    kwargs = {"agent": f"{__name__}:{agent}", "reward": f"{__name__}:calculator_reward"}
    make_env = env_factory(
        EnvConfig(name="agent", kwargs=kwargs) if agent else EnvConfig(name="toy_calculator")
    )
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
    for key in [k for k in _clients if k[0] is asyncio.get_running_loop()]:
        await _clients.pop(key).close()
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "episodes": stats.episodes,
        "turns": stats.turns,
        "peak_in_flight": stats.peak_in_flight_episodes,
        "groups_put": stats.groups_put,
        "failed": stats.groups_failed,
        "reward": sum(stats.rewards) / max(1, len(stats.rewards)),
    }


async def _run_bare(model_dir: str, url: str, concurrency: int, groups: int) -> dict:
    """The baseline: the roller's episodes (same tasks, `group_size` each) in a minimal asyncio
    loop — a semaphore for the concurrency, `gather`, nothing else."""
    from itertools import islice

    from transformers import AutoTokenizer

    from agentrl.envs.config import EnvConfig
    from agentrl.envs.registry import env_factory
    from agentrl.envs.toy import CalculatorEnv
    from agentrl.inference.sglang import SGLangClient
    from agentrl.rollers.agent_loop import run_episode
    from agentrl.rollers.chat import ChatRenderer
    from agentrl.rollers.config import RollerConfig
    from agentrl.rollers.tasks import task_stream

    make_env = env_factory(EnvConfig(name="toy_calculator"))
    config = RollerConfig(group_size=8, max_concurrent_episodes=concurrency, max_groups=groups)
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(model_dir), make_env().tool_schemas)
    client = SGLangClient(url, timeout_s=600)
    slots, in_flight, peak = asyncio.Semaphore(concurrency), [0], [0]

    async def one(task: dict) -> int:
        async with slots:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
            try:
                return (await run_episode(make_env(), task, client, renderer, config)).num_turns
            finally:
                in_flight[0] -= 1

    tasks = list(islice(task_stream("builtin", CalculatorEnv, 0), groups))
    wall, cpu = time.perf_counter(), time.process_time()
    turns = await asyncio.gather(*(one(task) for task in tasks for _ in range(config.group_size)))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    await client.close()
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "episodes": len(turns),
        "turns": sum(turns),
        "peak_in_flight": peak[0],
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
            url = f"http://127.0.0.1:{http_port}"
            result = asyncio.run(_run_roller(model_dir, url, queue_address, opts.concurrency, opts.groups))
            bare = asyncio.run(_run_bare(model_dir, url, opts.concurrency, opts.groups))
            http = asyncio.run(
                _run_roller(
                    model_dir, url, queue_address, opts.concurrency, opts.groups, "calculator_agent_http"
                )
            )
            try:
                import openai  # noqa: F401
            except ImportError:
                agent = None
            else:
                agent = asyncio.run(
                    _run_roller(
                        model_dir, url, queue_address, opts.concurrency, opts.groups, "calculator_agent"
                    )
                )
        finally:
            os.killpg(edge.pid, 9)
            edge.wait()

    overhead_ms = 1000 * result["cpu_s"] / max(1, result["turns"])
    turns_per_s = result["turns"] / result["wall_s"]
    bare_ms = 1000 * bare["cpu_s"] / max(1, bare["turns"])
    print_table(
        f"roller against an instant scripted server (latency {opts.delay_s:.1f}s per turn); bare loop: the same episodes, no queue, no admission",
        ["measure", "value", "bare loop", "target"],
        [
            ["peak concurrent episodes", result["peak_in_flight"], bare["peak_in_flight"], ">= 2000"],
            ["roller CPU per turn (ms)", overhead_ms, bare_ms, "< 1"],
            ["turns/s", turns_per_s, bare["turns"] / bare["wall_s"], ""],
            ["episodes", result["episodes"], bare["episodes"], ""],
            ["groups put", result["groups_put"], "-", ""],
        ],
    )
    agent_row = {
        "builtin_episodes_per_s": result["episodes"] / result["wall_s"],
        "endpoint_http_episodes_per_s": http["episodes"] / http["wall_s"],
        "endpoint_http_overhead_ms_per_turn": 1000 * http["cpu_s"] / max(1, http["turns"]),
        "endpoint_http_groups_failed": http["failed"],
    }
    runs = [("built-in", result), ("endpoint, HTTP agent", http)]
    if agent is None:
        print("SDK column left out: the openai package is not installed (pip install 'agentrl[dev]')")
    else:
        agent_row |= {
            "endpoint_episodes_per_s": agent["episodes"] / agent["wall_s"],
            "endpoint_overhead_ms_per_turn": 1000 * agent["cpu_s"] / max(1, agent["turns"]),
            "endpoint_reward": agent["reward"],
            "endpoint_groups_failed": agent["failed"],
        }
        runs.append(("endpoint, SDK agent", agent))
    print_table(
        "same task and server: the built-in agent loop vs an agent through the endpoint (in-process; "
        "its client's CPU counts)",
        ["measure", *(name for name, _ in runs)],
        [
            ["episodes/s", *(r["episodes"] / r["wall_s"] for _, r in runs)],
            ["CPU per turn (ms)", *(1000 * r["cpu_s"] / max(1, r["turns"]) for _, r in runs)],
            ["episodes", *(r["episodes"] for _, r in runs)],
            ["groups failed", *(r.get("failed", 0) for _, r in runs)],
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
            "cpu_s": result["cpu_s"],
            "turns": result["turns"],
            "bare_cpu_s": bare["cpu_s"],
            "bare_turns": bare["turns"],
            "bare_episodes": bare["episodes"],
            "bare_wall_s": bare["wall_s"],
            "bare_max_concurrent_episodes": bare["peak_in_flight"],
            "bare_overhead_ms_per_turn": bare_ms,
            **agent_row,
        },
        {
            "concurrency_vs_target": result["peak_in_flight"] / 2000,
            "overhead_budget_vs_ours": 1.0 / overhead_ms if overhead_ms else 0.0,
            "cpu_per_turn_bare_vs_ours": bare_ms / overhead_ms if overhead_ms else 0.0,
            "concurrency_vs_bare": result["peak_in_flight"] / bare["peak_in_flight"]
            if bare["peak_in_flight"]
            else 0.0,
        },
    )
    return 0
