"""`agentrl retriever`: writing the synthetic world, and refusals that say what to change."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.conftest import run_agentrl


def test_make_synthetic_writes_the_world_and_exits(tmp_path: Path) -> None:
    out = run_agentrl(
        "retriever", "--make-synthetic", str(tmp_path / "w"), "--num-people", "20", "--seed", "4"
    )
    assert out.returncode == 0, out.stderr
    names = {p.name for p in (tmp_path / "w").iterdir()}
    assert {"corpus.jsonl", "train.jsonl", "test.jsonl"} <= names
    first = json.loads((tmp_path / "w" / "corpus.jsonl").read_text().splitlines()[0])
    assert set(first) == {"id", "contents"}


def test_refusals(tmp_path: Path) -> None:
    out = run_agentrl("retriever")
    assert out.returncode == 2 and "--corpus" in out.stderr
    out = run_agentrl("retriever", "--corpus", str(tmp_path / "missing.jsonl"))
    assert out.returncode == 2 and "corpus not found" in out.stderr
    (tmp_path / "c.jsonl").write_text('{"id": "0", "contents": "T\\nx"}\n')
    out = run_agentrl("retriever", "--corpus", str(tmp_path / "c.jsonl"), "--method", "splade")
    assert out.returncode == 2 and "bm25 or dense" in out.stderr


@pytest.mark.skipif(
    importlib.util.find_spec("sentence_transformers") is not None, reason="sentence-transformers is installed"
)
def test_dense_without_sentence_transformers_says_what_to_install(tmp_path: Path) -> None:
    (tmp_path / "c.jsonl").write_text('{"id": "0", "contents": "T\\nx"}\n')
    out = run_agentrl("retriever", "--corpus", str(tmp_path / "c.jsonl"), "--method", "dense")
    assert out.returncode == 2 and "pip install" in out.stderr
