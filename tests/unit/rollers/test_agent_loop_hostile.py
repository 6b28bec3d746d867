"""Hostile completions through the real roller: every one becomes observations, every group is
put, and the roller's event loop never stalls (a heartbeat task measures it).

The "model" is `hostile_server.py`, a scripted SGLang server in its own process; the roller,
agent loop, tool env and ZeroMQ queue are the real ones.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from agentrl.config import RollerConfig, ZmqQueueConfig
from agentrl.envs.tool_env import ToolEnv
from agentrl.envs.tools import tool
from agentrl.inference.sglang import SGLangClient
from agentrl.queue.registry import create as create_queue
from agentrl.rollers.chat import ChatRenderer
from agentrl.rollers.roller import Roller
from tests.conftest import find_free_port
from tests.unit.rollers.hostile_server import COMPLETIONS

# Largest pause of the roller's event loop allowed, generous for a loaded 2-core machine.
MAX_GAP_S = 1.0
# The 5 MB completion's own bound. Before the fix it held the loop for minutes (a lazy regex
# rescanning the text from each of its 450,000 unclosed tags). What remains is the inference
# client's json.loads of the ~14 MB reply and json.dumps of the next request (C code holding the
# GIL: ~1-1.5 s each here under load), which no worker thread can move off the loop.
MAX_GAP_5MB_S = 5.0


class HostileTools(ToolEnv):
    """Tools whose results are what an attacker would make them return."""

    @tool
    def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @tool
    def echo(self, n: int) -> str:
        """A string of n characters."""
        return "x" * n

    @tool
    def nested(self, depth: int) -> list:
        """A list nested depth deep."""
        value: list = []
        for _ in range(depth):
            value = [value]
        return value

    @tool
    def recursive(self) -> dict:
        """A dict that contains itself."""
        value: dict = {}
        value["self"] = value
        return value


async def _heartbeat(gaps: list[float]) -> None:
    """Record, between consecutive beats, the CPU time the event-loop thread spent: what one
    step of an episode held the loop for. CPU time, not wall time, so that a machine loaded by
    other jobs (the scheduler not running us) does not read as a stall."""
    last = time.thread_time()
    while True:
        await asyncio.sleep(0.01)
        now = time.thread_time()
        gaps.append(now - last)
        last = now


async def _roll(tiny_model: Path, processes, cases: list[str], group_size: int):
    """Run one group per case through a real roller; return (stats, {case: group}, loop gaps)."""
    port = find_free_port()
    server = processes.start(
        [sys.executable, "-m", "tests.unit.rollers.hostile_server", str(tiny_model), str(port)]
    )
    url = (await asyncio.to_thread(server.stdout.readline)).decode().strip()
    assert url.startswith("http://127.0.0.1"), server.stderr.read().decode()[-2000:]

    qcfg = ZmqQueueConfig(address=f"tcp://127.0.0.1:{find_free_port()}", auth="none")
    backend = create_queue(qcfg)
    queue = backend.server(groups_per_step=len(cases), max_staleness=1).start()
    consumer = backend.consumer("rank0", server=queue)
    producer = backend.producer()
    client = SGLangClient(url)
    tasks = ({"id": c, "question": f"case: {c}"} for c in itertools.cycle(cases))
    config = RollerConfig(
        group_size=group_size,
        max_concurrent_episodes=4,
        max_groups=len(cases),
        max_turns=3,
        max_new_tokens=500_000,  # room for the 5 MB completion (450,001 tokens)
        max_total_tokens=1_000_000,
        log_every_s=60,
    )
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(tiny_model), HostileTools().tool_schemas)
    roller = Roller(config, HostileTools, tasks, client, renderer, producer)
    gaps: list[float] = []
    beat = asyncio.create_task(_heartbeat(gaps))
    try:
        stats = await asyncio.wait_for(roller.run(), 300)  # the queue's modules are imported by now
        batch = await asyncio.to_thread(consumer.get_batch, len(cases), 0, 1, 30)
    finally:
        beat.cancel()
        await client.close()
        producer.close()
        consumer.close()
        queue.stop()

    assert stats.groups_put == len(cases) and stats.groups_failed == 0 and roller.fatal is None
    by_case = {g.prompt_id: g for g in batch.groups}
    assert sorted(by_case) == sorted(cases)
    return stats, by_case, gaps


@pytest.mark.slow
async def test_hostile_tool_results_are_observations_and_the_loop_stays_free(
    tiny_model: Path, processes
) -> None:
    cases = [c for c in COMPLETIONS if c != "five_mb"]
    _, by_case, gaps = await _roll(tiny_model, processes, cases, group_size=2)
    for case, group in by_case.items():
        for episode in group.episodes:
            assert episode.finish_reason == "done" and episode.num_turns == 2, case
    metrics = {case: group.episodes[0].metrics for case, group in by_case.items()}
    for case in ("huge_int", "nested", "recursive"):
        assert metrics[case]["tool_error_bad_result"] == 1, (case, metrics[case])
    assert metrics["huge_str"]["tool_truncated"] == 1 and metrics["huge_str"]["tool_errors"] == 0
    assert metrics["many_calls"]["tool_calls_dropped"] == 992
    assert metrics["many_calls"]["tool_error_too_many_calls"] == 1
    assert max(gaps) < MAX_GAP_S, f"the roller's event loop stalled for {max(gaps):.2f} s"


@pytest.mark.slow
async def test_a_5mb_completion_is_an_observation_and_the_loop_stays_free(
    tiny_model: Path, processes
) -> None:
    _, by_case, gaps = await _roll(tiny_model, processes, ["five_mb"], group_size=1)
    (episode,) = by_case["five_mb"].episodes
    assert episode.finish_reason == "done" and episode.num_turns == 2
    assert episode.metrics["tool_error_malformed"] == 1  # one unterminated block, reported
    assert len(episode.tokens) > 450_000
    assert max(gaps) < MAX_GAP_5MB_S, f"the roller's event loop stalled for {max(gaps):.2f} s"
