"""Off-policy corrections and one-sided CISPO against oracles written from the papers' formulas.

The oracle works per sequence on plain lists of tokens (no agentrl helper): for each sequence i,
each loss token t with ρ_t = π_old/π_behav and r_t = π_θ/π_old,

    mis       M_t = ρ_t·1[lo ≤ ρ_t ≤ C]                      (masked IS: slime, verl token IS + RS)
    icepop    M_t = ρ_t·1[α ≤ ρ_t ≤ β]                       (IcePop, Ring-1T: M(k) = k on [α, β])
    seq_tis   M_t = min(g_i, C), g_i = exp(mean_t log ρ_t)   (geometric-mean sequence IS)
    seq_mask  K_i = 1[lo ≤ g_i ≤ hi]                         (SkyRL geometric mask, verl geo RS)

and the batch loss Σ_i Σ_t w_t·M_t·K_i·ℓ_t with ℓ_t PPO's −min(r·A, clip(r)·A) or CISPO's
−sg(min(r, 1+ε_high))·A·log π_θ (MiniMax-M1 with no lower bound) and w_t the aggregation weight.
Sequences have holes in their loss masks (tool output inside the episode), so the tokens the
oracle averages over must be exactly the generated ones. Loss and gradient must agree to float64
precision.
"""

import math

import pytest
import torch

from agentrl.config import LossConfig
from agentrl.learner.packing import MicroBatch
from agentrl.learner.train_step import microbatch_loss

# three sequences packed in one row: prompt positions, generated tokens, a tool-output hole, more generation
LAYOUT = [
    [0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 1],
    [0, 1, 1, 0, 1, 1, 1, 1],
    [0, 0, 0, 1, 1, 1, 1, 1, 0, 1],
    [0, 1, 1, 1, 1, 1],
]
ADV = [1.3, -0.7, 0.4, -1.1]


def _batch(seed: int, spread: float):
    """Random log-probs: π_θ, π_old (off by a little, so r ≠ 1) and π_behav (off by `spread`)."""
    g = torch.Generator().manual_seed(seed)
    n = sum(len(s) for s in LAYOUT)
    mask = torch.tensor([m for s in LAYOUT for m in s], dtype=torch.float64)
    seq_idx = torch.tensor([i for i, s in enumerate(LAYOUT) for _ in s])
    old = -torch.rand(n, generator=g, dtype=torch.float64) * 3 - 0.05
    logp = old + torch.randn(n, generator=g, dtype=torch.float64) * 0.3
    behav = old + torch.randn(n, generator=g, dtype=torch.float64) * spread
    return mask, seq_idx, old * mask, logp * mask, behav * mask


def _microbatch(mask, seq_idx, old, behav, weight):
    n = mask.numel()
    return MicroBatch(
        input_ids=torch.zeros(1, n, dtype=torch.long),
        position_ids=torch.arange(n)[None],
        attention_mask=None,
        targets=torch.zeros(n, dtype=torch.long),
        mask=mask,
        behav_logp=behav,
        versions=torch.zeros(n, dtype=torch.long),
        adv=torch.tensor([ADV[i] for i in seq_idx.tolist()], dtype=torch.float64) * mask,
        weight=weight,
        seq_idx=seq_idx,
        num_seqs=len(LAYOUT),
        real_tokens=n,
        extra={"old_logp": old},
    )


def _agg_weights(agg: str) -> list[list[float]]:
    counts = [sum(s) for s in LAYOUT]
    if agg == "token_mean":
        return [[1.0 / sum(counts)] * len(s) for s in LAYOUT]
    return [[1.0 / (len(LAYOUT) * counts[i])] * len(s) for i, s in enumerate(LAYOUT)]  # seq_mean_token_mean


def _oracle(cfg: LossConfig, logp, old, behav, weights) -> torch.Tensor:
    """The batch loss from the formulas above, sequence by sequence, token by token."""
    total = torch.zeros((), dtype=torch.float64)
    start = 0
    for i, layout in enumerate(LAYOUT):
        tokens = [start + t for t, m in enumerate(layout) if m]
        rho = {t: math.exp(float(old[t] - behav[t])) for t in tokens}
        g = math.exp(sum(math.log(rho[t]) for t in tokens) / len(tokens))
        keep = 1.0
        if cfg.seq_mask is not None:
            keep = 1.0 if cfg.seq_mask[0] <= g <= cfg.seq_mask[1] else 0.0
        for t in tokens:
            if cfg.off_policy == "mis":
                m = rho[t] if cfg.mis_low <= rho[t] <= cfg.is_cap else 0.0
            elif cfg.off_policy == "icepop":
                m = rho[t] if cfg.icepop_low <= rho[t] <= cfg.icepop_high else 0.0
            elif cfg.off_policy == "tis":
                m = min(rho[t], cfg.is_cap)
            elif cfg.off_policy == "seq_tis":
                m = min(g, cfg.is_cap)
            else:
                m = 1.0
            a = ADV[i]
            r = torch.exp(logp[t] - old[t])
            if cfg.policy_loss == "cispo":
                w = min(float(r.detach()), 1.0 + cfg.clip_high)
                term = -w * a * logp[t]
            else:
                term = -torch.minimum(r * a, r.clamp(1 - cfg.clip_low, 1 + cfg.clip_high) * a)
            total = total + weights[i][t - start] * m * keep * term
        start += len(layout)
    return total


