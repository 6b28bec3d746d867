"""What every driver of the learner's step does around it (`learner/step.py`): the decoupled loop
(`loop.run`) and the colocated ranks (`colocated/loop.py`) both call these.

    tally = RunTally(ConsoleProgress(...))
    batch = prepare(learner, groups, tally)          # `step.prepare`, its skips counted
    result = step.train(learner, batch)
    publish(learner, consumer, weight_sync, result.applied, tally)   # version += 1, push, publish
    periodic_save(learner, consumer, result.applied, tally)           # checkpoint / HF export every N
    ...
    save(learner, consumer); export(learner)         # at the end; `resume` at the start

A consumer (the queue, or the colocated rank for its task cursors) may carry its own cursor in the
checkpoint: `state_dict()` is saved with the weights and `load_state_dict()` gets it back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.learner import checkpoint, step
from agentrl.learner.data import PreparedBatch, no_generation_why
from agentrl.learner.state import Learner
from agentrl.log import get_logger
from agentrl.queue.base import Consumer
from agentrl.types import Group
from agentrl.weight_sync.base import WeightSyncEngine as WeightSync

log = get_logger("learner")


@dataclass
class RunTally:
    """What a driver carries from step to step: skips, and the versions `periodic_save` wrote."""

    progress: ConsoleProgress
    skipped: dict[str, int] = field(default_factory=dict)
    skips_in_a_row: int = 0
    last_skip: str = ""  # why the last group without generated tokens had none
    saved: int = -1
    exported: int = -1

    def count(self, reason: str, n: int = 1) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + n


def prepare(learner: Learner, groups: list[Group], tally: RunTally) -> PreparedBatch:
    """`step.prepare` (the loop's step 2): validated samples with advantages, split into mini-batches; skips counted."""
    batch = step.prepare(learner, groups)
    empty = [g for g in groups if g.episodes and not any(ep.loss_mask[1:].any() for ep in g.episodes)]
    if empty:
        tally.last_skip = no_generation_why(empty[-1])
    for reason, n in batch.skipped.items():
        tally.count(reason, n)
    return batch


def publish(
    learner: Learner,
    consumer: Consumer | None,
    weight_sync: WeightSync | None,
    applied: bool,
    tally: RunTally,
    counts_as_skip: bool = True,
) -> Any:
    """The loop's step 5: a new version after an applied step (published, pushed to the servers); a skipped
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


def periodic_save(learner: Learner, consumer: Consumer | None, applied: bool, tally: RunTally) -> None:
    """The loop's step 7: a checkpoint every `checkpoint.every` versions, an HF export every `export_every`."""
    every, export_every = learner.cfg.checkpoint.every, learner.cfg.checkpoint.export_every
    if applied and every and learner.version % every == 0:
        save(learner, consumer)
        tally.saved = learner.version
    if applied and export_every and learner.version % export_every == 0:
        export(learner)
        tally.exported = learner.version


def save(learner: Learner, consumer: Consumer | None) -> None:
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
    import torch

    from agentrl.learner import lora
    from agentrl.learner.fsdp import copy_tokenizer

    cfg, step_dir = learner.cfg, f"step_{learner.version:08d}"
    tensors = dict(learner.backend.adapter_tensors(learner.actor))  # a collective: every rank gathers
    out = [learner.run_dir / "adapter" / step_dir]
    if learner.rank == 0:
        lora.write_adapter(out[0], tensors, cfg.lora, cfg.model_path)
    if cfg.lora.export_merged:
        merged = learner.run_dir / "hf" / step_dir
        state = dict(learner.backend.merged_tensors(learner.actor))
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
