"""One SWE task in the SWE-bench / SWE-Gym instance layout, and JSONL files of them.

The field names are SWE-bench's (`instance_id`, `problem_statement`, `FAIL_TO_PASS`,
`PASS_TO_PASS`, `patch`, `test_patch`, `base_commit`, `repo`), so SWE-bench, SWE-Gym and
R2E-Gym exports load as they are. Two additions say where the repository comes from:
`image` (a Docker image with the repository at `workdir`, as SWE-Gym and R2E-Gym ship
them) or `repo_dir` (a directory snapshot, copied into a local sandbox — the offline
synthetic tasks). SWE-bench's dataset stores the test lists as JSON strings; both that
and plain lists are accepted.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_TEST_CMD = "python3 -m pytest -p no:cacheprovider -q"


@dataclass
class SweTask:
    """A repository with a problem to fix and the tests that decide whether it is fixed."""

    instance_id: str
    problem_statement: str
    FAIL_TO_PASS: list[str]
    """Tests (pytest node ids) that fail before the fix and must pass after it."""
    PASS_TO_PASS: list[str] = field(default_factory=list)
    """Tests that pass before the fix and must still pass after it."""
    repo: str = ""
    """`owner/name` of the upstream repository (informational)."""
    base_commit: str = ""
    """Commit the snapshot is at (informational; images and snapshots are already there)."""
    image: str | None = None
    """Docker image holding the repository at `workdir` (docker sandboxes)."""
    repo_dir: str | None = None
    """Host directory with the repository snapshot (local sandboxes); relative to the task file."""
    workdir: str = "/work"
    """Where the repository lives inside the sandbox (SWE-bench images use /testbed)."""
    patch: str = ""
    """The reference fix (a unified diff). Never shown to the model."""
    test_patch: str = ""
    """Tests added or changed by the fix, applied only for grading (hidden from the model)."""
    test_cmd: str = DEFAULT_TEST_CMD
    """Command that runs pytest in the repository; the grader appends the test ids."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Anything else the source carried (difficulty, bug kind, ...)."""

    @classmethod
    def from_dict(cls, data: dict[str, Any], base_dir: Path | None = None) -> SweTask:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        extra = {k: v for k, v in data.items() if k not in cls.__dataclass_fields__}
        for key in ("FAIL_TO_PASS", "PASS_TO_PASS"):
            value = known.get(key, [])
            known[key] = json.loads(value) if isinstance(value, str) else list(value)
        if known.get("repo_dir") and base_dir is not None and not Path(known["repo_dir"]).is_absolute():
            known["repo_dir"] = str(base_dir / known["repo_dir"])
        missing = [k for k in ("instance_id", "problem_statement", "FAIL_TO_PASS") if k not in data]
        if missing:
            raise ValueError(f"SWE task is missing {', '.join(missing)}: {str(data)[:200]}")
        if not known["FAIL_TO_PASS"]:
            raise ValueError(f"SWE task {known['instance_id']}: FAIL_TO_PASS is empty (nothing to fix)")
        task = cls(**known)
        task.metadata = {**extra, **task.metadata}
        return task

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def prompt_view(self) -> dict[str, Any]:
        """What the model may see: no reference patch, no hidden tests."""
        return {
            "instance_id": self.instance_id,
            "repo": self.repo,
            "problem_statement": self.problem_statement,
        }


def load_tasks(path: str | Path) -> list[SweTask]:
    """Tasks from a JSONL file (one SWE-bench-style instance per line)."""
    path = Path(path)
    tasks = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            tasks.append(SweTask.from_dict(json.loads(line), base_dir=path.parent))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: {exc}") from exc
    return tasks


def save_tasks(tasks: Iterable[SweTask], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(t.to_dict()) + "\n" for t in tasks))
    return path
