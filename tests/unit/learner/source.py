"""Test-side outside edge of the learner: groups made from the tiny model's vocabulary and an
in-process source with the TransferQueue consumer's methods (get_batch, ack, publish_version,
metrics, plus state_dict/load_state_dict for the checkpointed cursor)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from agentrl.types import Episode, Group


def make_episode(rng: np.random.Generator, length: int, prompt: int, reward: float, version: int = 0,
                 vocab: int = 1000) -> Episode:  # fmt: skip
    tokens = rng.integers(0, vocab, size=length)
    mask = np.zeros(length, dtype=np.uint8)
    mask[prompt:] = 1
    logprobs = np.where(mask == 1, -rng.uniform(0.5, 8.0, size=length), 0.0).astype(np.float32)
    versions = np.where(mask == 1, version, -1)
    return Episode(tokens, mask, logprobs, versions, reward=reward)


def make_groups(num_groups: int, group_size: int = 4, seed: int = 0, min_len: int = 6, max_len: int = 40,
                version: int = 0) -> list[Group]:  # fmt: skip
    """Groups with varied lengths and rewards (never all-equal inside a group)."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(num_groups):
        eps = []
        for i in range(group_size):
            length = int(rng.integers(min_len, max_len + 1))
            prompt = int(rng.integers(2, max(3, length // 2)))
            eps.append(
                make_episode(rng, length, prompt, reward=float((i + g) % 3 == 0) + 0.1 * i, version=version)
            )
        groups.append(Group(eps, group_id=f"g{seed}-{g}", prompt_id=f"p{g}"))
    return groups


@dataclass
class Batch:
    groups: list[Group]
    dropped_stale: int = 0


@dataclass
class ListSource:
    """Serves `groups` in order, `num_groups` at a time; remembers acks and published versions."""

    groups: list[Group]
    cursor: int = 0
    acked: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def get_batch(
        self, num_groups: int, learner_version: int, max_staleness: int, timeout_s: float | None = None
    ) -> Batch:
        if self.cursor >= len(self.groups):
            raise AssertionError("the learner asked for more groups than the test provided")
        out = self.groups[self.cursor : self.cursor + num_groups]
        self.cursor += len(out)
        return Batch(out)

    def ack(self, group_ids: list[str], dropped: str | None = None) -> None:
        self.acked.extend(group_ids)
        if dropped is not None:
            self.dropped.extend(group_ids)

    def publish_version(self, version: int) -> None:
        self.versions.append(version)

    def metrics(self) -> dict:
        return {"served": self.cursor}

    def state_dict(self) -> dict:
        return {"cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.cursor = state["cursor"]


def learner_config(**flat):
    """A `LearnerConfig` from the tests' flat keyword arguments (`lr=...`, `kl_coef=...`), each
    put where it lives now (`agentrl.learner.config.MOVED`): the tests keep one line per setup."""
    from agentrl.learner.config import MOVED, LearnerConfig

    nested: dict = {}
    for key, value in flat.items():
        if key in MOVED:
            section, field_name = MOVED[key].split(".")
            nested.setdefault(section, {})[field_name] = value
        else:
            nested[key] = value
    return LearnerConfig(**nested)
