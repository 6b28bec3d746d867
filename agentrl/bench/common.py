"""Shared helpers of the benchmarks: one table, then one JSON line; stopping a child."""

from __future__ import annotations

import json
import subprocess
from typing import Any


def print_table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    """A readable table on stdout (rich), before the JSON line."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*[f"{v:.4g}" if isinstance(v, float) else str(v) for v in row])
    Console().print(table)


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
