"""Contract tests: our SGLang client and embedded server against schemas of SGLang's API.

`schemas.py` says which SGLang sources (file + commit) each schema was written from."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

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


class Recorder:
    """A stand-in SGLang server that records every request and answers `{"success": true}`."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict | None]] = []

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else None
        self.seen.append((request.path, body))
        if request.path == "/get_weight_version":
            return web.json_response({"weight_version": "default"})
        return web.json_response({"success": True, "message": ""})


@pytest.fixture
async def recorder() -> AsyncIterator[tuple[Recorder, str]]:
    rec = Recorder()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", rec.handle)
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


async def test_admin_requests_match_sglang_dataclasses(recorder):
    rec, url = recorder
    async with SGLangClient(url) as client:
        await client.init_weights_update_group("127.0.0.1", 29500, 1, 3, "wg", "nccl")
        await client.update_weights_from_distributed(["a"], ["bfloat16"], [[2, 3]], "wg", weight_version=4)
        await client.update_weights_from_disk("/ckpt", weight_version=5)
        await client.destroy_weights_update_group("wg")
        await client.abort_request(rid="r1")
        await client.abort_request(abort_all=True)
        await client.pause_generation()
        await client.continue_generation()
        assert await client.get_weight_version() == 0  # SGLang's "default"
    schema = {
        "/init_weights_update_group": S.SGLangInitGroupReq,
        "/update_weights_from_distributed": S.SGLangUpdateDistributedReq,
        "/update_weights_from_disk": S.SGLangUpdateDiskReq,
        "/destroy_weights_update_group": S.SGLangDestroyGroupReq,
        "/abort_request": S.SGLangAbortReq,
        "/pause_generation": S.SGLangPauseReq,
    }
    checked = set()
    for path, body in rec.seen:
        if path in schema:
            schema[path].model_validate(body)
            checked.add(path)
    assert checked == set(schema)


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
        async with s.get(server.url + "/get_weight_version") as r:
            assert isinstance((await r.json())["weight_version"], str)
        # a top_k SGLang refuses (0) is refused here too
        bad = {"input_ids": [4], "sampling_params": {"top_k": 0}}
        async with s.post(server.url + "/generate", json=bad) as r:
            assert r.status == 400
