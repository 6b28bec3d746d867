"""Evaluate a policy on held-out QA: exact match per data source, as Search-R1 reports it.

    report = asyncio.run(evaluate_config(load_config("recipes/search_r1.yaml"), "test.jsonl"))
    print(format_report(report))

Each task is one greedy episode (top-k 1) of the configured env against the configured
inference servers; the report gives, per `data_source` and overall, the number of
questions, EM, substring EM, the share answered and the mean number of searches. Without a
task file the held-out split of the synthetic world is used. This is the engine behind
`agentrl eval`; it needs the inference servers and the retriever to be running. It lives with the
rollers because it drives their agent loop (the env package stays below the rollers).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from agentrl.config import AgentRLConfig
from agentrl.envs.base import Env
from agentrl.inference.base import InferenceClient
from agentrl.rollers.agent_loop import run_episode
from agentrl.rollers.chat import ChatRenderer
from agentrl.rollers.config import RollerConfig

FIELDS = ("em", "subem", "answered", "search_calls")


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Mean of each field per data source and overall, with the count `n`."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        groups[str(row.get("data_source", "unknown"))].append(row)
    groups["overall"] = rows
    return {
        source: {"n": len(items), **{f: sum(float(r.get(f, 0)) for r in items) / len(items) for f in FIELDS}}
        for source, items in groups.items()
        if items
    }


async def evaluate(
    make_env: Callable[[], Env],
    tasks: list[dict[str, Any]],
    client: InferenceClient,
    renderer: ChatRenderer,
    config: RollerConfig,
    concurrency: int = 32,
) -> dict[str, dict[str, float]]:
    """Run one episode per task (at most `concurrency` at once) and summarise EM per data source."""
    gate = asyncio.Semaphore(concurrency)

    async def one(task: dict[str, Any]) -> dict[str, Any]:
        async with gate:
            episode = await run_episode(make_env(), task, client, renderer, config)
        return {**episode.metrics, "reward": episode.reward}

    return summarize(await asyncio.gather(*(one(t) for t in tasks)))


async def evaluate_config(
    config: AgentRLConfig, tasks_path: str | None = None, limit: int | None = None
) -> dict[str, dict[str, float]]:
    """Evaluate the run's env and servers on a QA file (or the synthetic test split), greedily."""
    from transformers import AutoTokenizer

    from agentrl.envs.registry import env_factory
    from agentrl.envs.search.data import load_qa
    from agentrl.envs.search.synthetic import build_world
    from agentrl.inference.router import create as create_client
    from agentrl.rollers.main import tokenizer_path

    if tasks_path:
        tasks = load_qa(tasks_path, limit=limit)
    else:
        world = build_world(
            config.roller.task_kwargs.get("world_seed", 0), config.roller.task_kwargs.get("num_people", 200)
        )
        tasks = [q for q in world["qa"] if q["split"] == "test"][:limit]
    make_env = env_factory(config.env)
    renderer = ChatRenderer(
        AutoTokenizer.from_pretrained(tokenizer_path(config)), make_env().tool_schemas or None
    )
    client = create_client(config.inference)
    greedy = config.roller.model_copy(update={"top_k": 1})
    try:
        return await evaluate(
            make_env, tasks, client, renderer, greedy, config.roller.max_concurrent_episodes
        )
    finally:
        await client.close()


def format_report(report: dict[str, dict[str, float]]) -> str:
    """A plain table: one row per data source, `overall` last."""
    sources = [*sorted(s for s in report if s != "overall"), "overall"]
    lines = [f"{'data_source':<20} {'n':>6} " + " ".join(f"{f:>12}" for f in FIELDS)]
    for s in sources:
        row = report[s]
        lines.append(f"{s:<20} {int(row['n']):>6} " + " ".join(f"{row[f]:>12.3f}" for f in FIELDS))
    return "\n".join(lines)
