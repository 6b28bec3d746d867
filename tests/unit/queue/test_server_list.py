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


def test_an_env_service_that_moved_reaches_new_episodes_and_a_client_in_flight(
    zmq_queue: Harness, tmp_path: Path, monkeypatch
) -> None:
    """The live list's `services` (env kwarg -> URL), carried by the queue to a producer whose
    `on_services` is the roller's `live_services`: Search-R1 episodes built by `env_factory` after
    the move get the retriever's new URL, and the retriever client of an episode already running
    sends its next search there (the old retriever is stopped: nothing answers at the old URL)."""
    import json

    from agentrl.config import EnvConfig
    from agentrl.envs import base
    from agentrl.envs.registry import env_factory
    from agentrl.envs.search.retriever import BM25Retriever
    from agentrl.envs.search.server import RetrieverServer

    monkeypatch.setattr(base.live_services, "urls", {})  # this process's map, restored after
    monkeypatch.setattr(base.live_services, "epoch", 0)
    corpus = tmp_path / "corpus.jsonl"
    docs = [{"id": "0", "contents": '"Quorvel Guild"\nThe Quorvel Guild was founded by Dravo Kelmir.'}]
    corpus.write_text("".join(json.dumps(d) + "\n" for d in docs))
    path = tmp_path / "servers.json"
    zmq_queue.start(server_args={"servers_file": path})
    task = {"id": "q", "question": "Who founded the Quorvel Guild?", "golden_answers": ["Dravo Kelmir"]}

    async def go() -> tuple[str, str, str]:
        old, new = RetrieverServer(BM25Retriever(corpus)), RetrieverServer(BM25Retriever(corpus))
        old_url, new_url = f"{await old.start()}/retrieve", f"{await new.start()}/retrieve"
        producer = zmq_queue.producer()
        producer.on_services = base.live_services.update
        make_env = env_factory(EnvConfig(name="search_r1", kwargs={"retriever_url": old_url}))
        running = make_env()
        try:
            running.reset(task)
            first = await running.step("<search> Quorvel Guild </search>")
            assert "Dravo Kelmir" in first.observation  # answered by the retriever at old_url
            server_list.write(path, 2, ["http://127.0.0.1:1"], {"retriever_url": new_url})
            await old.stop()  # its node is gone: the old URL answers no more
            deadline = time.monotonic() + 30  # the server rereads the file every 0.5 s
            while base.live_services.epoch < 2:
                assert time.monotonic() < deadline, f"services not carried; producer has {producer.servers}"
                await producer.acquire_start(1)
                await producer.release_start(1)
                await asyncio.sleep(0.1)
            second = await running.step("<search> Quorvel Guild </search>")
            return second.observation, make_env().retriever_url, new_url
        finally:
            producer.close()
            closing = running.close()
            if closing is not None:
                await closing
            await new.stop()

    observation, fresh_url, new_url = asyncio.run(go())
    assert "Dravo Kelmir" in observation  # the episode in flight reached the retriever at new_url
    assert fresh_url == new_url and base.live_services.urls == {"retriever_url": new_url}


def test_a_learner_on_a_queue_it_does_not_host_hands_the_list_on(queue: Harness, tmp_path: Path) -> None:
    """A standalone zmq queue (the learner's consumer connects over TCP; the queue reads no file)
    and a real redis-server: the learner's consumer follows the launcher's file
    (`follow_servers`) and the queue carries each newer epoch, servers and env services, to a
    producer's hooks, once each, in order."""
    path = tmp_path / "servers.json"
    queue.start(**({"heartbeat_s": 0.2} if queue.kind == "redis" else {}))
    consumer = queue.consumer()
    consumer.follow_servers(path)

    async def go() -> tuple[list, list]:
        producer, servers, services = queue.producer(), [], []
        assert isinstance(producer, server_list.Follower)  # the hooks `Producer` declares
        producer.on_servers = lambda epoch, urls: servers.append((epoch, urls))
        producer.on_services = lambda epoch, urls: services.append((epoch, urls))

        async def until(epoch: int) -> None:
            deadline = time.monotonic() + 30  # the learner rereads the file every 0.5 s
            while producer.servers is None or producer.servers[0] < epoch:
                assert time.monotonic() < deadline, (
                    f"epoch {epoch} not carried; producer has {producer.servers}"
                )
                await producer.acquire_start(1)
                await producer.release_start(1)
                await asyncio.sleep(0.1)

        try:
            server_list.write(path, 1, ["http://127.0.0.1:1"])
            await until(1)
            server_list.write(
                path, 2, ["http://127.0.0.1:1", "http://127.0.0.1:2"], {"retriever_url": "http://h:3"}
            )
            await until(2)
        finally:
            producer.close()
        return servers, services

    servers, services = asyncio.run(go())
    assert servers == [(1, ["http://127.0.0.1:1"]), (2, ["http://127.0.0.1:1", "http://127.0.0.1:2"])]
    assert services == [(2, {"retriever_url": "http://h:3"})]  # told when the services moved only
