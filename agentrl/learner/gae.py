"""GAE(γ, λ) over token-level rewards of multi-turn episodes, and PPO's clipped value loss.

An episode is one flat token sequence in which only generated tokens (loss mask 1) are actions.
Prompt, tool and other environment tokens are not steps of the decision process: GAE runs over
the action tokens in order, so the value of the next *action* bootstraps the current one across
any tool output in between, and γ discounts once per action token, never per tool token.

    δ_t = r_t + γ·V(next action) − V_t          (V(next action) = 0 after the last action)
    A_t = δ_t + γλ·A(next action)               returns R_t = A_t + V_t

`values[t]` is V of the state just before token t (the critic's output at the position that
predicts t, as TRL's `value = full_value[:, context_length - 1 : -1]`). `rewards[t]` are the
episode's token rewards (`Episode.token_rewards()`: each turn's reward on its last generated
token). A reward on a non-action token is credited to the last action at or before it (the
action the environment was answering); one before the first action goes to the first action.

With one turn and every token an action this is exactly the recursion of TRL's
`PPOTrainer.train` ("6. compute advantages and returns", huggingface/trl
trl/experimental/ppo/ppo_trainer.py; TRL 1.16 no longer ships PPOTrainer), and `value_loss`
is its clipped value loss; tests/unit/learner/test_gae.py checks both on the same tensors.
The critic that produces `values` is `critic.py`; `learner.loss.advantage: gae` runs both in
the loop (`critic.gae_advantages`, per packed sequence).
"""

from __future__ import annotations

import numpy as np
import torch


def gae(
    rewards: np.ndarray, values: np.ndarray, action_mask: np.ndarray, gamma: float, lam: float
) -> tuple[np.ndarray, np.ndarray]:
    """(advantages, returns) of one episode, float64[T], 0 on non-action tokens."""
    rewards = np.asarray(rewards, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64)
    mask = np.asarray(action_mask).astype(bool)
    if not (rewards.shape == values.shape == mask.shape) or rewards.ndim != 1:
        raise ValueError(
            f"gae: rewards {rewards.shape}, values {values.shape}, mask {mask.shape} must be equal 1-D"
        )
    adv = np.zeros_like(rewards)
    ret = np.zeros_like(rewards)
    actions = np.flatnonzero(mask)
    if not actions.size:
        return adv, ret
    # each reward to the last action at or before it (the first action for earlier ones)
    owner = np.clip(np.searchsorted(actions, np.arange(len(rewards)), side="right") - 1, 0, None)
    r = np.zeros(actions.size)
    np.add.at(r, owner, rewards)
    v = values[actions]
    a = np.zeros(actions.size)
    next_value, next_adv = 0.0, 0.0
    for k in range(actions.size - 1, -1, -1):
        delta = r[k] + gamma * next_value - v[k]
        next_adv = a[k] = delta + gamma * lam * next_adv
        next_value = v[k]
    adv[actions] = a
    ret[actions] = a + v
    return adv, ret


def batch_gae(
    rewards: list[np.ndarray], values: list[np.ndarray], masks: list[np.ndarray], gamma: float, lam: float
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """`gae` for each episode of a batch."""
    out = [gae(r, v, m, gamma, lam) for r, v, m in zip(rewards, values, masks, strict=True)]
    return [a for a, _ in out], [r for _, r in out]


def whiten(adv: list[np.ndarray], masks: list[np.ndarray], shift_mean: bool = True) -> list[np.ndarray]:
    """Advantages normalised over every action token of the batch: (A − mean)/sqrt(var + 1e-8),
    var unbiased, as TRL's `masked_whiten`; 0 stays on non-action tokens."""
    flat = np.concatenate([a[np.asarray(m).astype(bool)] for a, m in zip(adv, masks, strict=True)])
    if flat.size < 2:
        return [np.zeros_like(a) for a in adv]
    mean, var = flat.mean(), flat.var(ddof=1)
    scale = 1.0 / np.sqrt(var + 1e-8)
    return [
        np.where(np.asarray(m).astype(bool), (a - mean) * scale + (0.0 if shift_mean else mean), 0.0)
        for a, m in zip(adv, masks, strict=True)
    ]


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss per token, 0.5·max((V − R)², (clip(V, V_old ± c) − R)²), and a
    bool tensor of tokens where the clipped term was larger; `clip=None` is the plain squared error."""
    unclipped = (values - returns) ** 2
    if clip is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    clipped_values = torch.clamp(values, old_values - clip, old_values + clip)
    clipped = (clipped_values - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), clipped > unclipped


def explained_variance(values: np.ndarray, returns: np.ndarray) -> float:
    """1 − Var(R − V)/Var(R) over action tokens: 1 is a perfect critic, ≤ 0 no better than a constant."""
    var = float(np.var(returns))
    return float("nan") if var == 0 else 1.0 - float(np.var(returns - values)) / var
