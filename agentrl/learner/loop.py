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

import functools
import json
import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from agentrl.config import LearnerConfig, ScheduleConfig
from agentrl.learner import checkpoint, registry, step
from agentrl.learner.backend import LearnerBackend, ModelPart
from agentrl.learner.critic import build_critic
from agentrl.learner.data import no_generation_why
from agentrl.learner.transcripts import StepNotes
from agentrl.log import MetricsLogger, get_logger
from agentrl.queue.base import Consumer
from agentrl.types import Group
from agentrl.weight_sync.base import WeightSyncEngine as WeightSync

log = get_logger("learner")


@dataclass
class Learner:
    """The loop's state: the backend, the model parts it runs, and where the run stands."""

    cfg: LearnerConfig
    run_dir: Path
    backend: LearnerBackend
    actor: ModelPart
    ref: ModelPart | None
    vocab_size: int
    pad_id: int
    critic: ModelPart | None = None
    version: int = 0
    consumed_groups: int = 0

    @property
    def trained_parts(self) -> list[ModelPart]:
        """What a checkpoint holds."""
        return [self.actor] + ([self.critic] if self.critic is not None else [])

    @property
    def critic_warming_up(self) -> bool:
        """Within `critic.warmup_steps`: only the critic trains (counted in its applied steps)."""
        if self.critic is None:
            return False
        return self.critic.scheduler.last_epoch < self.cfg.critic.warmup_steps * self.cfg.mini_batches

    @property
    def model(self) -> nn.Module:
        return self.actor.module

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.actor.optimizer

    @property
    def pack_rows(self) -> int | None:
        """The `row_tokens` this learner packs with (`learner.pack_row_tokens` for its model)."""
        return row_tokens(self.cfg.pack_row_tokens, self.model)

    @property
    def rank(self) -> int:
        return self.backend.rank

    @property
    def world_size(self) -> int:
        return self.backend.world_size

    @property
    def device(self) -> torch.device:
        return self.backend.device

    def weights(self) -> Callable[[], Iterable[tuple[str, torch.Tensor]]]:
        """What weight sync pushes: the actor's full tensors under HF names (a collective); for a
        LoRA actor, its adapter (`AdapterWeights`: the engine's `lora_mode` picks the adapter's
        tensors or base + adapter merged)."""
        if self.cfg.lora is None:
            return functools.partial(self.backend.full_tensors, self.actor)
        from agentrl.learner import lora
        from agentrl.weight_sync.base import AdapterSpec, AdapterWeights

        spec = AdapterSpec(self.cfg.lora.rank, self.cfg.lora.alpha, tuple(self.cfg.lora.target_modules),
                           self.cfg.model_path, bool(self.cfg.lora.modules_to_save))  # fmt: skip
        module = self.actor.module
        return AdapterWeights(
            adapter=lambda: lora.lora_only(lora.adapter_tensors(module)),
            merged=functools.partial(lora.merged_tensors, module),
            spec=spec,
        )


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
) -> Learner:
    """The backend (process group; `learner.backend` unless one is given), the actor with AdamW
    and its LR schedule (distributed by `shard` when given: the colocated HybridEngine's layout;
    with `learner.lora`, PEFT adapters on the frozen policy, only they in AdamW), the frozen
    reference when kl_coef > 0 (a LoRA actor's: itself with the adapter disabled), and the critic with its own AdamW when
    `loss.advantage: gae` (both in the backend's own layout)."""
    if cfg.lora is not None and (cfg.backend != "fsdp2" or shard is not None):
        where = "colocated mode" if shard is not None else f"learner.backend {cfg.backend}"
        raise ValueError(
            f"learner.lora: {where} does not train adapters yet; use learner.backend: fsdp2, decoupled"
        )
    backend = backend if backend is not None else registry.create(cfg.backend, cfg.megatron, cfg.seed)
    torch.manual_seed(cfg.seed)
    bf16 = cfg.dtype == "bfloat16"
    schedule = lr_lambda(cfg.schedule, cfg.max_steps * cfg.mini_batches)
    lora = {"lora": cfg.lora} if cfg.lora is not None else {}
    actor = backend.build("policy", cfg.model_path, name="actor", optim=cfg.optim, lr_lambda=schedule,
                          activation_checkpointing=cfg.activation_checkpointing, bf16=bf16, shard=shard, **lora)  # fmt: skip
    ref = None
    if cfg.loss.kl_coef > 0 and cfg.lora is not None:  # the base: the actor with its adapter disabled
        from agentrl.learner.lora import AdapterDisabled

        ref = ModelPart("ref", "policy", AdapterDisabled(actor.module))
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


