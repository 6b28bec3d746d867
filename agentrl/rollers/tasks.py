"""Where a roller's tasks come from: a JSONL or Parquet file, or the env's generator.

Tasks are plain dicts handed to `Env.reset`. Files are read once and cycled through in a
fresh seeded shuffle per epoch; the built-in generator (`Env.generate_tasks`) is asked for
new chunks forever, each from its own seed, so synthetic runs never repeat a chunk.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agentrl.envs.base import Env

CHUNK = 1024


def read_task_file(path: str | Path) -> list[dict[str, Any]]:
    """All tasks of a JSONL (one object per line) or Parquet file; bad lines name their number."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"roller.tasks: file not found: {path}")
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:
            raise ValueError(
                "roller.tasks: reading Parquet needs pyarrow (pip install 'agentrl[search]')"
            ) from exc
        return pq.read_table(path).to_pylist()
    tasks = []
    with path.open() as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                task = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"roller.tasks: {path}:{number}: not JSON: {exc}") from None
            if not isinstance(task, dict):
                raise ValueError(f"roller.tasks: {path}:{number}: a task must be a JSON object")
            tasks.append(task)
    if not tasks:
        raise ValueError(f"roller.tasks: {path} holds no tasks")
    return tasks


def task_stream(
    spec: str, env_cls: type[Env], seed: int, **generator_kwargs: Any
) -> Iterator[dict[str, Any]]:
    """An endless stream of tasks from `spec` (`builtin` or a file path)."""
    if spec == "builtin":
        chunk = 0
        while True:
            yield from env_cls.generate_tasks(CHUNK, seed=seed * 1_000_003 + chunk, **generator_kwargs)
            chunk += 1
    if generator_kwargs:
        raise ValueError("roller.task_kwargs: only the built-in generator takes options, not a task file")
    tasks = read_task_file(spec)
    rng = random.Random(seed)
    while True:
        order = list(range(len(tasks)))
        rng.shuffle(order)
        for i in order:
            yield tasks[i]
