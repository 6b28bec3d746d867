"""The roller's reward-model client against real sockets: concurrent scores go as one request,
and an unreachable, silent, refusing or malformed scorer is a `RewardModelError` naming the address,
in bounded time."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from agentrl.rewards.client import RewardModelClient, RewardModelError
from agentrl.rewards.config import RewardConfig
from tests.conftest import find_free_port


def scripted_scorer(answer, kind: str = "classifier") -> tuple[web.Application, list[dict]]:
    """An app answering `/score` with `answer(body)` (a JSON value, or a web.Response)."""
    seen: list[dict] = []

    async def score(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        out = answer(body)
        return out if isinstance(out, web.Response) else web.json_response(out)

    async def info(request: web.Request) -> web.Response:
        return web.json_response({"kind": kind, "model_path": "scripted"})

    app = web.Application()
    app.add_routes([web.post("/score", score), web.get("/model_info", info)])
    return app, seen


async def test_concurrent_scores_go_as_one_request_and_are_counted(serve_app) -> None:
    app, seen = scripted_scorer(lambda b: {"scores": [len(c) for c in b["conversations"]], "batch_size": 7})
    client = RewardModelClient(RewardConfig(url=await serve_app(app), max_batch_size=8, batch_wait_ms=5000))
    try:
        convs = [[{"role": "user", "content": "q"}] * n for n in range(1, 9)]
        assert await asyncio.gather(*(client.score(c) for c in convs)) == [float(n) for n in range(1, 9)]
        assert (await client.check())["kind"] == "classifier"
    finally:
        await client.close()
    assert len(seen) == 1 and len(seen[0]["conversations"]) == 8
    m = client.metrics()
    assert m["roller/reward_model_calls"] == 1 and m["roller/reward_model_scored"] == 8
    assert m["roller/reward_model_batch_mean"] == 8 and m["roller/reward_model_server_batch_mean"] == 7
    assert m["roller/reward_model_s"] > 0


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (lambda b: {"scores": [1.0, 2.0]}, "expected 1 finite scores"),
        (lambda b: {"scores": [float("nan")]}, "expected 1 finite scores"),
        (lambda b: {"scores": ["0.5"]}, "expected 1 finite scores"),
        (lambda b: {"score": [0.5]}, "expected 1 finite scores"),
        (lambda b: web.Response(text="<html>oops</html>"), "not JSON"),
        (lambda b: web.json_response({"error": {"message": "scoring failed: x"}}, status=500), "HTTP 500"),
    ],
    ids=["count", "nan", "string", "no-scores", "not-json", "http-500"],
)
async def test_a_malformed_answer_is_an_error_naming_the_address(serve_app, answer, message) -> None:
    app, _ = scripted_scorer(answer)
    url = await serve_app(app)
    client = RewardModelClient(RewardConfig(url=url, batch_wait_ms=0))
    try:
        with pytest.raises(RewardModelError, match=message) as err:
            await client.score([{"role": "user", "content": "q"}])
    finally:
        await client.close()
    assert url in str(err.value)
    assert client.metrics()["roller/reward_model_errors"] == 1


async def test_an_unreachable_or_silent_scorer_fails_in_bounded_time() -> None:
    port = find_free_port()  # nothing listens here
    client = RewardModelClient(RewardConfig(url=f"http://127.0.0.1:{port}", timeout_s=2))
    try:
        with pytest.raises(RewardModelError, match=rf"127.0.0.1:{port}/model_info: cannot reach it"):
            await asyncio.wait_for(client.check(wait_s=1), 10)
    finally:
        await client.close()

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(60)  # accepts the connection, never replies

    silent = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = silent.sockets[0].getsockname()[1]
    client = RewardModelClient(RewardConfig(url=f"http://127.0.0.1:{port}", timeout_s=0.5, batch_wait_ms=0))
    try:
        with pytest.raises(
            RewardModelError, match=rf"127.0.0.1:{port}/score: no answer within reward.timeout_s=0.5"
        ):
            await asyncio.wait_for(client.score([{"role": "user", "content": "q"}]), 10)
    finally:
        await client.close()
        silent.close()


async def test_a_scorer_of_the_other_kind_is_refused_at_check(serve_app) -> None:
    app, _ = scripted_scorer(lambda b: {"scores": []}, kind="judge")
    client = RewardModelClient(RewardConfig(url=await serve_app(app)))
    try:
        with pytest.raises(RewardModelError, match=r"serves kind 'judge', but reward.kind is 'classifier'"):
            await client.check()
    finally:
        await client.close()
