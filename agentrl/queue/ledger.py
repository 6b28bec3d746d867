"""The queue's ledger: one JSON line per event that decides a group's fate, for the per-group account.

    ledger = Ledger(run_dir / "queue_ledger.jsonl", epoch, durable=False, version=0)

Rows (several lives of a queue append to the same file; each life opens with its `life` row):
- `{"life": epoch, "durable": bool, "v": version}`: a queue started;
- `{"held": [ids]}` (unless the WAL is fsynced): groups it acknowledged to producers, written
  before those acks go out (durability off: held in memory alone; durable without `wal_fsync`: in
  a WAL whose tail may still be in the page cache);
- `{"lost_wal": [ids], "v": version}`: written by a durable queue at start-up, the acknowledged
  groups its WAL replay did not find (a torn tail: the machine died before the page cache
  reached the disk);
- `{"trained" | "dropped_stale" | "dropped_skipped": [ids], "v": version}`: what became of them;
- `{"remaining": [ids]}`: at a clean stop, what it still held.

A life with durability off that has no `remaining` row died (kill -9 of the learner hosting it):
the groups it held are gone, *lost with durability off*. `undurable_losses` names them, and a
queue started on the same ledger counts and reports the previous life's at once
(`lost_undurable`), so the loss is counted, never silent. With durability on the WAL recovers
them; without `wal_fsync` a machine crash can still cut its tail, so the recovering queue
compares what earlier durable lives acknowledged (`held`) with what its replay found
(`wal_losses`), and counts and names the difference the same way.
"""

from __future__ import annotations

import json
from collections.abc import Collection
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
    `last_only`: only the last life's (what a newly started queue reports); otherwise also the ids
    named by `lost_wal` rows (acknowledged, then lost in a torn WAL tail) and not trained since."""
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
    if not last_only:  # what recovering durable queues found missing from their WAL
        torn = {gid for row in rows for gid in row.get("lost_wal", [])}
        lost |= torn - {gid for row in rows for fate in FATES for gid in row.get(fate, [])}
    return lost


def wal_losses(rows: list[dict[str, Any]], found: Collection[str]) -> set[str]:
    """Ids that durable lives acknowledged (`held`), that no row settled (trained, dropped, or
    already counted lost), and that a WAL replay did not find (`found`: its queued and acked ids)."""
    held: set[str] = set()
    settled: set[str] = set()
    durable = False
    for row in rows:
        if "life" in row:
            durable = bool(row.get("durable"))
        elif durable and "held" in row:
            held.update(row["held"])
        for key in (*FATES, "lost_wal"):
            settled.update(row.get(key, []))
    return held - settled - set(found)


class Ledger:
    """The append side, owned by one `QueueServer` (its thread)."""

    def __init__(
        self,
        path: str | Path,
        epoch: str,
        durable: bool,
        version: int,
        wal_fsync: bool = False,
        wal_found: Collection[str] | None = None,
    ) -> None:
        """`durable`: this queue writes a WAL (`wal_fsync`: fsynced before each ack, so nothing it
        acknowledges needs a `held` row); `wal_found`: the ids its WAL replay found (queued or
        acked), to count what earlier durable lives acknowledged and the replay lost."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = read_rows(path)
        lost = undurable_losses(rows, last_only=True)
        torn = wal_losses(rows, wal_found) if wal_found is not None else set()
        self.lost_before = len(lost) + len(torn)
        if lost:
            log.warning(
                "the previous queue on this run (durability off) died holding %d acknowledged groups: they "
                "are lost (counted as lost_undurable; set queue.durable true so a restart recovers them)",
                len(lost),
            )
        if torn:
            names = sorted(torn)
            log.warning(
                "the WAL lost %d group(s) a previous queue had acknowledged (a torn tail: the machine died "
                "before the page cache reached the disk; set queue.wal_fsync true to close this window); "
                "counted as lost_undurable: %s%s",
                len(names),
                ", ".join(names[:20]),
                f" and {len(names) - 20} more" if len(names) > 20 else "",
            )
        self.writes_held = not (durable and wal_fsync)
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - closed in close()
        self._held: list[str] = []
        self.write({"life": epoch, "durable": durable, "v": version})
        if torn:
            self.write({"lost_wal": sorted(torn), "v": version})

    def write(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps(row) + "\n")

    def held(self, gid: str) -> None:
        """`gid` was accepted; written (unless the WAL is fsynced) by `flush_held` before its ack is sent."""
        if self.writes_held:
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
