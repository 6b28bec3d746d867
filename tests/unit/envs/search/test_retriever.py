"""BM25 (and optional dense) retrieval over a JSONL corpus, with the index cached on disk."""

from __future__ import annotations

import itertools
import json
import zlib
from pathlib import Path

import numpy as np
import pytest

from agentrl.envs.search.retriever import BM25Retriever, DenseRetriever, create_retriever, load_corpus
from agentrl.envs.search.synthetic import build_world, make_synthetic

DOCS = [
    {"id": "a", "contents": '"Quorvel Guild"\nThe Quorvel Guild was founded by Dravo Kelmir in 1811.'},
    {"id": "b", "contents": '"Dravo Kelmir"\nDravo Kelmir was a luthier born in Sulketra.'},
    {"title": "Sulketra", "text": "Sulketra is a small town known for its orchards."},
]


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    return path


def test_load_corpus_accepts_title_and_text(corpus: Path) -> None:
    docs = load_corpus(corpus)
    assert [d["id"] for d in docs] == ["a", "b", "2"]
    assert docs[2]["contents"] == '"Sulketra"\nSulketra is a small town known for its orchards.'
    bad = corpus.with_name("bad.jsonl")
    bad.write_text('{"id": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: a document needs 'contents'"):
        load_corpus(bad)


def test_bm25_ranks_batches_and_drops_non_matches(corpus: Path) -> None:
    retriever = BM25Retriever(corpus, corpus.parent / "index")
    hits = retriever.search(
        ["who founded the Quorvel Guild?", "where was Dravo Kelmir born", "xyzzy"], topk=2
    )
    assert hits[0][0][0]["id"] == "a"
    assert hits[1][0][0]["id"] == "b"
    assert hits[2] == []  # no shared term: no hits (as Lucene), not three random documents
    assert all(s1 >= s2 for row in hits for (_, s1), (_, s2) in itertools.pairwise(row))
    assert len(retriever.search(["Sulketra Dravo Quorvel"], topk=50)[0]) == 3  # topk beyond the corpus
    assert retriever.search([], topk=3) == []


def test_index_is_cached_and_rebuilt_when_the_corpus_changes(corpus: Path) -> None:
    index_dir = corpus.parent / "index"
    assert BM25Retriever(corpus, index_dir).built
    again = BM25Retriever(corpus, index_dir)
    assert not again.built and again.search(["Sulketra"], 1)[0][0][0]["id"] == "2"
    assert not list(corpus.parent.glob(".index.*"))  # no temporary build folders left behind
    with corpus.open("a") as f:
        f.write(json.dumps({"id": "z", "contents": '"Zentaro"\nZentaro is a river.'}) + "\n")
    changed = BM25Retriever(corpus, index_dir)
    assert changed.built and changed.search(["Zentaro"], 1)[0][0][0]["id"] == "z"
    # a different setting is a different index too
    assert BM25Retriever(corpus, index_dir, stopwords=None).built


def test_synthetic_questions_are_answerable_by_search(tmp_path: Path) -> None:
    paths = make_synthetic(tmp_path, seed=3, num_people=60)
    retriever = BM25Retriever(paths["corpus"])
    qa = build_world(3, 60)["qa"]
    hits = retriever.search([q["question"] for q in qa], topk=3)
    found = [
        any(q["golden_answers"][0].lower() in d["contents"].lower() for d, _ in row)
        for q, row in zip(qa, hits, strict=True)
    ]
    assert np.mean(found) >= 0.95


def _hash_encoder(texts: list[str], is_query: bool = True) -> np.ndarray:
    """A stand-in for a sentence-transformers model: hashed bag of words, normalised."""
    out = np.zeros((len(texts), 64), dtype=np.float32)
    for i, text in enumerate(texts):
        for word in text.lower().replace('"', " ").split():
            out[i, zlib.crc32(word.strip("?.,").encode()) % 64] += 1
    return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-6)


def test_dense_retrieval_with_faiss(corpus: Path) -> None:
    pytest.importorskip("faiss")
    retriever = create_retriever(
        corpus, "dense", corpus.parent / "dense", model_name="hash", encoder=_hash_encoder
    )
    assert retriever.built
    hits = retriever.search(["Dravo Kelmir luthier", "Sulketra orchards"], topk=1)
    assert hits[0][0][0]["id"] == "b" and hits[1][0][0]["id"] == "2"
    cached = DenseRetriever(corpus, corpus.parent / "dense", model_name="hash", encoder=_hash_encoder)
    assert not cached.built and cached.search(["Quorvel Guild founded"], 1)[0][0][0]["id"] == "a"


def test_unknown_method(corpus: Path) -> None:
    with pytest.raises(ValueError, match="bm25 or dense"):
        create_retriever(corpus, "splade")


def test_stemming_is_an_index_setting(corpus: Path) -> None:
    pytest.importorskip("Stemmer")
    plain = BM25Retriever(corpus, corpus.parent / "index")
    assert plain.search(["orchard"], 1) == [[]]  # "orchard" is not a token of "orchards"
    stemmed = BM25Retriever(corpus, corpus.parent / "index", stemmer="english")
    assert stemmed.built and stemmed.search(["orchard"], 1)[0][0][0]["id"] == "2"
