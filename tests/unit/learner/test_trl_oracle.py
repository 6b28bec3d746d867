"""Our GRPO-family loss against TRL's `GRPOTrainer._compute_loss` on the same model and inputs.

TRL is the oracle (dev extra). Its inputs: prompt ids, completion ids padded on the right with a
completion mask, advantages per sequence and `old_per_token_logps`, which we set to behaviour
log-probs that differ from the model's so that ratios move and both clip sides are exercised;
on our side the same episodes go through packing and `off_policy="none"` (π_old = behaviour).
"""

import numpy as np
import pytest
import torch

from agentrl.config import LossConfig
from agentrl.learner.advantages import compute_advantages
from agentrl.learner.losses import token_weights
from agentrl.learner.packing import Sample, packed_microbatch
from agentrl.learner.train_step import forward_logprobs, microbatch_loss

trl = pytest.importorskip("trl")

PROMPT = 5
LENGTHS = [7, 3, 9, 5]
REWARDS = np.array([1.0, 0.0, 0.5, 0.0])


@pytest.fixture(scope="module")
def trainer(tiny_model, tmp_path_factory):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path_factory.mktemp("trl")),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=max(LENGTHS),
        epsilon=0.2,
        epsilon_high=0.28,
        beta=0.0,
        loss_type="grpo",
        report_to=[],
        use_cpu=True,
        bf16=False,  # TrainingArguments autocasts to bf16 by default; compare in fp32
    )
    dataset = Dataset.from_dict({"prompt": ["hello"] * 8})
    return GRPOTrainer(model=str(tiny_model), reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                       args=args, train_dataset=dataset)  # fmt: skip


def _inputs(model):
    g = torch.Generator().manual_seed(0)
    width = max(LENGTHS)
    prompt = torch.randint(10, 600, (4, PROMPT), generator=g)
    completion = torch.randint(10, 600, (4, width), generator=g)
    cmask = torch.zeros(4, width, dtype=torch.long)
    for i, n in enumerate(LENGTHS):
        cmask[i, :n] = 1
    completion = completion * cmask  # pad id 0 after the end
    with torch.no_grad():
        logits = model(input_ids=torch.cat([prompt, completion], 1)).logits[:, PROMPT - 1 : -1].float()
        current = torch.log_softmax(logits, -1).gather(-1, completion[..., None]).squeeze(-1)
    behav = (current + 0.4 * torch.randn(current.shape, generator=g)) * cmask
    return prompt, completion, cmask, behav


def _ours(model, prompt, completion, cmask, behav, adv, cfg):
    samples = []
    for i, n in enumerate(LENGTHS):
        tokens = torch.cat([prompt[i], completion[i, :n]]).numpy()
        mask = np.r_[np.zeros(PROMPT), np.ones(n)].astype(np.uint8)
        lp = np.r_[np.zeros(PROMPT), behav[i, :n].numpy()].astype(np.float32)
        samples.append(Sample(tokens, mask, lp, np.where(mask, 0, -1), float(adv[i]), 0.0))
    for s, w in zip(samples, token_weights(LENGTHS, cfg.loss_agg, sum(LENGTHS), 4), strict=True):
        s.weight = w
    mb = packed_microbatch(samples)
    model.zero_grad()
    logp, ent = forward_logprobs(model, mb, entropy="metric")
    loss, sums, _ = microbatch_loss(logp, ent, mb, cfg, version=0)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, sums


@pytest.mark.parametrize(("trl_loss", "ours_agg"), [("grpo", "seq_mean_token_mean"), ("bnpo", "token_mean")])
def test_grpo_loss_and_grads_match_trl(trainer, trl_loss, ours_agg):
    model = trainer.model
    model.train()
    prompt, completion, cmask, behav = _inputs(model)
    adv = torch.tensor(compute_advantages("grpo", [REWARDS])[0], dtype=torch.float32)
    trainer.loss_type = trl_loss
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.training_step in a real run
    inputs = {
        "prompt_ids": prompt,
        "prompt_mask": torch.ones_like(prompt),
        "completion_ids": completion,
        "completion_mask": cmask,
        "advantages": adv,
        "old_per_token_logps": behav,
    }
    model.zero_grad()
    trl_value = trainer._compute_loss(model, inputs)
    trl_value.backward()
    trl_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    cfg = LossConfig(off_policy="none", loss_agg=ours_agg, clip_low=0.2, clip_high=0.28)
    loss, grads, sums = _ours(model, prompt, completion, cmask, behav, adv, cfg)
    assert sums["clipfrac"] > 0  # the behaviour noise makes some tokens clip
    torch.testing.assert_close(loss, trl_value.detach(), rtol=1e-5, atol=1e-7)
    assert grads.keys() == trl_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], trl_grads[name], rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.parametrize(
    ("trl_loss", "level", "ours", "trl_attrs", "scale"),
    [
        # GSPO: TRL's sequence-level importance weight with its per-sequence mean ("grpo")
        (
            "grpo",
            "sequence",
            dict(policy_loss="gspo", clip_low=3e-3, clip_high=4e-3),
            dict(epsilon_low=3e-3, epsilon_high=4e-3),
            1.0,
        ),
        # CISPO: TRL clamps the weight at ε_max only, `clamp(r, max=ε_max)`; ours is the paper's
        # one-sided clip (clip_low: null, cispo's default) with clip_high = ε_max − 1
        (
            "cispo",
            "token",
            dict(policy_loss="cispo", loss_agg="token_mean", clip_high=0.3),
            dict(epsilon_high=1.3),
            1.0,
        ),
        ("sapo", "token", dict(policy_loss="sapo", loss_agg="seq_mean_token_mean"), {}, 1.0),
        # Dr. GRPO: TRL divides the token sum by batch × max_completion_length, ours by the batch only
        ("dr_grpo", "token", dict(loss_agg="seq_mean_token_sum"), {}, 1.0 / max(LENGTHS)),
    ],
)
def test_other_objectives_match_trl(trainer, trl_loss, level, ours, trl_attrs, scale):
    model = trainer.model
    model.train()
    prompt, completion, cmask, behav = _inputs(model)
    adv = torch.tensor(compute_advantages("grpo", [REWARDS])[0], dtype=torch.float32)
    if level == "sequence":
        adv = -adv  # this draw's sequence ratios sit on the clipped side for these signs
    saved = {k: getattr(trainer, k) for k in ("loss_type", "importance_sampling_level", *trl_attrs)}
    trainer.loss_type, trainer.importance_sampling_level = trl_loss, level
    for k, v in trl_attrs.items():
        setattr(trainer, k, v)
    trainer.current_gradient_accumulation_steps = 1
    inputs = {
        "prompt_ids": prompt,
        "prompt_mask": torch.ones_like(prompt),
        "completion_ids": completion,
        "completion_mask": cmask,
        "advantages": adv,
        "old_per_token_logps": behav,
        "num_items_in_batch": cmask.sum(),
    }
    try:
        model.zero_grad()
        trl_value = trainer._compute_loss(model, inputs)
        trl_value.backward()
    finally:
        for k, v in saved.items():
            setattr(trainer, k, v)
    trl_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    cfg = LossConfig(off_policy="none", **ours)
    loss, grads, sums = _ours(model, prompt, completion, cmask, behav, adv, cfg)
    if trl_loss in ("grpo", "cispo"):
        assert sums["clipfrac"] > 0  # both sides of the comparison clip somewhere
    torch.testing.assert_close(loss * scale, trl_value.detach(), rtol=1e-5, atol=1e-7)
    assert grads.keys() == trl_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name] * scale, trl_grads[name], rtol=1e-4, atol=1e-7, msg=name)
