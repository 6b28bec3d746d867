"""Contract tests: our SGLang client and embedded server against schemas of SGLang 0.5.23's API.

`schemas.py` names the files of the 0.5.23 wheel each schema was written from."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from agentrl.inference.base import BadRequestError
from agentrl.inference.sglang import SGLangClient
from tests.conftest import find_free_port
from tests.unit.inference import schemas as S
from tests.unit.inference.conftest import ServerThread

SAMPLING = {
    "max_new_tokens": 16,
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 20,
    "stop": ["</tool_call>"],
    "stop_token_ids": [2],
    "ignore_eos": False,
}


WEIGHT_ROUTES = {
    "/init_weights_update_group": S.SGLangInitGroupReq,
    "/begin_weight_update": S.SGLangBeginUpdateReq,
    "/update_weights_from_distributed": S.SGLangUpdateDistributedReq,
    "/end_weight_update": S.SGLangEndUpdateReq,
    "/update_weights_from_disk": S.SGLangUpdateDiskReq,
    "/destroy_weights_update_group": S.SGLangDestroyGroupReq,
}
CONTROL_ROUTES = {
    "/abort_request": S.SGLangAbortReq,
    "/pause_generation": S.SGLangPauseReq,
    "/continue_generation": S.SGLangContinueReq,
}


class Recorder:
    """A recording stand-in with SGLang 0.5.23's routes for what our client calls, answering as
    `srt/entrypoints/http_server.py` does (see schemas.py): weight-update routes
    `{"success", "message"}`, `/abort_request` an empty 200, `GET /ping` an empty 200 (503 when
    `healthy` is False), `GET /model_info` the version the last update carried ("default" before
    any); any other route (e.g. the removed `/get_weight_version`) 404 as FastAPI answers it."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict | None]] = []  # (method, path, body)
        self.version = "default"
        self.healthy = True

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else None
        self.seen.append((request.method, request.path, body))
        route = (request.method, request.path)
        if route[0] == "POST" and request.path in WEIGHT_ROUTES:
            if request.path.startswith("/update_weights") and body.get("weight_version") is not None:
                self.version = body["weight_version"]
            extra = {"num_paused_requests": 0} if request.path == "/update_weights_from_disk" else {}
            return web.json_response({"success": True, "message": "Success", **extra})
        if route == ("POST", "/abort_request"):
            return web.Response(status=200)
        if route[0] == "POST" and request.path in CONTROL_ROUTES:
            return web.json_response({"message": "Generation paused successfully.", "status": "ok"})
        if route == ("GET", "/ping"):
            return web.Response(status=200 if self.healthy else 503)
        if route == ("GET", "/model_info"):
            return web.json_response(
                {
                    "model_path": "/m",
                    "served_model_name": "/m",
                    "tokenizer_path": "/m",
                    "is_generation": True,
                    "weight_version": self.version,
                    "load_format": "auto",
                }
            )
        return web.json_response({"detail": "Not Found"}, status=404)


@pytest.fixture
async def recorder() -> AsyncIterator[tuple[Recorder, str]]:
    rec = Recorder()
    app = web.Application()

    async def route(request: web.Request) -> web.Response:  # looked up per request: a test may swap it
        return await rec.handle(request)

    app.router.add_route("*", "/{tail:.*}", route)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    port = find_free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield rec, f"http://127.0.0.1:{port}"
    await runner.cleanup()


def test_generate_request_is_a_valid_sglang_request():
    payload = SGLangClient("http://x").generate_payload([1, 2, 3], SAMPLING, rid="r1", session_id="ep1")
    S.SGLangGenerateReq.model_validate(payload)
    S.SGLangSamplingParams.model_validate(payload["sampling_params"])
    with pytest.raises(ValueError, match="top_k"):  # SamplingParams.verify refuses 0
        S.SGLangSamplingParams.model_validate({"top_k": 0})


async def test_admin_requests_match_sglang_0_5_23(recorder):
    """A push as the broadcast engine runs it — group, session, bucket, end — then the disk and
    control routes: every request our client sends is one 0.5.23 takes, on a route it has, and the
    version comes back from `/model_info` as the update set it."""
    rec, url = recorder
    async with SGLangClient(url) as client:
        assert await client.alive()
        assert await client.get_weight_version() == 0  # "default": nothing pushed yet
        await client.init_weights_update_group("127.0.0.1", 29500, 1, 3, "wg", "nccl")
        await client.begin_weight_update()
        assert client.has_session and client.flattened_buckets
        await client.update_weights_from_distributed(
            ["a", "b"], ["bfloat16", "float32"], [[2, 3], [4]], "wg", weight_version=4, flattened=True
        )
        await client.end_weight_update(weight_version=4)
        assert await client.get_weight_version() == 4  # what the bucket carried, read back
        await client.update_weights_from_disk("/ckpt", weight_version=5)
        assert await client.get_weight_version() == 5
        await client.destroy_weights_update_group("wg")
        await client.abort_request(rid="r1")
        await client.abort_request(abort_all=True)
        await client.pause_generation()
        await client.continue_generation()
        rec.healthy = False
        assert not await client.alive()  # /ping's 503
    schema = {**WEIGHT_ROUTES, **CONTROL_ROUTES}
    checked = set()
    for method, path, body in rec.seen:
        if method == "GET":
            assert path in ("/ping", "/model_info") and body is None, (method, path)
        else:
            schema[path].model_validate(body)
        checked.add(path)
    assert checked == {*schema, "/ping", "/model_info"}
    update = next(b for m, p, b in rec.seen if p == "/update_weights_from_distributed")
    assert update["weight_version"] == "4" and update["load_format"] == "flattened_bucket"


