"""From consumed groups to training samples: validation, advantages, aggregation weights.

Bad input never reaches the model. A group is skipped — whole, because advantages are
computed within it — and counted under a named reason when:

    empty_group          it has no episodes
    arrays_disagree      an episode's four arrays have different lengths
    token_out_of_vocab   a token id is negative or ≥ the model's vocabulary size
    nonfinite_reward     a reward (or a per-turn reward) is NaN or ±inf
    nonfinite_logprobs   a behaviour log-prob on a generated token is NaN/inf or > 0
    too_long             an episode exceeds `max_seq_tokens`
    no_generated_tokens  no episode has a generated token after the first position

A batch left with zero trainable tokens is skipped by the loop (`no_trainable_tokens`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from agentrl.learner.advantages import compute_advantages, dapo_overlong_penalty, remax
from agentrl.learner.losses import token_weights
from agentrl.learner.packing import Sample
from agentrl.log import get_logger
from agentrl.types import Group

log = get_logger("learner.data")


@dataclass
class PreparedBatch:
    """Samples split into mini-batches (one optimizer step each) plus what was skipped and why."""

    mini_batches: list[list[Sample]]
    skipped: Counter = field(default_factory=Counter)
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def num_samples(self) -> int:
        return sum(len(m) for m in self.mini_batches)

    @property
    def trainable_tokens(self) -> int:
        return sum(int(s.loss_mask[1:].sum()) for m in self.mini_batches for s in m)


def invalid_reason(group: Group, vocab_size: int, max_seq_tokens: int | None) -> str | None:
    """Why this group cannot be trained on, or None if it can."""
    if not group.episodes:
        return "empty_group"
    generated = 0
    for ep in group.episodes:
        n = len(ep.tokens)
        if not (len(ep.loss_mask) == len(ep.logprobs) == len(ep.versions) == n):
            return "arrays_disagree"
        if n and (int(ep.tokens.min()) < 0 or int(ep.tokens.max()) >= vocab_size):
            return "token_out_of_vocab"
        if not np.isfinite(ep.reward) or not np.isfinite(ep.turn_rewards).all():
            return "nonfinite_reward"
        gen = ep.loss_mask.astype(bool)
        lp = ep.logprobs[gen]
        if lp.size and (not np.isfinite(lp).all() or (lp > 1e-3).any()):
            return "nonfinite_logprobs"
        if max_seq_tokens is not None and n > max_seq_tokens:
            return "too_long"
        generated += int(ep.loss_mask[1:].sum())
    return None if generated else "no_generated_tokens"


def no_generation_why(group: Group) -> str:
    """Why a group's episodes generated nothing, from their finish reasons and prompt length."""
    reasons = Counter(ep.finish_reason or "unknown" for ep in group.episodes)
    prompt = max(int(ep.metrics.get("prompt_tokens", ep.num_tokens)) for ep in group.episodes)
    ended = ", ".join(f"{r} ×{n}" for r, n in reasons.most_common())
    why = f"{len(group.episodes)} episodes ended with no generated token: {ended}; prompt {prompt} tokens"
    if reasons.get("context"):
        why += " (the prompt fills roller.max_total_tokens: raise it; agentrl env check shows the budget)"
    return why


def _weights(samples: list[Sample], mode: str) -> None:
    lengths = [int(s.loss_mask[1:].sum()) for s in samples]
    for s, w in zip(samples, token_weights(lengths, mode, sum(lengths), len(samples)), strict=True):
        s.weight = w


def prepare_batch(
    groups: list[Group],
    *,
    advantage: str,
    loss_agg: str,
    vocab_size: int,
    learner_version: int,
    mini_batches: int = 1,
    max_seq_tokens: int | None = None,
    overlong: tuple[int, int, float] | None = None,
    router_replay: bool = False,
) -> PreparedBatch:
    """Validate, compute advantages per group, and split groups into `mini_batches` slices.

    `overlong` = (L_max, L_cache, factor) adds DAPO's overlong penalty to each episode's reward
    (by its generated tokens) before the estimator; `reward/*` metrics stay the env's rewards.
    `advantage="gae"` leaves the advantages to the critic (`critic.gae_advantages`, after the
    packing): each sample carries its token rewards (`Episode.token_rewards()`, with the
    overlong penalty on its last generated token) and advantage 0 until then. `router_replay`: each
    sample carries its episode's routed experts (`learner.moe.router_replay`)."""
    good, skipped = _valid_groups(groups, advantage, vocab_size, max_seq_tokens)
    rewards = [g.rewards for g in good]
    penalty = None
    if overlong is not None:
        penalty = [dapo_overlong_penalty([ep.num_generated for ep in g.episodes], *overlong) for g in good]
        rewards = [r + p for r, p in zip(rewards, penalty, strict=True)]
    if advantage == "gae":
        advs = [np.zeros(len(r)) for r in rewards]
    elif advantage == "remax":
        advs = remax(rewards, [float(g.metrics["greedy_reward"]) for g in good])
    else:
        advs = compute_advantages(advantage, rewards)
    minis = _mini_batches(good, advs, penalty, advantage == "gae", mini_batches, loss_agg, router_replay)
    metrics = _batch_metrics(good, advs, learner_version)
    if penalty:
        metrics["reward/overlong_penalty_mean"] = float(np.concatenate(penalty).mean())
    return PreparedBatch(minis, skipped, metrics)


