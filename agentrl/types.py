"""Trajectory types: `Episode` and `Group`.

Token-in, token-out: an `Episode` holds the exact token ids the model saw and
produced, with per-token loss mask, behaviour log-probs and weight versions. A
`Group` is the n episodes sampled for one prompt (GRPO-style advantages are computed
within it) and is the unit that travels from rollers to the learner; `agentrl.wire`
turns it into frames and back (its decoder checks the fields declared here, in
`ARRAY_FIELDS` and `TURN_FIELDS`, one by one).

This module imports nothing else from agentrl.
"""

from __future__ import annotations

import copy
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# name -> dtype of each per-token array, in frame order
ARRAY_FIELDS: tuple[tuple[str, np.dtype], ...] = (
    ("tokens", np.dtype("<i4")),
    ("loss_mask", np.dtype("u1")),
    ("logprobs", np.dtype("<f4")),
    ("versions", np.dtype("<i4")),
)
# name -> dtype of each per-turn array (one entry per rewarded turn), in frame order
TURN_FIELDS: tuple[tuple[str, np.dtype], ...] = (
    ("reward_pos", np.dtype("<i4")),
    ("turn_rewards", np.dtype("<f4")),
)
_ARRAY_DTYPES = dict(ARRAY_FIELDS + TURN_FIELDS)


def _as_array(name: str, value: Any) -> np.ndarray:
    dtype = _ARRAY_DTYPES[name]
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise ValueError(f"Episode.{name} must be 1-D, got shape {arr.shape}")
    if arr.dtype != dtype:
        if arr.size and arr.dtype.kind == "f" and dtype.kind in "iu" and not np.all(arr == np.round(arr)):
            raise ValueError(f"Episode.{name} must hold integers, got non-integral {arr.dtype} values")
        arr = arr.astype(dtype)
    return np.ascontiguousarray(arr)


@dataclass
class Episode:
    """One multi-turn episode, token by token.

    tokens     int32[T]  prompt + every turn, exactly as the model saw it
    loss_mask  uint8[T]  1 on tokens the policy generated, 0 on prompt / env output
    logprobs   float32[T] behaviour log-prob from the inference server (0 where mask is 0)
    versions   int32[T]  weight version that produced each generated token, -1 elsewhere

    Per-turn rewards (optional, K entries, K = 0 when the env gives only an outcome):

    reward_pos    int32[K]   token index of the last generated token of each rewarded turn,
                             strictly increasing, in [0, T)
    turn_rewards  float32[K] the env's step reward of that turn (the last also holds the
                             final `Env.reward`); `reward` stays the episode's total, which
                             outcome-only estimators use

    Routed experts (optional; mixture-of-experts models served with `return_routed_experts`):

    routed_experts  int32[T, layers·top_k]  the experts each MoE layer routed token t to when t
                             was fed to the inference engine (layer-major, as SGLang returns
                             them), -1 on tokens it has no record of (the last token of a turn is
                             sampled, never fed); None: no record
    """

    tokens: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    reward: float = 0.0
    num_turns: int = 0
    finish_reason: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    reward_pos: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    turn_rewards: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    routed_experts: np.ndarray | None = None

    def __post_init__(self) -> None:
        for name, _ in ARRAY_FIELDS + TURN_FIELDS:
            setattr(self, name, _as_array(name, getattr(self, name)))
        n = len(self.tokens)
        for name, _ in ARRAY_FIELDS[1:]:
            if len(getattr(self, name)) != n:
                raise ValueError(f"Episode.{name} has {len(getattr(self, name))} entries, tokens has {n}")
        if len(self.turn_rewards) != len(self.reward_pos):
            raise ValueError(
                f"Episode.turn_rewards has {len(self.turn_rewards)} entries, reward_pos has {len(self.reward_pos)}"
            )
        problem = turn_problem(self.reward_pos, n)
        if problem:
            raise ValueError(f"Episode.reward_pos: {problem}")
        if self.routed_experts is not None:
            experts = np.ascontiguousarray(self.routed_experts, dtype=np.int32)
            if experts.ndim != 2 or len(experts) != n or not experts.shape[1]:
                raise ValueError(
                    f"Episode.routed_experts must be [{n} tokens, layers·top_k], got shape {experts.shape}"
                )
            if experts.size and experts.min() < -1:
                raise ValueError("Episode.routed_experts: values must be >= -1 (-1: no record)")
            self.routed_experts = experts
        self.reward = float(self.reward)
        self.num_turns = int(self.num_turns)

    def token_rewards(self) -> np.ndarray:
        """float32[T]: each turn's reward on the last generated token of its turn, 0 elsewhere.
        Without per-turn rewards the whole `reward` sits on the last generated token (the last
        token when nothing was generated; nothing for an empty episode)."""
        out = np.zeros(len(self.tokens), np.float32)
        if len(self.reward_pos):
            np.add.at(out, self.reward_pos, self.turn_rewards)
        elif len(out):
            generated = np.flatnonzero(self.loss_mask)
            out[generated[-1] if generated.size else -1] = self.reward
        return out

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_generated(self) -> int:
        return int(self.loss_mask.sum())

    def _generated_versions(self) -> np.ndarray:
        """The versions of the generated tokens: `versions` itself when every token is (no copy;
        `all` stops at the first prompt token otherwise)."""
        mask = self.loss_mask
        return self.versions if mask.all() else self.versions[mask.astype(bool)]

    @property
    def min_version(self) -> int:
        """Oldest weight version behind any generated token (-1 if none were generated)."""
        generated = self._generated_versions()
        return int(generated.min()) if generated.size else -1

    @property
    def max_version(self) -> int:
        """Newest weight version behind any generated token (-1 if none were generated)."""
        generated = self._generated_versions()
        return int(generated.max()) if generated.size else -1

    def without_tokens_before(self, oldest_version: int) -> tuple[Episode, int]:
        """This episode with its generated tokens of weights older than `oldest_version` out of
        the loss mask (a shallow copy with a new mask: the arrays may be read-only wire frames
        or shared with a queue that may hand the group out again), and how many were taken out."""
        stale = self.loss_mask.astype(bool) & (self.versions < oldest_version)
        count = int(stale.sum())
        if not count:
            return self, 0
        out = copy.copy(self)
        out.loss_mask = np.where(stale, 0, self.loss_mask).astype(self.loss_mask.dtype)
        return out, count

    @property
    def nbytes(self) -> int:
        routed = self.routed_experts.nbytes if self.routed_experts is not None else 0
        return routed + sum(getattr(self, name).nbytes for name, _ in ARRAY_FIELDS + TURN_FIELDS)


