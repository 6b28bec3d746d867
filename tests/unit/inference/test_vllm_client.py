"""The vLLM client against a real local aiohttp server that scripts vLLM's answers.

The fake server validates every request with the schemas in `schemas.py` (written from
vLLM's `protocol.py` and `rlhf/api_router.py`, commits cited there) and answers 400 as vLLM
would when a request does not fit; its scripted responses are validated too."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from pydantic import ValidationError

from agentrl.inference.base import InferenceError, ServerUnavailableError
from agentrl.inference.vllm import VLLMClient
from tests.conftest import find_free_port
from tests.unit.inference import schemas as S


class FakeVLLM:
    def __init__(self) -> None:
        self.version: str | None = None
        self.calls: list[tuple[str, object]] = []
        self.fail_next = False
        self.paused = False

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append((request.path, body))
        if self.fail_next:
            self.fail_next = False
            return web.json_response({"error": "engine dead"}, status=500)
        try:
            req = S.VLLMCompletionRequest.model_validate(body)
        except ValidationError as exc:
            return web.json_response({"error": {"message": str(exc)}}, status=400)
        prompt = req.prompt
        assert isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
        n = min(req.max_tokens or 16, 3)
        tokens = [(prompt[-1] + i + 1) % 100 for i in range(n)]
        stopped = req.stop_token_ids and tokens[-1] in req.stop_token_ids
        choice = {
            "index": 0,
            "text": "x" * n,
            "logprobs": {"token_logprobs": [-0.25 * (i + 1) for i in range(n)], "tokens": ["x"] * n},
            "finish_reason": "stop" if stopped or self.paused else "length",
            "stop_reason": tokens[-1] if stopped else None,
            "token_ids": tokens if req.return_token_ids else None,
        }
        if self.paused:
            choice["finish_reason"] = "abort"
        reply = {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": int(time.time()),
            "model": req.model or "served",
            "choices": [choice],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n},
        }
        S.VLLMCompletionResponse.model_validate(reply)
        return web.json_response(reply)

    async def admin(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else None
        self.calls.append((request.path, body if body is not None else dict(request.query)))
        schema = {
            "/init_weight_transfer_engine": S.VLLMInitTransfer,
            "/update_weights": S.VLLMUpdateWeights,
            "/finish_weight_update": S.VLLMFinishUpdate,
            "/abort_requests": S.VLLMAbortRequests,
        }.get(request.path)
        if schema is not None:
            try:
                schema.model_validate(body)
            except ValidationError as exc:
                return web.json_response({"detail": str(exc)}, status=400)
        if request.path == "/update_weights":
            S.VLLMNCCLUpdateInfo.model_validate(body["update_info"])
        if request.path == "/finish_weight_update" and body.get("weight_version") is not None:
            self.version = body["weight_version"]
        if request.path == "/pause":
            self.paused = request.query.get("mode") == "abort"
        if request.path == "/resume":
            self.paused = False
        return web.json_response({"message": "ok"})

    async def weight_info(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.version})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()


@pytest.fixture
async def vllm() -> AsyncIterator[tuple[FakeVLLM, str]]:
    fake = FakeVLLM()
    app = web.Application()
    app.add_routes(
        [
            web.post("/v1/completions", fake.completions),
            web.get("/weight_info", fake.weight_info),
            web.get("/health", fake.health),
        ]
        + [
            web.post(p, fake.admin)
            for p in (
                "/init_weight_transfer_engine",
                "/start_weight_update",
                "/update_weights",
                "/finish_weight_update",
                "/pause",
                "/resume",
                "/abort_requests",
            )
        ]
    )
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    port = find_free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield fake, f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def test_generate_sends_token_ids_and_parses_tokens_logprobs(vllm):
    fake, url = vllm
    async with VLLMClient(url, model="served") as client:
        params = {"max_new_tokens": 3, "temperature": 1.0, "top_k": -1, "stop_token_ids": [13]}
        res = await client.generate([1, 2, 10], params, rid="r1", session_id="ep")
        body = fake.calls[-1][1]
        assert body["prompt"] == [1, 2, 10] and body["max_tokens"] == 3 and body["top_k"] == 0
        assert body["return_token_ids"] is True and body["logprobs"] == 0 and body["request_id"] == "r1"
        assert res.output_ids == [11, 12, 13] and res.logprobs == [-0.25, -0.5, -0.75]
        assert (res.finish_reason, res.matched, res.weight_version) == ("stop", 13, 0)
        assert res.prompt_tokens == 3 and res.completion_tokens == 3


async def test_weight_update_sequence_sets_version(vllm):
    fake, url = vllm
    async with VLLMClient(url) as client:
        await client.init_weights_update_group("127.0.0.1", 29501, 1, 2)
        await client.update_weights_from_distributed(["w"], ["bfloat16"], [[4, 4]], weight_version=6)
        paths = [p for p, _ in fake.calls]
        assert paths == [
            "/init_weight_transfer_engine",
            "/start_weight_update",
            "/update_weights",
            "/finish_weight_update",
        ]
        assert await client.get_weight_version() == 6
        assert (await client.generate([5], {"max_new_tokens": 2})).weight_version == 6


async def test_pause_aborts_and_resume(vllm):
    fake, url = vllm
    async with VLLMClient(url) as client:
        await client.pause_generation()
        assert fake.calls[-1] == ("/pause", {"mode": "abort"})
        assert (await client.generate([5], {"max_new_tokens": 2})).finish_reason == "abort"
        await client.continue_generation()
        assert (await client.generate([5], {"max_new_tokens": 2})).finish_reason == "length"
        await client.abort_request(rid="r9")
        assert fake.calls[-1] == ("/abort_requests", {"request_ids": ["r9"]})


async def test_errors_map_to_the_router_kinds(vllm):
    fake, url = vllm
    async with VLLMClient(url) as client:
        fake.fail_next = True
        with pytest.raises(ServerUnavailableError):
            await client.generate([5], {"max_new_tokens": 2})
        with pytest.raises(InferenceError, match="no vLLM equivalent"):
            await client.generate([5], {"regex": "a+"})
        with pytest.raises(InferenceError, match="disk"):
            await client.update_weights_from_disk("/ckpt")
    async with VLLMClient(f"http://127.0.0.1:{find_free_port()}", connect_timeout_s=1) as dead:
        assert not await dead.health()
        with pytest.raises(ServerUnavailableError):
            await dead.generate([5], {})
