"""Resumable learner checkpoints with `torch.distributed.checkpoint` (DCP).

A checkpoint is a directory `<run_dir>/checkpoints/step_<version>/` holding:

    DCP shards   model and optimizer state, each rank writing its own shards
                 (`get_state_dict` gives FSDP2's sharded DTensors; loading reshards)
    rank<r>.pt   per-rank trainer state: scheduler, version, RNG states (torch, CUDA, numpy,
                 python) and the queue cursor (groups consumed, consumer state if it has one)

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
import torch.distributed.checkpoint as dcp
from torch import nn

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
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    version: int,
    cursor: dict[str, Any],
    keep: int = 2,
) -> Path:
    """Write checkpoint `step_<version>` under `root` (a collective: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rank = dist.get_rank() if dist.is_initialized() else 0
    path = root / f"step_{version:08d}"
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
    trainer = {"scheduler": scheduler.state_dict(), "version": version, "rng": _rng_state(), "cursor": cursor}
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
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> tuple[int, dict[str, Any]]:
    """Restore everything saved by `save_checkpoint`; returns (version, queue cursor)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    rank = dist.get_rank() if dist.is_initialized() else 0
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    trainer_file = path / f"rank{rank}.pt"
    if not trainer_file.exists():  # resumed with more ranks than saved: share rank 0's trainer state
        trainer_file = path / "rank0.pt"
    trainer = torch.load(trainer_file, weights_only=False)
    scheduler.load_state_dict(trainer["scheduler"])
    _set_rng_state(trainer["rng"])
    log.info("resumed from %s at version %d", path, trainer["version"])
    return trainer["version"], trainer["cursor"]
