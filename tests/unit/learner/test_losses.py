"""Policy losses, importance weights, KL estimators and aggregation against hand-computed values."""

import math

import pytest
import torch

from agentrl.learner import hf_model, losses


def t(*v):
    return torch.tensor(v, dtype=torch.float64)


def test_ppo_clip_asymmetric_bounds():
    # ratios e^0.5=1.6487 (A=+1 → clipped at 1.28), e^-0.5=0.6065 (A=-1 → clipped at 0.8),
    # 1.1 (A=+1, inside), 0.6065 with A=+1 (unclipped side wins: max(-0.6065, -0.8) = -0.6065)
    logp = t(0.5, -0.5, math.log(1.1), -0.5)
    adv = t(1.0, -1.0, 1.0, 1.0)
    loss, clipped = losses.ppo_clip(logp, torch.zeros(4, dtype=torch.float64), adv, 0.2, 0.28)
    torch.testing.assert_close(loss, t(-1.28, 0.8, -1.1, -math.exp(-0.5)))
    assert clipped.tolist() == [True, True, False, False]


def test_ppo_clip_gradient_is_zero_when_clipped():
    logp = t(0.5, 0.1).requires_grad_()
    loss, _ = losses.ppo_clip(logp, torch.zeros(2, dtype=torch.float64), t(1.0, 1.0), 0.2, 0.28)
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, t(0.0, -math.exp(0.1)))


def test_dual_clip_bounds_negative_advantages():
    # ratio e^2 = 7.389 with A = -1: PPO loss 7.389, dual clip c=3 caps it at 3
    logp = t(2.0, 2.0)
    loss, clipped = losses.ppo_clip(logp, torch.zeros(2, dtype=torch.float64), t(-1.0, 1.0), 0.2, 0.2, 3.0)
    torch.testing.assert_close(loss, t(3.0, -1.2))
    assert clipped.tolist() == [True, True]


def test_gspo_uses_the_sequence_mean_ratio():
    # sequence 0: log-ratios 0.2, 0.0 → s = e^0.1; sequence 1: log-ratios 0.6 → s = e^0.6 (clipped at 1.0004)
    logp = t(0.2, 0.0, 0.6).requires_grad_()
    old = t(0.0, 0.0, 0.0)
    mask = t(1.0, 1.0, 1.0)
    seq = torch.tensor([0, 0, 1])
    adv = t(1.0, 1.0, 1.0)
    loss, clipped = losses.gspo(logp, old, adv, mask, seq, 2, 3e-4, 4e-4)
    torch.testing.assert_close(loss.detach(), t(-1.0004, -1.0004, -1.0004))
    assert clipped.tolist() == [True, True, True]
    # inside the clip range the gradient is s·A·∇logπ per token
    logp2 = t(0.0002, 0.0).requires_grad_()
    loss2, _ = losses.gspo(logp2, t(0.0, 0.0), t(2.0, 2.0), t(1.0, 1.0), torch.tensor([0, 0]), 1, 3e-4, 4e-4)
    torch.testing.assert_close(loss2.detach(), -2 * math.exp(0.0001) * torch.ones(2, dtype=torch.float64))
    loss2.sum().backward()
    torch.testing.assert_close(logp2.grad, -2 * math.exp(0.0001) * torch.ones(2, dtype=torch.float64))


def test_tis_weight_is_truncated_at_cap():
    w = losses.tis_weight(t(0.0, 0.0, -1.0), t(-2.0, 0.5, -1.0), cap=2.0)
    torch.testing.assert_close(w, t(2.0, math.exp(-0.5), 1.0))


def test_masked_is_weight_drops_tokens_above_cap():
    w = losses.masked_is_weight(t(0.0, 0.0, -1.0), t(-2.0, 0.5, -1.0), 0.0, 2.0)
    torch.testing.assert_close(w, t(0.0, math.exp(-0.5), 1.0))


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("k1", 0.5),  # logp − ref = −1 − (−1.5)
        ("k3", math.exp(-0.5) + 0.5 - 1),  # r = ref − logp = −0.5: e^r − r − 1
        ("low_var_kl", math.exp(-0.5) + 0.5 - 1),
    ],
)
def test_kl_estimators(kind, expected):
    torch.testing.assert_close(losses.kl_penalty(t(-1.0), t(-1.5), kind), t(expected))


def test_low_var_kl_is_clamped():
    assert float(losses.kl_penalty(t(-30.0), t(0.0), "low_var_kl")) == 10.0


def test_entropy_from_logits():
    # uniform over 4 → log 4; one-hot-ish → ~0
    ent = hf_model.entropy_from_logits(torch.tensor([[0.0, 0, 0, 0], [100.0, 0, 0, 0]], dtype=torch.float64))
    torch.testing.assert_close(ent, t(math.log(4), 0.0), atol=1e-12, rtol=0)


def test_token_weights_three_aggregations():
    # two sequences with 2 and 4 loss tokens
    assert losses.token_weights([2, 4], "token_mean", 6, 2) == [1 / 6, 1 / 6]
    assert losses.token_weights([2, 4], "seq_mean_token_sum", 6, 2) == [1 / 2, 1 / 2]
    assert losses.token_weights([2, 4], "seq_mean_token_mean", 6, 2) == [1 / 4, 1 / 8]


def test_aggregate_matches_hand_sum():
    # per-token loss 1..6, seq A = tokens 1,2 ; seq B = tokens 3..6
    loss = t(1, 2, 3, 4, 5, 6)
    mask = torch.ones(6, dtype=torch.float64)
    w_tok = t(*([1 / 6] * 6))
    w_seq = t(1 / 4, 1 / 4, 1 / 8, 1 / 8, 1 / 8, 1 / 8)
    torch.testing.assert_close(losses.aggregate(loss, mask, w_tok), t(21 / 6)[0])
    torch.testing.assert_close(losses.aggregate(loss, mask, w_seq), t((1.5 + 4.5) / 2)[0])
