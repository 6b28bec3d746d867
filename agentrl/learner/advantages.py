"""Advantage estimators: one short function each, from episode rewards to episode advantages.

Every estimator takes the rewards of a batch as a list of per-group arrays (one float per
episode) and returns advantages in the same shape. Outcome rewards only (an episode's total,
`Episode.reward`, even when it carries per-turn rewards): the advantage of an episode is
broadcast to each of its generated tokens by the caller. Token-level estimation over per-turn
rewards is GAE (`learner/gae.py`).

    grpo            (r − mean_group) / (std_group + eps)          DeepSeekMath GRPO
    dr_grpo         r − mean_group (no std, and no length normalisation in the loss)   Dr. GRPO
    rloo            r − mean of the *other* episodes of the group  RLOO
    reinforce_pp    (r − mean_batch) / (std_batch + eps)           REINFORCE++ (batch-normalised)
    grpo_batch_std  (r − mean_group) / (std_batch + eps)           TRL `scale_rewards="batch"`
    remax           r − r_greedy of the same prompt                ReMax (needs the greedy reward)

std is the sample standard deviation (unbiased, as torch.std and TRL use). A group of one
episode has no baseline in GRPO/RLOO terms and gets advantage 0.

Reward shaping before the estimator: `dapo_overlong_penalty` (DAPO's soft overlong punishment).
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


def grpo_batch_std(rewards: Rewards, eps: float = EPS) -> Rewards:
    """Group-mean baseline scaled by the std of every reward in the batch: TRL 1.16's
    `GRPOTrainer` with `scale_rewards="batch"` (its `_generate_and_score_completions`). REINFORCE++
    (`reinforce_pp`) differs: it subtracts the batch mean, not each group's."""
    flat = np.concatenate([np.asarray(r, dtype=np.float64) for r in rewards]) if rewards else np.zeros(0)
    std = flat.std(ddof=1) if flat.size > 1 else 0.0
    return [(np.asarray(r, dtype=np.float64) - np.mean(r)) / (std + eps) for r in rewards]


def remax(rewards: Rewards, greedy_rewards: list[float]) -> Rewards:
    """ReMax (Li et al. 2023, arXiv 2310.10505, Alg. 1): the baseline of a prompt's sampled
    episodes is the reward of the greedy (argmax-decoded) episode for the same prompt.

    `greedy_rewards[g]` is that reward for group g: the roller runs that episode with
    `roller.greedy_baseline` and sends its reward as `Group.metrics["greedy_reward"]`
    (`learner.loss.advantage: remax`; `data.prepare_batch` reads it)."""
    if len(greedy_rewards) != len(rewards):
        raise ValueError(f"remax: {len(greedy_rewards)} greedy rewards for {len(rewards)} groups")
    return [np.asarray(r, dtype=np.float64) - float(b) for r, b in zip(rewards, greedy_rewards, strict=True)]


def dapo_overlong_penalty(
    lengths: np.ndarray, max_tokens: int, buffer_tokens: int, factor: float = 1.0
) -> np.ndarray:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13), added to the
    reward of an episode that generated `lengths` tokens:

        0                                  |y| ≤ L_max − L_cache
        ((L_max − L_cache) − |y|) / L_cache    L_max − L_cache < |y| ≤ L_max
        −1                                 |y| > L_max

    times `factor`. For multi-turn episodes |y| counts every generated token of the episode."""
    lengths = np.asarray(lengths, dtype=np.float64)
    start = max_tokens - buffer_tokens
    ramp = (start - lengths) / buffer_tokens if buffer_tokens else np.zeros_like(lengths)
    penalty = np.where(lengths <= start, 0.0, np.where(lengths <= max_tokens, ramp, -1.0))
    return factor * penalty


ESTIMATORS: dict[str, Callable[[Rewards], Rewards]] = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
    "grpo_batch_std": grpo_batch_std,
}


def compute_advantages(name: str, rewards: Rewards) -> Rewards:
    """Dispatch by the config's `learner.loss.advantage` name."""
    try:
        return ESTIMATORS[name](rewards)
    except KeyError:
        raise ValueError(
            f"unknown advantage estimator {name!r}; choose one of {sorted(ESTIMATORS)}"
        ) from None
