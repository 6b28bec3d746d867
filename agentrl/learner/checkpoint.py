"""Resumable learner checkpoints: the directory layout, trainer state and the `latest` marker.

A checkpoint is a directory `<run_dir>/checkpoints/step_<version>/` holding:

    shards       every trained part's weights and optimizer state, written by the backend
                 (`LearnerBackend.save`; FSDP2: DCP, each rank its own shards, loading reshards)
    rank<r>.pt   per-rank trainer state: each part's LR schedule, version, RNG states (torch,
                 CUDA, numpy, python) and the queue cursor (groups consumed, consumer state)

`<run_dir>/checkpoints/latest` names the newest complete checkpoint; it is written last, by
rank 0, after a barrier, so an interrupted save is never picked up by `--resume`.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from agentrl.learner.backend import LearnerBackend, ModelPart
from agentrl.log import get_logger

log = get_logger("learner.checkpoint")


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(
    root: Path,
    backend: LearnerBackend,
    parts: list[ModelPart],
    version: int,
    cursor: dict[str, Any],
    keep: int = 2,
) -> Path:
    """Write checkpoint `step_<version>` of the trained `parts` under `root` (a collective)."""
    rank = backend.rank
    path = root / f"step_{version:08d}"
    backend.save(parts, path)
    schedulers = {p.name: p.scheduler.state_dict() for p in parts}
    trainer = {"schedulers": schedulers, "version": version, "rng": _rng_state(), "cursor": cursor}
    torch.save(trainer, path / f"rank{rank}.pt")
    _barrier()
    if rank == 0:
        tmp = root / "latest.tmp"
        tmp.write_text(path.name + "\n")
        tmp.replace(root / "latest")
        old = sorted(p for p in root.glob("step_*") if p.is_dir() and p != path)
        for stale in old[: max(0, len(old) - (keep - 1))]:
            shutil.rmtree(stale, ignore_errors=True)
        log.info("saved checkpoint %s", path)
    _barrier()
    return path


def latest_checkpoint(root: Path) -> Path | None:
    marker = root / "latest"
    if not marker.exists():
        return None
    path = root / marker.read_text().strip()
    return path if path.is_dir() else None


def load_checkpoint(
    path: Path, backend: LearnerBackend, parts: list[ModelPart]
) -> tuple[int, dict[str, Any]]:
    """Restore everything saved by `save_checkpoint`; returns (version, queue cursor)."""
    rank = backend.rank
    backend.load(parts, path)
    trainer_file = path / f"rank{rank}.pt"
    if not trainer_file.exists():  # resumed with more ranks than saved: share rank 0's trainer state
        trainer_file = path / "rank0.pt"
    trainer = torch.load(trainer_file, weights_only=False)
    for part in parts:
        part.scheduler.load_state_dict(trainer["schedulers"][part.name])
    _set_rng_state(trainer["rng"])
    log.info("resumed from %s at version %d", path, trainer["version"])
    return trainer["version"], trainer["cursor"]
