"""The objectives and estimators added after GRPO, each against its paper's formula written out
per token in plain Python: DAPO's decoupled clip and overlong shaping, CISPO, SAPO, ReMax, and
the group-mean / batch-std scaling of TRL's `scale_rewards="batch"`."""

import math

import numpy as np
import pytest
import torch

from agentrl.learner import losses
from agentrl.learner.advantages import (
    compute_advantages,
    dapo_overlong_penalty,
    grpo_batch_std,
    reinforce_pp,
    remax,
)

LOG_RATIOS = [0.5, -0.5, 0.05, -0.4, 1.2, -1.5]
ADVS = [1.0, -1.0, 2.0, 0.5, -0.7, -2.0]


def t(v):
    return torch.tensor(v, dtype=torch.float64)


def test_dapo_decoupled_clip_is_the_papers_objective():
    # DAPO (arXiv 2503.14476) eq. 10: min(r·A, clip(r, 1 − ε_low, 1 + ε_high)·A), maximised
    eps_low, eps_high = 0.2, 0.28
    loss, clipped = losses.ppo_clip(t(LOG_RATIOS), t([0.0] * 6), t(ADVS), eps_low, eps_high)
    for i, (lr, a) in enumerate(zip(LOG_RATIOS, ADVS, strict=True)):
        r = math.exp(lr)
        objective = min(r * a, min(max(r, 1 - eps_low), 1 + eps_high) * a)
        assert float(loss[i]) == pytest.approx(-objective, rel=1e-12)
        assert bool(clipped[i]) == (objective != r * a)


def test_cispo_value_and_gradient_are_the_papers():
    # MiniMax-M1 (arXiv 2506.13585) eq. 4: J = sg(clip(r, 1 − ε_low, 1 + ε_high))·A·log π_θ
    old = t([-1.0] * 6)
    logp = (old + t(LOG_RATIOS)).requires_grad_()
    loss, clipped = losses.cispo(logp, old, t(ADVS), 0.2, 0.28)
    loss.sum().backward()
    for i, (lr, a) in enumerate(zip(LOG_RATIOS, ADVS, strict=True)):
        w = min(max(math.exp(lr), 0.8), 1.28)
        assert float(loss[i].detach()) == pytest.approx(-w * a * float(logp[i].detach()), rel=1e-12)
        assert float(logp.grad[i]) == pytest.approx(-w * a, rel=1e-12)  # every token keeps a gradient
        assert bool(clipped[i]) == (w != math.exp(lr))


def test_sapo_soft_gate_and_its_gradient_weight():
    # SAPO (arXiv 2511.20347): f(r) = (4/τ)·σ(τ(r − 1)), τ_pos for A > 0, τ_neg otherwise;
    # ∇f = 4σ(1−σ)·r·∇log π, so at r = 1 the gradient is A·∇log π, as for the unclipped surrogate
    tau_pos, tau_neg = 1.0, 1.05
    logp = t(LOG_RATIOS).requires_grad_()
    loss, _ = losses.sapo(logp, t([0.0] * 6), t(ADVS), tau_pos, tau_neg)
    loss.sum().backward()
    for i, (lr, a) in enumerate(zip(LOG_RATIOS, ADVS, strict=True)):
        r, tau = math.exp(lr), tau_pos if a > 0 else tau_neg
        s = 1 / (1 + math.exp(-tau * (r - 1)))
        assert float(loss[i].detach()) == pytest.approx(-(4 / tau) * s * a, rel=1e-12)
        assert float(logp.grad[i]) == pytest.approx(-4 * s * (1 - s) * r * a, rel=1e-12)
    at_one = t([0.0, 0.0]).requires_grad_()
    losses.sapo(at_one, t([0.0, 0.0]), t([1.5, -0.5]), tau_pos, tau_neg)[0].sum().backward()
    torch.testing.assert_close(at_one.grad, t([-1.5, 0.5]))


def test_dapo_overlong_penalty_follows_eq_13():
    l_max, l_cache = 20, 4
    lengths = [1, 16, 17, 18, 20, 21, 100]
    expected = [0.0 if n <= l_max - l_cache else ((l_max - l_cache) - n) / l_cache if n <= l_max else -1.0
                for n in lengths]  # fmt: skip
    np.testing.assert_allclose(dapo_overlong_penalty(np.array(lengths), l_max, l_cache), expected)
    np.testing.assert_allclose(
        dapo_overlong_penalty(np.array(lengths), l_max, l_cache, 0.5), np.multiply(expected, 0.5)
    )
    np.testing.assert_allclose(dapo_overlong_penalty(np.array([20, 21]), 20, 0), [0.0, -1.0])  # hard cut


def test_remax_subtracts_the_greedy_reward_of_the_same_prompt():
    out = remax([np.array([1.0, 0.0, 1.0]), np.array([0.2, 0.9])], greedy_rewards=[1.0, 0.5])
    np.testing.assert_allclose(out[0], [0.0, -1.0, 0.0])
    np.testing.assert_allclose(out[1], [-0.3, 0.4])
    with pytest.raises(ValueError, match="2 groups"):
        remax([np.array([1.0]), np.array([0.0])], [1.0])


