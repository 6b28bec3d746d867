"""The micro-batcher: concurrent calls share one batched call, in order, errors reach every caller."""

from __future__ import annotations

import asyncio

import pytest

from agentrl.rewards.batching import MicroBatcher


async def test_concurrent_calls_share_batches_up_to_max_size() -> None:
    calls: list[list[int]] = []

    async def double(items: list[int]) -> list[int]:
        calls.append(list(items))
        return [2 * x for x in items]

    batcher = MicroBatcher(double, max_size=4, wait_s=10.0)  # batches fill before the wait ends
    results = await asyncio.gather(*(batcher.submit(i) for i in range(8)))
    assert results == [2 * i for i in range(8)]
    assert calls == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert batcher.stats() == {"batches": 2, "batch_size_mean": 4.0}


async def test_a_lone_call_runs_after_the_wait_and_weights_count() -> None:
    calls: list[list[list[str]]] = []

    async def lengths(items: list[list[str]]) -> list[int]:
        calls.append(items)
        return [len(x) for x in items]

    batcher = MicroBatcher(lengths, max_size=3, wait_s=0.01, weight=len)
    assert await batcher.submit(["a"]) == 1  # alone: runs once the wait is over
    # 2 + 2 > 3: the second request goes in the next batch; an oversized one runs alone
    assert await asyncio.gather(
        batcher.submit(["a", "b"]), batcher.submit(["c", "d"]), batcher.submit(list("wxyz"))
    ) == [2, 2, 4]
    assert [len(c) for c in calls] == [1, 1, 1, 1]
    assert list(batcher.sizes) == [1, 2, 2, 4]


async def test_an_error_reaches_every_caller_of_its_batch_and_the_next_batch_runs() -> None:
    async def fail_on_negative(items: list[int]) -> list[int]:
        if any(x < 0 for x in items):
            raise ValueError("negative")
        return items

    batcher = MicroBatcher(fail_on_negative, max_size=2, wait_s=10.0)
    results = await asyncio.gather(*(batcher.submit(x) for x in (1, -1, 3, 4)), return_exceptions=True)
    assert [type(r) for r in results[:2]] == [ValueError, ValueError]
    assert results[2:] == [3, 4]


async def test_a_wrong_number_of_results_is_an_error() -> None:
    async def short(items: list[int]) -> list[int]:
        return items[:-1]

    batcher = MicroBatcher(short, max_size=2, wait_s=10.0)
    with pytest.raises(RuntimeError, match="1 results for 2 items"):
        await asyncio.gather(batcher.submit(1), batcher.submit(2))
