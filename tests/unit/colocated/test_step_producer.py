"""The colocated replica's in-process queue (`StepProducer`): admission per step, the cut, what
goes on into the next step (partial rollouts), and a dropped group replaced only while the step
is open."""

from __future__ import annotations

import asyncio

from agentrl.colocated.loop import StepProducer
from agentrl.types import Group


def _group(task: int) -> Group:
    return Group([], prompt_id=str(task), metrics={"task_index": task})


async def _admitted(producer: StepProducer, n: int) -> list[int]:
    return [(await asyncio.wait_for(producer.acquire_start(1), 1)).first_task for _ in range(n)]


async def _blocks(producer: StepProducer) -> bool:
    try:
        await asyncio.wait_for(producer.acquire_start(1), 0.05)
    except TimeoutError:
        return True
    return False


def test_a_step_admits_its_in_flight_count_and_is_cut_at_its_target() -> None:
    async def scenario() -> None:
        # replica 1 of 2, 4 groups in flight, 2 trained per step (partial_rollout 0.5)
        p = StepProducer(replica=1, replicas=2, in_flight=4, target=2)
        await p.begin(0)
        assert await _admitted(p, 4) == [1, 3, 5, 7]  # its share of one task stream
        assert await _blocks(p)  # no fifth while four run
        await p.put(_group(3))
        assert not p._full.is_set()
        await p.put(_group(1))
        await asyncio.wait_for(p.full(), 1)
        assert [g.metrics["task_index"] for g in p.cut()] == [3, 1]
        assert p.running == 2  # cut: they go on into the next step
        await p.put(_group(5))  # finished between steps: the next step's
        await p.release_start(1)  # dropped between steps: not replaced until a step is open
        assert await _blocks(p)
        await p.begin(1)
        assert await _admitted(p, 4) == [9, 11, 13, 15]  # back to 4 running
        await p.put(_group(9))
        await asyncio.wait_for(p.full(), 1)  # 5 (from before) and 9
        assert [g.metrics["task_index"] for g in p.cut()] == [5, 9]

    asyncio.run(scenario())


def test_without_partial_rollouts_a_dropped_group_is_replaced_within_the_step() -> None:
    async def scenario() -> None:
        p = StepProducer(replica=0, replicas=1, in_flight=2, target=2)
        await p.begin(0)
        assert await _admitted(p, 2) == [0, 1]
        await p.release_start(1)  # dynamic sampling dropped task 0
        assert await _admitted(p, 1) == [2]
        await p.put(_group(1))
        await p.put(_group(2))
        await asyncio.wait_for(p.full(), 1)
        assert [g.metrics["task_index"] for g in p.cut()] == [1, 2] and p.running == 0
        await p.begin(1)
        assert (await p.acquire_start(1)).version == 1

    asyncio.run(scenario())
