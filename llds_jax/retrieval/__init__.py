"""Retrieval for Search-R1 rollouts: corpus access, BM25 / dense / HTTP retrievers, the service.

The rollout depends only on `Retriever.search(queries, topk) -> list[list[Hit]]` and
`format_docs`; `build_retriever(config.retrieval)` picks the implementation. The dense
retriever is imported on first use (it pulls in JAX), so BM25/HTTP users never pay for it.
"""

from llds_jax.retrieval.bm25 import BM25Retriever
from llds_jax.retrieval.client import HttpRetriever
from llds_jax.retrieval.config import default_retrieval_config
from llds_jax.retrieval.corpus import Corpus, CorpusFormatError
from llds_jax.retrieval.factory import build_retriever
from llds_jax.retrieval.hit import Hit, RetrievalError, Retriever, format_docs

__all__ = [
    "BM25Retriever",
    "Corpus",
    "CorpusFormatError",
    "DenseRetriever",
    "Hit",
    "HttpRetriever",
    "RetrievalError",
    "Retriever",
    "build_retriever",
    "default_retrieval_config",
    "format_docs",
]


def __getattr__(name: str):
    if name == "DenseRetriever":
        from llds_jax.retrieval.dense import DenseRetriever

        return DenseRetriever
    raise AttributeError(f"module 'llds_jax.retrieval' has no attribute {name!r}")
