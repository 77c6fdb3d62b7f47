"""Dense retrieval: corpus embeddings in resumable shards, a faiss index from a factory string.

Embedding wiki-18 takes GPU-hours (and CPU-days), so building is split in two, in one
index directory:
1. ``embeddings/shard_NNNNN.npy`` — ``shard_size`` passages each, written atomically; a
   rerun skips finished shards, so an interrupted build resumes where it stopped;
2. ``faiss/<factory>.faiss`` — any faiss ``index_factory`` string with inner-product
   metric ("Flat" exact, "HNSW32" graph, "IVF4096,PQ64" compressed); trained on a sample
   when the type needs training, then filled shard by shard from memory-mapped files.
   Several factories share one set of embeddings (Flat vs HNSW costs no re-encoding).
``meta.json`` pins the corpus, encoder and options: resuming with different ones is
refused, since mixing two embedding spaces in one index silently ruins recall.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import faiss
import numpy as np
from ml_collections import ConfigDict
from tqdm import tqdm

from llds_jax.retrieval.config import resolve_index_path
from llds_jax.retrieval.corpus import Corpus
from llds_jax.retrieval.embedder import EmbedderOptions, TextEmbedder
from llds_jax.retrieval.hit import Hit, RetrievalError, check_search_args

logger = logging.getLogger(__name__)

META_FILE = "meta.json"
MAX_TRAIN_VECTORS = 262_144


def _shard_path(index_dir: Path, shard: int) -> Path:
    return index_dir / "embeddings" / f"shard_{shard:05d}.npy"


def faiss_file(index_dir: str | os.PathLike, factory: str) -> Path:
    """Where the index of one factory string lives inside a dense index directory."""
    return Path(index_dir) / "faiss" / ("".join(ch if ch.isalnum() else "_" for ch in factory) + ".faiss")


def _save_atomically(target: Path, array: np.ndarray) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".tmp")
    with os.fdopen(fd, "wb") as handle:
        np.save(handle, array)
    os.replace(tmp, target)


def _check_or_write_meta(index_dir: Path, meta: dict) -> None:
    path = index_dir / META_FILE
    if path.exists():
        old = json.loads(path.read_text())
        if old != meta:
            changed = ", ".join(f"{key}: {old.get(key)!r} → {meta.get(key)!r}"
                                for key in sorted(set(old) | set(meta)) if old.get(key) != meta.get(key))
            raise RetrievalError(f"{path}: existing shards were built with other settings ({changed}); "
                                 f"use another index_path")
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(meta, indent=2) + "\n")


def _claim(shard_path: Path) -> bool:
    """Take the shard's lock file (O_EXCL); a lock left by a dead process on this host is broken.

    Locks let several workers (processes or hosts sharing the directory) fill one index.
    """
    lock = shard_path.with_name(shard_path.name + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        host, _, pid = lock.read_text().partition(":")
        if host != socket.gethostname() or not pid.isdigit() or _alive(int(pid)):
            return False
        lock.unlink(missing_ok=True)
        return _claim(shard_path)
    with os.fdopen(fd, "w") as handle:
        handle.write(f"{socket.gethostname()}:{os.getpid()}")
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def embed_corpus_shards(corpus: Corpus, embedder: TextEmbedder, index_dir: Path, shard_size: int,
                        show_progress: bool = True, poll_seconds: float = 10.0) -> list[Path]:
    """Encode every shard not yet on disk; returns all shard paths in row order once all exist.

    Shards another live worker holds are waited for, not duplicated.
    """
    num_shards = -(-len(corpus) // shard_size)
    paths = [_shard_path(index_dir, s) for s in range(num_shards)]
    rows_in = lambda shard: min(shard_size, len(corpus) - shard * shard_size)
    chunk_size = embedder.options.batch_size * 4
    initial = sum(rows_in(s) for s, p in enumerate(paths) if p.exists())
    with tqdm(total=len(corpus), initial=initial, desc="embedding passages", unit="passage",
              disable=not show_progress) as bar:
        while missing := [s for s, p in enumerate(paths) if not p.exists()]:
            progressed = False
            for shard in missing:
                if paths[shard].exists() or not _claim(paths[shard]):
                    continue
                try:
                    texts = list(corpus.iter_contents(shard * shard_size, (shard + 1) * shard_size))
                    vectors = []
                    for start in range(0, len(texts), chunk_size):
                        vectors.append(embedder.encode_passages(texts[start : start + chunk_size]))
                        bar.update(len(vectors[-1]))
                    _save_atomically(paths[shard], np.concatenate(vectors))
                finally:
                    paths[shard].with_name(paths[shard].name + ".lock").unlink(missing_ok=True)
                progressed = True
            if not progressed:
                time.sleep(poll_seconds)
    return paths


def build_faiss_index(shard_paths: Sequence[Path], dim: int, factory: str, seed: int = 0) -> faiss.Index:
    """Inner-product index of the given factory over the shards' vectors, in row order."""
    try:
        index = faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as exc:
        raise ValueError(f"faiss cannot build factory string {factory!r}: {exc}") from None
    shards = [np.load(p, mmap_mode="r") for p in shard_paths]
    if not index.is_trained:
        starts = np.cumsum([0] + [len(shard) for shard in shards])
        picked = np.sort(np.random.default_rng(seed).choice(starts[-1], min(starts[-1], MAX_TRAIN_VECTORS), replace=False))
        index.train(np.concatenate([
            shard[picked[(picked >= lo) & (picked < hi)] - lo] for shard, lo, hi in zip(shards, starts, starts[1:])
        ]).astype(np.float32))
    for shard in shards:
        index.add(np.ascontiguousarray(shard, dtype=np.float32))
    return index


