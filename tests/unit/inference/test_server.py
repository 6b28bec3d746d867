"""The embedded server over real HTTP: generate, bad input, API key, abort/pause, weight updates.

The server runs in a background thread of this process (see conftest.py) on a free loopback
port; the test talks to it with the SGLang client and raw aiohttp, and plays the trainer's
side of a real gloo group for `/update_weights_from_distributed`."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import aiohttp
import pytest
import torch

from agentrl.inference.base import BadRequestError, InferenceError
from agentrl.inference.sglang import SGLangClient
from tests.conftest import find_free_port
from tests.unit.inference.conftest import ServerThread

PROMPT = [5, 17, 42, 99, 3]
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


async def _post(url: str, path: str, body, headers=None) -> tuple[int, dict | str]:
    async with aiohttp.ClientSession(headers=headers) as s:
        data = body if isinstance(body, (str, bytes)) else None
        kw = {"data": data} if data is not None else {"json": body}
        async with s.post(url + path, **kw) as r:
            return r.status, (await r.json() if r.content_type == "application/json" else await r.text())


async def test_generate_returns_sglang_shape_and_matching_logprobs(server: ServerThread):
    status, out = await _post(
        server.url,
        "/generate",
        {
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": 10, "ignore_eos": True},
            "return_logprob": True,
        },
    )
    assert status == 200
    meta = out["meta_info"]
    assert len(out["output_ids"]) == 10 and meta["completion_tokens"] == 10 and meta["prompt_tokens"] == 5
    assert meta["finish_reason"] == {"type": "length", "length": 10}
    assert [t[1] for t in meta["output_token_logprobs"]] == out["output_ids"]
    ids = torch.tensor([PROMPT + out["output_ids"]])
    with torch.no_grad():
        logp = server.engine.model(input_ids=ids).logits[0].log_softmax(-1)
    ref = logp[4:-1].gather(1, torch.tensor(out["output_ids"])[:, None]).squeeze(1)
    got = torch.tensor([t[0] for t in meta["output_token_logprobs"]])
    assert torch.allclose(got, ref, atol=1e-4)


async def test_batch_and_n_and_text(server: ServerThread):
    status, out = await _post(
        server.url,
        "/generate",
        {"input_ids": [PROMPT, PROMPT[:2]], "sampling_params": {**GREEDY, "n": 2}, "rid": "batch"},
    )
    assert status == 200 and len(out) == 4
    assert out[0]["output_ids"] == out[1]["output_ids"]  # greedy copies agree
    assert {o["meta_info"]["id"] for o in out} == {"batch-0-0", "batch-0-1", "batch-1-0", "batch-1-1"}
    status, out = await _post(server.url, "/generate", {"text": "the answer is", "sampling_params": GREEDY})
    assert status == 200 and isinstance(out["text"], str) and len(out["output_ids"]) == 8


async def test_client_generate_result(server: ServerThread):
    async with SGLangClient(server.url) as client:
        res = await client.generate(PROMPT, GREEDY, rid="c1")
        assert res.finish_reason == "length" and len(res.output_ids) == 8 == len(res.logprobs)
        assert res.weight_version == await client.get_weight_version()
        assert await client.health()
        with pytest.raises(BadRequestError, match="out of vocabulary"):
            await client.generate([10**6], GREEDY)


BAD = [
    ("{not json", "malformed JSON"),
    ({"input_ids": PROMPT, "bogus": 1}, "bogus: unknown field"),
    ({"input_ids": [1, 2, 999999]}, "out of vocabulary"),
    ({"input_ids": [-1]}, "out of vocabulary"),
    ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"input_ids": PROMPT, "sampling_params": {"temprature": 1}}, "temprature: unknown field"),
    ({"input_ids": [7] * 4200}, "context length"),
    ({"input_ids": []}, "empty"),
    ({"text": "hi", "input_ids": PROMPT}, "exactly one"),
    ({"input_ids": PROMPT, "stream": True}, "streaming is not supported"),
    ([1, 2], "JSON object"),
]


async def test_bad_input_gets_400_and_server_keeps_serving(server: ServerThread):
    for body, message in BAD:
        raw = body if isinstance(body, str) else None
        status, out = await _post(server.url, "/generate", raw if raw is not None else body)
        assert status == 400, (body, out)
        assert message in out["message"] and out["object"] == "error", (body, out)  # SGLang's ErrorResponse
    status, out = await _post(server.url, "/update_weights_from_disk", {"model_path": "/nonexistent"})
    assert status == 400 and out["success"] is False
    status, out = await _post(server.url, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY})
    assert status == 200 and len(out["output_ids"]) == 8


async def test_abort_by_rid_returns_partial_then_pause_holds(server: ServerThread):
    async with SGLangClient(server.url) as client:
        long = {"max_new_tokens": 3000, "ignore_eos": True}
        task = asyncio.create_task(client.generate(PROMPT, long, rid="to-abort"))
        while server.engine.num_running == 0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        await client.abort_request(rid="to-abort")
        res = await asyncio.wait_for(task, 30)
        assert res.finish_reason == "abort" and 0 < len(res.output_ids) < 3000
        assert len(res.logprobs) == len(res.output_ids)

        task = asyncio.create_task(client.generate(PROMPT, long))
        while server.engine.num_running == 0:
            await asyncio.sleep(0.01)
        await client.pause_generation()
        assert (await asyncio.wait_for(task, 30)).finish_reason == "abort"
        held = asyncio.create_task(client.generate(PROMPT, GREEDY))
        await asyncio.sleep(0.3)
        assert not held.done()
        await client.continue_generation()
        assert len((await asyncio.wait_for(held, 30)).output_ids) == 8


async def test_api_key_guards_every_route_but_health(tiny_model: Path):
    # SGLang 0.5.23 `decide_request_auth` (srt/utils/auth.py): /health* always open
    srv = ServerThread(tiny_model, api_key="s3cret").start()
    try:
        for path in ("/model_info", "/get_model_info", "/get_weight_version", "/ping"):
            async with aiohttp.ClientSession() as s, s.get(srv.url + path) as r:
                assert r.status == 401, path
        for path in ("/health", "/health_generate"):
            async with aiohttp.ClientSession() as s, s.get(srv.url + path) as r:
                assert r.status == 200, path
        status, _ = await _post(srv.url, "/generate", {"input_ids": PROMPT})
        assert status == 401
        async with SGLangClient(srv.url, api_key="wrong") as bad:
            assert not await bad.alive()
            with pytest.raises(BadRequestError, match="401"):
                await bad.get_weight_version()
        async with SGLangClient(srv.url, api_key="s3cret") as good:
            assert await good.health() and await good.alive()
            assert len((await good.generate(PROMPT, GREEDY)).output_ids) == 8
    finally:
        srv.stop()


async def test_admin_key_replaces_the_api_key_on_admin_routes(tiny_model: Path):
    srv = ServerThread(tiny_model, api_key="user", admin_api_key="root").start()
    try:
        async with (
            SGLangClient(srv.url, api_key="user") as user,
            SGLangClient(srv.url, api_key="root") as root,
        ):
            assert len((await user.generate(PROMPT, GREEDY)).output_ids) == 8
            with pytest.raises(BadRequestError, match="401"):
                await user.pause_generation()
            await root.pause_generation()
            await root.continue_generation()
    finally:
        srv.stop()


async def test_abort_matches_rid_prefixes_and_an_empty_rid_aborts_nothing(server: ServerThread):
    async with SGLangClient(server.url) as client:
        long = {"max_new_tokens": 3000, "ignore_eos": True}
        tasks = [asyncio.create_task(client.generate(PROMPT, long, rid=f"ep7-turn{i}")) for i in range(2)]
        other = asyncio.create_task(
            client.generate(PROMPT, {"max_new_tokens": 40, "ignore_eos": True}, rid="x")
        )
        while server.engine.num_running < 3:
            await asyncio.sleep(0.01)
        status, _ = await _post(server.url, "/abort_request", {"rid": ""})
        assert status == 200 and server.engine.num_running == 3
        await client.abort_request(rid="ep7-")
        results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        assert all(r.finish_reason == "abort" for r in results)
        assert (await asyncio.wait_for(other, 30)).finish_reason == "length"


@pytest.mark.parametrize("mode", ["in_place", "retract"])
async def test_pause_keeps_running_requests_in_place_and_retract_modes(server: ServerThread, mode: str):
    async with SGLangClient(server.url) as client:
        task = asyncio.create_task(client.generate(PROMPT, {"max_new_tokens": 60, "ignore_eos": True}))
        while server.engine.num_running == 0:
            await asyncio.sleep(0.01)
        status, out = await _post(server.url, "/pause_generation", {"mode": mode, "unknown_field": 1})
        assert status == 200 and out["status"] == "ok"
        steps = server.engine.steps
        await asyncio.sleep(0.3)
        assert not task.done() and server.engine.steps == steps  # held, not stepped, not aborted
        assert await client.alive()  # liveness answers while paused
        await client.continue_generation()
        res = await asyncio.wait_for(task, 30)
        assert res.finish_reason == "length" and len(res.output_ids) == 60


def _perturbed_checkpoint(src: Path, dst: Path, scale: float = 5.0) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(src / "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    changed = {k: (v + scale * torch.randn(v.shape, generator=gen)).contiguous() for k, v in tensors.items()}
    save_file(changed, str(dst / "model.safetensors"))
    return changed


async def test_update_weights_from_disk_changes_outputs_and_version(tiny_model: Path, tmp_path: Path):
    srv = ServerThread(tiny_model).start()
    try:
        async with SGLangClient(srv.url) as client:
            before = await client.generate(PROMPT, GREEDY)
            _perturbed_checkpoint(tiny_model, tmp_path / "v7")
            await client.update_weights_from_disk(str(tmp_path / "v7"), weight_version=7)
            after = await client.generate(PROMPT, GREEDY)
            assert after.weight_version == 7 == await client.get_weight_version()
            assert after.output_ids != before.output_ids
            # a checkpoint of another shape is refused and changes nothing
            from safetensors.torch import save_file

            (tmp_path / "bad").mkdir()
            save_file({"model.norm.weight": torch.ones(3)}, str(tmp_path / "bad" / "model.safetensors"))
            with pytest.raises(BadRequestError, match="shape mismatch"):
                await client.update_weights_from_disk(str(tmp_path / "bad"), weight_version=8)
            again = await client.generate(PROMPT, GREEDY)
            assert again.output_ids == after.output_ids and again.weight_version == 7
    finally:
        srv.stop()


async def test_update_weights_from_distributed_over_gloo(tiny_model: Path, tmp_path: Path):
    """This test is the trainer: rank 0 of a real gloo group; the server joins as rank 1."""
    from agentrl.inference.weight_group import dtype_name, join_group

    srv = ServerThread(tiny_model).start()
    port = find_free_port()
    trainer: dict = {}
    joined = threading.Thread(
        target=lambda: trainer.update(g=join_group("127.0.0.1", port, 0, 2, "wg", "gloo", 30))
    )
    try:
        async with SGLangClient(srv.url) as client:
            before = await client.generate(PROMPT, GREEDY)
            joined.start()
            await client.init_weights_update_group("127.0.0.1", port, 1, 2, "wg", "gloo")
            joined.join(30)
            group = trainer["g"]
            new = _perturbed_checkpoint(tiny_model, tmp_path / "ckpt")
            names = sorted(new)
            # outside a session the server refuses before receiving anything (SGLang 0.5.23)
            with pytest.raises(BadRequestError, match="between begin_weight_update"):
                await client.update_weights_from_distributed(["x"], ["float32"], [[1]], "wg")
            await client.begin_weight_update()
            assert client.has_session and client.flattened_buckets
            with pytest.raises(InferenceError, match="already open"):
                await client.begin_weight_update()
            # send in two buckets, each: post the metadata, then broadcast in the order of `names`
            for bucket, version in ((names[: len(names) // 2], None), (names[len(names) // 2 :], 3)):
                call = asyncio.create_task(
                    client.update_weights_from_distributed(
                        bucket,
                        [dtype_name(new[n].dtype) for n in bucket],
                        [list(new[n].shape) for n in bucket],
                        "wg",
                        weight_version=version,
                    )
                )
                for n in bucket:
                    await asyncio.to_thread(group.broadcast, new[n].clone(), 0)
                await asyncio.wait_for(call, 30)
            # staged, not applied: the model and its version change only at the commit
            assert await client.get_weight_version() == 0 and client.stages_updates
            assert (await client.generate(PROMPT, GREEDY)).output_ids == before.output_ids
            await client.end_weight_update()
            assert await client.get_weight_version() == 3
            for n in names:
                assert torch.equal(srv.engine.model.state_dict()[n], new[n]), n
            await client.begin_weight_update()
            # one bucket as a single flattened uint8 broadcast (SGLang's FlattenedTensorBucket layout)
            flat_new = {n: (t * 0.5).contiguous() for n, t in new.items()}
            call = asyncio.create_task(
                client.update_weights_from_distributed(
                    names,
                    [dtype_name(flat_new[n].dtype) for n in names],
                    [list(flat_new[n].shape) for n in names],
                    "wg",
                    weight_version=3,
                    flattened=True,
                )
            )
            flat = torch.cat([flat_new[n].reshape(-1).view(torch.uint8) for n in names])
            await asyncio.to_thread(group.broadcast, flat, 0)
            await asyncio.wait_for(call, 30)
            await client.end_weight_update()
            after = await client.generate(PROMPT, GREEDY)
            assert after.weight_version == 3 and after.output_ids != before.output_ids
            for n in names:
                assert torch.equal(srv.engine.model.state_dict()[n], flat_new[n]), n
            await client.begin_weight_update()
            # names the model lacks: the server still receives (the group stays aligned), then refuses
            call = asyncio.create_task(
                client.update_weights_from_distributed(["nope"], ["float32"], [[2]], "wg", 4)
            )
            await asyncio.to_thread(group.broadcast, torch.ones(2), 0)
            with pytest.raises(BadRequestError, match="unknown parameter names"):
                await asyncio.wait_for(call, 30)
            assert await client.get_weight_version() == 3
            # a failed bucket spoils the session: its commit is refused, nothing changes
            with pytest.raises(BadRequestError, match="a bucket of this session failed"):
                await client.end_weight_update()
            # an aborted session discards what it staged
            await client.begin_weight_update()
            call = asyncio.create_task(
                client.update_weights_from_distributed(
                    names[:1], [dtype_name(new[names[0]].dtype)], [list(new[names[0]].shape)], "wg", 9
                )
            )
            await asyncio.to_thread(group.broadcast, new[names[0]] * 3, 0)
            await asyncio.wait_for(call, 30)
            await client.abort_weight_update()
            assert await client.get_weight_version() == 3
            assert torch.equal(srv.engine.model.state_dict()[names[0]], flat_new[names[0]])
            await client.abort_weight_update()  # no session open: nothing to abort, not an error
            with pytest.raises(InferenceError, match="no weight-update session"):
                await client.end_weight_update()
            await client.destroy_weights_update_group("wg")
            with pytest.raises(InferenceError):
                await client.update_weights_from_distributed(["x"], ["float32"], [[1]], "wg")
    finally:
        srv.stop()


async def test_client_that_gives_up_frees_the_engine(server: ServerThread):
    async with SGLangClient(server.url, timeout_s=0.5) as client:
        with pytest.raises(InferenceError):
            await client.generate(PROMPT, {"max_new_tokens": 3000, "ignore_eos": True}, rid="gone")
    for _ in range(100):
        if server.engine.num_running == 0:
            break
        await asyncio.sleep(0.05)
    assert server.engine.num_running == 0


async def test_stop_string_is_matched_and_trimmed_from_text(server: ServerThread):
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True, "skip_special_tokens": False}
    _, free = await _post(server.url, "/generate", {"input_ids": PROMPT, "sampling_params": params})
    stop = free["text"][4:6]
    assert len(stop) == 2
    _, out = await _post(
        server.url, "/generate", {"input_ids": PROMPT, "sampling_params": {**params, "stop": stop}}
    )
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in out["text"] and free["text"].startswith(out["text"])
    assert out["output_ids"] == free["output_ids"][: len(out["output_ids"])]
