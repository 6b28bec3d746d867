"""Admission credits under rollers' leases, and the queue's lifetimes (zmq backend).

Real server thread, real sockets; a "killed" roller is one whose heartbeat stops (its tasks are
cancelled and its socket closed without the `bye` a clean close sends)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from agentrl.queue.account import invariant_residuals
from agentrl.queue.base import LeaseLapsed, QueueError, QueueUnavailable, RunOver
from tests.unit.queue.conftest import Harness, make_group

pytestmark = pytest.mark.timeout(90)

FAST = {"heartbeat_s": 0.2, "roller_lease_s": 1.0}


def _kill(producer) -> None:
    """What kill -9 does to a producer: no more heartbeats, no `bye`."""
    for task in producer._tasks:
        task.cancel()
    producer._sock.close(linger=0)
    producer._sock = None


def _residuals_zero(m: dict) -> bool:
    return invariant_residuals(m) == (0, 0)


def _wait(predicate, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_a_dead_rollers_credits_come_back_and_a_replacement_is_admitted(zmq_queue: Harness) -> None:
    zmq_queue.start(groups_per_step=2, max_staleness=0, **FAST)
    server = zmq_queue.server

    async def go() -> None:
        dead, replacement = zmq_queue.producer(), zmq_queue.producer()
        await dead.acquire_start(2)  # the whole window, at version 0
        await dead.put(make_group(seed=1))  # one put, one credit still held
        m = server.metrics()
        assert (m["leased"], m["depth"], m["started"], m["admission_limit"]) == (1, 1, 2, 2)
        assert _residuals_zero(m)
        _kill(dead)
        admission = await asyncio.wait_for(replacement.acquire_start(1), timeout=20)  # after the lapse
        assert admission.version == 0 and admission.first_task == 2  # the cursor moves on
        m = server.metrics()
        assert m["admission_reclaimed"] == 1 and m["leases_lapsed"] == 1 and _residuals_zero(m)
        replacement.close()

    asyncio.run(go())
    # a clean close gives back what the replacement still held
    assert _wait(lambda: server.metrics()["leased"] == 0)
    m = server.metrics()
    assert m["admission_released"] == 1 and _residuals_zero(m)


def test_a_late_roller_finds_its_lease_gone_and_starts_fresh(zmq_queue: Harness) -> None:
    zmq_queue.start(groups_per_step=2, max_staleness=0, **FAST)
    server = zmq_queue.server

    async def go() -> None:
        late = zmq_queue.producer()
        await late.acquire_start(1)
        old_lease = late.lease
        late._tasks[2].cancel()  # a partition: its heartbeat stops reaching the queue
        assert await asyncio.to_thread(_wait, lambda: server.metrics()["admission_reclaimed"] == 1)
        with pytest.raises(LeaseLapsed):  # the group admitted under the lapsed lease is not taken
            await asyncio.wait_for(late.put(make_group(seed=1)), timeout=10)
        assert late.lease != old_lease and late.held == 0
        assert (await asyncio.wait_for(late.acquire_start(2), timeout=10)).version == 0  # a fresh lease
        await late.put(make_group(seed=2))
        late.close()

    asyncio.run(go())
    m = server.metrics()
    assert m["refused_lapsed"] >= 1 and m["groups_in"] == 1 and _residuals_zero(m)


def test_a_restarted_queue_learns_what_live_rollers_hold(zmq_queue: Harness, tmp_path: Path) -> None:
    """Kill the (durable) server, start it again on the same address: the roller's re-sent
    messages restore its lease with the credits it holds, and no credit is counted twice."""
    zmq_queue.start(groups_per_step=2, max_staleness=0, durable=True)
    first = zmq_queue.server
    address = first.endpoint

    async def go() -> None:
        producer = zmq_queue.producer()
        await producer.acquire_start(2)
        await producer.put(make_group(seed=1))
        assert producer.held == 1
        first.stop()
        second = zmq_queue.backend.server(groups_per_step=2, max_staleness=0, bind=address).start()
        zmq_queue.server = second
        await asyncio.wait_for(producer.put(make_group(seed=2)), timeout=20)
        m = second.metrics()
        assert m["admission_restored"] == 1 and m["leased"] == 0 and m["depth"] == 2  # one from the WAL
        assert m["run_id"] == first.run_id  # a durable queue keeps its run
        assert m["put_unleased"] == 0 and m["duplicates"] == 0  # nothing re-sent that was answered
        assert _residuals_zero(m)
        producer.close()

    asyncio.run(go())


def test_a_resumed_learner_rebuilds_admission_instead_of_flooding(zmq_queue: Harness) -> None:
    """A fresh queue told version 7 admits one window ((7 + 0 + 1) x 2 - 7 x 2), not 16 groups."""
    zmq_queue.start(groups_per_step=2, max_staleness=0)
    consumer = zmq_queue.consumer()
    consumer.publish_version(7)
    m = consumer.metrics()
    assert m["admission_limit"] - m["started"] == 2

    async def go() -> None:
        producer = zmq_queue.producer()
        await producer.acquire_start(2)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(producer.acquire_start(1), timeout=0.5)
        producer.close()

    asyncio.run(go())


def test_the_learner_version_going_back_on_resume_does_not_stall_admission(zmq_queue: Harness) -> None:
    """The durable row of issue 14: the queue reached version 5, the learner resumes from 3."""
    zmq_queue.start(groups_per_step=2, max_staleness=0)
    consumer = zmq_queue.consumer()
    consumer.publish_version(5)
    consumer.publish_version(3)

    async def go() -> int:
        producer = zmq_queue.producer()
        try:
            return (await asyncio.wait_for(producer.acquire_start(2), timeout=10)).version
        finally:
            producer.close()

    assert asyncio.run(go()) == 3


def test_the_producer_reports_the_learners_version_also_when_it_goes_back(queue: Harness) -> None:
    """The roller's admissible window follows `on_version`: after a resume from an older
    checkpoint the queue's version goes down, and a router that kept the highest version its
    servers reported would refuse every server at k=0 (a CI run stalled so, at version 1 after 2)."""
    queue.start(groups_per_step=2, max_staleness=0)
    consumer = queue.consumer()
    heard: list[int] = []

    async def admitted_at(version: int) -> None:
        consumer.publish_version(version)
        producer = queue.producer()
        producer.on_version = heard.append
        try:
            await asyncio.wait_for(producer.acquire_start(1), timeout=10)
            await producer.release_start(1)
        finally:
            producer.close()

    asyncio.run(admitted_at(2))
    assert heard and heard[-1] == 2
    asyncio.run(admitted_at(1))
    assert heard[-1] == 1


def test_after_the_learner_finishes_a_producer_is_told_the_run_is_over(queue: Harness) -> None:
    """zmq answers `RunOver`; Redis has no channel back, so its `finished` flag is read by every
    put and acquire (before, a Redis roller went on putting groups nobody would train)."""
    queue.start(groups_per_step=2, max_staleness=0)
    consumer = queue.consumer()

    async def go() -> None:
        producer = queue.producer()
        try:
            await asyncio.wait_for(producer.acquire_start(1), timeout=10)
            await asyncio.to_thread(consumer.finish)
            with pytest.raises(RunOver):
                await asyncio.wait_for(producer.acquire_start(1), timeout=10)
            with pytest.raises(RunOver):
                await asyncio.wait_for(producer.put(make_group(seed=3)), timeout=10)
        finally:
            producer.close()

    asyncio.run(go())


def test_redis_takes_no_group_after_the_finish_even_from_a_put_already_past_its_wait(
    tmp_path: Path, secret: str, redis_url: str
) -> None:
    """A put that read `finished` unset, then reached Redis after the learner's finish: the PUT
    script itself refuses it (RunOver), so the learner's last count stays the last."""
    queue = Harness("redis", tmp_path, redis_url)
    try:
        queue.start(groups_per_step=2, max_staleness=0)
        consumer = queue.consumer()

        async def go() -> None:
            producer = queue.producer()
            try:
                await asyncio.wait_for(producer.acquire_start(1), timeout=10)
                script = producer._put

                async def finished_meanwhile(**kwargs):  # the learner finishes between wait and put
                    await asyncio.to_thread(consumer.finish)
                    return await script(**kwargs)

                producer._put = finished_meanwhile
                before = await producer._redis.xlen(producer.stream)
                with pytest.raises(RunOver):
                    await asyncio.wait_for(producer.put(make_group(seed=4)), timeout=10)
                assert await producer._redis.xlen(producer.stream) == before
            finally:
                producer.close()

        asyncio.run(go())
    finally:
        queue.close()


