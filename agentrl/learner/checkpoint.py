"""Resumable learner checkpoints: written whole or not at all, verified before they are resumed.

A checkpoint is a directory `<run_dir>/checkpoints/step_<version>/` holding:

    shards         every trained part's weights and optimizer state, written by the backend
                   (`LearnerBackend.save`; FSDP2: DCP, each rank its own shards, loading reshards)
    rank<r>.pt     per-rank trainer state: each part's LR schedule, version, RNG states (torch,
                   CUDA, numpy, python) and the queue cursor (groups consumed, consumer state)
    manifest.json  every file's size and SHA-256, written last

Saving (a collective): the weights and optimizer state are first checked to be finite (never
saved otherwise); every rank writes into `partial-step_<version>/`; every rank learns whether
every rank's writes succeeded (the first error, e.g. ENOSPC, is raised on all of them and the
partial directory removed); the ranks hash a share of the files each, rank 0 writes the manifest,
renames the directory to `step_<version>` and only then points `<run_dir>/checkpoints/latest` at
it. A save that dies half-way leaves a `partial-*` directory, which is never resumed and is
removed by the next save or resume.

Resuming (`resume_point`): the newest `step_*` whose files all match its manifest (each rank
checks a share). A newer one that does not match (truncated, bit-flipped, a file missing) is
named in the log with what is wrong and moved aside to `corrupt-step_<version>` for inspection,
and the newest intact one is resumed instead; when none is intact the learner refuses to start,
naming each checkpoint and what to delete.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
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

MANIFEST = "manifest.json"
PARTIAL = "partial-"
CORRUPT = "corrupt-"
FULL_BYTES = 1 << 20  # a write failed with less than this free: the disk is full


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or no intact one can be resumed; the message says which
    checkpoint, what is wrong and what to do."""


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


def _gather(obj: Any) -> list[Any]:
    """Every rank's `obj`, on every rank (a collective; also the barrier between phases)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _rank_world() -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _files(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _cause(exc: BaseException) -> BaseException:
    """The error underneath DCP's per-rank wrapper (`CheckpointException.failures`)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        inner = first[0] if isinstance(first, tuple) else first
        if isinstance(inner, BaseException):
            return _cause(inner)
    return exc


def _describe(exc: BaseException) -> str:
    cause = _cause(exc)
    return f"{type(cause).__name__}: {cause}"


def _write_failure(exc: BaseException, directory: Path) -> str:
    """What went wrong writing into `directory`. torch's zip writer reports a full disk as
    "unexpected pos": the free space, measured now, says whether that is what happened."""
    text = _describe(exc)
    if isinstance(_cause(exc), OSError) and _cause(exc).errno == errno.ENOSPC:
        return text
    try:
        free = shutil.disk_usage(directory if directory.exists() else directory.parent).free
    except OSError:
        return text
    if free < FULL_BYTES:
        return f"No space left on device: {free} bytes free on the file system of {directory} ({text})"
    return text


def _remove_partials(root: Path) -> None:
    for partial in sorted(root.glob(f"{PARTIAL}step_*")):
        shutil.rmtree(partial, ignore_errors=True)
        log.warning("removed %s: a checkpoint save that did not complete", partial)


def _latest_name(root: Path) -> str | None:
    marker = root / "latest"
    return marker.read_text().strip() if marker.exists() else None


def save_checkpoint(
    root: Path,
    backend: LearnerBackend,
    parts: list[ModelPart],
    version: int,
    cursor: dict[str, Any],
    keep: int = 2,
) -> Path:
    """Write checkpoint `step_<version>` of the trained `parts` under `root` (a collective; see
    the module docstring). Raises `CheckpointError` naming the first failure; `latest` then still
    names the previous checkpoint."""
    rank, world = _rank_world()
    final = root / f"step_{version:08d}"
    previous = _latest_name(root) or "no checkpoint yet"
    for part in parts:
        bad = backend.first_nonfinite(part)
        if bad is not None:
            raise CheckpointError(
                f"not saving checkpoint {final}: {bad} of the {part.name} is not finite; `latest` still "
                f"names {previous}"
            )
    tmp = root / f"{PARTIAL}{final.name}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        _remove_partials(root)
    _gather(None)
    error: BaseException | None = None
    try:
        backend.save(parts, tmp)
        schedulers = {p.name: p.scheduler.state_dict() for p in parts}
        trainer = {"schedulers": schedulers, "version": version, "rng": _rng_state(), "cursor": cursor}
        with open(tmp / f"rank{rank}.pt", "wb") as f:
            torch.save(trainer, f)
            f.flush()
            os.fsync(f.fileno())
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # every rank must hear of it, or the others wait in the next collective
        error = exc  # (DCP's CheckpointException is a BaseException)
    _raise_first(_gather(None if error is None else _write_failure(error, tmp)), error, final, tmp, previous)

    names = _files(tmp)  # every rank's writes are complete (the gather above was the barrier)
    mine = {name: [(tmp / name).stat().st_size, _sha256(tmp / name)] for name in names[rank::world]}
    files = {name: entry for share in _gather(mine) for name, entry in share.items()}
    error = None
    if rank == 0:
        try:
            _publish(root, tmp, final, {"version": version, "files": files}, keep)
        except Exception as exc:
            error = exc
    _raise_first(_gather(None if error is None else _write_failure(error, tmp)), error, final, tmp, previous)
    return final


