"""Retrieval over a JSONL corpus: BM25 by default, dense (sentence-transformers + faiss) optionally.

The corpus is Search-R1's layout (e.g. its wiki-18.jsonl): one JSON object per line with
`id` and `contents`, where the first line of `contents` is the title and the rest is the
text. Lines with `title` and `text` instead are accepted and joined the same way.

    retriever = BM25Retriever("corpus.jsonl", index_dir="runs/index")   # built once, then loaded
    hits = retriever.search(["who founded Quorvel?"], topk=3)            # [[(doc, score), ...]]

An index is built once and cached on disk next to a `meta.json` holding the corpus's
fingerprint (size, mtime and a hash of its bytes) and the index settings; a changed corpus
or setting rebuilds it. Builds are written to a temporary folder and renamed into place,
so a crash never leaves a half-written index that a later run would trust.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from agentrl.jsonl import read_objects
from agentrl.log import get_logger

logger = get_logger(__name__)

Document = dict[str, Any]
Hits = list[list[tuple[Document, float]]]


def load_corpus(path: str | Path) -> list[Document]:
    """Documents of a JSONL corpus, each with a string `id` and `contents` (title line + text)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"corpus not found: {path}")
    docs: list[Document] = []
    for number, doc in read_objects(path, "document"):
        if "contents" not in doc:
            if "text" not in doc:
                raise ValueError(f"{path}:{number}: a document needs 'contents' (or 'title' and 'text')")
            doc["contents"] = f'"{doc["title"]}"\n{doc["text"]}' if doc.get("title") else doc["text"]
        doc["id"] = str(doc.get("id", len(docs)))
        docs.append(doc)
    if not docs:
        raise ValueError(f"{path}: the corpus holds no documents")
    return docs


