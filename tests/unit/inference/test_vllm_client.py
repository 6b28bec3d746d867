"""The vLLM client against a real local aiohttp server that scripts vLLM's answers.

The fake server validates every request with the schemas in `schemas.py` (written from
vLLM's `protocol.py` and `rlhf/api_router.py`, commits cited there) and answers 400 as vLLM
would when a request does not fit; its scripted responses are validated too."""

from __future__ import annotations

import base64
import io
import json
import time
from collections.abc import AsyncIterator, Callable

import numpy as np
import pytest
from aiohttp import web
from pydantic import ValidationError

from agentrl.inference.base import BadRequestError, InferenceError, ServerUnavailableError
from agentrl.inference.vllm import VLLMClient
from tests.conftest import find_free_port
from tests.unit.inference import schemas as S

# `GenerateRequest` and `SamplingParams` fields the client may send (vLLM 0.32,
# entrypoints/scale_out/token_in_token_out/protocol.py, sampling_params.py).
GENERATE_FIELDS = {"request_id", "token_ids", "sampling_params", "model", "stream", "priority", "cache_salt"}
SAMPLING_FIELDS = {
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k",
    "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens", "logprobs",
    "include_stop_str_in_output", "skip_special_tokens", "detokenize",
}  # fmt: skip


class FakeVLLM:
    def __init__(self) -> None:
        self.version: str | None = None
        self.calls: list[tuple[str, object]] = []
        self.fail_next = False
        self.paused = False
        self.finish_reason: str | None = None  # scripted finish_reason of the next completion
        self.rpc_error: str | None = None  # scripted worker error of the next /collective_rpc
        self.generate_route = "absent"  # /inference/v1/generate: absent (404), disabled (403) or "on"
        self.spans: list[dict] | None = None  # scripted weight_versions of the next generate reply
        self.routing: Callable[[list[int]], np.ndarray | None] | None = None
        """Routed experts (a server started with --enable-return-routed-experts): the array for the
        tokens fed to the model (prompt + output - 1), sent as `numpy2base64` sends it."""

    def routed_experts(self, prompt: list[int], tokens: list[int]) -> str | None:
        array = self.routing(prompt + tokens[:-1]) if self.routing is not None else None
        return None if array is None else numpy2base64(array)

    async def generate(self, request: web.Request) -> web.Response:
        """`/inference/v1/generate` (vllm/entrypoints/scale_out/token_in_token_out/, vLLM 0.32): 403
        when the server runs without --enable-scale-out, as `register_scale_out_api_routers` answers."""
        if self.generate_route == "absent":
            return web.json_response({"detail": "Not Found"}, status=404)
        body = await request.json()
        self.calls.append((request.path, body))
        if self.generate_route == "disabled":
            return web.json_response({"error": {"message": "Scale-out endpoints are disabled"}}, status=403)
        if not set(body) <= GENERATE_FIELDS or not set(body["sampling_params"]) <= SAMPLING_FIELDS:
            return web.json_response({"error": {"message": f"unknown fields in {body}"}}, status=400)
        prompt, sp = body["token_ids"], body["sampling_params"]
        assert all(isinstance(t, int) for t in prompt) and sp["logprobs"] == 0
        n = min(sp.get("max_tokens", 16), 3)
        tokens = [(prompt[-1] + i + 1) % 100 for i in range(n)]
        version = self.version or "default"
        spans = self.spans if self.spans is not None else [{"version": version, "start": 0, "end": n}]
        self.spans = None
        choice = {
            "index": 0,
            "finish_reason": "abort" if self.paused else "length",
            "stop_reason": None,
            "token_ids": tokens,
            "weight_versions": spans,
            "routed_experts": self.routed_experts(prompt, tokens),
            "logprobs": {
                "content": [{"token_id": t, "logprob": -0.5 * (i + 1)} for i, t in enumerate(tokens)]
            },
        }
        usage = {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}
        request_id = f"generate-tokens-{body.get('request_id', 'x')}"
        return web.json_response(
            {"request_id": request_id, "output_mode": "tokens", "choices": [choice], "usage": usage}
        )

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
            "routed_experts": self.routed_experts(prompt, tokens),
        }
        if self.paused:
            choice["finish_reason"] = "abort"
        if self.finish_reason is not None:
            choice["finish_reason"], self.finish_reason = self.finish_reason, None
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

    async def collective_rpc(self, request: web.Request) -> web.Response:
        """`/collective_rpc` (vllm/entrypoints/serve/dev/rpc/api_router.py): method + kwargs, one result
        per worker; a worker's exception comes back as HTTP 500."""
        body = await request.json()
        assert set(body) <= {"method", "args", "kwargs", "timeout"} and isinstance(body["method"], str)
        payload = json.loads(body["kwargs"]["payload"])
        self.calls.append((f"rpc:{body['method']}", payload))
        if self.rpc_error is not None:
            message, self.rpc_error = self.rpc_error, None
            return web.json_response({"error": {"message": message, "code": 500}}, status=500)
        return web.json_response({"results": [{"ok": True}]})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await request.json()
        assert set(body) == {"new_version"} and isinstance(body["new_version"], str)
        self.calls.append((request.path, body))
        self.version = body["new_version"]
        return web.json_response({"success": True, "new_version": self.version})

    async def weight_info(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.version})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()


