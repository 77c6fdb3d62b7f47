"""``--mode=index`` and ``--mode=serve`` (dispatched by ``llds_jax/main.py``).

    python -m llds_jax.main --mode=index --config=configs/retriever.py
    python -m llds_jax.main --mode=serve --config=configs/retriever.py --config.retrieval.port=8001

``serve`` with ``method=bm25`` and no index on disk builds it first (seconds for the
bundled corpus); a dense index is never built implicitly because it takes hours at scale.
"""

from __future__ import annotations

import logging
import signal

from ml_collections import ConfigDict

from llds_jax.retrieval.config import check_method, resolve_index_path
from llds_jax.retrieval.factory import open_bm25
from llds_jax.retrieval.server import ServiceLimits, serve

logger = logging.getLogger(__name__)


def index_main(config: ConfigDict) -> None:
    """Build (or, for dense, resume) the index of ``config.retrieval`` and write it to disk."""
    r = config.retrieval
    index_dir = resolve_index_path(r)
    if check_method(r) == "bm25":
        from llds_jax.retrieval.bm25 import BM25Retriever
        from llds_jax.retrieval.corpus import Corpus

        corpus = Corpus(r.corpus_path)
        BM25Retriever.build(corpus, show_progress=True).save(index_dir)
        print(f"BM25 index over {len(corpus)} rows of {corpus.path} written to {index_dir}", flush=True)
        return
    from llds_jax.retrieval.dense import build_dense_index_from_config

    faiss_path = build_dense_index_from_config(r, index_dir)  # method=mesh serves these same embeddings
    print(f"dense {r.faiss_factory!r} index over {r.corpus_path} written to {faiss_path}", flush=True)


def _exit_cleanly(signum, frame) -> None:
    raise SystemExit(0)


def serve_main(config: ConfigDict) -> None:
    """Serve ``POST /retrieve`` on ``retrieval.host:port`` until interrupted."""
    logging.basicConfig(level=logging.INFO)
    r = config.retrieval
    if check_method(r) == "bm25":
        retriever = open_bm25(r, build_if_missing=True)
    else:
        from llds_jax.retrieval.factory import open_vector_retriever

        retriever = open_vector_retriever(r)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, restores the handlers it found and then
    # re-raises the signal, so with the default handlers a clean stop exits -15 / KeyboardInterrupt.
    # A stop the service was asked for (before or while serving) is a success: exit 0.
    for stop in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop, _exit_cleanly)
    limits = ServiceLimits(default_topk=r.topk, max_topk=r.max_topk, max_queries=r.max_queries,
                           max_query_chars=r.max_query_chars, max_request_bytes=r.max_request_bytes)
    serve(retriever, r.host, r.port, limits, description=f"{r.method} over {r.corpus_path}")