def _raise_first(
    errors: list[str | None], error: BaseException | None, final: Path, tmp: Path, previous: str
) -> None:
    """Raise on every rank if any rank failed (rank 0 removes the partial directory first)."""
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if not failed:
        return
    cleanup = "rank 0 removes the partial directory"
    if _rank_world()[0] == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        cleanup = (
            f"could not remove {tmp}: delete it" if tmp.exists() else "the partial directory was removed"
        )
    r, first = failed[0]
    raise CheckpointError(
        f"checkpoint {final.name} could not be written under {final.parent} (rank {r}: {first}); {cleanup}, "
        f"and `latest` still names {previous}"
    ) from error


def _publish(root: Path, tmp: Path, final: Path, manifest: dict[str, Any], keep: int) -> None:
    """Rank 0: the manifest, the rename to `final`, `latest`, and the pruning of old checkpoints."""
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    if final.exists():  # a resume from an older checkpoint reached this version again
        log.warning("replacing %s with the checkpoint just written at the same version", final)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    marker = root / "latest.tmp"
    marker.write_text(final.name + "\n")
    marker.replace(root / "latest")
    _fsync_dir(root)
    old = sorted(p for p in root.glob("step_*") if p.is_dir() and p != final)
    for stale in old[: max(0, len(old) - (keep - 1))]:
        shutil.rmtree(stale, ignore_errors=True)
    log.info("saved checkpoint %s (%d files, checksums in %s)", final, len(manifest["files"]), MANIFEST)


def verify(path: Path) -> list[str]:
    """What is wrong with checkpoint `path` (empty: every file matches its manifest). A collective:
    each rank checks a share of the files; every rank gets the whole answer."""
    rank, world = _rank_world()
    problems: list[str] = []
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        files, problems = {}, [f"no {MANIFEST}"] if rank == 0 else []
    except (ValueError, KeyError, TypeError) as exc:
        files, problems = {}, [f"{MANIFEST} unreadable ({exc})"] if rank == 0 else []
    for name in sorted(files)[rank::world]:
        size, digest = files[name]
        file = path / name
        if not file.is_file():
            problems.append(f"{name} missing")
        elif file.stat().st_size != size:
            problems.append(f"{name} is {file.stat().st_size} bytes, the manifest says {size} (truncated?)")
        elif _sha256(file) != digest:
            problems.append(f"{name} does not match its SHA-256 (corrupted)")
    return [p for share in _gather(problems) for p in share]


def resume_point(root: Path) -> Path | None:
    """The newest intact checkpoint under `root` (None: there is none, a fresh start). A collective.
    Corrupt or incomplete newer ones are named and moved aside; none intact raises
    `CheckpointError` naming each and what to delete."""
    rank, _ = _rank_world()
    if rank == 0 and root.is_dir():
        _remove_partials(root)
    steps = sorted((p for p in root.glob("step_*") if p.is_dir()), reverse=True)
    if not steps:
        return None
    latest = _latest_name(root)
    rejected: list[tuple[Path, list[str]]] = []
    chosen = None
    for path in steps:
        problems = verify(path)
        if not problems:
            chosen = path
            break
        if problems == [f"no {MANIFEST}"] and path.name == latest and (path / ".metadata").exists():
            if rank == 0:
                log.warning(
                    "%s was written before checkpoints carried checksums: resuming it unverified", path
                )
            chosen = path
            break
        if rank == 0:
            log.error("checkpoint %s is corrupt or incomplete: %s", path, "; ".join(problems[:8]))
        rejected.append((path, problems))
    if chosen is None:
        listing = "; ".join(f"{p.name}: {pr[0]}" for p, pr in rejected)
        raise CheckpointError(
            f"--resume: no intact checkpoint under {root} ({listing}). Restore an intact copy, or delete "
            f"{', '.join(str(p) for p, _ in rejected)} to start afresh"
        )
    if rejected:
        if rank == 0:
            for path, _ in rejected:
                aside = path.with_name(CORRUPT + path.name)
                shutil.rmtree(aside, ignore_errors=True)
                try:  # (the other ranks wait in the gather below: nothing may raise here)
                    path.rename(aside)
                    log.warning(
                        "moved the corrupt checkpoint %s to %s (delete it once inspected)", path, aside
                    )
                except OSError as exc:
                    log.error("could not move the corrupt checkpoint %s aside (%s): delete it", path, exc)
            log.warning("--resume: falling back to %s, the newest intact checkpoint", chosen)
        _gather(None)
    return chosen


def load_checkpoint(
    path: Path, backend: LearnerBackend, parts: list[ModelPart]
) -> tuple[int, dict[str, Any]]:
    """Restore everything saved by `save_checkpoint`; returns (version, queue cursor)."""
    rank = backend.rank
    try:
        backend.load(parts, path)
        trainer_file = path / f"rank{rank}.pt"
        if not trainer_file.exists():  # resumed with more ranks than saved: share rank 0's trainer state
            trainer_file = path / "rank0.pt"
        trainer = torch.load(trainer_file, weights_only=False)
        for part in parts:
            part.scheduler.load_state_dict(trainer["schedulers"][part.name])
    except Exception as exc:
        raise CheckpointError(
            f"--resume: {path} matches its checksums but does not load into this learner ({_describe(exc)}): "
            "was it written with another model or learner config?"
        ) from exc
    _set_rng_state(trainer["rng"])
    log.info("resumed from %s at version %d", path, trainer["version"])
    return trainer["version"], trainer["cursor"]
