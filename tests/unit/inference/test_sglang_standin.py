"""`SGLangClient` against the strict SGLang 0.5.23 stand-in (tests/sglang_standin.py names the
wheel's file and function behind each rule): versions from `/model_info`, liveness that
answers while paused, aborts by prefix, pause modes, and the weight-update session."""

from __future__ import annotations

import asyncio

import pytest

from agentrl.inference.base import BadRequestError
from agentrl.inference.sglang import SGLangClient
from tests.sglang_standin import StandInSGLang

PARAMS = {"max_new_tokens": 400, "ignore_eos": True}


@pytest.fixture
def standin():
    server = StandInSGLang().start()
    yield server
    server.stop()


async def _running(server: StandInSGLang, n: int = 1) -> None:
    while len(server._running) < n:
        await asyncio.sleep(0.01)


async def test_version_comes_from_model_info_and_each_response(standin: StandInSGLang):
    async with SGLangClient(standin.url) as client:
        assert await client.get_weight_version() == 0  # "default"
        standin.weight_version = "3"
        assert await client.get_weight_version() == 3
        res = await client.generate([1, 2, 3], {"max_new_tokens": 4})
        assert res.weight_version == 3 and len(res.output_ids) == len(res.logprobs) == 4
    assert "/get_weight_version" not in standin.calls  # the removed route is never asked


async def test_liveness_answers_while_paused_and_health_does_not(standin: StandInSGLang):
    async with SGLangClient(standin.url, connect_timeout_s=3) as client:
        await client.pause_generation()
        assert await client.alive()
        assert not await client.health()  # SGLang holds /health while paused: never used for liveness
        await client.continue_generation()
        assert await client.health()


async def test_pause_abort_returns_partial_output_and_holds_new_requests(standin: StandInSGLang):
    async with SGLangClient(standin.url) as client:
        task = asyncio.create_task(client.generate([1, 2], PARAMS))
        await _running(standin)
        await asyncio.sleep(0.1)
        await client.pause_generation()
        res = await asyncio.wait_for(task, 10)
        assert res.finish_reason == "abort" and 0 < len(res.output_ids) < 400
        held = asyncio.create_task(client.generate([1, 2], {"max_new_tokens": 2}))
        await asyncio.sleep(0.2)
        assert not held.done()
        await client.continue_generation()
        assert (await asyncio.wait_for(held, 10)).finish_reason == "length"


async def test_abort_by_prefix_and_empty_rid(standin: StandInSGLang):
    async with SGLangClient(standin.url) as client:
        mine = [asyncio.create_task(client.generate([1], PARAMS, rid=f"ep1-t{i}")) for i in range(2)]
        other = asyncio.create_task(client.generate([1], {"max_new_tokens": 30}, rid="ep2-t0"))
        await _running(standin, 3)
        await client.abort_request(rid="")  # ignored, 200
        await client.abort_request(rid="ep1-")
        assert all(r.finish_reason == "abort" for r in await asyncio.wait_for(asyncio.gather(*mine), 10))
        assert (await asyncio.wait_for(other, 10)).finish_reason == "length"


async def test_updates_outside_a_session_are_refused_and_the_session_is_detected(standin: StandInSGLang):
    async with SGLangClient(standin.url) as client:
        with pytest.raises(BadRequestError, match="between begin_weight_update"):
            await client.update_weights_from_distributed(["w"], ["float32"], [[2]], "g")
        assert client.has_session is None and not client.flattened_buckets
        await client.begin_weight_update()
        assert client.has_session and client.flattened_buckets and standin.session
        await client.end_weight_update()
        assert not standin.session
        with pytest.raises(BadRequestError, match="no weight-update session"):
            await client.end_weight_update()
