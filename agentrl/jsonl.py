"""Reading a JSONL file of objects (a task file, a retriever corpus) with errors that name the
line: one reader, so every such file fails the same way on a bad line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def read_objects(path: Path, what: str, where: str = "") -> Iterator[tuple[int, dict[str, Any]]]:
    """Each non-blank line of `path` as (line number, object). A line that is not JSON, or not a
    JSON object, raises `ValueError` naming `path:number` after `where` (e.g. "roller.tasks: ")
    and, for the second, `what` a line holds (e.g. "task")."""
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{where}{path}:{number}: not JSON: {exc}") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}{path}:{number}: a {what} must be a JSON object")
            yield number, obj
