"""One learner step, the same for every driver: the decoupled loop (`loop.run`), the colocated
ranks (`colocated/loop.py`) and `agentrl bench learner` call these functions and nothing else.

    batch = prepare(learner, groups)       # validate, skip with a counted reason, advantages
    result = train(learner, batch)         # pack, recompute, (GAE), forward/backward, AdamW
    m = result.metrics(learner)            # the step's metrics (the same on every rank)
    learner.weights()                      # then: the weight iterator a driver pushes or reshards

`train` runs, per step:

    1. pack each mini-batch into this rank's micro-batches (balanced over the data-parallel
       ranks), on the device
    2. recompute, without gradients, what the objective needs from frozen models: π_old / π_prox
       (decoupled PPO; TIS with several mini-batches) and π_ref (KL penalty); with
       `learner.distill` the teacher's log-probs, its reverse-KL reward added to the advantages
    3. with a critic: its old values, GAE advantages and returns (`critic.gae_advantages`)
    4. forward/backward, clip and AdamW per mini-batch (`train_step.optimizer_step`; skipped when
       the loss or gradient norm is non-finite): the actor, unless the critic is warming up,
       then the critic (`critic.critic_step`)

A driver decides what happens around it: where the groups come from, when the version advances
(`result.applied`), where the weights go, what is acked, logged and saved.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from agentrl.learner import distill
from agentrl.learner.critic import critic_step, gae_advantages
from agentrl.learner.data import PreparedBatch, prepare_batch
from agentrl.learner.packing import MicroBatch, non_padding_fraction, padded_plan, plan_microbatches
from agentrl.learner.train_step import optimizer_step, recompute_logprobs
from agentrl.types import Group

if TYPE_CHECKING:
    from agentrl.learner.state import Learner


def prepare(learner: Learner, groups: list[Group]) -> PreparedBatch:
    """Validated samples with advantages, split into `learner.mini_batches` mini-batches; a batch
    left with no trainable token counts `no_trainable_tokens` in its `skipped`."""
    cfg = learner.cfg
    batch = prepare_batch(groups, advantage=cfg.loss.advantage, loss_agg=cfg.loss.loss_agg,
                          vocab_size=learner.vocab_size, learner_version=learner.version,
                          mini_batches=cfg.mini_batches, max_seq_tokens=cfg.max_seq_tokens,
                          overlong=cfg.loss.overlong, router_replay=cfg.moe.router_replay)  # fmt: skip
    if batch.trainable_tokens == 0:
        batch.skipped["no_trainable_tokens"] += 1
    return batch


def pack(learner: Learner, batch: PreparedBatch, padded: bool = False) -> list[list[MicroBatch]]:
    """Steps 1-2: each mini-batch packed into this rank's micro-batches, on the device, with the
    frozen policies' log-probs the objective needs (π_old / π_prox, π_ref). The batch is split
    over the backend's data-parallel ranks (under tensor parallel the ranks of a TP group get the
    same micro-batches). `padded`: one rank's rows in arrival order, padded (the baseline layout
    `bench learner` compares packing with)."""
    cfg, loss, backend = learner.cfg, learner.cfg.loss, learner.backend
    if batch.trainable_tokens == 0:
        return []
    if padded:
        plans = [
            padded_plan(samples, cfg.micro_batch_tokens, learner.pad_id) for samples in batch.mini_batches
        ]
    else:
        plans = [plan_microbatches(samples, cfg.micro_batch_tokens, backend.dp_size, backend.dp_rank,
                                   cfg.pad_multiple, learner.pad_id, learner.pack_rows)
                 for samples in batch.mini_batches]  # fmt: skip
    plans = [[mb.to(learner.device) for mb in plan] for plan in plans]
    needs_old = loss.needs_old_logp(cfg.mini_batches)
    for plan in plans:
        if needs_old:
            recompute_logprobs(backend, learner.actor, plan, "old_logp", cfg.temperature)
        if learner.ref is not None:
            recompute_logprobs(backend, learner.ref, plan, "ref_logp", cfg.temperature)
    if cfg.distill.enabled:  # the teacher's reverse-KL reward folded into the advantages
        batch.metrics.update(
            distill.apply(cfg.distill, [mb for plan in plans for mb in plan], backend.all_reduce)
        )
    return plans


@dataclass
class StepResult:
    """What one step did: the batch and its micro-batches, the per-mini-batch metrics of the
    actor's and the critic's optimizer steps, and the advantage statistics of GAE."""

    batch: PreparedBatch
    plans: list[list[MicroBatch]]
    steps: list[dict[str, float]] = field(default_factory=list)
    critic_steps: list[dict[str, float]] = field(default_factory=list)
    adv_stats: dict[str, float] = field(default_factory=dict)
    warming: bool = False
    has_critic: bool = False
    t_train: float = 0.0

    @property
    def applied(self) -> bool:
        """The actor's weights changed (a new version)."""
        return any(not s["step_skipped"] for s in self.steps)

    @property
    def nonfinite(self) -> bool:
        """The actor ran and every one of its optimizer steps was skipped as non-finite."""
        return bool(self.steps) and not self.applied

    @property
    def used(self) -> bool:
        """The step trained something: the actor, or the critic during its warm-up."""
        return self.applied or (self.warming and any(not s["critic/step_skipped"] for s in self.critic_steps))

    def metrics(self, learner: Learner) -> dict[str, float]:
        """The step's metrics: per-mini-batch means of the actor's and the critic's, the batch's
        (rewards, advantages, lengths), packing and throughput."""
        m: dict[str, float] = {}
        if self.steps:
            for key in self.steps[-1]:
                m[key] = sum(s[key] for s in self.steps) / len(self.steps)
            m["step_skipped"] = float(sum(s["step_skipped"] for s in self.steps))
        m.update(self.batch.metrics)
        mbs = [mb for plan in self.plans for mb in plan]
        m["packing/non_padding_frac"] = non_padding_fraction(mbs) if mbs else 0.0
        m["packing/micro_batches"] = float(len(mbs))
        m["time/train_s"] = self.t_train
        # this rank's tokens times the data-parallel ranks (a TP group's ranks train the same ones)
        m["tokens_per_s"] = self.tokens * learner.backend.dp_size / max(self.t_train, 1e-9)
        m.update(self.adv_stats)
        if self.critic_steps:
            m.update(
                {
                    k: sum(r[k] for r in self.critic_steps) / len(self.critic_steps)
                    for k in self.critic_steps[0]
                }
            )
        if self.has_critic:
            m["critic/warmup"] = float(self.warming)
        return m

    @property
    def tokens(self) -> int:
        """This rank's real (non-padding) tokens."""
        return sum(mb.real_tokens for plan in self.plans for mb in plan)


def train(learner: Learner, batch: PreparedBatch, padded: bool = False) -> StepResult:
    """Steps 1-4 on a prepared batch (see the module docstring); a collective: every rank calls it
    with the same batch."""
    cfg, critic = learner.cfg, learner.critic
    plans = pack(learner, batch, padded)
    adv_stats = gae_advantages(learner.backend, critic, plans, cfg.loss) if critic and plans else {}
    t0 = time.perf_counter()  # time/train_s: the optimizer steps (forward/backward included)
    warming = learner.critic_warming_up
    steps = [] if warming else [optimizer_step(learner.backend, learner.actor, plan, cfg, learner.version)
                                for plan in plans]  # fmt: skip
    critic_steps = (
        [critic_step(learner.backend, critic, plan, cfg.critic) for plan in plans] if critic else []
    )
    return StepResult(batch, plans, steps, critic_steps, adv_stats, warming, critic is not None,
                      time.perf_counter() - t0)  # fmt: skip