def test_remax_through_prepare_batch_uses_each_groups_greedy_reward():
    """`loss.advantage: remax`: the learner reads the roller's `Group.metrics["greedy_reward"]`;
    a group without one (a roller without `roller.greedy_baseline`) is skipped, named."""
    from agentrl.learner.data import prepare_batch
    from tests.unit.learner.source import make_groups

    groups = make_groups(3, group_size=4, seed=5)
    groups[0].metrics["greedy_reward"] = 0.25
    groups[1].metrics["greedy_reward"] = 1.0
    kw = dict(advantage="remax", loss_agg="token_mean", vocab_size=1000, learner_version=0)
    batch = prepare_batch(groups, **kw)
    assert batch.skipped == {"no_greedy_reward": 1}
    got = [s.advantage for s in batch.mini_batches[0]]
    want = np.concatenate([groups[0].rewards - 0.25, groups[1].rewards - 1.0])
    np.testing.assert_allclose(got, want)


def test_remax_needs_the_rollers_greedy_baseline():
    from agentrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"roller\.greedy_baseline"):
        load_config(None, ["--learner.loss.advantage=remax"])
    cfg = load_config(None, ["--learner.loss.advantage=remax", "--roller.greedy_baseline=true"])
    assert cfg.learner.loss.advantage == "remax"


def test_grpo_batch_std_is_trls_scale_rewards_batch():
    # TRL 1.16 GRPOTrainer._generate_and_score_completions, scale_rewards="batch":
    # (rewards − group mean) / (std(all rewards) + 1e-4), std unbiased
    groups = [np.array([1.0, 0.0, 0.0, 1.0]), np.array([0.5, 0.5, 2.0, 0.0])]
    r = torch.tensor(np.concatenate(groups))
    trl = (r - r.view(-1, 4).mean(1).repeat_interleave(4)) / (r.std() + 1e-4)
    np.testing.assert_allclose(np.concatenate(grpo_batch_std(groups)), trl.numpy(), rtol=1e-12)
    np.testing.assert_allclose(np.concatenate(compute_advantages("grpo_batch_std", groups)), trl.numpy())
    # REINFORCE++ subtracts the batch mean instead: the two differ whenever group means differ
    assert not np.allclose(np.concatenate(reinforce_pp(groups)), trl.numpy(), atol=1e-3)


def test_overlong_shaping_changes_the_advantages_not_the_reward_metrics():
    from agentrl.learner.data import prepare_batch
    from tests.unit.learner.source import make_groups

    groups = make_groups(1, group_size=4, seed=3, min_len=10, max_len=40)
    lengths = np.array([ep.num_generated for ep in groups[0].episodes])
    kw = dict(advantage="dr_grpo", loss_agg="token_mean", vocab_size=1000, learner_version=0)
    plain = prepare_batch(groups, **kw)
    l_max = int(np.median(lengths))
    shaped = prepare_batch(groups, overlong=(l_max, 4, 1.0), **kw)
    rewards = groups[0].rewards + dapo_overlong_penalty(lengths, l_max, 4)
    np.testing.assert_allclose([s.advantage for s in shaped.mini_batches[0]], rewards - rewards.mean())
    assert shaped.metrics["reward/mean"] == plain.metrics["reward/mean"]
    assert shaped.metrics["reward/overlong_penalty_mean"] < 0


@pytest.mark.parametrize(
    "overrides",
    [dict(policy_loss="cispo", clip_low=1.0, clip_high=4.0), dict(policy_loss="sapo", overlong_max_tokens=20,
                                                                   overlong_buffer_tokens=8)],
)  # fmt: skip
def test_new_objectives_train_through_the_loop(tiny_model, tmp_path, overrides):
    from agentrl.learner.fsdp import full_state_dict
    from agentrl.learner.loop import build_learner, run
    from agentrl.log import MetricsLogger, read_metrics
    from tests.unit.learner.source import ListSource, learner_config, make_groups

    cfg = learner_config(model_path=str(tiny_model), groups_per_step=2, max_steps=1, micro_batch_tokens=64, lr=1e-3,
                        batch_timeout_s=0.1, **overrides)  # fmt: skip
    learner = build_learner(cfg, tmp_path)
    before = {k: v.clone() for k, v in full_state_dict(learner.model).items()}
    metrics = MetricsLogger(tmp_path)
    run(learner, ListSource(make_groups(2, seed=6)), max_staleness=1, metrics=metrics)
    metrics.close()
    row = read_metrics(tmp_path / "metrics.jsonl")[0]
    assert row["step_skipped"] == 0 and math.isfinite(row["loss"])
    after = full_state_dict(learner.model)
    assert any(not torch.equal(before[k], after[k]) for k in before)
