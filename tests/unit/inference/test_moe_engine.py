"""The embedded engine on a mixture-of-experts model (the `tiny-moe` preset, Qwen2-MoE): its
log-probs against transformers' forward, and the routed experts it returns against the experts
transformers' forward chooses for the same tokens."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from agentrl.inference.base import InferenceError
from agentrl.inference.engine import Engine, Request
from agentrl.inference.sampling import SamplingParams
from agentrl.inference.sglang import SGLangClient
from agentrl.moe import RoutingRecorder, decode_routed_experts, encode_routed_experts, routing_shape


@pytest.fixture(scope="module")
def moe_engine(tiny_moe_model: Path):
    engine = Engine(str(tiny_moe_model), max_batch_size=8)
    engine.start()
    yield engine
    engine.stop()


def _generate(engine: Engine, prompts: list[list[int]], max_new_tokens: int = 12) -> list[Request]:
    """Submit every prompt at once (one left-padded prefill, then batched decode) and wait."""
    done = threading.Semaphore(0)
    reqs = [
        Request(
            f"r{i}",
            ids,
            SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, sampling_seed=i),
            lambda _r: done.release(),
            return_routed_experts=True,
        )
        for i, ids in enumerate(prompts)
    ]
    engine.call(lambda: engine.pause("in_place")).result(timeout=30)  # admit them together
    for req in reqs:
        engine.submit(req)
    engine.call(engine.resume).result(timeout=30)
    for _ in reqs:
        assert done.acquire(timeout=120)
    return reqs


def test_moe_logprobs_and_routed_experts_equal_the_hf_forward(moe_engine: Engine):
    """Three prompts of 3, 7 and 11 tokens decoded together for 12 steps: each sampled token's
    log-prob equals transformers' forward over prompt + output (fp32, < 1e-5), and the experts the
    engine reports for each fed token ([prompt + output - 1, layers, top_k]) are the ones
    transformers' routers choose on that forward."""
    model = moe_engine.model
    assert routing_shape(model) == (2, 2)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 1000, (n,), generator=gen).tolist() for n in (3, 7, 11)]
    reqs = _generate(moe_engine, prompts)
    recorder = RoutingRecorder(model)
    try:
        for req in reqs:
            assert req.finish_reason["type"] == "length" and len(req.output_ids) == 12
            seq = torch.tensor([req.input_ids + req.output_ids])
            with torch.no_grad():
                logits = model(input_ids=seq[:, :-1]).logits[0].float()
            chosen = recorder.take()  # [layers, tokens, top_k]
            ref = torch.log_softmax(logits, -1)[len(req.input_ids) - 1 :].gather(
                -1, torch.tensor(req.output_ids)[:, None]
            )[:, 0]
            assert (torch.tensor(req.logprobs) - ref).abs().max().item() < 1e-5
            routed = torch.cat(req.routed_experts)
            assert routed.shape == (len(req.input_ids) + 11, 2, 2)
            assert torch.equal(routed.sort(-1).values, chosen.permute(1, 0, 2).sort(-1).values)
    finally:
        recorder.close()


def test_routed_experts_wire_form_round_trips():
    experts = np.arange(24, dtype=np.int32).reshape(3, 2, 4) % 4
    assert np.array_equal(decode_routed_experts(encode_routed_experts(experts), 2, 4), experts)
    with pytest.raises(ValueError, match="whole rows"):
        decode_routed_experts(encode_routed_experts(experts), 5, 4)


async def test_routed_experts_reach_the_episode_over_http(tiny_moe_model: Path, tiny_model: Path):
    """Two turns through the real HTTP server, SGLang client and the rollers' trace: the episode's
    routed experts are the server's rows for every fed token (a token keeps the routing of the
    turn that first fed it), -1 on the last token, and survive the queue's wire format; a dense
    model's server refuses the request."""
    from agentrl.inference.base import BadRequestError
    from agentrl.rollers.agent_loop import _generate_turn, _Trace
    from agentrl.types import Episode, Group
    from agentrl.wire import decode_group, encode_group
    from tests.unit.inference.conftest import ServerThread

    params = {"max_new_tokens": 5, "temperature": 1.0, "ignore_eos": True}
    srv = ServerThread(tiny_moe_model).start()
    try:
        async with SGLangClient(srv.url, routed_experts=True) as client:
            trace = _Trace()
            trace.add_context([5, 17, 42, 99, 3])
            first = await _generate_turn(client, trace, params, "s")
            assert first.routed_experts.shape == (5 + 5 - 1, 4)
            trace.add_context([7, 8, 9])
            second = await _generate_turn(client, trace, params, "s")
            assert second.routed_experts.shape == (5 + 5 + 3 + 5 - 1, 4)
            episode = trace.routed_experts()
    finally:
        srv.stop()
    assert episode.shape == (18, 4) and (episode[-1] == -1).all() and (episode[:-1] >= 0).all()
    assert np.array_equal(episode[:9], first.routed_experts)  # the first turn's routing of its tokens
    assert np.array_equal(episode[9:17], second.routed_experts[9:])
    ep = Episode(trace.tokens, trace.mask, trace.logprobs, trace.versions, routed_experts=episode)
    assert np.array_equal(decode_group(encode_group(Group([ep]))).episodes[0].routed_experts, episode)

    dense = ServerThread(tiny_model).start()
    try:
        async with SGLangClient(dense.url, routed_experts=True) as client:
            with pytest.raises(BadRequestError, match="no mixture-of-experts router agentrl records"):
                await client.generate([5, 17], params)
    finally:
        dense.stop()


def test_an_abort_before_any_forward_carries_no_routing():
    """The embedded server's reply to a request aborted before its prefill (`_routed_experts` in
    agentrl/inference/server.py: an empty array): no routing, rather than rows of width 0 that the
    rollers would keep for those tokens in place of the resumed request's."""
    empty = encode_routed_experts(np.zeros((0, 2, 2), np.int32))
    client = SGLangClient("http://127.0.0.1:1", routed_experts=True)

    def reply(kind: str, output_ids: list[int]) -> dict:
        meta = {"finish_reason": {"type": kind}, "prompt_tokens": 5, "routed_experts": empty,
                "output_token_logprobs": [[-1.0, t, None] for t in output_ids]}  # fmt: skip
        return {"output_ids": output_ids, "meta_info": meta}

    assert client.parse_generate(reply("abort", []), 5).routed_experts is None
    with pytest.raises(InferenceError, match="0 routed experts are not 5 rows"):
        client.parse_generate(reply("stop", [7]), 5)