def numpy2base64(array: np.ndarray) -> str:
    """vLLM 0.32's encoding of `routed_experts` (`numpy2base64` in `vllm/utils/serial_utils.py`,
    which both generate routes call): the array's `.npy` bytes, base64 (vLLM uses pybase64, whose
    output is the standard alphabet, as `base64`'s)."""
    with io.BytesIO() as buffer:
        np.save(buffer, array, allow_pickle=False)
        return base64.b64encode(buffer.getbuffer()).decode("ascii")


@pytest.fixture
async def vllm() -> AsyncIterator[tuple[FakeVLLM, str]]:
    fake = FakeVLLM()
    app = web.Application()
    app.add_routes(
        [
            web.post("/v1/completions", fake.completions),
            web.post("/inference/v1/generate", fake.generate),
            web.get("/weight_info", fake.weight_info),
            web.get("/health", fake.health),
            web.post("/collective_rpc", fake.collective_rpc),
            web.post("/update_weight_version", fake.update_weight_version),
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


async def test_weight_update_runs_the_worker_extension_protocol(vllm):
    fake, url = vllm
    async with VLLMClient(url, group_timeout_s=7) as client:
        await client.init_weights_update_group("127.0.0.1", 29501, 1, 2, "g", "gloo")
        await client.begin_weight_update()
        await client.update_weights_from_distributed(["w"], ["bfloat16"], [[4, 4]], "g", 6, flattened=True)
        assert await client.get_weight_version() == 0  # nothing is live before the commit
        await client.end_weight_update()  # the version comes from the buckets' announcement
        await client.destroy_weights_update_group("g")
        assert [p for p, _ in fake.calls] == [
            "rpc:agentrl_join_group",
            "rpc:agentrl_discard",
            "rpc:agentrl_receive",
            "rpc:agentrl_commit",
            "/update_weight_version",
            "rpc:agentrl_leave_group",
        ]
        join, receive = fake.calls[0][1], fake.calls[2][1]
        assert join == {
            "master_address": "127.0.0.1",
            "master_port": 29501,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": "g",
            "backend": "gloo",
            "timeout_s": 7,
        }
        assert receive == {
            "names": ["w"],
            "dtypes": ["bfloat16"],
            "shapes": [[4, 4]],
            "group_name": "g",
            "flattened": True,
        }
        assert await client.get_weight_version() == 6
        assert (await client.generate([5], {"max_new_tokens": 2})).weight_version == 6


async def test_failed_commit_keeps_the_version(vllm):
    fake, url = vllm
    async with VLLMClient(url) as client:
        fake.rpc_error = "Worker failed with error 'nothing staged to commit'"
        with pytest.raises(ServerUnavailableError, match="nothing staged"):
            await client.end_weight_update(3)
        assert "/update_weight_version" not in [p for p, _ in fake.calls]
        assert await client.get_weight_version() == 0


async def test_disk_load_goes_through_the_worker(vllm):
    fake, url = vllm
    async with VLLMClient(url) as client:
        await client.update_weights_from_disk("/ckpt/v4", 4)
        assert fake.calls[-2] == ("rpc:agentrl_load_from_disk", {"path": "/ckpt/v4"})
        assert await client.get_weight_version() == 4


async def test_sampling_is_pinned_to_neutral_defaults(vllm):
    fake, url = vllm
    async with VLLMClient(url) as client:
        await client.generate([5], {"max_new_tokens": 2, "temperature": 0.7, "repetition_penalty": 1.1})
        body = fake.calls[-1][1]
        assert (body["temperature"], body["repetition_penalty"]) == (0.7, 1.1)
        assert (body["top_p"], body["top_k"], body["min_p"]) == (1.0, 0, 0.0)
        assert (body["presence_penalty"], body["frequency_penalty"]) == (0.0, 0.0)


async def test_finish_reasons(vllm):
    fake, url = vllm
    async with VLLMClient(url) as client:
        fake.finish_reason = "repetition"
        res = await client.generate([5], {"max_new_tokens": 2})
        assert (res.finish_reason, res.matched) == ("length", "repetition")
        fake.finish_reason = "error"
        with pytest.raises(ServerUnavailableError, match="'error'"):
            await client.generate([5], {"max_new_tokens": 2})
        fake.finish_reason = "banana"
        with pytest.raises(InferenceError, match="'banana'"):
            await client.generate([5], {"max_new_tokens": 2})


async def test_pause_aborts_and_resume(vllm):
    fake, url = vllm
    async with VLLMClient(url) as client:
        await client.pause_generation()
        assert fake.calls[-1] == ("/pause", {"mode": "abort"})
        assert (await client.generate([5], {"max_new_tokens": 2})).finish_reason == "abort"
        await client.continue_generation()
        assert (await client.generate([5], {"max_new_tokens": 2})).finish_reason == "length"
        await client.abort_request(rid="r9")  # vLLM's engine id of the request's only completion
        assert fake.calls[-1] == ("/abort_requests", {"request_ids": ["cmpl-r9-0"]})


async def test_errors_map_to_the_router_kinds(vllm):
    fake, url = vllm
    async with VLLMClient(url) as client:
        fake.fail_next = True
        with pytest.raises(ServerUnavailableError):
            await client.generate([5], {"max_new_tokens": 2})
        with pytest.raises(InferenceError, match="no vLLM equivalent"):
            await client.generate([5], {"regex": "a+"})
    async with VLLMClient(f"http://127.0.0.1:{find_free_port()}", connect_timeout_s=1) as dead:
        assert not await dead.health()
        with pytest.raises(ServerUnavailableError):
            await dead.generate([5], {})


async def test_generate_route_reports_the_version_of_the_first_token(vllm):
    """`/inference/v1/generate`: the version comes from the reply's per-token spans (the oldest, so a
    request spanning a push is never reported fresher than its first token), not from /weight_info."""
    fake, url = vllm
    fake.generate_route, fake.version = "on", "4"
    async with VLLMClient(url, model="served") as client:
        params = {"max_new_tokens": 3, "temperature": 1.0, "top_k": -1, "sampling_seed": 9}
        res = await client.generate([1, 2, 10], params, rid="r1")
        path, body = fake.calls[-1]
        assert path == "/inference/v1/generate" and len(fake.calls) == 1  # no /weight_info round trip
        assert body["token_ids"] == [1, 2, 10] and body["request_id"] == "r1" and body["model"] == "served"
        sp = body["sampling_params"]
        assert (sp["max_tokens"], sp["top_k"], sp["seed"], sp["logprobs"]) == (3, 0, 9, 0)
        assert (sp["top_p"], sp["min_p"], sp["repetition_penalty"]) == (1.0, 0.0, 1.0)
        assert res.output_ids == [11, 12, 13] and res.logprobs == [-0.5, -1.0, -1.5]
        assert (res.finish_reason, res.weight_version, res.prompt_tokens) == ("length", 4, 3)
        assert client.exact_versions is True
        fake.spans = [{"version": "6", "start": 0, "end": 1}, {"version": "7", "start": 1, "end": 3}]
        assert (await client.generate([5], {"max_new_tokens": 3})).weight_version == 6
        fake.spans = [{"version": "default", "start": 0, "end": 3}]
        assert (await client.generate([5], {"max_new_tokens": 3})).weight_version == 0
        await client.abort_request(rid="r1")
        assert fake.calls[-1] == ("/abort_requests", {"request_ids": ["generate-tokens-r1"]})


async def test_tokens_without_a_version_are_refused(vllm):
    fake, url = vllm
    fake.generate_route, fake.spans = "on", []
    async with VLLMClient(url) as client:
        with pytest.raises(InferenceError, match="without weight_versions"):
            await client.generate([5], {"max_new_tokens": 2})


@pytest.mark.parametrize("route", ["disabled", "absent"])
async def test_a_server_without_the_generate_route_is_driven_through_completions(vllm, route):
    fake, url = vllm
    fake.generate_route, fake.version = route, "3"
    async with VLLMClient(url) as client:
        await client.abort_request(rid="r0")  # route not known yet: both engine ids
        assert fake.calls[-1] == ("/abort_requests", {"request_ids": ["generate-tokens-r0", "cmpl-r0-0"]})
        for _ in range(2):
            res = await client.generate([5], {"max_new_tokens": 2})
            assert (res.weight_version, res.output_ids) == (3, [6, 7])
        paths = [p for p, _ in fake.calls]
        assert client.exact_versions is False and paths.count("/v1/completions") == 2
        assert paths.count("/inference/v1/generate") == (1 if route == "disabled" else 0)  # asked once
        await client.abort_request(rid="r9")
        assert fake.calls[-1] == ("/abort_requests", {"request_ids": ["cmpl-r9-0"]})


async def test_a_generate_route_that_worked_is_not_given_up_on(vllm):
    fake, url = vllm
    fake.generate_route = "on"
    async with VLLMClient(url) as client:
        await client.generate([5], {"max_new_tokens": 2})
        fake.generate_route = "disabled"  # e.g. a different server restarted on the address
        with pytest.raises(BadRequestError):
            await client.generate([5], {"max_new_tokens": 2})


LAYERS, TOP_K = 3, 2


def routing(num_experts: int, extra_rows: int = 0) -> Callable[[list[int]], np.ndarray]:
    """What a MoE server routes each fed token to, in vLLM's dtype for `num_experts` (uint8 up to
    256 experts, else uint16: `RoutedExpertsCapturer.output_dtype_name`,
    `vllm/model_executor/layers/fused_moe/routed_experts_capturer.py`), [fed, layers, top_k]."""
    dtype = np.uint8 if num_experts <= 256 else np.uint16

    def route(fed: list[int]) -> np.ndarray:
        ids = [[[(t * 7 + layer * 31 + k * 101 + 250) % num_experts for k in range(TOP_K)] for layer in range(LAYERS)]
               for t in fed + fed[: extra_rows]]  # fmt: skip
        return np.array(ids, dtype=dtype)

    return route


@pytest.mark.parametrize("route", ["on", "absent"])  # /inference/v1/generate, or the /v1/completions fallback
@pytest.mark.parametrize("num_experts", [60, 300])  # uint8, uint16 on the wire
async def test_routed_experts_are_the_rows_vllm_sent(vllm, route: str, num_experts: int) -> None:
    from agentrl.rollers.agent_loop import _Trace

    fake, url = vllm
    fake.generate_route, fake.routing = route, routing(num_experts)
    prompt = [5, 40, 9, 77]
    async with VLLMClient(url, routed_experts=True) as client:
        res = await client.generate(prompt, {"max_new_tokens": 3})
    fed = prompt + res.output_ids[:-1]
    expected = routing(num_experts)(fed).astype(np.int32).reshape(len(fed), LAYERS * TOP_K)
    assert res.routed_experts.dtype == np.int32 and np.array_equal(res.routed_experts, expected)
    assert expected.max() > 255 if num_experts > 256 else expected.max() < 256  # the dtype mattered
    # as the rollers keep it: every fed token its row, the last output token (never fed) none
    trace = _Trace()
    trace.add_context(prompt)
    trace.add_generated(res)
    kept = trace.routed_experts()
    assert np.array_equal(kept[:-1], expected) and (kept[-1] == -1).all()
    async with VLLMClient(url) as client:  # not asked: not read
        assert (await client.generate(prompt, {"max_new_tokens": 3})).routed_experts is None


async def test_routed_experts_that_are_not_one_row_per_fed_token_are_refused(vllm) -> None:
    fake, url = vllm
    fake.generate_route = "on"
    bad: list[tuple[Callable[[list[int]], np.ndarray], str]] = [
        (
            routing(60, extra_rows=1),
            r"shape \[8, 3, 2\]: expected \[7, layers, top_k\].*prompt 5 \+ output 3 - 1",
        ),
        (lambda fed: routing(60)(fed)[:-1], r"shape \[6, 3, 2\]: expected \[7"),
        (lambda fed: routing(60)(fed).reshape(len(fed), -1), r"shape \[7, 6\]"),
        (lambda fed: routing(60)(fed).astype(np.float32), "dtype float32"),
        (lambda fed: np.zeros((len(fed), 0, 2), np.uint8), r"shape \[7, 0, 2\]"),
    ]
    async with VLLMClient(url, routed_experts=True) as client:
        for route, message in bad:
            fake.routing = route
            with pytest.raises(InferenceError, match=message):
                await client.generate([1, 2, 3, 4, 5], {"max_new_tokens": 3})
        fake.routing = None
        fake.routed_experts = lambda prompt, tokens: "bm90IG5weQ=="  # base64, not of a .npy
        with pytest.raises(InferenceError, match=r"not the base64 of a \.npy"):
            await client.generate([1, 2], {"max_new_tokens": 3})


async def test_routed_experts_absent_fail_a_finished_request_not_an_aborted_one(vllm) -> None:
    """vLLM sends none for a request aborted before any forward (`GenerateChoiceBase.routed_experts`
    in `token_in_token_out/protocol.py`): the result has no routing, the resumed request covers the
    tokens; a finished request without them comes from a server without the flag."""
    fake, url = vllm
    fake.generate_route = "on"
    async with VLLMClient(url, routed_experts=True) as client:
        with pytest.raises(InferenceError, match="--enable-return-routed-experts"):
            await client.generate([1, 2], {"max_new_tokens": 3})
        fake.paused = True  # replies finish with "abort"
        res = await client.generate([1, 2], {"max_new_tokens": 3})
        assert res.finish_reason == "abort" and res.routed_experts is None
        fake.routing = routing(60)  # an abort after some forwards: the rows so far, checked the same way
        res = await client.generate([1, 2], {"max_new_tokens": 3})
        assert res.finish_reason == "abort" and res.routed_experts.shape == (4, LAYERS * TOP_K)