def set_search_depth(index: faiss.Index, ef_search: int, nprobe: int) -> None:
    """Recall/speed knobs of approximate indexes; a no-op for Flat."""
    inner = faiss.downcast_index(index)
    if isinstance(inner, faiss.IndexHNSW):
        inner.hnsw.efSearch = ef_search
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None:
        ivf.nprobe = nprobe


def build_dense_index(corpus: Corpus, embedder: TextEmbedder, index_dir: str | os.PathLike, factory: str,
                      shard_size: int, encoder_name: str, show_progress: bool = True) -> Path:
    """Embed (resuming) and write ``faiss/<factory>.faiss``; returns the faiss file."""
    index_dir = Path(index_dir)
    options = dataclasses.asdict(embedder.options)
    options.pop("batch_size")  # throughput only: vectors do not depend on it
    meta = {"corpus_path": str(Path(corpus.path).resolve()), "num_docs": len(corpus), "dim": embedder.dim,
            "encoder": encoder_name, "options": options, "shard_size": shard_size}
    _check_or_write_meta(index_dir, meta)
    shard_paths = embed_corpus_shards(corpus, embedder, index_dir, shard_size, show_progress)
    index = build_faiss_index(shard_paths, embedder.dim, factory)
    target = faiss_file(index_dir, factory)
    target.parent.mkdir(parents=True, exist_ok=True)
    faiss.write_index(index, str(target) + ".tmp")
    os.replace(str(target) + ".tmp", target)
    return target


class DenseRetriever:
    """Encodes queries with the JAX encoder and searches a faiss inner-product index."""

    def __init__(self, embedder: TextEmbedder, index: faiss.Index, corpus: Corpus):
        if index.ntotal != len(corpus):
            raise RetrievalError(f"faiss index holds {index.ntotal} vectors but corpus {corpus.path} has {len(corpus)} rows")
        if index.d != embedder.dim:
            raise RetrievalError(f"faiss index has dimension {index.d} but the encoder produces {embedder.dim}")
        self.embedder, self.index, self.corpus = embedder, index, corpus

    @classmethod
    def load(cls, index_dir: str | os.PathLike, factory: str, embedder: TextEmbedder, corpus: Corpus,
             ef_search: int = 128, nprobe: int = 32, mmap: bool = False) -> DenseRetriever:
        """``mmap=True`` leaves Flat/IVF vectors on disk (page cache) instead of reading them into RAM."""
        index_path = faiss_file(index_dir, factory)
        if not index_path.exists():
            raise FileNotFoundError(f"no {factory!r} dense index at {index_path}; run --mode=index with method=dense")
        index = faiss.read_index(str(index_path), faiss.IO_FLAG_MMAP if mmap else 0)
        set_search_depth(index, ef_search, nprobe)
        return cls(embedder, index, corpus)

    def search(self, queries: Sequence[str], topk: int) -> list[list[Hit]]:
        queries = check_search_args(queries, topk)
        if not queries:
            return []
        scores, rows = self.index.search(self.embedder.encode_queries(queries), min(topk, len(self.corpus)))
        results = []
        for row_ids, row_scores in zip(rows, scores):
            keep = row_ids >= 0  # approximate indexes may return fewer than k neighbours
            docs = self.corpus.rows(row_ids[keep])
            results.append([Hit(id=i, contents=c, score=float(s)) for (i, c), s in zip(docs, row_scores[keep])])
        return results


def embedder_from_config(r: ConfigDict) -> tuple[TextEmbedder, str]:
    """The configured encoder (all-MiniLM-L6-v2 from the asset cache when ``encoder_path`` is empty)."""
    from llds_jax.utils.assets import minilm_dir

    encoder_path = r.encoder_path or str(minilm_dir())
    options = EmbedderOptions(query_prefix=r.query_prefix, passage_prefix=r.passage_prefix, pooling=r.pooling,
                              normalize=r.normalize, max_length=r.max_length, batch_size=r.batch_size)
    return TextEmbedder.from_pretrained(encoder_path, options), encoder_path


def build_dense_index_from_config(r: ConfigDict, index_dir: Path) -> Path:
    embedder, encoder_path = embedder_from_config(r)
    return build_dense_index(Corpus(r.corpus_path), embedder, index_dir, r.faiss_factory, r.shard_size,
                             encoder_name=encoder_path)


def open_dense(r: ConfigDict) -> DenseRetriever:
    embedder, _ = embedder_from_config(r)
    return DenseRetriever.load(resolve_index_path(r), r.faiss_factory, embedder, Corpus(r.corpus_path),
                               ef_search=r.hnsw_ef_search, nprobe=r.ivf_nprobe)
