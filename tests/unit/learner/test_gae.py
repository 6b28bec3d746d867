"""GAE over multi-turn episodes against a hand-computed table (tool tokens are not actions), and
GAE, whitening, the PPO actor loss and the clipped value loss against TRL's PPOTrainer formulas
on the same tensors. TRL 1.16 (installed) no longer ships PPOTrainer; the oracle below is its
code path transcribed from huggingface/trl trl/experimental/ppo/ppo_trainer.py at commit
0062ee10a9bc59dbb7ba244f3bbaf2e81f25196f: `PPOTrainer.train`, "6. compute advantages and
returns" and the `vf_losses1/2`, `pg_losses/2` lines, and `masked_mean` / `masked_whiten`."""

import numpy as np
import pytest
import torch

from agentrl.learner import losses
from agentrl.learner.gae import batch_gae, explained_variance, gae, value_loss, whiten
from agentrl.types import Episode

GAMMA, LAM = 0.9, 0.8


def test_gae_hand_table_across_tool_tokens():
    # prompt P P, turn 1 a1 a2 (reward 0.5 on a2), tool output T T, turn 2 a3 a4 (reward 1.0 on a4)
    mask = np.array([0, 0, 1, 1, 0, 0, 1, 1])
    values = np.array([9.0, 9.0, 0.2, 0.4, 9.0, 9.0, 0.6, 0.8])  # values on non-actions are ignored
    rewards = np.array([0, 0, 0, 0.5, 0, 0, 0, 1.0])
    # by hand, actions only (a2's next value is a3's: it bootstraps across T T, undiscounted by them):
    #   a4: δ = 1 − .8 = .2                 A = .2
    #   a3: δ = .9·.8 − .6 = .12            A = .12 + .72·.2 = .264
    #   a2: δ = .5 + .9·.6 − .4 = .64       A = .64 + .72·.264 = .83008
    #   a1: δ = .9·.4 − .2 = .16            A = .16 + .72·.83008 = .7576576
    adv, ret = gae(rewards, values, mask, GAMMA, LAM)
    np.testing.assert_allclose(adv, [0, 0, 0.7576576, 0.83008, 0, 0, 0.264, 0.2], rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(ret, [0, 0, 0.9576576, 1.23008, 0, 0, 0.864, 1.0], rtol=1e-12, atol=1e-15)


def test_gae_credits_rewards_on_tool_tokens_to_the_action_before_them():
    mask = np.array([0, 1, 0, 0, 1])
    values = np.array([0.0, 0.5, 0.0, 0.0, 0.25])
    on_tool = gae(np.array([0, 0, 0.3, 0, 1.0]), values, mask, GAMMA, LAM)
    on_action = gae(np.array([0, 0.3, 0, 0, 1.0]), values, mask, GAMMA, LAM)
    np.testing.assert_allclose(on_tool[0], on_action[0])
    before_any = gae(np.array([0.3, 0, 0, 0, 1.0]), values, mask, GAMMA, LAM)  # goes to the first action
    np.testing.assert_allclose(before_any[0], on_action[0])
    assert not gae(np.zeros(3), np.zeros(3), np.zeros(3), GAMMA, LAM)[0].any()  # nothing generated
    with pytest.raises(ValueError, match="equal 1-D"):
        gae(np.zeros(3), np.zeros(2), np.zeros(3), GAMMA, LAM)


def test_gae_on_an_episodes_per_turn_rewards():
    ep = Episode(np.arange(8), [0, 0, 1, 1, 0, 0, 1, 1], np.zeros(8), [-1, -1, 0, 0, -1, -1, 0, 0],
                 reward=1.5, reward_pos=[3, 7], turn_rewards=[0.5, 1.0])  # fmt: skip
    values = np.array([9.0, 9.0, 0.2, 0.4, 9.0, 9.0, 0.6, 0.8])
    adv, _ = gae(ep.token_rewards(), values, ep.loss_mask, GAMMA, LAM)
    np.testing.assert_allclose(adv[[2, 3, 6, 7]], [0.7576576, 0.83008, 0.264, 0.2], rtol=1e-6)


def _trl_gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float):
    """TRL PPOTrainer.train, step 6, verbatim in structure: a backward loop over response tokens."""
    lastgaelam = 0
    advantages_reversed = []
    gen_length = rewards.shape[1]
    for t in reversed(range(gen_length)):
        nextvalues = values[:, t + 1] if t < gen_length - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], axis=1)
    return advantages, advantages + values


def _masked_mean(values, mask):
    return (values * mask).sum() / mask.sum()


