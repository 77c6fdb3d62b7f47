"""`build_retriever(config.retrieval)`: the one place that turns a config section into a `Retriever`.

The trainer and evaluator call this and never name an implementation: a ``url`` means a
remote service, otherwise the in-process retriever of ``method`` over ``corpus_path``.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ml_collections import ConfigDict

from llds_jax.retrieval.bm25 import BM25Retriever
from llds_jax.retrieval.client import HttpRetriever
from llds_jax.retrieval.corpus import Corpus, corpus_fingerprint
from llds_jax.retrieval.hit import Retriever
from llds_jax.utils.assets import cache_dir

logger = logging.getLogger(__name__)
METHODS = ("bm25", "dense")


def check_method(r: ConfigDict) -> str:
    if r.method not in METHODS:
        raise ValueError(f"retrieval.method must be one of {METHODS}, got {r.method!r}")
    return r.method


def resolve_index_path(r: ConfigDict) -> Path:
    """``retrieval.index_path``, or a cache directory named after the corpus file and method.

    The fingerprint (path, size, mtime) keeps an index from silently serving an edited
    corpus. A dense directory holds the embeddings once and one faiss file per factory.
    """
    if r.index_path:
        return Path(r.index_path)
    corpus_path = Path(r.corpus_path)
    return cache_dir() / "indexes" / f"{corpus_path.name}.{corpus_fingerprint(corpus_path)}.{check_method(r)}"


def open_bm25(r: ConfigDict, build_if_missing: bool = True) -> BM25Retriever:
    corpus = Corpus(r.corpus_path)
    index_dir = resolve_index_path(r)
    if BM25Retriever.exists(index_dir):
        return BM25Retriever.load(index_dir, corpus)
    if not build_if_missing:
        raise FileNotFoundError(f"no BM25 index at {index_dir}; run --mode=index first")
    logger.info("no BM25 index at %s: building it over %s (%d rows)", index_dir, corpus.path, len(corpus))
    retriever = BM25Retriever.build(corpus)
    retriever.save(index_dir)
    return retriever


def build_retriever(r: ConfigDict) -> Retriever:
    """In-process BM25 (built and cached on first use) or dense, or HTTP when ``r.url`` is set."""
    if r.get("url"):
        return HttpRetriever(r.url, timeout=r.timeout, retries=r.retries, backoff=r.backoff,
                             max_queries_per_request=r.max_queries)
    if check_method(r) == "bm25":
        return open_bm25(r)
    from llds_jax.retrieval.dense import open_dense  # imports JAX: only when asked for

    return open_dense(r)