def _save(learner: Learner, consumer: Consumer | None) -> None:
    cursor: dict[str, Any] = {"consumed_groups": learner.consumed_groups}
    if consumer is not None and hasattr(consumer, "state_dict"):
        cursor["consumer"] = consumer.state_dict()
    checkpoint.save_checkpoint(learner.run_dir / "checkpoints", learner.backend, learner.trained_parts,
                               learner.version, cursor, learner.cfg.checkpoint.keep)  # fmt: skip


def export(learner: Learner) -> Path:
    """The actor as an HF checkpoint under `<run_dir>/hf/` (and, with `critic.export`, the critic
    under `<run_dir>/hf_critic/`), each with a `latest` link. A LoRA actor is exported as a PEFT
    adapter under `<run_dir>/adapter/` (and, with `lora.export_merged`, merged under `hf/`)."""
    parts = [] if learner.cfg.lora is not None else [(learner.actor, "hf")]
    if learner.critic is not None and learner.cfg.critic.export:
        parts.append((learner.critic, "hf_critic"))
    written = []
    for part, folder in parts:
        out = learner.run_dir / folder / f"step_{learner.version:08d}"
        learner.backend.export(part, out, learner.cfg.model_path)
        written.append(out)
    if learner.cfg.lora is not None:
        written += _export_lora(learner)
    if learner.rank == 0:
        for out in written:
            latest = out.parent / "latest"
            latest.unlink(missing_ok=True)
            latest.symlink_to(out.name)
            log.info("exported %s", out)
    return written[0]


def _export_lora(learner: Learner) -> list[Path]:
    """The LoRA actor's PEFT adapter directory (and the merged HF checkpoint), rank 0 writing."""
    from agentrl.learner import lora
    from agentrl.learner.fsdp import copy_tokenizer

    cfg, step_dir = learner.cfg, f"step_{learner.version:08d}"
    tensors = dict(lora.adapter_tensors(learner.model))  # a collective: every rank gathers
    out = [learner.run_dir / "adapter" / step_dir]
    if learner.rank == 0:
        lora.write_adapter(out[0], tensors, cfg.lora, cfg.model_path)
    if cfg.lora.export_merged:
        merged = learner.run_dir / "hf" / step_dir
        state = dict(lora.merged_tensors(learner.model))
        if learner.rank == 0:
            lora.write_merged(merged, state, learner.model)
            copy_tokenizer(Path(cfg.model_path), merged)
        out.append(merged)
    if learner.world_size > 1:
        torch.distributed.barrier()
    return out


def resume(learner: Learner, consumer: Consumer | None) -> bool:
    """Load the newest intact checkpoint if one exists (a corrupt newer one is named and set
    aside; see `checkpoint.resume_point`); the consumer gets its saved cursor back."""
    path = checkpoint.resume_point(learner.run_dir / "checkpoints")
    if path is None:
        log.info("--resume: no checkpoint under %s; starting fresh", learner.run_dir / "checkpoints")
        return False
    learner.version, cursor = checkpoint.load_checkpoint(path, learner.backend, learner.trained_parts)
    learner.consumed_groups = cursor.get("consumed_groups", 0)
    if consumer is not None and "consumer" in cursor and hasattr(consumer, "load_state_dict"):
        consumer.load_state_dict(cursor["consumer"])
    return True


