"""The docs and docstrings are the project's own: they name no file outside the repository (a
design or style note kept elsewhere) and no issue number of a tracker a reader cannot see."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OUTSIDE = re.compile(r"DESIGN\.md|STYLE\.md|REFERENCES\.md|\bissues? #?\d+", re.IGNORECASE)


def _texts() -> list[Path]:
    return [
        *sorted(REPO.glob("docs/**/*.md")),
        REPO / "README.md",
        *sorted((REPO / "agentrl").rglob("*.py")),
        *sorted((REPO / "recipes").glob("*")),
    ]


def test_docs_and_docstrings_name_nothing_outside_the_repository() -> None:
    found = []
    for path in _texts():
        rel = path.relative_to(REPO).as_posix()
        if not path.is_file():
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                found.append(f"{rel}:{n}: {line.strip()}")
    assert not found, "references outside the repository:\n" + "\n".join(found)
