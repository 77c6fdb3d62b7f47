"""`build_retriever(config.retrieval, tokenizer)`: the one place that turns a config section into a `Retriever`.

The trainer and evaluator call this and never name an implementation: a ``url`` means a
remote service, otherwise the in-process retriever of ``method`` over ``corpus_path``.
"""

from __future__ import annotations

import logging

from ml_collections import ConfigDict

from llds_jax.retrieval.bm25 import BM25Retriever
from llds_jax.retrieval.client import HttpRetriever
from llds_jax.retrieval.config import RetrievalConfigError, check_method, resolve_index_path
from llds_jax.retrieval.corpus import Corpus
from llds_jax.retrieval.hit import Retriever
from llds_jax.retrieval.short_docs import maybe_short_docs

logger = logging.getLogger(__name__)


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


def build_retriever(r: ConfigDict, tokenizer=None, mesh=None) -> Retriever:
    """In-process BM25 (built and cached on first use), dense or mesh, or HTTP when ``r.url`` is set;
    seen through the ``retrieval.max_doc_tokens`` cut when it is set (in ``tokenizer``'s tokens).

    The cut is applied here, from the section, so every mode that builds a policy's retriever
    (train, sft, eval) sees the same documents for the same config. ``mesh``: the trainer's device
    mesh, which ``method="mesh"`` shards its index over (``open_mesh``); other methods ignore it.
    """
    limit = int(r.max_doc_tokens)
    if limit and tokenizer is None:
        raise RetrievalConfigError(f"retrieval.max_doc_tokens={limit} cuts passages in the policy's tokens: "
                                   "build_retriever needs the policy's tokenizer (or set it to 0)")
    return maybe_short_docs(_open(r, mesh), tokenizer, limit)


def _open(r: ConfigDict, mesh=None) -> Retriever:
    if r.url:
        return HttpRetriever(r.url, timeout=r.timeout, retries=r.retries, backoff=r.backoff,
                             max_queries_per_request=r.max_queries)
    if check_method(r) == "bm25":
        return open_bm25(r)
    return open_vector_retriever(r, mesh)


def open_vector_retriever(r: ConfigDict, mesh=None) -> Retriever:
    """``dense`` (faiss on the host) or ``mesh`` (the same vectors in device memory, over ``mesh`` when
    given, else this process's devices); imports JAX and faiss."""
    if check_method(r) == "mesh":
        from llds_jax.retrieval.mesh import open_mesh

        return open_mesh(r, mesh)
    from llds_jax.retrieval.dense import open_dense

    return open_dense(r)