def test_nobody_waits_silently_for_a_queue_that_is_not_there(zmq_queue: Harness, free_port: int) -> None:
    zmq_queue.start(connect_timeout_s=1.0, heartbeat_s=0.2, roller_lease_s=1.0)
    producer = zmq_queue.backend.producer(address=f"tcp://127.0.0.1:{free_port}")

    async def go() -> None:
        with pytest.raises(QueueUnavailable, match=r"no answer from the queue.*AGENTRL_QUEUE_SECRET"):
            await asyncio.wait_for(producer.acquire_start(1), timeout=30)
        with pytest.raises(QueueUnavailable):  # and every later call says the same at once
            await producer.put(make_group())
        producer.close()

    asyncio.run(go())
    with pytest.raises(QueueUnavailable, match="no answer from the queue"):
        zmq_queue.backend.consumer("rank0", address=f"tcp://127.0.0.1:{free_port}")


def test_a_wrong_secret_is_logged_and_the_client_says_what_to_check(
    zmq_queue: Harness, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    zmq_queue.start(connect_timeout_s=1.0, heartbeat_s=0.2, roller_lease_s=1.0)
    monkeypatch.setenv("AGENTRL_QUEUE_SECRET", "another-secret-of-enough-length-000")
    producer = zmq_queue.producer()

    async def go() -> None:
        with pytest.raises(QueueUnavailable, match="holds the queue's secret"):
            await asyncio.wait_for(producer.acquire_start(1), timeout=30)
        producer.close()

    with caplog.at_level("WARNING", logger="agentrl.queue.server"):
        asyncio.run(go())
    refusals = [r for r in caplog.records if "failed its MAC" in r.getMessage()]
    assert refusals and len(refusals) <= 2  # rate-limited: one report per REFUSAL_LOG_S
    assert zmq_queue.server.metrics()["refused_auth"] >= 3


def test_a_roller_of_another_run_is_refused_and_a_finished_run_ends_its_rollers(zmq_queue: Harness) -> None:
    zmq_queue.start(groups_per_step=2, max_staleness=0, run_id="run-a")
    consumer = zmq_queue.consumer()

    async def go() -> None:
        stranger = zmq_queue.backend.producer(address=zmq_queue.address)
        stranger.run_id = "run-b"
        with pytest.raises(QueueUnavailable, match="serves run 'run-a'"):
            await asyncio.wait_for(stranger.acquire_start(1), timeout=10)
        stranger.close()

        member = zmq_queue.producer()
        await member.acquire_start(1)
        assert member.run_id == "run-a"  # adopted from the first answer
        await asyncio.to_thread(consumer.finish)
        with pytest.raises(RunOver, match="finished at version 0"):
            await asyncio.wait_for(member.acquire_start(1), timeout=10)
        member.close()

    asyncio.run(go())
    m = zmq_queue.server.metrics()
    assert m["refused_run"] >= 1 and m["finished"]


def test_a_put_the_queue_stored_as_the_run_ended_counts_as_put(zmq_queue: Harness) -> None:
    """The queue stores a put that arrives after the learner finished and acks it in a reply that
    also says the run is over: the producer must see the put succeed (the queue holds the group),
    and only its later calls fail with RunOver."""
    zmq_queue.start(groups_per_step=2, max_staleness=0)
    consumer = zmq_queue.consumer()

    async def go() -> None:
        producer = zmq_queue.producer()
        await producer.acquire_start(1)
        await asyncio.to_thread(consumer.finish)
        await asyncio.wait_for(producer.put(make_group(seed=3)), timeout=10)
        with pytest.raises(RunOver):
            await asyncio.wait_for(producer.acquire_start(1), timeout=10)
        producer.close()

    asyncio.run(go())
    assert zmq_queue.server.metrics()["groups_in"] == 1


def test_a_put_in_flight_when_the_end_is_heard_still_counts_as_put(zmq_queue: Harness) -> None:
    """The end of the run reaches the producer first in the answer to another request (here a
    waiting `acq`), while a put it already sent is still unanswered; the queue stores that put
    and acks it. The put must count as put, not fail with RunOver (a CI run of test_run had the
    roller's groups_put one short of the queue's groups_in)."""
    zmq_queue.start(groups_per_step=1, max_staleness=0)
    consumer = zmq_queue.consumer()

    async def go() -> None:
        producer = zmq_queue.producer()
        await producer.acquire_start(1)  # the whole window
        waiting = asyncio.create_task(producer.acquire_start(1))  # queued at the server
        await asyncio.sleep(0.3)
        consumer.finish()  # blocks this loop: the server answers the waiting acq with the end
        put = asyncio.create_task(producer.put(make_group(seed=4)))  # sent before that answer is read
        await asyncio.wait_for(put, timeout=10)
        with pytest.raises(RunOver):
            await asyncio.wait_for(waiting, timeout=10)
        producer.close()

    asyncio.run(go())
    assert zmq_queue.server.metrics()["groups_in"] == 1


def test_a_learner_with_another_config_is_refused(zmq_queue: Harness) -> None:
    zmq_queue.start(groups_per_step=4, max_staleness=1)
    with pytest.raises(QueueUnavailable, match=r"learner\.groups_per_step: the learner has 8"):
        zmq_queue.backend.consumer("rank0", address=zmq_queue.address, hello={"gps": 8, "ms": 1})
    with pytest.raises(QueueUnavailable, match=r"learner\.staleness: the learner has token .* group"):
        zmq_queue.backend.consumer("rank1", address=zmq_queue.address, hello={"gps": 4, "ms": 1, "pt": 1})


def test_binding_a_taken_address_says_what_to_do(zmq_queue: Harness) -> None:
    zmq_queue.start()
    other = zmq_queue.backend.server(groups_per_step=4, max_staleness=1, bind=zmq_queue.address)
    with pytest.raises(QueueError, match=r"address already in use.*--queue\.standalone true"):
        other.start()
    other.stop()


def test_a_roller_whose_queue_goes_silent_gives_up_saying_so(zmq_queue: Harness) -> None:
    """The learner (hosting the queue) is gone for good: after `silent_timeout_s` the producer
    fails every call with a message, so the roller exits instead of waiting forever."""
    zmq_queue.start(groups_per_step=2, max_staleness=0, silent_timeout_s=1.0, **FAST)

    async def go() -> None:
        producer = zmq_queue.producer()
        await producer.acquire_start(1)
        zmq_queue.server.stop()
        zmq_queue.server = None
        with pytest.raises(QueueUnavailable, match="has been silent"):
            await asyncio.wait_for(producer.acquire_start(1), timeout=30)
        producer.close()

    asyncio.run(go())


@pytest.fixture
def redis_queue(tmp_path: Path, secret: str, redis_url: str):
    harness = Harness("redis", tmp_path, redis_url)
    yield harness
    harness.close()


def test_redis_a_dead_rollers_credits_come_back_and_a_late_one_starts_a_fresh_lease(
    redis_queue: Harness,
) -> None:
    """The Redis backend's leases: a producer whose heartbeat stops (kill -9: no `bye`) has its
    credits reclaimed, a replacement is admitted, and the late producer's put is refused."""
    redis_queue.start(groups_per_step=2, max_staleness=0, **FAST)
    consumer = redis_queue.consumer()

    async def go() -> None:
        dead, replacement = redis_queue.producer(), redis_queue.producer()
        await dead.acquire_start(2)  # the whole window at version 0
        await dead.put(make_group(seed=1))  # one put, one credit still held
        m = consumer.metrics()
        assert (m["started"], m["leased"], m["admission_spent"]) == (2, 1, 1)
        idle = redis_queue.producer()  # a lease holding nothing: reaping it gives back 0 (not "-0")
        await idle.release_start(1)
        dead._heartbeat.cancel()  # what kill -9 (or a partition) does to its heartbeat
        idle._heartbeat.cancel()
        waiter = asyncio.ensure_future(replacement.acquire_start(1))
        await asyncio.sleep(0.3)
        # the window is full while the lease lives (on a loaded machine it may have lapsed by now)
        assert not waiter.done() or consumer.metrics()["admission_reclaimed"] == 1
        admission = await asyncio.wait_for(waiter, timeout=20)  # after the lapse (the script reaps)
        assert admission.version == 0 and admission.first_task == 2  # the cursor moves on
        assert await asyncio.to_thread(_wait, lambda: consumer.metrics()["leases_lapsed"] == 2)
        assert consumer.metrics()["admission_reclaimed"] == 1
        old_lease = dead.lease
        with pytest.raises(LeaseLapsed):  # the late producer's group is not taken
            await dead.put(make_group(seed=2))
        assert dead.lease != old_lease and dead.lapses == 1  # it goes on under a fresh lease
        replacement.close()
        dead.close()

    asyncio.run(go())
    m = consumer.metrics()
    assert m["groups_in"] == 1 and m["leased"] == 0  # closes gave back what they held
    assert m["admitted"] == m["admission_spent"] + m["admission_released"] + m["admission_reclaimed"]


def test_a_request_sent_while_the_queue_was_down_is_granted_once(zmq_queue: Harness, tmp_path: Path) -> None:
    """An `acq` sent while the server is down waits in the socket and reaches the restarted server
    on reconnect; the reply to the heartbeat queued before it shows the new epoch, so the producer
    re-sends the `acq` while the first copy still waits for room. The server grants it once
    (before, twice: the producer settled one reply, and the second grant was a credit the server
    counted as held that the roller never had, so at k=0 the run stalled one group short of a
    step)."""
    zmq_queue.start(groups_per_step=1, max_staleness=0, durable=True, heartbeat_s=0.2)
    first = zmq_queue.server
    address = first.endpoint

    async def go() -> None:
        producer = zmq_queue.producer()
        await producer.acquire_start(1)  # the whole window
        first.stop()
        waiting = asyncio.create_task(producer.acquire_start(1))
        await asyncio.sleep(1.0)  # the acq and heartbeats sent to nobody: queued in the DEALER's pipe
        second = zmq_queue.backend.server(groups_per_step=1, max_staleness=0, bind=address).start()
        zmq_queue.server = second
        await asyncio.sleep(1.0)  # the new epoch seen, the waiting acq re-sent
        consumer = zmq_queue.consumer()

        def train_a_step(version: int) -> None:
            batch = consumer.get_batch(1, learner_version=version - 1, max_staleness=0, timeout_s=10)
            consumer.ack(batch.group_ids)
            consumer.publish_version(version)

        await producer.put(make_group(seed=1))  # the first credit spent
        await asyncio.to_thread(train_a_step, 1)  # room for one: the waiting acq is granted
        await asyncio.wait_for(waiting, timeout=20)
        await producer.put(make_group(version=1, seed=2))
        await asyncio.to_thread(train_a_step, 2)  # room for one more, which a second copy would take
        await asyncio.sleep(0.5)
        m = second.metrics()
        assert producer.held == 0 and m["leased"] == 0, m
        assert (m["started"], m["admission_limit"]) == (2, 3) and _residuals_zero(m)
        await asyncio.wait_for(producer.acquire_start(1), timeout=5)  # the room is the producer's to take
        producer.close()

    asyncio.run(go())


def test_a_stalled_queue_thread_reclaims_nothing_from_a_live_roller(zmq_queue: Harness) -> None:
    """The server's thread held up for three roller leases (here by its own lock, as a stopped or
    starved process holds it up): when it runs again, the live roller's pings are still unread in
    its socket, yet its lease stands, its credit stays and the group it then puts is stored."""
    zmq_queue.start(groups_per_step=2, max_staleness=0, heartbeat_s=0.5, roller_lease_s=1.0)
    server = zmq_queue.server

    async def go() -> None:
        producer = zmq_queue.producer()
        await producer.acquire_start(2)
        await producer.put(make_group(seed=1))  # one credit still held
        with server._lock:
            await asyncio.sleep(3.0)  # the heartbeat goes on, into the stalled server's socket
        await asyncio.sleep(1.5)  # longer than a lease after the thaw
        await asyncio.wait_for(producer.put(make_group(seed=2)), timeout=20)
        producer.close()

    asyncio.run(go())
    m = server.metrics()
    assert (m["leases_lapsed"], m["admission_reclaimed"], m["refused_lapsed"]) == (0, 0, 0), m
    assert m["groups_in"] == 2 and _residuals_zero(m)
