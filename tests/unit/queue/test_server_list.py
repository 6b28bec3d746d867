"""The TransferQueue carries the launcher's live server list (`inference.server_list`) to the
producers: every reply has it once the file exists, and a producer's `on_servers` hears each new
epoch once, in order (the roller's router swaps its server set on it)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from agentrl.inference import server_list
from tests.unit.queue.conftest import Harness


def test_a_producer_hears_each_new_epoch_of_the_server_list(zmq_queue: Harness, tmp_path: Path) -> None:
    path = tmp_path / "servers.json"
    zmq_queue.start(server_args={"servers_file": path})

    async def until(producer, epoch: int) -> None:
        deadline = time.monotonic() + 30  # the server rereads the file every 0.5 s
        while producer.servers is None or producer.servers[0] < epoch:
            assert time.monotonic() < deadline, f"epoch {epoch} not carried; producer has {producer.servers}"
            await producer.acquire_start(1)
            await producer.release_start(1)
            await asyncio.sleep(0.1)

    async def go() -> list:
        producer, told = zmq_queue.producer(), []
        producer.on_servers = lambda epoch, urls: told.append((epoch, urls))
        try:
            await producer.acquire_start(1)
            await producer.release_start(1)
            assert producer.servers is None and told == []  # no list yet: nothing carried
            server_list.write(path, 1, ["http://127.0.0.1:1", "http://127.0.0.1:2"])
            await until(producer, 1)
            server_list.write(path, 0, ["http://127.0.0.1:9"])  # an older epoch is never applied
            server_list.write(path, 2, ["http://127.0.0.1:2"])
            await until(producer, 2)
        finally:
            producer.close()
        return told

    told = asyncio.run(go())
    assert told == [(1, ["http://127.0.0.1:1", "http://127.0.0.1:2"]), (2, ["http://127.0.0.1:2"])]
