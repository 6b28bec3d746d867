"""Behaviour log-prob semantics (`InferenceConfig.logprobs`) against the learner's recompute.

With "full" (SGLang 0.5.23's semantics) the embedded server's log-probs under top-p / top-k
sampling equal `learner.hf_model.forward_logprobs` on the same tokens to < 1e-4 (fp32);
"truncated" log-probs do not, so a config asking for them with truncation is refused, and so is
top-p / top-k with vLLM, whose log-probs are always of the truncated distribution."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM

from agentrl.config import AgentRLConfig
from agentrl.inference.sglang import SGLangClient
from agentrl.learner.hf_model import forward_logprobs
from agentrl.learner.packing import MicroBatch
from tests.unit.inference.conftest import ServerThread

PROMPT = [5, 17, 42, 99, 3, 64, 8]
TEMPERATURE = 0.7


def learner_logprobs(model, output_ids: list[int]) -> torch.Tensor:
    tokens = torch.tensor(PROMPT + output_ids)
    n, t = len(PROMPT), len(tokens)
    mask = torch.zeros(t, dtype=torch.long)
    mask[n - 1 : t - 1] = 1  # positions that predict a generated token
    zeros = torch.zeros(t)
    mb = MicroBatch(
        input_ids=tokens[None], position_ids=torch.arange(t)[None], attention_mask=None,
        targets=torch.cat([tokens[1:], tokens[:1]]), mask=mask, behav_logp=zeros, versions=zeros.long(),
        adv=zeros, weight=zeros, seq_idx=zeros.long(), num_seqs=1, real_tokens=t,
    )  # fmt: skip
    with torch.no_grad():
        logp, _ = forward_logprobs(model, mb, TEMPERATURE)
    return logp[mask.bool()]


async def _max_diff(server: ServerThread, model, params: dict) -> float:
    async with SGLangClient(server.url) as client:
        res = await client.generate(PROMPT, {"max_new_tokens": 16, "temperature": TEMPERATURE, "ignore_eos": True,
                                             "sampling_seed": 3, **params})  # fmt: skip
    ours = learner_logprobs(model, res.output_ids)
    return float((ours - torch.tensor(res.logprobs)).abs().max())


@pytest.mark.parametrize("params", [{"top_p": 0.9}, {"top_k": 20}], ids=["top_p", "top_k"])
async def test_full_logprobs_equal_the_learners_and_truncated_ones_do_not(tiny_model: Path, params: dict):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    full = ServerThread(tiny_model).start()
    truncated = ServerThread(tiny_model, logprobs="truncated").start()
    try:
        assert await _max_diff(full, model, params) < 1e-4
        assert await _max_diff(truncated, model, params) > 1e-3  # the mismatch the setting prevents
    finally:
        full.stop()
        truncated.stop()


def test_truncated_logprobs_with_truncation_are_refused_naming_the_fields():
    with pytest.raises(ValidationError, match=r"inference\.logprobs.*roller\.top_p=0\.9"):
        AgentRLConfig.model_validate({"inference": {"logprobs": "truncated"}, "roller": {"top_p": 0.9}})
    with pytest.raises(ValidationError, match=r"roller\.top_k=20"):
        AgentRLConfig.model_validate({"inference": {"logprobs": "truncated"}, "roller": {"top_k": 20}})
    with pytest.raises(ValidationError, match=r"SGLang 0\.5\.23 returns only full"):
        AgentRLConfig.model_validate(
            {"inference": {"type": "sglang", "servers": ["http://127.0.0.1:1"], "logprobs": "truncated"}}
        )
    AgentRLConfig.model_validate({"roller": {"top_p": 0.9, "top_k": 20}})  # full (default): accepted


def test_top_p_or_top_k_with_vllm_is_refused_naming_the_fields():
    """vLLM 0.32 reports log-probs after top-k/top-p (processed_logprobs: tests/integration/test_vllm.py
    checks its truncation order) or before temperature (raw_logprobs), never the full tempered
    distribution the learner recomputes."""
    for roller, field in (({"top_p": 0.9}, r"roller\.top_p=0\.9"), ({"top_k": 20}, r"roller\.top_k=20")):
        with pytest.raises(ValidationError, match=field + r".*inference\.type: vllm"):
            AgentRLConfig.model_validate({"inference": {"type": "vllm"}, "roller": roller})
    no_truncation = {"roller": {"temperature": 0.7}, "learner": {"temperature": 0.7}}
    AgentRLConfig.model_validate({"inference": {"type": "vllm"}, **no_truncation})  # accepted