CASES = [
    dict(off_policy="mis", is_cap=1.5, mis_low=0.6),
    dict(off_policy="mis", is_cap=1.5),  # one-sided: only ratios above C are masked
    dict(off_policy="icepop"),  # IcePop's [0.5, 5]
    dict(off_policy="icepop", icepop_low=0.8, icepop_high=1.25),
    dict(off_policy="seq_tis", is_cap=1.0),
    dict(off_policy="icepop", seq_mask=(0.96, 1.02)),
    dict(off_policy="mis", policy_loss="cispo", is_cap=2.0, clip_high=0.2),
    dict(off_policy="tis", policy_loss="cispo", clip_high=0.1, seq_mask=(0.96, 1.02)),
]


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_loss_and_gradient_equal_the_oracle(case, agg):
    cfg = LossConfig(loss_agg=agg, **case)
    spread = 0.6 if cfg.off_policy in ("mis", "icepop") else 0.15
    mask, seq_idx, old, logp0, behav = _batch(seed=7, spread=spread)
    weights = _agg_weights(agg)
    flat_w = torch.tensor([w for ws in weights for w in ws], dtype=torch.float64) * mask
    mb = _microbatch(mask, seq_idx, old, behav, flat_w)

    logp = logp0.clone().requires_grad_()
    ours, sums, _ = microbatch_loss(logp, None, mb, cfg, version=0)
    ours.backward()
    ref_logp = logp0.clone().requires_grad_()
    expected = _oracle(cfg, ref_logp, old, behav, weights)
    expected.backward()
    torch.testing.assert_close(ours.detach(), expected.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(logp.grad, ref_logp.grad, rtol=1e-12, atol=1e-14)
    assert float(logp.grad[mask == 0].abs().sum()) == 0.0  # prompt and tool tokens get nothing
    if cfg.off_policy in ("mis", "icepop"):
        masked = sums["is_masked"] / sums["tokens"]
        assert 0 < masked < 1, "the draw should mask some tokens and keep others"
    if cfg.seq_mask is not None:
        assert 0 < sums["seqs_masked"] < len(LAYOUT), "the draw should mask some sequences and keep others"


def test_seq_mask_without_a_token_correction():
    """off_policy: none with seq_mask: the surrogate's π_old is behaviour, the mask's ratio is the
    learner's π_old over behaviour; masked sequences contribute nothing, kept ones PPO's loss."""
    cfg = LossConfig(off_policy="none", seq_mask=(0.96, 1.02))
    mask, seq_idx, old, logp0, behav = _batch(seed=7, spread=0.15)
    weights = _agg_weights("token_mean")
    flat_w = torch.tensor([w for ws in weights for w in ws], dtype=torch.float64) * mask
    logp = logp0.clone().requires_grad_()
    ours, sums, _ = microbatch_loss(
        logp, None, _microbatch(mask, seq_idx, old, behav, flat_w), cfg, version=0
    )
    ours.backward()
    # the oracle: PPO against behaviour (π_old = behav), times the geometric-mean sequence mask
    ref = logp0.clone().requires_grad_()
    total = torch.zeros((), dtype=torch.float64)
    start = 0
    for i, layout in enumerate(LAYOUT):
        tokens = [start + t for t, m in enumerate(layout) if m]
        g = math.exp(sum(float(old[t] - behav[t]) for t in tokens) / len(tokens))
        if 0.96 <= g <= 1.02:
            for t in tokens:
                r = torch.exp(ref[t] - behav[t])
                total = total - weights[i][t - start] * torch.minimum(r * ADV[i], r.clamp(0.8, 1.28) * ADV[i])
        start += len(layout)
    total.backward()
    torch.testing.assert_close(ours.detach(), total.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(logp.grad, ref.grad, rtol=1e-12, atol=1e-14)
    assert 0 < sums["seqs_masked"] < len(LAYOUT)


def test_cispo_default_has_no_lower_bound():
    """With defaults CISPO's weight is not raised to 1 − ε: a ratio of 0.3 stays 0.3 (MiniMax-M1)."""
    cfg = LossConfig(policy_loss="cispo")
    assert cfg.clip_low is None
    old = torch.tensor([0.0, 0.0], dtype=torch.float64)
    logp = torch.tensor([math.log(0.3), math.log(3.0)], dtype=torch.float64).requires_grad_()
    mb = _microbatch(
        torch.ones(2, dtype=torch.float64), torch.tensor([0, 0]), old, old, torch.ones(2, dtype=torch.float64)
    )
    mb.adv = torch.ones(2, dtype=torch.float64)
    mb.num_seqs = 1
    ours, _, _ = microbatch_loss(logp, None, mb, cfg.model_copy(update={"off_policy": "none"}), version=0)
    ours.backward()
    assert logp.grad.tolist() == pytest.approx([-0.3, -1.28], rel=1e-12)  # −sg(w)·A per token
    with pytest.raises(ValueError, match="clip_low"):
        LossConfig(policy_loss="ppo_clip", clip_low=None)


@pytest.mark.parametrize(
    ("fields", "mini_batches", "needs"),
    [
        (dict(off_policy="decoupled"), 1, True),  # π_prox always
        (dict(off_policy="tis"), 1, False),  # one update: π_old is the forward's own detached π
        (dict(off_policy="icepop"), 2, True),  # the second mini-batch must not read updated weights
        (dict(off_policy="none", seq_mask=(0.9, 1.1)), 2, True),
        (dict(off_policy="none"), 2, False),  # π_old is the behaviour policy
    ],
)
def test_old_logprobs_are_recomputed_where_a_correction_reads_them(fields, mini_batches, needs):
    assert LossConfig(**fields).needs_old_logp(mini_batches) is needs
