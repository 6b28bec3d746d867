"""Advantage estimators: one short function each, from episode rewards to episode advantages.

Every estimator takes the rewards of a batch as a list of per-group arrays (one float per
episode) and returns advantages in the same shape. Outcome rewards only: the advantage of
an episode is broadcast to each of its generated tokens by the caller.

    grpo          (r − mean_group) / (std_group + eps)           DeepSeekMath GRPO
    dr_grpo       r − mean_group (no std, and no length normalisation in the loss)   Dr. GRPO
    rloo          r − mean of the *other* episodes of the group   RLOO
    reinforce_pp  (r − mean_batch) / (std_batch + eps)            REINFORCE++ (batch-normalised)

std is the sample standard deviation (unbiased, as torch.std and TRL use). A group of one
episode has no baseline in GRPO/RLOO terms and gets advantage 0.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

EPS = 1e-4  # TRL/verl use 1e-4 for GRPO's std normalisation

Rewards = list[np.ndarray]


def grpo(rewards: Rewards, eps: float = EPS) -> Rewards:
    """Group-normalised: (r − group mean) / (group std + eps)."""
    out = []
    for r in rewards:
        r = np.asarray(r, dtype=np.float64)
        std = r.std(ddof=1) if r.size > 1 else 0.0
        out.append((r - r.mean()) / (std + eps) if r.size > 1 else np.zeros_like(r))
    return out


def dr_grpo(rewards: Rewards) -> Rewards:
    """Dr. GRPO: group mean baseline without the std division (pair with seq_mean_token_sum)."""
    return [np.asarray(r, dtype=np.float64) - np.mean(r) for r in rewards]


def rloo(rewards: Rewards) -> Rewards:
    """Leave-one-out baseline: r_i − mean_{j≠i} r_j = n/(n−1) · (r_i − mean)."""
    out = []
    for r in rewards:
        r = np.asarray(r, dtype=np.float64)
        n = r.size
        out.append((r - (r.sum() - r) / (n - 1)) if n > 1 else np.zeros_like(r))
    return out


def reinforce_pp(rewards: Rewards, eps: float = 1e-8) -> Rewards:
    """REINFORCE++: outcome reward normalised over the whole batch (mean and std of all episodes)."""
    flat = np.concatenate([np.asarray(r, dtype=np.float64) for r in rewards]) if rewards else np.zeros(0)
    if flat.size < 2:
        return [np.zeros_like(np.asarray(r, dtype=np.float64)) for r in rewards]
    mean, std = flat.mean(), flat.std(ddof=1)
    return [(np.asarray(r, dtype=np.float64) - mean) / (std + eps) for r in rewards]


ESTIMATORS: dict[str, Callable[[Rewards], Rewards]] = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
}


def compute_advantages(name: str, rewards: Rewards) -> Rewards:
    """Dispatch by the config's `learner.advantage` name."""
    try:
        return ESTIMATORS[name](rewards)
    except KeyError:
        raise ValueError(
            f"unknown advantage estimator {name!r}; choose one of {sorted(ESTIMATORS)}"
        ) from None
