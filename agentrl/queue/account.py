"""The per-group account of a finished (or resumed and finished) run, from the files it left.

    acct = account(run_dir)          # after the learner exited
    assert (acct.lost, acct.duplicated, acct.leaked_credits) == (0, 0, 0)

Sources, all under the run directory (several lives of a resumed learner append to them):
- `roller-<i>.groups`: `{id, task}` per line for every group the queue acknowledged to roller i;
- `learner_groups.jsonl`: per step, the ids trained on (`trained`) or skipped (`skipped`);
- `queue_ledger.jsonl` (a hosted queue): ids dropped as stale / skipped, and at each clean
  stop the ids still held (`remaining`);
- `queue_final.json`: the queue's metrics when the learner stopped;
- `learner.jsonl`: per step, the queue's metrics as the learner saw them (`queue/*`).

lost: acknowledged to a roller, yet neither trained, nor dropped (counted), nor still held by the
queue at the end, nor lost with durability off. lost_undurable: acknowledged by a queue with
`queue.durable: false` that died holding them (kill -9 of the learner hosting it; see `ledger.py`),
or by a durable queue without `queue.wal_fsync` whose WAL tail a machine crash cut: the documented
loss window of those settings, counted apart from `lost` (which is a bug). duplicated: trained more than once. leaked_credits: admission credits the
queue cannot account for at the end (the credit invariant's residual) plus credits still held
under leases when the queue stopped (every roller had left or lapsed by then).

`invariant_residuals(metrics)` checks one snapshot of the queue's metrics:
`admitted − spent − released − reclaimed − leased` (credits) and
`groups_in + recovered − trained − dropped − depth − inflight` (groups); both are 0 in every snapshot.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.queue.ledger import read_rows, undurable_losses


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def invariant_residuals(m: dict[str, Any], prefix: str = "") -> tuple[float, float]:
    """(credit residual, group residual) of one snapshot of the zmq queue's metrics."""

    def g(key: str) -> float:
        return m.get(prefix + key, 0)

    credits = (
        g("admitted")
        - g("admission_spent")
        - g("admission_released")
        - g("admission_reclaimed")
        - g("leased")
    )
    groups = (
        g("groups_in")
        + g("recovered")
        - g("trained")
        - g("dropped_stale")
        - g("dropped_skipped")
        - g("depth")
        - g("inflight")
    )
    return credits, groups


@dataclass
class Account:
    put: set[str] = field(default_factory=set)
    trained: Counter = field(default_factory=Counter)
    dropped: dict[str, set[str]] = field(default_factory=dict)
    remaining: set[str] = field(default_factory=set)
    final: dict[str, Any] = field(default_factory=dict)
    step_residuals: list[tuple[float, float]] = field(default_factory=list)
    tasks: dict[str, list[int | None]] = field(default_factory=dict)  # roller -> task numbers it put
    undurable: set[str] = field(default_factory=set)  # held by a durability-off queue that died

    @property
    def unaccounted(self) -> set[str]:
        dropped = set().union(*self.dropped.values()) if self.dropped else set()
        return self.put - set(self.trained) - dropped - self.remaining

    @property
    def lost_ids(self) -> set[str]:
        return self.unaccounted - self.undurable

    @property
    def lost_undurable(self) -> int:
        return len(self.unaccounted & self.undurable)

    @property
    def lost(self) -> int:
        return len(self.lost_ids)

    @property
    def duplicated(self) -> int:
        return sum(n - 1 for n in self.trained.values() if n > 1)

    @property
    def leaked_credits(self) -> int:
        if not self.final:
            return 0
        credits, _ = invariant_residuals(self.final)
        return int(abs(credits)) + int(self.final.get("leased", 0))

    def summary(self) -> dict[str, Any]:
        return {
            "put": len(self.put),
            "trained": sum(self.trained.values()),
            "dropped": {k: len(v) for k, v in self.dropped.items()},
            "remaining": len(self.remaining),
            "lost": self.lost,
            "lost_undurable": self.lost_undurable,
            "duplicated": self.duplicated,
            "leaked_credits": self.leaked_credits,
            "reclaimed": self.final.get("admission_reclaimed", 0),
        }


def account(run_dir: Path | str) -> Account:
    run_dir = Path(run_dir)
    acct = Account()
    for path in sorted(run_dir.glob("roller-*.groups")):
        rows = read_jsonl(path)
        acct.put.update(row["id"] for row in rows)
        acct.tasks[path.name.removesuffix(".groups")] = [row["task"] for row in rows]
    for row in read_jsonl(run_dir / "learner_groups.jsonl"):
        acct.trained.update(row.get("trained", []))
        acct.dropped.setdefault("skipped", set()).update(row.get("skipped", []))
    remaining: set[str] = set()
    ledger = read_rows(run_dir / "queue_ledger.jsonl")
    acct.undurable = undurable_losses(ledger)
    for row in ledger:
        for key in ("dropped_stale", "dropped_skipped"):
            acct.dropped.setdefault(key.removeprefix("dropped_"), set()).update(row.get(key, []))
        if "remaining" in row:
            remaining = set(row["remaining"])  # the last stop's; earlier lives' are trained or dropped since
    acct.remaining = remaining - set(acct.trained)
    final = run_dir / "queue_final.json"
    if final.exists():
        acct.final = json.loads(final.read_text())
    for row in read_jsonl(run_dir / "learner.jsonl"):
        if "queue/admitted" in row:
            acct.step_residuals.append(invariant_residuals(row, "queue/"))
    return acct
