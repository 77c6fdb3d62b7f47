"""Retrieval for Search-R1 rollouts: corpus access, BM25 / dense / HTTP retrievers, the service.

The rollout depends only on `Retriever.search(queries, topk) -> list[list[Hit]]` and
`format_docs`; `build_retriever(config.retrieval)` picks the implementation.
"""

from llds_jax.retrieval.bm25 import BM25Retriever
from llds_jax.retrieval.corpus import Corpus, CorpusFormatError
from llds_jax.retrieval.hit import Hit, RetrievalError, Retriever, format_docs

__all__ = [
    "BM25Retriever",
    "Corpus",
    "CorpusFormatError",
    "Hit",
    "RetrievalError",
    "Retriever",
    "format_docs",
]