async def test_client_reads_failure_replies_of_the_session_routes(recorder):
    """0.5.23 answers a refused begin/end with 400 `{"success": false}`, and has no
    `/get_weight_version` (404): each is an error, never a silent success."""
    rec, url = recorder

    async def refuse(request: web.Request) -> web.Response:
        rec.seen.append((request.method, request.path, await request.json()))
        reply = {"success": False, "message": "no weight-update session is open"}
        return web.json_response(S.SGLangWeightResp(**reply).model_dump(exclude_none=True), status=400)

    handle, rec.handle = rec.handle, refuse
    async with SGLangClient(url) as client:
        with pytest.raises(BadRequestError, match="no weight-update session"):
            await client.end_weight_update()
        rec.handle = handle
        with pytest.raises(BadRequestError, match="404"):
            await client.http.request("GET", "/get_weight_version")


def test_client_parses_sglang_responses():
    client = SGLangClient("http://x")
    base = {"id": "r", "prompt_tokens": 3, "completion_tokens": 2, "cached_tokens": 0}
    examples = [
        (
            {"finish_reason": {"type": "stop", "matched": "</tool_call>"}, "weight_version": "default"},
            ("stop", "</tool_call>", 0),
        ),
        ({"finish_reason": {"type": "length", "length": 2}, "weight_version": "12"}, ("length", None, 12)),
        (
            {"finish_reason": {"type": "abort", "message": "paused"}, "weight_version": "3"},
            ("abort", None, 3),
        ),
    ]
    for meta, (kind, matched, version) in examples:
        reply = {
            "text": "ab",
            "output_ids": [7, 8],
            "meta_info": {**base, **meta, "output_token_logprobs": [[-0.5, 7, None], [-1.5, 8, None]]},
        }
        S.SGLangGenerateResp.model_validate(reply)
        res = client.parse_generate(reply, 3)
        assert (res.finish_reason, res.matched, res.weight_version) == (kind, matched, version)
        assert res.output_ids == [7, 8] and res.logprobs == [-0.5, -1.5]
    # older releases return no output_ids at the top level: ids come from the logprob triples
    reply = {"text": "a", "meta_info": {**base, **examples[1][0], "output_token_logprobs": [[-0.1, 9, None]]}}
    assert client.parse_generate(reply, 3).output_ids == [9]


async def test_embedded_server_speaks_sglang_shapes(server: ServerThread):
    body = {"input_ids": [4, 5, 6], "sampling_params": SAMPLING, "return_logprob": True, "rid": "shape"}
    S.SGLangGenerateReq.model_validate(body)
    async with aiohttp.ClientSession() as s:
        async with s.post(server.url + "/generate", json=body) as r:
            assert r.status == 200
            S.SGLangGenerateResp.model_validate(await r.json())
        async with s.post(server.url + "/update_weights_from_disk", json={"model_path": "/nope"}) as r:
            assert r.status == 400
            S.SGLangWeightResp.model_validate(await r.json())
        async with s.get(server.url + "/model_info") as r:
            S.SGLangModelInfo.model_validate(await r.json())
        async with s.get(server.url + "/ping") as r:
            assert r.status == 200
        for path, model in (
            ("/begin_weight_update", S.SGLangBeginUpdateReq),
            ("/end_weight_update", S.SGLangEndUpdateReq),
        ):
            async with s.post(server.url + path, json=model().model_dump(exclude_none=True)) as r:
                assert r.status == 200, await r.text()
                S.SGLangWeightResp.model_validate(await r.json())
        async with s.post(server.url + "/end_weight_update", json={}) as r:  # no session open: refused
            assert r.status == 400 and not S.SGLangWeightResp.model_validate(await r.json()).success
        # a top_k SGLang refuses (0) is refused here too
        bad = {"input_ids": [4], "sampling_params": {"top_k": 0}}
        async with s.post(server.url + "/generate", json=bad) as r:
            assert r.status == 400