def _trl_whiten(values, mask):
    mean = _masked_mean(values, mask)
    var = _masked_mean((values - mean) ** 2, mask) * (mask.sum() / (mask.sum() - 1))
    return (values - mean) * torch.rsqrt(var + 1e-8)


def test_gae_and_whitening_match_trls_ppo_on_single_turn_responses():
    g = torch.Generator().manual_seed(0)
    rewards = -0.05 * torch.rand(3, 6, generator=g)  # TRL's per-token −β·KL
    rewards[:, -1] += torch.tensor([1.0, -0.5, 0.25])  # plus the score on the last token
    values = torch.randn(3, 6, generator=g)
    trl_adv, trl_ret = _trl_gae(rewards, values, GAMMA, LAM)
    mask = np.ones(6)
    ours_adv, ours_ret = batch_gae(list(rewards.double().numpy()), list(values.double().numpy()), [mask] * 3,
                                   GAMMA, LAM)  # fmt: skip
    np.testing.assert_allclose(np.stack(ours_adv), trl_adv.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.stack(ours_ret), trl_ret.numpy(), rtol=1e-5, atol=1e-6)
    ours_white = np.stack(whiten(ours_adv, [mask] * 3))
    np.testing.assert_allclose(
        ours_white, _trl_whiten(trl_adv, torch.ones(3, 6)).numpy(), rtol=1e-4, atol=1e-5
    )


def test_ppo_actor_and_critic_losses_match_trls_ppo():
    g = torch.Generator().manual_seed(1)
    shape = (4, 7)
    mask = (torch.rand(shape, generator=g) > 0.2).float()
    adv = torch.randn(shape, generator=g)
    old_logp = -torch.rand(shape, generator=g) * 3
    logp = (old_logp + 0.3 * torch.randn(shape, generator=g)).requires_grad_()
    old_values = torch.randn(shape, generator=g)
    values = (old_values + 0.4 * torch.randn(shape, generator=g)).requires_grad_()
    returns = torch.randn(shape, generator=g)
    cliprange, cliprange_value = 0.2, 0.2

    # TRL: the lines of PPOTrainer.train that compute vf_loss, vf_clipfrac and pg_loss
    vpredclipped = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    vf_losses1 = torch.square(values - returns)
    vf_losses2 = torch.square(vpredclipped - returns)
    trl_vf = 0.5 * _masked_mean(torch.max(vf_losses1, vf_losses2), mask)
    trl_vf_clipfrac = _masked_mean((vf_losses2 > vf_losses1).float(), mask)
    ratio = torch.exp(logp - old_logp)
    pg_losses = -adv * ratio
    pg_losses2 = -adv * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    trl_pg = _masked_mean(torch.max(pg_losses, pg_losses2), mask)
    trl_grads = torch.autograd.grad(trl_pg + trl_vf, [logp, values])

    # ours: the same per-token terms, aggregated with token_mean weights as the learner does
    weight = torch.full(shape, losses.token_weights([int(mask.sum())], "token_mean", int(mask.sum()), 1)[0])
    pg, _ = losses.ppo_clip(logp, old_logp, adv, cliprange, cliprange)
    vf, vf_clipped = value_loss(values, old_values, returns, cliprange_value)
    ours_pg = losses.aggregate(pg, mask, weight)
    ours_vf = losses.aggregate(vf, mask, weight)
    grads = torch.autograd.grad(ours_pg + ours_vf, [logp, values])
    torch.testing.assert_close(ours_pg, trl_pg, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(ours_vf, trl_vf, rtol=1e-5, atol=1e-7)
    assert 0 < float(trl_vf_clipfrac) < 1  # both value-loss branches are exercised
    torch.testing.assert_close((vf_clipped.float() * mask).sum() / mask.sum(), trl_vf_clipfrac)
    for ours, trl in zip(grads, trl_grads, strict=True):
        torch.testing.assert_close(ours, trl, rtol=1e-5, atol=1e-7)


def test_value_loss_without_clip_and_explained_variance():
    v, r = torch.tensor([1.0, 2.0]), torch.tensor([0.0, 4.0])
    loss, clipped = value_loss(v, torch.zeros(2), r, None)
    torch.testing.assert_close(loss, torch.tensor([0.5, 2.0]))
    assert not clipped.any()
    ret = np.array([1.0, 2.0, 3.0, 4.0])
    assert explained_variance(ret, ret) == 1.0
    assert explained_variance(np.full(4, ret.mean()), ret) == pytest.approx(0.0)
    assert np.isnan(explained_variance(np.zeros(2), np.ones(2)))
