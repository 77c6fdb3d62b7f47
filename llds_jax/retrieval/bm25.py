"""BM25 over a corpus with ``bm25s``: sparse scores precomputed at index time, pure numpy.

Search-R1 uses pyserini (Lucene, a JVM); bm25s needs no JVM, builds the 30,913-passage
shared corpus in seconds and saves as plain ``.npy`` files we memory-map at load. We
index ``contents`` (title line + text), as the reference's pyserini index does. No
stemmer: PyStemmer is not a dependency, so "dogs" does not match "dog" (Lucene's default
English analyser would stem); stopwords are bm25s's English list.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from llds_jax.retrieval.corpus import Corpus
from llds_jax.retrieval.hit import Hit, RetrievalError, check_search_args

META_FILE = "llds_bm25.json"
FORMAT_VERSION = 1
STOPWORDS = "en"

if TYPE_CHECKING:
    import bm25s


def _bm25s():
    """``bm25s`` is imported on first use: importing it runs a JAX op, which would start the
    JAX backend before ``jax.distributed.initialize`` and fix the device count too early."""
    import bm25s

    return bm25s


def _tokenize(texts: list[str], show_progress: bool):
    return _bm25s().tokenize(texts, stopwords=STOPWORDS, return_ids=False, show_progress=show_progress)


class BM25Retriever:
    """In-process BM25; ``search`` returns corpus rows best first, ties broken by bm25s order."""

    def __init__(self, model: bm25s.BM25, corpus: Corpus):
        self.model = model
        self.corpus = corpus

    @classmethod
    def build(cls, corpus: Corpus, show_progress: bool = False) -> BM25Retriever:
        texts = list(corpus.iter_contents())
        tokens = _bm25s().tokenize(texts, stopwords=STOPWORDS, show_progress=show_progress)
        model = _bm25s().BM25()
        model.index(tokens, show_progress=show_progress)
        return cls(model, corpus)

    def save(self, index_dir: str | os.PathLike) -> Path:
        index_dir = Path(index_dir)
        index_dir.mkdir(parents=True, exist_ok=True)
        self.model.save(str(index_dir), show_progress=False)
        meta = {
            "format_version": FORMAT_VERSION,
            "kind": "bm25",
            "corpus_path": str(self.corpus.path),
            "num_docs": len(self.corpus),
            "stopwords": STOPWORDS,
        }
        (index_dir / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        return index_dir

    @staticmethod
    def exists(index_dir: str | os.PathLike) -> bool:
        return (Path(index_dir) / META_FILE).exists()

    @classmethod
    def load(cls, index_dir: str | os.PathLike, corpus: Corpus) -> BM25Retriever:
        """Memory-maps the saved index; refuses one built over a corpus of another size."""
        index_dir = Path(index_dir)
        meta_path = index_dir / META_FILE
        if not meta_path.exists():
            raise FileNotFoundError(f"no BM25 index in {index_dir} (missing {META_FILE}); run --mode=index first")
        meta = json.loads(meta_path.read_text())
        if meta.get("kind") != "bm25" or meta.get("format_version") != FORMAT_VERSION:
            raise RetrievalError(f"{meta_path}: not a format-{FORMAT_VERSION} BM25 index: {meta}")
        if meta["num_docs"] != len(corpus):
            raise RetrievalError(
                f"{meta_path}: index covers {meta['num_docs']} rows (built from {meta['corpus_path']}) "
                f"but corpus {corpus.path} has {len(corpus)}; rebuild the index"
            )
        model = _bm25s().BM25.load(str(index_dir), mmap=True, show_progress=False)
        return cls(model, corpus)

    def search(self, queries: Sequence[str], topk: int) -> list[list[Hit]]:
        """Queries with no known token (empty, all stopwords) still get ``topk`` hits, all scored 0."""
        queries = check_search_args(queries, topk)
        if not queries:
            return []
        k = min(topk, len(self.corpus))
        doc_ids, scores = self.model.retrieve(_tokenize(queries, False), k=k, show_progress=False)
        results = []
        for row_ids, row_scores in zip(doc_ids, scores):
            rows = self.corpus.rows(row_ids)
            results.append([Hit(id=i, contents=c, score=float(s)) for (i, c), s in zip(rows, row_scores)])
        return results