@dataclass
class RunTally:
    """What `run` carries from step to step: skips, and the versions step 7 wrote."""

    progress: ConsoleProgress
    skipped: dict[str, int] = field(default_factory=dict)
    skips_in_a_row: int = 0
    last_skip: str = ""  # why the last group without generated tokens had none
    saved: int = -1
    exported: int = -1

    def count(self, reason: str, n: int = 1) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + n


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
        resume(learner, consumer)
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
        batch = _prepare(learner, groups, tally)

        # 3-4. pack, recompute frozen log-probs (and the critic's values, GAE); forward/backward,
        #      clip, AdamW per mini-batch: the actor (not while the critic warms up), then the critic
        result = step.train(learner, batch)
        applied = result.applied
        if result.nonfinite:
            tally.count("nonfinite_step")
            log.error("step at version %d skipped: non-finite loss or gradient norm", learner.version)

        # 5. version += 1; publish; hand weights to weight sync
        pushed = _publish(learner, consumer, weight_sync, applied, tally, counts_as_skip=not result.used)

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
        _periodic_save(learner, consumer, applied, tally)

    tally.progress.close()
    if tally.saved != learner.version:  # the last step's checkpoint may already be written
        _save(learner, consumer)
    if tally.exported != learner.version and (stop is None or not stop.is_set()):
        export(learner)
    return learner.version


def _prepare(learner: Learner, groups: list[Group], tally: RunTally):
    """Step 2: validated samples with advantages, split into mini-batches; skips counted."""
    batch = step.prepare(learner, groups)
    empty = [g for g in groups if g.episodes and not any(ep.loss_mask[1:].any() for ep in g.episodes)]
    if empty:
        tally.last_skip = no_generation_why(empty[-1])
    for reason, n in batch.skipped.items():
        tally.count(reason, n)
    return batch


def row_tokens(setting: int | None, model: Any) -> int | None:
    """`learner.pack_row_tokens` for `model`: None (one row per micro-batch) or the row width
    (0: rows as wide as the longest sequence, unless the attention is flash attention's varlen)."""
    if setting is None:
        return None
    if setting == 0:
        attn = str(getattr(getattr(model, "config", None), "_attn_implementation", None) or "")
        return None if attn.startswith("flash") else 1  # 1: every row as wide as the longest sequence
    return setting


def _publish(
    learner: Learner,
    consumer: Consumer | None,
    weight_sync: WeightSync | None,
    applied: bool,
    tally: RunTally,
    counts_as_skip: bool = True,
) -> Any:
    """Step 5: a new version after an applied step (published, pushed to the servers); a skipped
    step counts towards `max_consecutive_skips` (a critic warm-up step does not). Returns weight
    sync's push report, if any."""
    if not applied:
        if not counts_as_skip:
            return None
        tally.skips_in_a_row += 1
        limit = learner.cfg.max_consecutive_skips
        if limit and tally.skips_in_a_row >= limit:
            last = f"; the last: {tally.last_skip}" if tally.last_skip else ""
            raise RuntimeError(f"{tally.skips_in_a_row} consecutive learner steps skipped ({tally.skipped}){last}; "
                               "see the log for the reasons, or raise learner.max_consecutive_skips")  # fmt: skip
        return None
    learner.version += 1
    tally.skips_in_a_row = 0
    pushed = weight_sync.push(learner.weights(), learner.version) if weight_sync is not None else None
    if learner.rank == 0 and consumer is not None:
        consumer.publish_version(learner.version)
    return pushed


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


def _periodic_save(learner: Learner, consumer: Consumer | None, applied: bool, tally: RunTally) -> None:
    """Step 7: a checkpoint every `checkpoint.every` versions, an HF export every `export_every`."""
    every, export_every = learner.cfg.checkpoint.every, learner.cfg.checkpoint.export_every
    if applied and every and learner.version % every == 0:
        _save(learner, consumer)
        tally.saved = learner.version
    if applied and export_every and learner.version % export_every == 0:
        export(learner)
        tally.exported = learner.version


class ConsoleProgress:
    """A progress bar of learner versions on an interactive console (rank 0); nothing elsewhere,
    where the per-step log line and the metrics files say the same."""

    def __init__(self, total: int, start: int, enabled: bool) -> None:
        import sys

        self._bar = None
        if enabled and sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(TextColumn("learner"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[info]}"), TimeRemainingColumn())  # fmt: skip
            self._bar.start()
            self._task = self._bar.add_task("train", total=total, completed=start, info="")

    def update(self, version: int, info: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=version, info=info)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
