"""`microbatch_loss` composes the pieces as documented: which π_old each off-policy mode uses,
where the importance weight multiplies, the KL and entropy terms, and the aggregation weight."""

import math

import pytest
import torch

from agentrl.config import LossConfig
from agentrl.learner.packing import MicroBatch
from agentrl.learner.train_step import microbatch_loss


def _mb(**extra):
    n = 4
    return MicroBatch(
        input_ids=torch.zeros(1, n, dtype=torch.long),
        position_ids=torch.arange(n)[None],
        attention_mask=None,
        targets=torch.zeros(n, dtype=torch.long),
        mask=torch.tensor([1.0, 1.0, 1.0, 0.0]),
        behav_logp=torch.tensor([-1.0, -2.0, -0.1, 0.0]),
        versions=torch.tensor([3, 3, 2, -1]),
        adv=torch.tensor([1.0, -1.0, 1.0, 0.0]),
        weight=torch.tensor([0.25, 0.25, 0.25, 0.0]),
        seq_idx=torch.zeros(n, dtype=torch.long),
        num_seqs=1,
        real_tokens=n,
        extra=extra,
    )


LOGP = torch.tensor([-1.2, -1.0, -1.5, -3.0])


@pytest.mark.parametrize("mode", ["none", "tis", "decoupled"])
def test_off_policy_modes(mode):
    cfg = LossConfig(off_policy=mode, is_cap=2.0, clip_low=0.2, clip_high=0.28)
    loss, sums, _ = microbatch_loss(LOGP, None, _mb(), cfg, version=3)
    if mode == "none":
        # π_old = behaviour, no weight: ratios e^-0.2 (A=+1), e^1.0 (A=-1), e^-1.4 (A=+1);
        # per token max(−A·r, −A·clip(r, 0.8, 1.28))
        r, a = [math.exp(-0.2), math.exp(1.0), math.exp(-1.4)], [1.0, -1.0, 1.0]
        per = [max(-ai * ri, -ai * min(max(ri, 0.8), 1.28)) for ri, ai in zip(r, a, strict=True)]
        assert per == [-r[0], r[1], -r[2]]  # inside the range, A<0 side unclipped, A>0 below range
    else:
        # π_old = logp.detach(): ratio 1, per-token loss −A, times the weight exp(old − behav)
        w = [math.exp(-0.2), math.exp(1.0), math.exp(-1.4)]
        w = [min(x, 2.0) for x in w] if mode == "tis" else [x if x <= 2.0 else 0.0 for x in w]
        per = [-1 * w[0], 1 * w[1], -1 * w[2]]
    assert float(loss) == pytest.approx(0.25 * sum(per), rel=1e-6)
    assert sums["tokens"] == 3
    assert sums["is_capped"] == 1  # e^1.0 > 2
    assert sums["on_policy_tokens"] == 2  # versions == 3 on two loss tokens


def test_decoupled_uses_the_recomputed_proximal_policy():
    cfg = LossConfig(off_policy="decoupled", is_cap=2.0)
    prox = torch.tensor([-1.0, -2.0, -0.1, 0.0])  # equal to behaviour: weights 1
    loss, _, _ = microbatch_loss(LOGP, None, _mb(old_logp=prox), cfg, version=3)
    r = torch.exp(LOGP - prox)[:3]
    a = torch.tensor([1.0, -1.0, 1.0])
    per = torch.maximum(-a * r, -a * r.clamp(0.8, 1.2 + 0.08))
    assert float(loss) == pytest.approx(float(0.25 * per.sum()), rel=1e-6)


def test_kl_and_entropy_terms():
    cfg = LossConfig(off_policy="tis", is_cap=100.0, kl_coef=0.5, kl_estimator="k3", entropy_coef=0.1)
    ref = torch.tensor([-1.0, -1.0, -1.0, 0.0])
    ent = torch.tensor([2.0, 2.0, 2.0, 9.0])
    base, _, _ = microbatch_loss(LOGP, None, _mb(), LossConfig(off_policy="tis", is_cap=100.0), version=3)
    loss, sums, _ = microbatch_loss(LOGP, ent, _mb(ref_logp=ref), cfg, version=3)
    x = (ref - LOGP)[:3]
    kl = (torch.exp(x) - x - 1).sum() * 0.25  # k3, token-mean weights (k1 as a loss term is refused)
    assert float(loss) == pytest.approx(float(base) + 0.5 * float(kl) - 0.1 * 2.0 * 0.75, rel=1e-6)
    assert sums["entropy"] == pytest.approx(6.0)
