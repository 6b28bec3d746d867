"""QA data for the Search-R1 env: Search-R1's Parquet layout and NQ / HotpotQA-style JSONL.

Every loader returns tasks in one shape, which is what `SearchR1Env.reset` reads:

    {"id": "nq-17", "question": "who wrote ...?", "golden_answers": ["..."], "data_source": "nq"}

Accepted inputs (one record per row/line; the first field found wins):
- Search-R1's Parquet (`scripts/data_process/qa_search_train_merge.py` writes it):
  `question`, `golden_answers`, `data_source`, plus `reward_model.ground_truth.target`
  and the rendered `prompt` — the prompt is ignored, the env renders its own template;
- FlashRAG / NQ-open JSONL: `question` with `golden_answers`, `answer` or `answers` (list);
- HotpotQA JSON or JSONL: `_id`, `question`, `answer` (a string).

`normalize_task` is also applied by the env to every task it is handed, so a roller can
point `roller.tasks` straight at a Search-R1 Parquet file.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def _as_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if hasattr(value, "tolist"):  # numpy arrays from pandas-written Parquet
        value = value.tolist()
    return [str(v) for v in value]


def golden_answers(row: dict[str, Any]) -> list[str]:
    """The gold answers of a record in any of the accepted layouts."""
    for key in ("golden_answers", "answers", "answer"):
        if row.get(key) is not None:
            return _as_list(row[key])
    ground_truth = (row.get("reward_model") or {}).get("ground_truth") or {}
    if isinstance(ground_truth, dict) and ground_truth.get("target") is not None:
        return _as_list(ground_truth["target"])
    return []


def normalize_task(row: dict[str, Any], data_source: str | None = None, index: int = 0) -> dict[str, Any]:
    """A task in the env's shape; keeps extra fields; ValueError names what is missing."""
    question = row.get("question")
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"a QA record needs a non-empty 'question', got keys {sorted(row)}")
    answers = golden_answers(row)
    if not answers:
        raise ValueError(
            "a QA record needs gold answers: 'golden_answers', 'answers', 'answer' or "
            f"reward_model.ground_truth.target (question: {question[:80]!r})"
        )
    source = row.get("data_source") or data_source or "unknown"
    task_id = row.get("id", row.get("_id"))
    if task_id is None:
        task_id = f"{source}-{(row.get('extra_info') or {}).get('index', index)}"
    return {
        **{k: v for k, v in row.items() if k not in ("prompt", "reward_model")},
        "id": str(task_id),
        "question": question.strip(),
        "golden_answers": answers,
        "data_source": source,
    }


def _read_rows(path: Path) -> Iterable[dict[str, Any]]:
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:
            raise ValueError("reading Parquet needs pyarrow: pip install 'agentrl[search]'") from exc
        yield from pq.read_table(path).to_pylist()
        return
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json" and text.lstrip().startswith("["):  # HotpotQA ships one JSON array
        yield from json.loads(text)
        return
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                yield json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{path}:{number}: not JSON: {exc}") from None


def load_qa(
    path: str | Path, data_source: str | None = None, limit: int | None = None
) -> list[dict[str, Any]]:
    """Tasks from a Parquet, JSONL or JSON-array file; `data_source` fills in where records lack one."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"QA file not found: {path}")
    source = data_source or path.stem
    tasks = []
    for i, row in enumerate(_read_rows(path)):
        if limit is not None and len(tasks) >= limit:
            break
        try:
            tasks.append(normalize_task(row, source, i))
        except ValueError as exc:
            raise ValueError(f"{path}: record {i + 1}: {exc}") from None
    if not tasks:
        raise ValueError(f"{path} holds no QA records")
    return tasks


def write_tasks(tasks: list[dict[str, Any]], path: str | Path) -> Path:
    """Write tasks as JSONL, or as Parquet when the path ends in `.parquet`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(tasks), path)
    else:
        with path.open("w", encoding="utf-8") as f:
            for task in tasks:
                f.write(json.dumps(task, ensure_ascii=False) + "\n")
    return path
