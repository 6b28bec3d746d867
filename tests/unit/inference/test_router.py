"""The router over real embedded servers, a dead port and a server that hangs."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from agentrl.inference.base import BadRequestError, RequestLostError
from agentrl.inference.router import Router
from agentrl.inference.sglang import SGLangClient
from tests.conftest import find_free_port
from tests.unit.inference.conftest import ServerThread

PROMPT = [5, 17, 42, 99, 3]
PARAMS = {"max_new_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def second(tiny_model: Path):
    srv = ServerThread(tiny_model).start()
    yield srv
    srv.stop()


@pytest.fixture
async def hanging() -> AsyncIterator[str]:
    """A server that accepts /generate and never answers (a wedged GPU, a stuck process)."""

    async def never(request: web.Request) -> web.Response:
        await asyncio.sleep(3600)
        return web.Response()

    app = web.Application()
    app.add_routes([web.post("/generate", never), web.get("/health", never)])
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    port = find_free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


def _dead_url() -> str:
    return f"http://127.0.0.1:{find_free_port()}"


async def test_balances_and_fails_over_from_a_dead_server(server: ServerThread, second: ServerThread):
    router = Router(
        [SGLangClient(_dead_url(), connect_timeout_s=2), SGLangClient(server.url), SGLangClient(second.url)]
    )
    try:
        results = await asyncio.gather(*(router.generate(PROMPT, PARAMS) for _ in range(24)))
        assert all(len(r.output_ids) == 6 for r in results)
        used = Counter(r.server for r in results)
        assert set(used) == {server.url, second.url} and min(used.values()) >= 4, used
        assert router.stats["lost"] == 0 and router.stats["completed"] == 24
        assert router.healthy[0] is False
    finally:
        await router.close()


async def test_sticky_sessions_stay_on_one_server(server: ServerThread, second: ServerThread):
    async with Router([SGLangClient(server.url), SGLangClient(second.url)]) as router:
        for session in ("ep-a", "ep-b", "ep-c"):
            servers = {(await router.generate(PROMPT, PARAMS, session_id=session)).server for _ in range(4)}
            assert len(servers) == 1


async def test_hanging_server_times_out_and_request_moves_on(server: ServerThread, hanging: str):
    async with Router([SGLangClient(hanging), SGLangClient(server.url)], request_timeout_s=1.5) as router:
        router.outstanding[1] = 5  # make the hanging one look least loaded so it is tried first
        res = await asyncio.wait_for(router.generate(PROMPT, PARAMS), 20)
        router.outstanding[1] = 0
        assert res.server == server.url and router.stats["retries"] == 1 and router.stats["lost"] == 0


async def test_all_servers_down_is_a_counted_loss_not_a_hang():
    async with Router(
        [SGLangClient(_dead_url(), connect_timeout_s=1) for _ in range(2)], max_retries=3
    ) as router:
        with pytest.raises(RequestLostError, match="2 server"):
            await asyncio.wait_for(router.generate(PROMPT, PARAMS), 20)
        assert router.stats["lost"] == 1


async def test_bad_request_is_not_retried(server: ServerThread, second: ServerThread):
    async with Router([SGLangClient(server.url), SGLangClient(second.url)]) as router:
        with pytest.raises(BadRequestError):
            await router.generate([10**7], PARAMS)
        assert router.stats["retries"] == 0 and router.stats["bad_requests"] == 1


async def test_admin_calls_fan_out(server: ServerThread, second: ServerThread):
    async with Router([SGLangClient(server.url), SGLangClient(second.url)]) as router:
        await router.pause_generation()
        assert server.engine.paused and second.engine.paused
        await router.continue_generation()
        assert not server.engine.paused and not second.engine.paused
        assert await router.get_weight_version() == 0


async def test_health_checks_mark_servers_down_and_up_again(server: ServerThread):
    async with Router([SGLangClient(server.url), SGLangClient(_dead_url(), connect_timeout_s=1)]) as router:
        router.healthy[0] = False
        assert await router.check_health() == [True, False]
        assert router.healthy == [True, False]


def test_factory_picks_client_by_type():
    from agentrl.config import InferenceConfig
    from agentrl.inference.router import create
    from agentrl.inference.vllm import VLLMClient

    one = create(InferenceConfig(type="sglang", servers=["http://127.0.0.1:1"]))
    assert isinstance(one, SGLangClient)
    many = create(
        InferenceConfig(type="vllm", servers=["http://127.0.0.1:1", "http://127.0.0.1:2"], max_retries=5)
    )
    assert isinstance(many, Router) and many.max_retries == 5
    assert all(isinstance(c, VLLMClient) for c in many.clients)
    embedded = create(InferenceConfig(), ["http://127.0.0.1:3"])
    assert isinstance(embedded, SGLangClient)


async def test_a_request_waits_for_the_only_server_to_come_back(tiny_model: Path):
    # the only server is down when the request arrives (killed, restarting on the same port)
    late = ServerThread(tiny_model)
    late.port, late.url = (port := find_free_port()), f"http://127.0.0.1:{port}"
    async with Router([SGLangClient(late.url, connect_timeout_s=1)], server_wait_s=60) as router:
        request = asyncio.create_task(router.generate(PROMPT, PARAMS))
        await asyncio.sleep(1.5)
        assert not request.done()  # waiting, not lost after a burst of fast failures
        await asyncio.to_thread(late.start)
        try:
            result = await asyncio.wait_for(request, 60)
        finally:
            late.stop()
        assert result.server == late.url and len(result.output_ids) == 6
        assert router.stats["lost"] == 0 and router.stats["waits"] >= 1


async def test_a_server_behind_the_admissible_window_gets_no_work(server: ServerThread, second: ServerThread):
    second.engine.weight_version = "5"  # the learner pushed 5; `server` came back at 0
    try:
        async with Router([SGLangClient(server.url), SGLangClient(second.url)], max_staleness=1) as router:
            await router.check_health()
            assert router.versions == [0, 5] and router.floor() == 4
            results = await asyncio.gather(*(router.generate(PROMPT, PARAMS) for _ in range(8)))
            assert {r.server for r in results} == {second.url}
        async with Router([SGLangClient(server.url), SGLangClient(second.url)], max_staleness=5) as router:
            await router.check_health()  # at k=5, version 0 is still admissible
            results = await asyncio.gather(*(router.generate(PROMPT, PARAMS) for _ in range(8)))
            assert {r.server for r in results} == {server.url, second.url}
    finally:
        second.engine.weight_version = "0"


async def test_no_server_inside_the_window_is_a_counted_loss_after_server_wait_s(server: ServerThread):
    async with Router([SGLangClient(server.url)], max_staleness=1, server_wait_s=1.0) as router:
        router.newest = 5  # it saw version 5 before the server came back at 0
        await router.check_health()
        with pytest.raises(RequestLostError, match="behind the admissible window"):
            await asyncio.wait_for(router.generate(PROMPT, PARAMS), 20)
        assert router.stats["lost"] == 1 and router.stats["completed"] == 0


async def test_the_window_follows_the_learners_version_back_after_a_resume(server: ServerThread):
    """Servers saw version 2, the learner resumed from the checkpoint of version 1 and pushed it:
    at k=0 the server at 1 is admissible again once the queue says the learner is at 1."""
    async with Router([SGLangClient(server.url)], max_staleness=0, server_wait_s=1.0) as router:
        router.newest = 2  # a server reported 2 before the learner died
        server.engine.weight_version = "1"
        try:
            await router.check_health()
            assert router.floor() == 2
            with pytest.raises(RequestLostError, match="behind the admissible window"):
                await asyncio.wait_for(router.generate(PROMPT, PARAMS), 20)
            router.learner_version(1)
            assert router.floor() == 1
            assert (await asyncio.wait_for(router.generate(PROMPT, PARAMS), 20)).server == server.url
            router.learner_version(2)  # the next step: a server still at 1 is behind again
            assert router.floor() == 2
        finally:
            server.engine.weight_version = "0"


async def test_a_request_behind_the_window_probes_soon_then_less_often(server: ServerThread, monkeypatch):
    """At k=0 every step waits for a push already under way: the waiting request probes at once,
    after FIRST_PROBE_S, then twice as long each time up to probe_interval_s, and goes as soon as
    a probe sees the pushed version (here the 5th)."""
    from agentrl.inference import router as router_mod

    async with Router([SGLangClient(server.url)], max_staleness=0, server_wait_s=30.0, probe_interval_s=0.2,
                      health_interval_s=3600) as router:  # fmt: skip
        router.learner_version(1)  # the learner published 1; the server is still at 0
        await router.start()  # the health loop probes once, then sleeps past the test
        while router.versions != [0]:
            await asyncio.sleep(0.01)
        probes, sleeps = [], []
        real_check, real_sleep = router.check_health, asyncio.sleep

        async def check_health() -> None:
            probes.append(len(sleeps))
            if len(probes) == 5:
                server.engine.weight_version = "1"  # the push lands
            await real_check()

        async def sleep(seconds: float, *args) -> None:
            if seconds > 0:  # the event loop's and aiohttp's sleep(0) yields are not waits
                sleeps.append(round(seconds, 6))
            await real_sleep(seconds, *args)

        monkeypatch.setattr(router, "check_health", check_health)
        monkeypatch.setattr(router_mod.asyncio, "sleep", sleep)
        try:
            assert (await asyncio.wait_for(router.generate(PROMPT, PARAMS), 20)).server == server.url
        finally:
            monkeypatch.undo()
            server.engine.weight_version = "0"
        first = router_mod.FIRST_PROBE_S
        assert probes == [0, 1, 2, 3, 4], (probes, sleeps)
        assert sleeps[:4] == [first, 2 * first, 4 * first, min(8 * first, 0.2)]


async def test_set_servers_adds_and_removes_servers_and_keeps_sessions_on_kept_ones(
    server: ServerThread, second: ServerThread
):
    """The launcher's live server list (carried by the queue): a newer epoch swaps the set, an old
    one is ignored; a kept server keeps its sessions, a removed one gets no new request."""
    router = Router([SGLangClient(server.url)], client_factory=SGLangClient)
    try:
        assert (await router.generate(PROMPT, PARAMS, session_id="ep")).server == server.url
        assert router.set_servers(1, [server.url, second.url])
        assert router.healthy == [True, False]  # the new one is not used before a probe saw it
        assert not router.set_servers(1, [second.url]) and not router.set_servers(0, [second.url])
        assert (await router.generate(PROMPT, PARAMS, session_id="ep")).server == server.url
        await router.check_health()
        results = await asyncio.gather(*(router.generate(PROMPT, PARAMS) for _ in range(12)))
        assert {r.server for r in results} == {server.url, second.url}
        assert router.set_servers(2, [second.url])
        results = await asyncio.gather(*(router.generate(PROMPT, PARAMS, session_id="ep") for _ in range(4)))
        assert {r.server for r in results} == {second.url} and router.url == second.url
        assert router.stats["lost"] == 0
    finally:
        await router.close()


async def test_a_request_in_flight_on_a_removed_server_fails_over_to_the_new_list(
    server: ServerThread, hanging: str
):
    router = Router([SGLangClient(hanging)], request_timeout_s=1.5, client_factory=SGLangClient)
    try:
        task = asyncio.create_task(router.generate(PROMPT, PARAMS))
        for _ in range(200):  # until the request is on the hanging server
            if router.outstanding[0] == 1:
                break
            await asyncio.sleep(0.05)
        assert router.outstanding[0] == 1
        router.set_servers(1, [server.url])
        assert list(router._retired) and router.outstanding == [0]
        result = await asyncio.wait_for(task, 30)
        assert result.server == server.url and router.stats["retries"] == 1 and router.stats["lost"] == 0
        assert not router._retired  # the removed server's client is closed once its request is done
    finally:
        await router.close()


def test_set_servers_without_a_factory_refuses_new_urls():
    router = Router([SGLangClient(_dead_url())])
    with pytest.raises(ValueError, match="client_factory"):
        router.set_servers(1, [_dead_url()])
