"""The colocated mode's config section (`colocated:`): ranks and the training and generation layouts.

Kept beside the colocated code; `agentrl.config` assembles it into the run's `AgentRLConfig` and
re-exports it.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from agentrl.section import Section


class ColocatedConfig(Section):
    """`mode: colocated`: generation and training alternate on the same ranks (agentrl/colocated)."""

    num_processes: int = Field(2, ge=1)
    """Ranks (torchrun processes on this machine): `t`-way tensor parallel times `num_processes/t`-way
    FSDP2 for training."""
    t: int = Field(1, ge=1)
    """Tensor-parallel degree of training (FSDP2 + TP on a (dp, tp) mesh when > 1); the ranks of one
    TP group train on the same micro-batches, the batch is split over the num_processes/t dp ranks."""
    tg: int = Field(1, ge=1)
    """Tensor-parallel degree of one generation engine replica; there are num_processes/tg replicas."""
    max_batch_size: int = Field(64, ge=1)
    """Sequences one replica decodes together."""
    partial_rollout: float | None = Field(None, gt=0, le=1)
    """Partial rollouts against the long tail: each replica keeps ⌈(groups_per_step/replicas) /
    partial_rollout⌉ groups in flight, and a step stops generating once groups_per_step/replicas of
    them are done (that share of its groups); the unfinished episodes keep their tokens and
    versions and go on after the next reshard, on the new weights (their later tokens carry the
    newer version, as after a weight push in decoupled mode). None: a step waits for all its groups
    (on-policy). The time an episode waits across a training step counts towards
    `roller.episode_timeout_s`. A checkpoint does not hold unfinished episodes: `--resume` goes on
    with the next tasks (those groups' tasks are skipped), so it repeats the uninterrupted run only
    without partial rollouts."""

    @model_validator(mode="after")
    def _layouts(self) -> ColocatedConfig:
        """The layouts the HybridEngine reshards between (agentrl/hybrid/reshard.py)."""
        n = self.num_processes
        if n % self.t:
            raise ValueError(f"colocated.t={self.t} must divide colocated.num_processes={n} (t-way TP × dp)")
        if n % self.tg:
            raise ValueError(
                f"colocated.tg={self.tg} must divide colocated.num_processes={n} (replicas of tg ranks)"
            )
        if self.t > 1 and self.tg > self.t:
            raise ValueError(
                f"colocated.tg={self.tg} above colocated.t={self.t}: the generation TP groups would stride across "
                "the (dp, tp) training mesh out of rank order (the lm_head's logits would gather permuted); use "
                "tg <= t, or t: 1"
            )
        if self.t > 1 and self.t % self.tg:
            raise ValueError(
                f"colocated.tg={self.tg} must divide colocated.t={self.t}: otherwise a generation TP group holds its "
                "shards out of rank order, as with tg > t"
            )
        return self
