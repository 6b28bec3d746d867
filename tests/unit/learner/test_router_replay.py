"""Router replay (R3) on the `tiny-moe` model, end to end through real components: the embedded
engine generates and records each token's routed experts; the FSDP2 backend (world size 1, gloo)
computes log-probs of the same tokens on weights a tiny perturbation away, perturbed so that one
token's top-2 selection flips. With the recorded routing replayed the learner's log-probs equal
the engine's; with the model's own routing they do not; the step's metrics log the mismatch KL
both ways, and the router still gets its gradient."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from agentrl.config import LearnerConfig, OptimConfig
from agentrl.inference.engine import Engine, Request
from agentrl.inference.sampling import SamplingParams
from agentrl.learner.config import MoeConfig
from agentrl.learner.packing import Sample, packed_microbatch, padded_microbatch
from agentrl.learner.registry import create
from agentrl.learner.train_step import optimizer_step
from agentrl.moe import RoutingRecorder, routers
from tests.moe_cases import near_tie

PROMPT = [17, 402, 33, 918, 5, 260, 71, 640, 88, 12]


@pytest.fixture(scope="module")
def case(tiny_moe_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """(server checkpoint, learner checkpoint, the finished request, flipped (position, a, b)):
    `tests/moe_cases.near_tie`, the server copy's request run through the embedded engine."""
    server_dir, learner_dir, (t, a, b) = near_tie(tiny_moe_model, tmp_path_factory.mktemp("replay"), PROMPT)
    engine = Engine(str(server_dir))
    engine.start()
    try:
        done = threading.Event()
        req = Request("r", PROMPT, SamplingParams(max_new_tokens=16, ignore_eos=True, sampling_seed=3),
                      lambda _r: done.set(), return_routed_experts=True)  # fmt: skip
        engine.submit(req)
        assert done.wait(120)
    finally:
        engine.stop()
    return server_dir, learner_dir, req, (t, a, b)


def _sample(req: Request, replay: bool) -> Sample:
    n, p = len(req.output_ids), len(req.input_ids)
    routed = torch.cat(req.routed_experts).reshape(p + n - 1, -1).numpy()
    routed = np.concatenate([routed, np.full((1, routed.shape[1]), -1, np.int32)])
    return Sample(
        np.array(req.input_ids + req.output_ids),
        np.array([0] * p + [1] * n),
        np.array([0.0] * p + req.logprobs, np.float32),
        np.array([-1] * p + [0] * n),
        advantage=1.0,
        weight=1.0 / n,
        routed_experts=routed if replay else None,
    )


def test_replayed_routing_gives_the_servers_logprobs_where_the_argmax_flips(case):
    _server_dir, learner_dir, req, (t, a, b) = case
    assert req.finish_reason["type"] == "length"
    recorded = torch.cat(req.routed_experts)  # [prompt + output − 1, layers, top_k]
    assert a in recorded[t, 0].tolist() and b not in recorded[t, 0].tolist()

    backend = create("fsdp2")
    actor = backend.build("policy", learner_dir, optim=OptimConfig(lr=1e-2))
    recorder = RoutingRecorder(actor.module)
    try:
        own = {}
        for replay in (True, False):
            for pack in (packed_microbatch, padded_microbatch):
                mb = pack([_sample(req, replay)])
                with torch.no_grad():
                    logp = backend.logprobs(actor, mb)[0]
                chosen = recorder.take()  # [layers, tokens, top_k]
                m = mb.mask.bool()
                own[replay, pack] = (logp[m] - mb.behav_logp[m]).abs().max().item(), chosen[0, t].tolist()
    finally:
        recorder.close()
    for pack in (packed_microbatch, padded_microbatch):
        err_replay, routed_replay = own[True, pack]
        err_own, routed_own = own[False, pack]
        assert sorted(routed_replay) == sorted(recorded[t, 0].tolist())  # replayed: the server's experts
        assert b in routed_own and a not in routed_own  # the learner's own top-k flipped
        assert err_replay < 1e-5, err_replay
        assert err_own > 1e-3, err_own

    # one training step with replay: the metrics log the mismatch both ways; the router trains
    cfg = LearnerConfig(moe=MoeConfig(router_replay=True))
    gate = "model.layers.0.mlp.gate.weight"
    before = dict(backend.full_tensors(actor))[gate].clone()
    metrics = optimizer_step(backend, actor, [packed_microbatch([_sample(req, True)])], cfg, version=0)
    assert metrics["moe/mismatch_kl_k3_replay"] < 1e-9
    assert metrics["moe/mismatch_kl_k3_no_replay"] > 1e-7
    assert metrics["step_skipped"] == 0.0
    assert not torch.equal(dict(backend.full_tensors(actor))[gate], before)


def test_the_config_refuses_replay_it_cannot_do() -> None:
    from agentrl.config import ConfigError, load_config

    on = ["--learner.moe.router_replay", "true", "--inference.routed_experts", "true"]
    assert load_config(None, on).learner.moe.router_replay
    assert load_config(None, [*on, "--learner.backend", "megatron"]).learner.moe.router_replay
    # vLLM: the config cannot know the server's device; its launcher refuses where vLLM has no
    # Triton (tests/unit/inference/test_vllm_launch.py, tests/integration/test_vllm_moe.py)
    assert load_config(None, [*on, "--inference.type", "vllm"]).inference.routed_experts
    for extra, message in [
        (["--inference.routed_experts", "false"], r"needs inference\.routed_experts: true"),
        (
            ["--inference.type", "vllm", "--inference.routed_experts", "false"],
            r"needs inference\.routed_experts",
        ),
        (["--learner.backend", "megatron", "--learner.megatron.pp", "2"], r"needs one pipeline stage"),
        (["--mode", "colocated"], "colocated does not carry routed experts"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, on + extra)


def test_routed_experts_of_another_width_are_refused_by_name(tiny_moe_model: Path) -> None:
    """Rows recorded over more layers than the model's MoE ones (vLLM records every hidden layer)."""
    from transformers import AutoModelForCausalLM

    from agentrl.learner.hf_model import forward_logprobs

    model = AutoModelForCausalLM.from_pretrained(str(tiny_moe_model), dtype=torch.float32)
    layers, top_k = len(routers(model)), int(routers(model)[0].top_k)
    n = len(PROMPT)
    sample = Sample(
        np.array(PROMPT),
        np.array([0] * (n - 1) + [1]),
        np.zeros(n, np.float32),
        np.array([-1] * (n - 1) + [0]),
        advantage=1.0,
        weight=1.0,
        routed_experts=np.zeros((n, (layers + 1) * top_k), np.int32),
    )
    with pytest.raises(
        ValueError, match=rf"{(layers + 1) * top_k} recorded experts per token.*need {layers * top_k}"
    ):
        forward_logprobs(model, packed_microbatch([sample]), 1.0)
