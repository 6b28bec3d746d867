"""How `agentrl scale` and `agentrl status` reach a running `agentrl run` (local or Ray): files in
its run directory, so they work from any shell that sees the run directory.

- The launcher rewrites `<run_dir>/launcher_state.json` about once a second: its own PID and
  kind, and per process its role, node, PID, state and restarts. When the run ends, after its
  processes were stopped, it writes it once more with `ended: true` and each process's final
  state (`mark_ended`): no process of an ended run is listed as running.
- `agentrl scale` writes `<run_dir>/launcher_scale.json` (`{"rollers": N, "servers": M}`); the
  launcher reads it on its next round, starts or stops rollers, and starts or stops servers
  (new slots on new ports, handed on through the live server list, `launch/servers.py`),
  without touching the learner, then records what it did
  under `scale` in its state.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

STATE = "launcher_state.json"
QUEUE_COUNTS = ("depth", "inflight", "groups_in", "trained", "dropped_stale", "admitted", "leased", "leases",
                "admission_reclaimed")  # fmt: skip
"""The queue's counts `agentrl status` shows (from the learner's last `queue/*` metrics)."""
SCALE = "launcher_scale.json"


def write_state(run_dir: Path, launcher: str, processes: list[dict[str, Any]], **extra: Any) -> None:
    state = {"launcher": launcher, "pid": os.getpid(), "time": time.time(), "processes": processes, **extra}
    tmp = run_dir / f".{STATE}.tmp"
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(run_dir / STATE)


def exit_state(code: int | None) -> str:
    """A process's state from its exit code: running, `exited N`, or `stopped by SIGNAL`."""
    import signal

    if code is None:
        return "running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"stopped by {signal.Signals(-code).name}"
    return f"exited {code}"


def mark_ended(run_dir: Path, final: dict[str, str]) -> None:
    """After the launcher stopped the run's processes: the last state written, with each named
    process's final state from `final` (name -> state), every other one not already ended marked
    `stopped`, and `ended: true`."""
    try:
        state = read_state(run_dir)
    except (FileNotFoundError, ValueError):
        return  # the run ended before its first state was written
    for p in state["processes"]:
        if p["name"] in final:
            p["state"] = final[p["name"]]
        elif not p.get("state", "").startswith(("exited", "stopped", "scaled down")):
            p["state"] = "stopped"
    extra = {k: v for k, v in state.items() if k not in ("launcher", "pid", "time", "processes")}
    write_state(run_dir, state["launcher"], state["processes"], **{**extra, "ended": True})


def read_state(run_dir: Path) -> dict[str, Any]:
    path = run_dir / STATE
    if not path.exists():
        raise FileNotFoundError(
            f"{path}: no launcher state (is `agentrl run` running with run_dir {run_dir}?)"
        )
    return json.loads(path.read_text())


def launcher_alive(state: dict[str, Any], fresh_s: float = 10.0) -> bool:
    """Whether the launcher still runs: it rewrote its state in the last `fresh_s` seconds (its
    PID alone is no proof from another PID namespace or node) and has not marked the run ended."""
    return not state.get("ended") and time.time() - float(state.get("time", 0)) < fresh_s


def request_scale(run_dir: Path, rollers: int | None, servers: int | None) -> dict[str, Any]:
    """Ask the running launcher of `run_dir` for `rollers` rollers and `servers` servers."""
    if rollers is None and servers is None:
        raise ValueError("give --rollers N and/or --servers M")
    for name, n in (("--rollers", rollers), ("--servers", servers)):
        if n is not None and n < 0:
            raise ValueError(f"{name}: must be >= 0, not {n}")
    if servers == 0:
        raise ValueError("--servers: a run keeps at least one server (the rollers would have none)")
    state = read_state(run_dir)
    if not launcher_alive(state):
        raise RuntimeError(f"the launcher of {run_dir} (pid {state.get('pid')}) is not running")
    request = {k: v for k, v in (("rollers", rollers), ("servers", servers)) if v is not None}
    request["id"] = time.time_ns()
    tmp = run_dir / f".{SCALE}.tmp"
    tmp.write_text(json.dumps(request))
    tmp.replace(run_dir / SCALE)
    return request


class ScaleWatch:
    """The launcher's side: `poll()` returns a new scale request once, else None."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / SCALE
        self.path.unlink(missing_ok=True)  # a request left by an earlier life of the run is not ours
        self.last_id: int | None = None

    def poll(self) -> dict[str, Any] | None:
        try:
            request = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        if request.get("id") == self.last_id:
            return None
        self.last_id = request.get("id")
        return request


def roller_slots(running: list[int], want: int) -> tuple[list[int], list[int]]:
    """`agentrl scale --rollers want` over the rollers running with indices `running` (ascending):
    the indices to stop (the highest first) and the new ones to start (after the highest)."""
    stop = running[want:][::-1]
    after = running[-1] + 1 if running else 0
    return stop, list(range(after, after + want - len(running)))


def status_table(run_dir: Path):
    """Each process (role, node, PID, state, restarts), the learner's version, the queue's counts."""
    from rich.table import Table

    from agentrl.log import last_metrics

    state = read_state(run_dir)
    alive = launcher_alive(state)
    learner = last_metrics(run_dir / "learner.jsonl")
    title = (
        f"agentrl status — {run_dir} ({state['launcher']} launcher, pid {state['pid']}, "
        f"{'running' if alive else 'not running'})"
    )
    table = Table(title=title)
    for col in ("process", "kind", "node", "pid", "state", "restarts"):
        table.add_column(col)
    for p in state["processes"]:
        state_ = p.get("state", "?") if alive else f"{p.get('state', '?')} (at last record)"
        row = (
            p["name"],
            p["kind"],
            p.get("node", "-"),
            str(p.get("pid") or "-"),
            state_,
            str(p.get("restarts", 0)),
        )
        table.add_row(*row)
    queue = {k: learner[f"queue/{k}"] for k in QUEUE_COUNTS if f"queue/{k}" in learner}
    summary = [f"learner version {learner.get('step', 0)}"]
    summary += [f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in queue.items()]
    table.caption = " · ".join(summary)
    return table
