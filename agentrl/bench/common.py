"""Shared helpers of the benchmarks: one table, then one JSON line; stopping a child."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any


def print_table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    """A readable table on stdout (rich), before the JSON line; 200 columns wide where stdout is
    not a terminal (a log or a pipe, where rich would fall back to 80 and cut every cell short)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*[f"{v:.4g}" if isinstance(v, float) else str(v) for v in row])
    Console(width=None if sys.stdout.isatty() else 200).print(table)


def emit(bench: str, metrics: dict[str, Any], ratios: dict[str, float]) -> None:
    """The last line of every benchmark: `{"bench", "metrics", "ratios"}`."""
    print(json.dumps({"bench": bench, "metrics": metrics, "ratios": ratios}), flush=True)


def stop_child(proc: subprocess.Popen, timeout_s: float) -> tuple[Any, Any]:
    """SIGTERM a child and give it `timeout_s` to stop (and stop its own children), then SIGKILL.
    Its pipes are drained meanwhile, so a chatty child cannot block on a full one; returns
    what was left in them."""
    proc.terminate()
    try:
        return proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()


def steady_rate(records: list[dict[str, Any]], warmup_steps: int, samples_per_step: int) -> dict[str, Any]:
    """Samples/s of a run's steady state: from the end of its step `warmup_steps` to the end of its
    last step, given its per-step records in order (each with `time`, wall seconds at the end of
    that step, and `step`). Every run a bench compares goes through this with the same
    `warmup_steps`, so none carries work done before its window into it (an asynchronous run's
    rollers start groups before the learner's first step; a synchronous run's do not).

    Returns the raw figures beside the rate: `samples` and `seconds` (numerator and denominator),
    and the steps that bound the window."""
    if warmup_steps < 1:
        raise ValueError("warmup_steps must be at least 1: the window starts at the end of a step")
    if len(records) < warmup_steps + 1:
        raise ValueError(
            f"{len(records)} step records cannot give a window after {warmup_steps} warm-up steps: "
            "the run needs at least warmup_steps + 1 steps"
        )
    start, end = records[warmup_steps - 1], records[-1]
    samples = samples_per_step * (len(records) - warmup_steps)
    seconds = end["time"] - start["time"]
    return {
        "samples": samples,
        "seconds": seconds,
        "samples_per_s": samples / seconds if seconds > 0 else 0.0,
        "from_step": start["step"],
        "to_step": end["step"],
    }


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field} (a Linux kernel is needed)")


class PeakResident:
    """This process's resident-set growth over a block, from the kernel's own high-water mark
    (`VmHWM`, reset on entry by writing 5 to /proc/self/clear_refs): every page the process
    touched counts, whoever allocated it (Python tensors, gloo's internal buffers, the C heap).
    `extra` = peak during the block - resident at its start. Pair with `fix_mmap_threshold()`,
    or glibc may serve the block's allocations from memory an earlier block freed and hide them."""

    def __enter__(self) -> PeakResident:
        import gc

        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.base = _status_bytes("VmRSS")
        return self

    def __exit__(self, *exc: object) -> None:
        self.peak = _status_bytes("VmHWM")

    @property
    def extra(self) -> int:
        return self.peak - self.base


def fix_mmap_threshold(nbytes: int = 64 * 1024) -> bool:
    """Map every allocation of `nbytes` or more afresh (glibc `mallopt(M_MMAP_THRESHOLD)`, which also
    turns off the dynamic threshold), so a freed buffer's pages leave the resident set and a later
    allocation shows in it; False where the C library has no `mallopt`. Allocations that are mapped
    afresh each time also fault their pages in each time: time nothing under the 64 KiB default
    that a like-for-like baseline does not pay as well (`REUSE_THRESHOLD` gives the heap back)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(-3, nbytes))  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


REUSE_THRESHOLD = 32 << 20
"""glibc's largest dynamic mmap threshold on 64-bit (`DEFAULT_MMAP_THRESHOLD_MAX`): where a process
that freed buffers of up to this size settles, serving them again from its heap."""


def trim_heap() -> bool:
    """Give the heap's free pages back to the kernel (glibc `malloc_trim(0)`), so memory reused from
    it afterwards faults in again and shows in the resident set; False where there is none."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False