def turn_problem(pos: np.ndarray, n: int) -> str | None:
    """What is wrong with per-turn reward positions for an episode of n tokens, or None."""
    if not len(pos):
        return None
    if int(pos[0]) < 0 or int(pos[-1]) >= n:
        return f"positions must lie in [0, {n}), got {int(pos.min())}..{int(pos.max())}"
    if len(pos) > 1 and not bool((pos[1:] > pos[:-1]).all()):
        return "positions must be strictly increasing (one entry per turn)"
    return None


@dataclass
class Group:
    """The episodes sampled for one prompt: the unit of transfer and of advantage computation."""

    episodes: list[Episode]
    group_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    prompt_id: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def min_version(self) -> int:
        """Oldest weight version behind any generated token of the group (-1 if none)."""
        versions = [int(v.min()) for v in (e._generated_versions() for e in self.episodes) if v.size]
        return min(versions) if versions else -1

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.episodes)

    @property
    def rewards(self) -> np.ndarray:
        return np.array([e.reward for e in self.episodes], dtype=np.float64)

    def staleness(self, learner_version: int) -> int:
        """Learner steps since the oldest weights that produced this group."""
        oldest = self.min_version
        return learner_version - oldest if oldest >= 0 else 0

    @property
    def max_version(self) -> int:
        """Newest weight version behind any generated token of the group (-1 if none)."""
        versions = [int(v.max()) for v in (e._generated_versions() for e in self.episodes) if v.size]
        return max(versions) if versions else -1

    def is_admissible(self, learner_version: int, max_staleness: int, per_token: bool = False) -> bool:
        """Admissible at v iff v − min(versions) ≤ max_staleness (by its oldest generated token).
        `per_token` (`learner.staleness: token`): iff some generated token is within the bound,
        v − max(versions) ≤ max_staleness; its older tokens are then masked (`without_stale_tokens`)."""
        judged_by = self.max_version if per_token else self.min_version
        return judged_by < 0 or learner_version - judged_by <= max_staleness

    def without_stale_tokens(self, learner_version: int, max_staleness: int) -> tuple[Group, int]:
        """This group with the generated tokens older than the bound (v − version > max_staleness)
        out of its episodes' loss masks (a shallow copy), and how many were taken out."""
        pairs = [e.without_tokens_before(learner_version - max_staleness) for e in self.episodes]
        masked = sum(n for _, n in pairs)
        if not masked:
            return self, 0
        out = copy.copy(self)
        out.episodes = [e for e, _ in pairs]
        return out, masked