def fingerprint(path: str | Path) -> str:
    """A hash of the corpus bytes: the cache key of its index."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def default_index_dir(corpus_path: str | Path, method: str) -> Path:
    corpus_path = Path(corpus_path)
    return corpus_path.with_name(f"{corpus_path.stem}.{method}_index")


class Retriever:
    """Base class: load or build a cached index, then answer batches of queries."""

    method = "base"

    def __init__(self, corpus_path: str | Path, index_dir: str | Path | None = None) -> None:
        self.corpus_path = Path(corpus_path)
        self.corpus = load_corpus(self.corpus_path)
        self.index_dir = Path(index_dir) if index_dir else default_index_dir(self.corpus_path, self.method)
        self.built = False  # True when this instance built the index instead of loading it
        meta = {"corpus": fingerprint(self.corpus_path), "documents": len(self.corpus), **self.settings()}
        if self._cached_meta() == meta:
            self.load(self.index_dir)
            logger.info(
                "%s index loaded from %s (%d documents)", self.method, self.index_dir, len(self.corpus)
            )
            return
        self._build_atomically(meta)

    def settings(self) -> dict[str, Any]:
        """Everything besides the corpus that the index depends on."""
        return {"method": self.method}

    def _cached_meta(self) -> dict[str, Any] | None:
        try:
            return json.loads((self.index_dir / "meta.json").read_text())
        except (OSError, ValueError):
            return None

    def _build_atomically(self, meta: dict[str, Any]) -> None:
        self.index_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{self.index_dir.name}.", dir=self.index_dir.parent))
        try:
            self.build(tmp)
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
            if self.index_dir.exists():
                shutil.rmtree(self.index_dir)
            os.replace(tmp, self.index_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.built = True
        logger.info("%s index built in %s (%d documents)", self.method, self.index_dir, len(self.corpus))

    def build(self, out_dir: Path) -> None:
        raise NotImplementedError

    def load(self, index_dir: Path) -> None:
        raise NotImplementedError

    def search(self, queries: Sequence[str], topk: int) -> Hits:
        """The best `topk` documents of each query with their scores, best first."""
        raise NotImplementedError


class BM25Retriever(Retriever):
    """Okapi BM25 with `bm25s` (sparse matrices in numpy; no torch, no Java)."""

    method = "bm25"

    def __init__(
        self,
        corpus_path: str | Path,
        index_dir: str | Path | None = None,
        stopwords: str | None = "en",
        stemmer: str | None = None,
    ) -> None:
        """`stemmer`: a Snowball language (e.g. "english") applied to documents and queries; needs PyStemmer."""
        self.stopwords = stopwords
        self.stemmer = stemmer
        self._stem = None
        if stemmer:
            try:
                import Stemmer
            except ImportError as exc:
                raise ValueError(f"stemmer={stemmer!r} needs PyStemmer: pip install PyStemmer") from exc
            self._stem = Stemmer.Stemmer(stemmer).stemWords
        super().__init__(corpus_path, index_dir)

    def settings(self) -> dict[str, Any]:
        import bm25s

        return {
            "method": self.method,
            "stopwords": self.stopwords,
            "stemmer": self.stemmer,
            "bm25s": bm25s.__version__,
        }

    def _tokenize(self, texts: list[str], return_ids: bool) -> Any:
        import bm25s

        return bm25s.tokenize(
            texts, stopwords=self.stopwords, stemmer=self._stem, return_ids=return_ids, show_progress=False
        )

    def build(self, out_dir: Path) -> None:
        import bm25s

        tokens = self._tokenize([d["contents"] for d in self.corpus], return_ids=True)
        self.index = bm25s.BM25()
        self.index.index(tokens, show_progress=False)
        self.index.save(str(out_dir), show_progress=False)

    def load(self, index_dir: Path) -> None:
        import bm25s

        self.index = bm25s.BM25.load(str(index_dir), show_progress=False)

    def search(self, queries: Sequence[str], topk: int) -> Hits:
        if not queries:
            return []
        k = max(1, min(topk, len(self.corpus)))
        tokens = self._tokenize(list(queries), return_ids=False)
        ids, scores = self.index.retrieve(tokens, k=k, show_progress=False, n_threads=1)
        # documents that share no term with the query score 0: they are not hits (as in Lucene)
        return [
            [(self.corpus[int(i)], float(s)) for i, s in zip(row_ids, row_scores, strict=True) if s > 0]
            for row_ids, row_scores in zip(ids, scores, strict=True)
        ]


Encoder = Callable[[list[str]], np.ndarray]


def sentence_transformer_encoder(model_name: str, query_prefix: str = "", doc_prefix: str = "") -> Encoder:
    """An encoder from sentence-transformers (optional: `pip install sentence-transformers`)."""
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError as exc:
        raise ValueError(
            "dense retrieval needs sentence-transformers and faiss: pip install sentence-transformers faiss-cpu"
        ) from exc
    model = SentenceTransformer(model_name)

    def encode(texts: list[str], is_query: bool = True) -> np.ndarray:
        prefix = query_prefix if is_query else doc_prefix
        return model.encode([prefix + t for t in texts], normalize_embeddings=True, convert_to_numpy=True)

    return encode  # type: ignore[return-value]


class DenseRetriever(Retriever):
    """Inner-product search over normalised embeddings with a faiss flat index (optional extra).

    `encoder(texts, is_query=...)` maps texts to a float matrix; the default loads a
    sentence-transformers model by name (e5 models want "query: " / "passage: " prefixes)."""

    method = "dense"

    def __init__(
        self,
        corpus_path: str | Path,
        index_dir: str | Path | None = None,
        model_name: str = "intfloat/e5-base-v2",
        encoder: Callable[..., np.ndarray] | None = None,
        batch_size: int = 256,
    ) -> None:
        try:
            import faiss  # noqa: F401
        except ImportError as exc:
            raise ValueError("dense retrieval needs faiss: pip install faiss-cpu") from exc
        self.model_name = model_name
        self.batch_size = batch_size
        prefixes = ("query: ", "passage: ") if "e5" in model_name.lower() else ("", "")
        self.encoder = encoder or sentence_transformer_encoder(model_name, *prefixes)
        super().__init__(corpus_path, index_dir)

    def settings(self) -> dict[str, Any]:
        return {"method": self.method, "model": self.model_name}

    def _encode(self, texts: list[str], is_query: bool) -> np.ndarray:
        parts = [
            np.asarray(self.encoder(texts[i : i + self.batch_size], is_query=is_query), dtype=np.float32)
            for i in range(0, len(texts), self.batch_size)
        ]
        return np.ascontiguousarray(np.concatenate(parts))

    def build(self, out_dir: Path) -> None:
        import faiss

        vectors = self._encode([d["contents"] for d in self.corpus], is_query=False)
        self.index = faiss.IndexFlatIP(vectors.shape[1])
        self.index.add(vectors)
        faiss.write_index(self.index, str(out_dir / "faiss.index"))

    def load(self, index_dir: Path) -> None:
        import faiss

        self.index = faiss.read_index(str(index_dir / "faiss.index"))

    def search(self, queries: Sequence[str], topk: int) -> Hits:
        if not queries:
            return []
        k = max(1, min(topk, len(self.corpus)))
        scores, ids = self.index.search(self._encode(list(queries), is_query=True), k)
        return [
            [(self.corpus[int(i)], float(s)) for i, s in zip(row_ids, row_scores, strict=True) if i >= 0]
            for row_ids, row_scores in zip(ids, scores, strict=True)
        ]


def create_retriever(
    corpus_path: str | Path, method: str = "bm25", index_dir: str | Path | None = None, **kwargs: Any
) -> Retriever:
    """A retriever by method name: `bm25` (default) or `dense`."""
    kinds: dict[str, type[Retriever]] = {"bm25": BM25Retriever, "dense": DenseRetriever}
    if method not in kinds:
        raise ValueError(f"unknown retrieval method {method!r}; choose bm25 or dense")
    return kinds[method](corpus_path, index_dir, **kwargs)
