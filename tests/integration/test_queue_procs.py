"""The TransferQueue across real processes: N producers, M consumers, and kill -9 of a durable server.

Also the worker script those tests start:
    python tests/integration/test_queue_procs.py producer ADDRESS PREFIX COUNT ACKED_FILE [DELAY_S]
    python tests/integration/test_queue_procs.py consumer ADDRESS NAME OUT_FILE IDLE_S [HOLD_S]
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
SECRET = "integration-secret-0123456789abcdef"
ENV = {**os.environ, "AGENTRL_QUEUE_SECRET": SECRET, "PYTHONPATH": str(REPO)}


# ------------------------------------------------------------------ workers (run as scripts)


def _config(address: str) -> Any:
    from agentrl.config import RedisQueueConfig, ZmqQueueConfig

    if address.startswith("redis://"):
        return RedisQueueConfig(url=address, stream="itest")
    return ZmqQueueConfig(address=address)


def _producer(address: str, prefix: str, count: int, acked_file: str, delay_s: float = 0.0) -> None:
    from agentrl.queue import create
    from tests.unit.queue.conftest import make_group

    async def main() -> None:
        producer = create(_config(address)).producer()
        with open(acked_file, "a") as out:

            async def one(i: int) -> None:
                group = make_group(seed=i, tokens=128)
                group.group_id = f"{prefix}-{i:05d}"
                await producer.put(group)
                out.write(group.group_id + "\n")
                out.flush()

            for start in range(0, count, 8):
                await asyncio.gather(*(one(i) for i in range(start, min(start + 8, count))))
                await asyncio.sleep(delay_s)
        producer.close()

    asyncio.run(main())


def _consumer(address: str, name: str, out_file: str, idle_s: float, hold_s: float = 0.0) -> None:
    from agentrl.queue import create

    consumer = create(_config(address)).consumer(name)
    with open(out_file, "a") as out:
        while True:
            try:
                batch = consumer.get_batch(4, learner_version=0, max_staleness=10, timeout_s=idle_s)
            except TimeoutError:
                break
            out.write("".join(g + "\n" for g in batch.group_ids))
            out.flush()
            time.sleep(hold_s)  # "training": the window in which a crash leaves groups unacked
            consumer.ack(batch.group_ids)
    consumer.close()


# ------------------------------------------------------------------ tests


def _start_server(processes, port: int, log: Path, *extra: str):
    proc = processes.agentrl(
        "queue", "--bind", f"tcp://127.0.0.1:{port}", *extra, env=ENV, stderr=log.open("a")
    )
    deadline = time.monotonic() + 60
    while "serving on" not in log.read_text():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "queue server did not start"
        time.sleep(0.1)
    return proc


def _worker(processes, *args: str):
    return processes.start([sys.executable, __file__, *args], env=ENV, cwd=REPO, stdout=None, stderr=None)


def _lines(paths: list[Path]) -> list[str]:
    return [line for p in paths if p.exists() for line in p.read_text().split()]


def _start_redis(processes, port: int) -> str:
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server; .ci/run does)")
    processes.start([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
    import redis

    client = redis.Redis(port=port)
    deadline = time.monotonic() + 30
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
    client.close()
    return f"redis://127.0.0.1:{port}/0"


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("backend", ["zmq", "redis"])
def test_many_producers_many_consumers_no_loss_no_duplicate(
    processes, free_port: int, tmp_path: Path, backend: str
) -> None:
    if backend == "zmq":
        address = f"tcp://127.0.0.1:{free_port}"
        _start_server(processes, free_port, tmp_path / "server.log")
    else:
        address = _start_redis(processes, free_port)
    outs = [tmp_path / f"got{j}" for j in range(2)]
    consumers = [_worker(processes, "consumer", address, f"rank{j}", str(outs[j]), "10") for j in range(2)]
    # a consumer opens its output file once it has joined the queue; start producing only when
    # both have, or the first one up could drain everything before the other one asks (each
    # waits 10 s for data before it quits: room for the producers to start on a loaded machine)
    deadline = time.monotonic() + 60
    while not all(o.exists() for o in outs):
        assert all(c.poll() is None for c in consumers) and time.monotonic() < deadline, (
            "a consumer did not start"
        )
        time.sleep(0.05)
    producers = [
        _worker(processes, "producer", address, f"p{i}", "60", str(tmp_path / f"acked{i}")) for i in range(3)
    ]
    for proc in producers + consumers:
        assert proc.wait(timeout=120) == 0
    got = Counter(_lines(outs))
    assert set(got) == {f"p{i}-{n:05d}" for i in range(3) for n in range(60)}
    assert max(got.values()) == 1
    assert all(o.exists() and o.read_text() for o in outs), "one consumer got nothing"


@pytest.mark.slow
@pytest.mark.integration
def test_kill_9_of_a_durable_server_loses_and_duplicates_nothing(
    processes, free_port: int, tmp_path: Path
) -> None:
    address = f"tcp://127.0.0.1:{free_port}"
    durable = ("--queue.durable", "true", "--queue.wal_dir", str(tmp_path / "wal"))
    server = _start_server(processes, free_port, tmp_path / "server.log", *durable)
    acked, got = tmp_path / "acked", tmp_path / "got"
    producer = _worker(processes, "producer", address, "g", "240", str(acked), "0.02")
    consumer = _worker(processes, "consumer", address, "rank0", str(got), "6", "0.1")
    deadline = time.monotonic() + 60
    while len(_lines([acked])) < 80:
        assert time.monotonic() < deadline and producer.poll() is None
        time.sleep(0.02)
    os.kill(server.pid, signal.SIGKILL)
    server.wait()
    _start_server(processes, free_port, tmp_path / "server2.log", *durable)
    recovered = re.search(r"recovered (\d+) unacked", (tmp_path / "server2.log").read_text())
    assert recovered and int(recovered.group(1)) > 0, "the crash should leave acked-but-unconsumed groups"
    assert producer.wait(timeout=120) == 0
    assert consumer.wait(timeout=120) == 0
    delivered = Counter(_lines([got]))
    assert len(_lines([acked])) == 240
    assert set(delivered) == set(_lines([acked]))
    assert max(delivered.values()) == 1, [g for g, n in delivered.items() if n > 1]


@pytest.mark.integration
def test_a_queue_frozen_past_the_roller_lease_reclaims_nothing_from_a_live_roller(
    processes, free_port: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGSTOP of the queue's process for three roller leases, then SIGCONT: the live roller's
    heartbeats waited unread in the socket, so its lease stands, its credit stays, and the group
    it finishes afterwards is stored (a learner hosting the queue freezes it the same way)."""
    from agentrl.config import ZmqQueueConfig
    from agentrl.queue import create
    from tests.unit.queue.conftest import make_group

    fast = ("--queue.heartbeat_s", "0.25", "--queue.roller_lease_s", "1")
    log = tmp_path / "server.log"
    server = _start_server(processes, free_port, log, *fast)
    config = ZmqQueueConfig(address=f"tcp://127.0.0.1:{free_port}", heartbeat_s=0.25, roller_lease_s=1.0)
    monkeypatch.setenv("AGENTRL_QUEUE_SECRET", SECRET)

    async def roller() -> None:
        producer = create(config).producer()
        await producer.acquire_start(2)
        await producer.put(make_group(seed=1))  # one credit still held
        os.kill(server.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(3.5)  # the heartbeat goes on, into the frozen queue's socket
        finally:
            os.kill(server.pid, signal.SIGCONT)
        await asyncio.sleep(1.5)  # longer than a lease after the thaw
        await asyncio.wait_for(producer.put(make_group(seed=2)), timeout=20)  # the finished group
        producer.close()

    asyncio.run(roller())
    consumer = create(config).consumer("rank0")
    m = consumer.metrics()
    consumer.close()
    assert (m["leases_lapsed"], m["admission_reclaimed"], m["refused_lapsed"]) == (0, 0, 0), m
    assert m["groups_in"] == 2
    assert "did not run for" in log.read_text()  # the stall is said, with its length


def test_standalone_server_refuses_to_start_without_a_secret() -> None:
    env = {k: v for k, v in os.environ.items() if k != "AGENTRL_QUEUE_SECRET"}
    result = subprocess.run(
        [sys.executable, "-m", "agentrl", "queue", "--bind", "tcp://127.0.0.1:0"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env=env,
    )
    assert result.returncode == 2
    assert "AGENTRL_QUEUE_SECRET" in result.stderr and "queue.auth=none" in result.stderr


if __name__ == "__main__":
    role, *rest = sys.argv[1:]
    if role == "producer":
        _producer(rest[0], rest[1], int(rest[2]), rest[3], float(rest[4]) if len(rest) > 4 else 0.0)
    else:
        _consumer(rest[0], rest[1], rest[2], float(rest[3]), float(rest[4]) if len(rest) > 4 else 0.0)