def _valid_groups(
    groups: list[Group], advantage: str, vocab_size: int, max_seq_tokens: int | None
) -> tuple[list[Group], Counter]:
    """The groups fit to train on, and a count of the others by reason (each logged)."""
    skipped: Counter = Counter()
    good: list[Group] = []
    for g in groups:
        reason = invalid_reason(g, vocab_size, max_seq_tokens)
        if reason is None and advantage == "remax" and not _has_greedy_reward(g):
            reason = "no_greedy_reward"  # a roller without roller.greedy_baseline sent it
        if reason is None:
            good.append(g)
        else:
            skipped[reason] += 1
            detail = f" ({no_generation_why(g)})" if reason == "no_generated_tokens" else ""
            log.warning("skipping group %s: %s%s", g.group_id, reason, detail)
    return good, skipped


def _mini_batches(
    good: list[Group],
    advs: list[np.ndarray],
    penalty: list[np.ndarray] | None,
    gae: bool,
    mini_batches: int,
    loss_agg: str,
    router_replay: bool = False,
) -> list[list[Sample]]:
    """Every `mini_batches`-th group in each slice, one weighted `Sample` per episode; with `gae`
    each carries its token rewards (the overlong `penalty` on its last generated token)."""
    slices = [good[i::mini_batches] for i in range(mini_batches)] if good else []
    adv_of = {id(g): a for g, a in zip(good, advs, strict=True)}
    penalty_of = {id(g): dict(enumerate(p)) for g, p in zip(good, penalty or [], strict=False)}
    minis: list[list[Sample]] = []
    for part in slices:
        samples = [
            Sample(ep.tokens, ep.loss_mask, ep.logprobs, ep.versions, float(a), 0.0,
                   _token_rewards(ep, penalty_of.get(id(g), {}).get(i)) if gae else None,
                   ep.routed_experts if router_replay else None)
            for g in part
            for i, (ep, a) in enumerate(zip(g.episodes, adv_of[id(g)], strict=True))
        ]  # fmt: skip
        if samples:
            _weights(samples, loss_agg)
            minis.append(samples)
    return minis


def _has_greedy_reward(group: Group) -> bool:
    value = group.metrics.get("greedy_reward")
    return isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value)


def _token_rewards(ep, penalty: float | None) -> np.ndarray:
    """The episode's token rewards, with DAPO's overlong penalty on its last generated token."""
    rewards = ep.token_rewards().astype(np.float64)
    generated = np.flatnonzero(ep.loss_mask)
    if penalty and generated.size:
        rewards[generated[-1]] += penalty
    return rewards


def _batch_metrics(groups: list[Group], advs: list[np.ndarray], version: int) -> dict[str, float]:
    if not groups:
        return {}
    rewards = np.concatenate([g.rewards for g in groups])
    adv = np.concatenate(advs)
    lengths = np.array([ep.num_tokens for g in groups for ep in g.episodes])
    gen = np.array([ep.num_generated for g in groups for ep in g.episodes])
    m = {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()),
        "reward/min": float(rewards.min()),
        "reward/max": float(rewards.max()),
        "adv/mean": float(adv.mean()),
        "adv/std": float(adv.std()),
        "adv/abs_max": float(np.abs(adv).max()),
        "seq/len_mean": float(lengths.mean()),
        "seq/len_max": float(lengths.max()),
        "seq/generated_mean": float(gen.mean()),
        "seq/turns_mean": float(np.mean([ep.num_turns for g in groups for ep in g.episodes])),
        "groups/uniform_reward_frac": float(np.mean([np.ptp(g.rewards) == 0 for g in groups])),
    }
    for s, n in sorted(Counter(g.staleness(version) for g in groups).items()):
        m[f"staleness/{s}"] = float(n)
    m.update(_episode_metrics(groups))
    return m


def _episode_metrics(groups: list[Group]) -> dict[str, float]:
    """Means of the envs' numeric episode metrics (tool calls, errors, searches, EM...) as
    `episode/<key>`, and the share of each finish reason as `finish/<reason>`."""
    sums: dict[str, float] = {}
    reasons: Counter = Counter()
    episodes = [ep for g in groups for ep in g.episodes]
    for ep in episodes:
        reasons[ep.finish_reason or "unknown"] += 1
        for key, value in ep.metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value):
                sums[key] = sums.get(key, 0.0) + float(value)
    m = {f"episode/{k}": v / len(episodes) for k, v in sums.items()}
    m.update({f"finish/{r}": n / len(episodes) for r, n in reasons.items()})
    return m
