"""Where a roller's tasks come from: a JSONL or Parquet file, or the env's generator.

Tasks are plain dicts handed to `Env.reset`, numbered 0, 1, 2, ... (`TaskSource`). Files are
read once, every task checked against the fields the env declares it needs
(`Env.required_task_fields`: a missing one is refused at start-up, naming the file, line and
field, not when the env meets it mid-run), and cycled through in a fresh seeded shuffle per epoch; the built-in generator
(`Env.generate_tasks`) is asked for new chunks forever, each from its own seed, so synthetic
runs never repeat a chunk. Rollers of one run take their task numbers from the queue's shared
cursor (see `TaskSource`).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agentrl.envs.base import Env
from agentrl.jsonl import read_objects

CHUNK = 1024


def read_task_file(path: str | Path, env_cls: type[Env] | None = None) -> list[dict[str, Any]]:
    """All tasks of a JSONL (one object per line) or Parquet file; bad lines name their number,
    as does a task missing a field `env_cls` requires (`Env.required_task_fields`)."""
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
        rows = pq.read_table(path).to_pylist()
        for number, task in enumerate(rows):
            _check_fields(task, env_cls, f"{path}: row {number}")
        return rows
    tasks = []
    for number, task in read_objects(path, "task", "roller.tasks: "):
        _check_fields(task, env_cls, f"{path}:{number}")
        tasks.append(task)
    if not tasks:
        raise ValueError(f"roller.tasks: {path} holds no tasks")
    return tasks


def _check_fields(task: dict[str, Any], env_cls: type[Env] | None, where: str) -> None:
    missing = env_cls.missing_task_fields(task) if env_cls is not None else []
    if missing:
        raise ValueError(
            f"roller.tasks: {where}: the task lacks field {', '.join(missing)}, which "
            f"{env_cls.__name__} needs (its required_task_fields; keys here: {sorted(task)[:20]})"
        )


class TaskSource:
    """The run's task stream as numbered tasks: `source[i]` is task i of `spec` (`builtin` or a
    file), the same on every roller with the same seed.

    The queue hands each admitted group the next number of the run's task cursor, so N rollers
    split one stream disjointly (each task goes to exactly one roller) and a restarted roller
    continues at the run's cursor instead of replaying from task 0. A file is cycled in a fresh
    seeded shuffle per epoch (task i is in epoch i // len); the built-in generator is asked for
    chunk i // CHUNK, each chunk from its own seed."""

    def __init__(self, spec: str, env_cls: type[Env], seed: int, **generator_kwargs: Any) -> None:
        self.spec, self.env_cls, self.seed, self.kwargs = spec, env_cls, seed, generator_kwargs
        self._tasks: list[dict[str, Any]] | None = None
        if spec != "builtin":
            if generator_kwargs:
                raise ValueError(
                    "roller.task_kwargs: only the built-in generator takes options, not a task file"
                )
            self._tasks = read_task_file(spec, env_cls)
        self._cached: tuple[int, list[Any]] = (-1, [])  # (chunk or epoch, its tasks or order)

    def __getitem__(self, i: int) -> dict[str, Any]:
        if i < 0:
            raise IndexError(f"task {i}: tasks are numbered from 0")
        size = CHUNK if self._tasks is None else len(self._tasks)
        block, pos = divmod(i, size)
        if self._cached[0] != block:
            if self._tasks is None:
                items = self.env_cls.generate_tasks(CHUNK, seed=self.seed * 1_000_003 + block, **self.kwargs)
            else:
                items = list(range(size))
                random.Random(self.seed * 1_000_003 + block).shuffle(items)
            self._cached = (block, list(items))
        item = self._cached[1][pos]
        return item if self._tasks is None else self._tasks[item]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self[i] for i in itertools.count())


def task_stream(
    spec: str, env_cls: type[Env], seed: int, **generator_kwargs: Any
) -> Iterator[dict[str, Any]]:
    """An endless stream of tasks from `spec` (`builtin` or a file path), tasks 0, 1, 2, ... of
    `TaskSource` (one roller alone, or a bench that does not share a queue cursor)."""
    return iter(TaskSource(spec, env_cls, seed, **generator_kwargs))
