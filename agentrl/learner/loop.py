"""The learner's main loop, as a short numbered script, and the objects it runs with.

    learner = build_learner(cfg, run_dir)           # backend, actor (+ reference), optimizer
    run(learner, consumer, max_staleness, weight_sync, resume=True)

`run` repeats until `cfg.max_steps` weight versions exist (each step below is one helper or a
few lines in `run`):

    1. wait for a batch admissible at the current version (rank 0 asks the queue and
       broadcasts the groups to the other ranks)
    2. validate, skip bad groups with a counted reason, compute advantages
    3. pack into token-budget micro-batches balanced across ranks; recompute frozen log-probs
    4. forward/backward over the micro-batches, clip, AdamW step (skipped if the loss or the
       gradient norm is non-finite; a non-finite optimizer state, or weights after the step, stop
       the learner naming the tensor, before anything is pushed or saved)
    5. version += 1; publish it; hand the weights to weight sync
    6. ack the groups; record their ids (`<run_dir>/learner_groups.jsonl`); log metrics; a
       sample of transcripts every N steps (`transcripts.py`)
    7. checkpoint and export every N steps (and at the end)

A stop request (`stop.set()`, from SIGTERM / SIGINT in `learner.main`) is honoured between
steps and while waiting for a batch: the loop saves its final checkpoint and returns, never
mid-step. Rank 0 decides, so every rank stops at the same step.

The queue consumer and the weight-sync engine are reached through the small protocols below,
so tests drive the loop with an in-process source and the real queue plugs in unchanged; the
models only through the learner backend (`backend.LearnerBackend`; FSDP2 in `fsdp.py`).
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from agentrl.config import LearnerConfig, ScheduleConfig
from agentrl.learner import bookkeeping, registry, step
from agentrl.learner.backend import LearnerBackend
from agentrl.learner.bookkeeping import ConsoleProgress, RunTally
from agentrl.learner.critic import build_critic
from agentrl.learner.state import Learner
from agentrl.learner.transcripts import StepNotes
from agentrl.log import MetricsLogger, get_logger
from agentrl.queue.base import Consumer
from agentrl.types import Group
from agentrl.weight_sync.base import WeightSyncEngine as WeightSync

log = get_logger("learner")


def lr_lambda(schedule: ScheduleConfig, total_steps: int):
    """Linear warm-up to the peak, then constant / cosine / linear decay to min_lr_ratio at
    `total_steps` optimizer steps."""

    def factor(step: int) -> float:
        if step < schedule.warmup_steps:
            return (step + 1) / schedule.warmup_steps
        if schedule.lr_decay == "constant":
            return 1.0
        total = max(total_steps - schedule.warmup_steps, 1)
        progress = min((step - schedule.warmup_steps) / total, 1.0)
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if schedule.lr_decay == "cosine" else 1 - progress
        return schedule.min_lr_ratio + (1 - schedule.min_lr_ratio) * shape

    return factor


def build_learner(
    cfg: LearnerConfig,
    run_dir: str | Path,
    backend: LearnerBackend | None = None,
    shard: Callable[[nn.Module], nn.Module] | None = None,
    push_buckets: int | None = None,
) -> Learner:
    """The backend (process group; `learner.backend` unless one is given), the actor with AdamW
    and its LR schedule (distributed by `shard` when given: the colocated HybridEngine's layout;
    with `learner.lora`, LoRA adapters on the frozen policy, only they in AdamW), the frozen
    reference when kl_coef > 0 (a LoRA actor's: itself with the adapter disabled), and the critic
    with its own AdamW when `loss.advantage: gae` (both in the backend's own layout).
    `push_buckets`: the broadcast weight push's bucket bytes, when the actor is pushed that way."""
    if cfg.lora is not None and shard is not None and cfg.backend != "fsdp2":
        raise ValueError(
            f"learner.lora: colocated mode trains adapters on learner.backend fsdp2 only, not {cfg.backend}"
        )
    backend = backend if backend is not None else registry.create(cfg.backend, cfg.megatron, cfg.seed)
    torch.manual_seed(cfg.seed)
    bf16 = cfg.dtype == "bfloat16"
    schedule = lr_lambda(cfg.schedule, cfg.max_steps * cfg.mini_batches)
    lora = {"lora": cfg.lora} if cfg.lora is not None else {}
    actor = backend.build("policy", cfg.model_path, name="actor", optim=cfg.optim, lr_lambda=schedule,
                          activation_checkpointing=cfg.activation_checkpointing, bf16=bf16, shard=shard,
                          push_buckets=push_buckets, **lora)  # fmt: skip
    ref = None
    if cfg.loss.kl_coef > 0 and cfg.lora is not None:  # the base: the actor with its adapter disabled
        ref = backend.adapter_disabled(actor)
    elif cfg.loss.kl_coef > 0:
        ref = backend.build("policy", cfg.model_path, name="ref", bf16=bf16)
    critic = build_critic(backend, cfg) if cfg.loss.advantage == "gae" else None
    config = actor.module.config
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    return Learner(cfg, Path(run_dir), backend, actor, ref, config.vocab_size, pad, critic)


WAIT_POLL_S = 1.0  # a wait for a batch is cut into polls this long, so a stop request is seen


def why_waiting(before: dict[str, Any], now: dict[str, Any], max_staleness: int) -> str:
    """Why no admissible batch came, from two snapshots of the queue's metrics."""
    arrived = now.get("groups_in", 0) - before.get("groups_in", 0)
    stale = now.get("dropped_stale", 0) - before.get("dropped_stale", 0)
    leases, leased = now.get("leases"), now.get("leased", 0)
    if leases == 0:
        return "no roller holds a lease: none has connected, or all are gone (start rollers on this queue)"
    if arrived and stale:
        return (f"{arrived} groups arrived and {stale} were dropped as stale (max_staleness={max_staleness}): "
                "rollers generate with old weights; check that weight sync reaches every server")  # fmt: skip
    if arrived:
        return f"{arrived} groups arrived, {now.get('depth', 0)} queued: not yet a full batch"
    who = f"{leases} roller(s) hold {leased} admitted groups" if leases is not None else "no group arrived"
    return f"nothing arrived: {who} (slow episodes, or servers unreachable?)"


def _next_batch(
    learner: Learner,
    consumer: Consumer | None,
    max_staleness: int,
    weight_sync: WeightSync | None,
    stop: threading.Event | None = None,
) -> tuple[list[Group], dict] | None:
    """The next batch (None when a stop was requested); while waiting for it, a server that came
    back behind the current version (restarted, or dropped and up again) gets the current weights
    at once, every rank joining that push as after a step (it does not wait for the next step)."""
    while True:
        waited = _wait_for_groups(learner, consumer, max_staleness, stop, weight_sync)
        if waited is None:
            return None
        groups, stats, late = waited
        if not late:
            return groups, stats
        log.info("servers %s are behind version %d: pushing the current weights now", late, learner.version)
        weight_sync.push(learner.weights(), learner.version)


def _wait_for_groups(
    learner: Learner,
    consumer: Consumer | None,
    max_staleness: int,
    stop: threading.Event | None = None,
    weight_sync: WeightSync | None = None,
) -> tuple[list[Group], dict, list[str]] | None:
    """Rank 0 blocks on the queue until groups arrive, or until weight sync names servers behind
    the current version; every rank returns the same (groups, stats, servers behind), or None
    when a stop was requested while waiting."""
    payload: Any = None
    behind = getattr(weight_sync, "behind", None)
    if learner.rank == 0:
        cfg, groups, stats, late = learner.cfg, [], {}, []
        waited, before = 0.0, None
        while not groups and not (stop is not None and stop.is_set()):
            if behind is not None and (late := behind(learner.version)):
                break
            poll = min(WAIT_POLL_S, cfg.batch_timeout_s) if stop is not None else cfg.batch_timeout_s
            try:
                batch = consumer.get_batch(cfg.groups_per_step, learner.version, max_staleness, poll)
            except TimeoutError:
                batch = None
            groups = list(getattr(batch, "groups", None) or [])
            if not groups:
                waited += poll
                if before is None:
                    before = consumer.metrics()
                if waited >= cfg.batch_timeout_s:
                    now = consumer.metrics()
                    log.info("waiting for an admissible batch at version %d: %s", learner.version,
                             why_waiting(before, now, max_staleness))  # fmt: skip
                    waited, before = 0.0, now
            else:
                stats = {
                    f"queue/{k}": v
                    for k, v in vars(batch).items()
                    if isinstance(v, (int, float)) and not isinstance(v, bool)
                }
                ages = getattr(batch, "ages_s", None)
                if ages:
                    stats["queue/age_s_mean"] = sum(ages) / len(ages)
                    stats["queue/age_s_max"] = max(ages)
        payload = (groups, stats, late) if groups or late else None
    return learner.backend.broadcast_object(payload)


def _record_groups(learner: Learner, groups: list[Group], applied: bool) -> None:
    """Append the step's group ids to `learner_groups.jsonl` (the account of what was trained)."""
    line = {"v": learner.version, "trained" if applied else "skipped": [g.group_id for g in groups]}
    learner.run_dir.mkdir(parents=True, exist_ok=True)
    with open(learner.run_dir / "learner_groups.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")


def run(
    learner: Learner,
    consumer: Consumer | None,
    max_staleness: int,
    weight_sync: WeightSync | None = None,
    metrics: MetricsLogger | None = None,
    resume_from_checkpoint: bool = False,
    stop: threading.Event | None = None,
    exporter: Any = None,
) -> int:
    """Train until `cfg.max_steps` versions exist or `stop` is set; returns the final version.
    `consumer` is needed on rank 0 only; `weight_sync.push` and `metrics.log` are called on every
    rank / rank 0 respectively, and so is `exporter.step` (the Prometheus endpoint's
    `observe.prometheus.LearnerExporter`), with the step's logged metrics."""
    cfg = learner.cfg
    if resume_from_checkpoint:
        bookkeeping.resume(learner, consumer)
    if learner.rank == 0 and consumer is not None:
        consumer.publish_version(learner.version)
    tally = RunTally(ConsoleProgress(cfg.max_steps, learner.version, enabled=learner.rank == 0))
    notes = StepNotes(learner.run_dir, cfg.model_path, cfg.logging) if learner.rank == 0 else None
    while learner.version < cfg.max_steps:
        # 1. wait for a batch admissible at the current version (or stop)
        t0 = time.perf_counter()
        waited = _next_batch(learner, consumer, max_staleness, weight_sync, stop)
        if waited is None:
            log.warning("stop requested at version %d: saving the final checkpoint", learner.version)
            break
        groups, queue_stats = waited
        t_wait = time.perf_counter() - t0
        learner.consumed_groups += len(groups)

        # 2. validate, skip bad groups with a counted reason, compute advantages
        batch = bookkeeping.prepare(learner, groups, tally)

        # 3-4. pack, recompute frozen log-probs (and the critic's values, GAE); forward/backward,
        #      clip, AdamW per mini-batch: the actor (not while the critic warms up), then the critic
        result = step.train(learner, batch)
        applied = result.applied
        if result.nonfinite:
            tally.count("nonfinite_step")
            log.error("step at version %d skipped: non-finite loss or gradient norm", learner.version)

        # 5. version += 1; publish; hand weights to weight sync
        pushed = bookkeeping.publish(
            learner, consumer, weight_sync, applied, tally, counts_as_skip=not result.used
        )

        # 6. ack the groups (after the step: a crash before it means redelivery); log metrics
        if learner.rank == 0:
            # a warm-up step's groups go back as skipped too: the actor never trains on them, and
            # the queue's admission counts groups_per_step groups per version
            _ack(learner, consumer, groups, applied)
            m = {**result.metrics(learner), **queue_stats, "time/wait_data_s": t_wait,
                 "groups_consumed": float(learner.consumed_groups)}  # fmt: skip
            m.update({f"skipped/{k}": float(v) for k, v in tally.skipped.items()})
            notes.step(learner.version, groups, m, metrics)  # flat-reward count; transcripts when due
            _report(learner, consumer, metrics, m, pushed, tally)
            if exporter is not None:
                exporter.step(learner.version, m)

        # 7. checkpoint and export every N steps
        bookkeeping.periodic_save(learner, consumer, applied, tally)

    tally.progress.close()
    if tally.saved != learner.version:  # the last step's checkpoint may already be written
        bookkeeping.save(learner, consumer)
    if tally.exported != learner.version and (stop is None or not stop.is_set()):
        bookkeeping.export(learner)
    return learner.version


def _ack(learner: Learner, consumer: Consumer | None, groups: list[Group], applied: bool) -> None:
    """Step 6 (rank 0): ack the groups and record their ids. A skipped step returns its groups'
    admission, or the rollers would wait for a version that only new groups can bring (a livelock
    when every step is skipped)."""
    if consumer is not None:
        consumer.ack([g.group_id for g in groups], dropped=None if applied else "skipped")
    _record_groups(learner, groups, applied)


def _report(
    learner: Learner, consumer: Consumer | None, metrics: MetricsLogger | None, m: dict[str, float],
    pushed: Any, tally: RunTally,
) -> None:  # fmt: skip
    """Step 6 (rank 0): the step's metrics (with weight sync's and the queue's), a log line and
    the progress bar."""
    if metrics is not None:
        if pushed is not None:
            m.update(pushed.as_metrics())
        if consumer is not None:
            m.update({f"queue/{k}": v for k, v in consumer.metrics().items() if isinstance(v, (int, float))})
        metrics.log(m, learner.version)
    if "loss" in m:
        reward = m.get("reward/mean", float("nan"))
        log.info("version %d  loss %.4g  reward %.3g  grad_norm %.3g  %.0f tok/s", learner.version, m["loss"],
                 reward, m["grad_norm"], m["tokens_per_s"])  # fmt: skip
        tally.progress.update(learner.version, f"reward {reward:.3f}  loss {m['loss']:.4g}")
    elif "critic/value_loss" in m:
        log.info("version %d  critic warm-up  value loss %.4g  explained variance %.3g", learner.version,
                 m["critic/value_loss"], m["critic/explained_variance"])  # fmt: skip
