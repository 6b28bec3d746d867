"""Behaviour every TransferQueue backend shares: run against the ZeroMQ server and a real Redis."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from tests.unit.queue.conftest import Harness, make_group

pytestmark = pytest.mark.timeout(90)  # a hang fails this test, not the whole run


def test_groups_arrive_whole_and_in_order(queue: Harness) -> None:
    queue.start()
    groups = [make_group(version=0, seed=i, episodes=1 + i % 3) for i in range(6)]
    queue.put(groups)
    consumer = queue.consumer()
    batch = consumer.get_batch(6, learner_version=0, max_staleness=1, timeout_s=10)
    assert batch.group_ids == [g.group_id for g in groups]  # FIFO
    for sent, got in zip(groups, batch.groups, strict=False):
        assert len(got.episodes) == len(sent.episodes) and got.prompt_id == sent.prompt_id
        for a, b in zip(sent.episodes, got.episodes, strict=False):
            np.testing.assert_array_equal(a.tokens, b.tokens)
            np.testing.assert_array_equal(a.logprobs, b.logprobs)
            assert a.reward == b.reward
    assert len(batch.ages_s) == 6 and all(a >= 0 for a in batch.ages_s)
    consumer.ack(batch.group_ids)
    m = consumer.metrics()
    assert m["groups_in"] == 6 and m["groups_out"] == 6 and m["depth"] == 0
    assert m["age_s_max"] >= m["age_s_p50"] >= 0


def test_oldest_first_hands_out_the_stalest_admissible_groups(queue: Harness) -> None:
    queue.start(selection="oldest_first")
    groups = [make_group(version=v, seed=v) for v in (3, 1, 2)]
    queue.put(groups)
    batch = queue.consumer().get_batch(2, learner_version=3, max_staleness=5, timeout_s=10)
    assert [g.min_version for g in batch.groups] == [1, 2]
    assert batch.staleness == [2, 1]


def test_stale_groups_are_dropped_counted_and_never_returned(queue: Harness) -> None:
    queue.start()
    old, fresh = make_group(version=0, seed=1), make_group(version=5, seed=2)
    queue.put([old, fresh])
    consumer = queue.consumer()
    batch = consumer.get_batch(1, learner_version=5, max_staleness=2, timeout_s=10)
    assert batch.group_ids == [fresh.group_id]
    assert batch.dropped_stale == 1
    assert consumer.metrics()["dropped_stale"] == 1
    with pytest.raises(TimeoutError):
        consumer.get_batch(1, learner_version=5, max_staleness=2, timeout_s=0.5)


def test_admission_waits_for_the_learner_version(queue: Harness) -> None:
    queue.start(groups_per_step=2, max_staleness=0)
    consumer = queue.consumer()

    async def roller() -> list[int]:
        producer = queue.producer()
        try:
            first = await producer.acquire_start(2)  # (0 + 0 + 1) * 2 groups may start at v=0
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(producer.acquire_start(1), timeout=0.7)
            await producer.put(make_group(version=0, seed=1))
            await producer.put(make_group(version=0, seed=2))

            def train_one_step() -> None:  # take both groups, step to version 1, ack them trained
                batch = consumer.get_batch(2, 0, 0, 10)
                consumer.publish_version(1)
                consumer.ack(batch.group_ids)

            trainer = threading.Timer(0.3, train_one_step)
            trainer.start()
            second = await asyncio.wait_for(producer.acquire_start(2), timeout=10)
            trainer.join()
            return [first.version, second.version, await producer.current_version(), second.first_task]
        finally:
            producer.close()

    assert asyncio.run(roller()) == [0, 1, 1, 2]  # the second grant gets the next tasks of the cursor


def test_groups_of_a_skipped_step_return_their_admission(queue: Harness) -> None:
    """The learner skipped its step (e.g. no trainable tokens): its version stays, so without the
    admission back no roller could start the groups that let it move on (a livelock)."""
    queue.start(groups_per_step=2, max_staleness=0)
    consumer = queue.consumer()

    async def roller() -> None:
        producer = queue.producer()
        try:
            await producer.acquire_start(2)
            await producer.put(make_group(version=0, seed=1))
            await producer.put(make_group(version=0, seed=2))
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(producer.acquire_start(1), timeout=0.5)
            batch = await asyncio.to_thread(consumer.get_batch, 2, 0, 0, 10)
            with pytest.raises(ValueError, match="dropped must be one of"):
                consumer.ack(batch.group_ids, dropped="boring")
            await asyncio.to_thread(consumer.ack, batch.group_ids, "skipped")
            assert (await asyncio.wait_for(producer.acquire_start(2), timeout=10)).version == 0  # still v0
        finally:
            producer.close()

    asyncio.run(roller())
    m = consumer.metrics()
    assert m["dropped_skipped"] == 2 and m.get("dropped_stale", 0) == 0 and m["depth"] == 0


def test_full_queue_makes_put_wait_never_drop(queue: Harness) -> None:
    queue.start(capacity_groups=2)
    groups = [make_group(seed=i) for i in range(3)]
    done = threading.Event()

    def rollers() -> None:
        queue.put(groups)
        done.set()

    thread = threading.Thread(target=rollers)
    thread.start()
    consumer = queue.consumer()
    first = consumer.get_batch(2, learner_version=0, max_staleness=1, timeout_s=10)
    assert not done.wait(0.7), "the third put returned while the queue was full"
    consumer.ack(first.group_ids)
    assert done.wait(10)
    thread.join()
    last = consumer.get_batch(1, learner_version=0, max_staleness=1, timeout_s=10)
    assert first.group_ids + last.group_ids == [g.group_id for g in groups]


def test_unacked_groups_come_back_when_the_rank_restarts(queue: Harness) -> None:
    queue.start()
    groups = [make_group(seed=i) for i in range(4)]
    queue.put(groups)
    crashed = queue.consumer("rank0")
    held = crashed.get_batch(2, learner_version=0, max_staleness=1, timeout_s=10)
    crashed.close()  # never acked
    other = queue.consumer("rank1").get_batch(2, learner_version=0, max_staleness=1, timeout_s=10)
    restarted = queue.consumer("rank0").get_batch(2, learner_version=0, max_staleness=1, timeout_s=10)
    assert set(restarted.group_ids) == set(held.group_ids)
    assert set(other.group_ids).isdisjoint(held.group_ids)


def test_a_group_put_twice_is_delivered_once(queue: Harness) -> None:
    queue.start()
    group = make_group(seed=7)
    queue.put([group])
    queue.put([group])
    consumer = queue.consumer()
    assert consumer.get_batch(1, 0, 1, timeout_s=10).group_ids == [group.group_id]
    with pytest.raises(TimeoutError):
        consumer.get_batch(1, 0, 1, timeout_s=0.5)


def test_groups_held_past_their_lease_go_to_another_rank(queue: Harness) -> None:
    queue.start(lease_s=0.5)
    groups = [make_group(seed=i) for i in range(2)]
    queue.put(groups)
    stuck = queue.consumer("rank0").get_batch(2, 0, 1, timeout_s=10)  # never acked, never restarted
    other = queue.consumer("rank1").get_batch(2, 0, 1, timeout_s=10)
    assert sorted(other.group_ids) == sorted(stuck.group_ids)
    if queue.kind == "zmq":
        assert queue.server.metrics()["redelivered"] == 2


def test_a_producer_learns_the_runs_max_staleness_from_the_queue(queue: Harness) -> None:
    # the roller's router takes its version window from this, not from the roller's own config
    queue.start(groups_per_step=2, max_staleness=3)

    async def go() -> tuple[int | None, list[int]]:
        producer, told = queue.producer(), []
        producer.on_max_staleness = told.append
        assert producer.max_staleness is None  # nothing heard yet
        await producer.acquire_start(1)
        producer.close()
        return producer.max_staleness, told

    assert asyncio.run(go()) == (3, [3])


def test_per_token_staleness_keeps_partly_stale_groups_with_their_old_tokens_masked(queue: Harness) -> None:
    # learner.staleness: token. At v=5 with k=2 a group is kept while any generated token is of
    # version >= 3; its older tokens leave the loss mask; a group with none left is dropped as stale
    queue.start(max_staleness=2, server_args={"per_token_staleness": True})
    old, spanning, fresh = (make_group(version=0, seed=1), make_group(version=1, seed=2),
                            make_group(version=5, seed=3))  # fmt: skip
    for ep in spanning.episodes:  # the episode's later half was generated after two pushes
        generated = np.flatnonzero(ep.loss_mask)
        ep.versions[generated[len(generated) // 2 :]] = 4
    queue.put([old, spanning, fresh])
    consumer = queue.consumer()
    consumer.per_token_staleness = True
    batch = consumer.get_batch(2, learner_version=5, max_staleness=2, timeout_s=10)
    assert batch.group_ids == [spanning.group_id, fresh.group_id]
    assert batch.dropped_stale == 1 and consumer.metrics()["dropped_stale"] == 1
    for sent, got in zip(spanning.episodes, batch.groups[0].episodes, strict=True):
        np.testing.assert_array_equal(got.loss_mask, sent.loss_mask * (sent.versions >= 3))
    generated = sum(e.num_generated for g in (spanning, fresh) for e in g.episodes)
    stale = sum(int(((e.loss_mask == 1) & (e.versions < 3)).sum()) for e in spanning.episodes)
    assert batch.stale_tokens_masked == pytest.approx(stale / generated) and stale > 0
    assert batch.staleness == [1, 0]  # by the oldest token that still trains
    consumer.ack(batch.group_ids)
    m = consumer.metrics()
    assert m["groups_in"] == 3 and m["depth"] == 0
