"""The queue's ledger: one JSON line per event that decides a group's fate, for the per-group account.

    ledger = Ledger(run_dir / "queue_ledger.jsonl", epoch, durable=False, version=0)

Rows (several lives of a queue append to the same file; each life opens with its `life` row):
- `{"life": epoch, "durable": bool, "v": version}`: a queue started;
- `{"held": [ids]}` (durability off only): groups it acknowledged to producers and holds in memory
  alone, written before those acks go out;
- `{"trained" | "dropped_stale" | "dropped_skipped": [ids], "v": version}`: what became of them;
- `{"remaining": [ids]}`: at a clean stop, what it still held.

A life with durability off that has no `remaining` row died (kill -9 of the learner hosting it):
the groups it held are gone, *lost with durability off*. `undurable_losses` names them, and a
queue started on the same ledger counts and reports the previous life's at once
(`lost_undurable`), so the loss is counted, never silent. With durability on the WAL recovers
them, so no `held` rows are written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agentrl.log import get_logger

log = get_logger("queue.ledger")

FATES = ("trained", "dropped_stale", "dropped_skipped")


def read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a torn last line of a killed queue
            continue
    return rows


def undurable_losses(rows: list[dict[str, Any]], last_only: bool = False) -> set[str]:
    """Ids held by a durability-off life that died, and not trained or dropped by any later row
    (a producer may re-send a put whose ack the dead queue never sent: the next life takes it).
    `last_only`: only the last life's (what a newly started queue reports)."""
    lives: list[tuple[bool, bool, set[str]]] = []  # (durable, stopped cleanly, held)
    settled: list[set[str]] = []  # per life: ids trained or dropped from that life on
    for row in rows:
        if "life" in row:
            lives.append((bool(row.get("durable")), False, set()))
            settled.append(set())
            continue
        if not lives:
            continue  # a ledger from before lives were recorded
        durable, _, held = lives[-1]
        if "held" in row:
            held.update(row["held"])
        if "remaining" in row:
            lives[-1] = (durable, True, held)
        for fate in FATES:
            for done in settled:
                done.update(row.get(fate, []))
    lost: set[str] = set()
    for i, (durable, clean, held) in enumerate(lives):
        if not durable and not clean and (not last_only or i == len(lives) - 1):
            lost |= held - settled[i]
    return lost


class Ledger:
    """The append side, owned by one `QueueServer` (its thread)."""

    def __init__(self, path: str | Path, epoch: str, durable: bool, version: int) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.lost_before = len(undurable_losses(read_rows(path), last_only=True))
        if self.lost_before:
            log.warning(
                "the previous queue on this run (durability off) died holding %d acknowledged groups: they "
                "are lost (counted as lost_undurable; set queue.durable true so a restart recovers them)",
                self.lost_before,
            )
        self.durable = durable
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - closed in close()
        self._held: list[str] = []
        self.write({"life": epoch, "durable": durable, "v": version})

    def write(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps(row) + "\n")

    def held(self, gid: str) -> None:
        """`gid` was accepted; written (durability off) by `flush_held` before its ack is sent."""
        if not self.durable:
            self._held.append(gid)

    def flush_held(self) -> None:
        if self._held:
            self.write({"held": self._held})
            self._held = []

    @property
    def closed(self) -> bool:
        return self._file.closed

    def close(self, remaining: list[str]) -> None:
        if not self._file.closed:
            self.flush_held()
            self.write({"remaining": remaining})
            self._file.close()
