"""Exact dense retrieval inside the accelerator mesh: ``retrieval.method="mesh"``.

Search-R1's retriever is E5 over wiki-18 with a faiss ``IndexFlatIP``: 21 M passages x 768
dims, one paper turn (2,560 queries) ≈ 83 TFLOP of inner products. A TPU host's CPUs take
tens of seconds for that; the chips of the trainer's own mesh take milliseconds, and their
memory holds the vectors (fp32 64 GB, bf16 32 GB in all). So the corpus matrix lives
sharded along the passage axis in device memory and one jitted program answers a batch:

1. every device scores the (replicated) queries against its shard, ``chunk`` passages at a
   time, and keeps a running top-k (``lax.top_k`` of [running k | this chunk's k]); the only
   score matrix is one chunk's, so the program's extra memory per device is bounded by
   ``queries x chunk x 4`` bytes (+ the same again as top_k's workspace) — 2,560 x 4,096 x 4 =
   42 MB at the defaults — never ``queries x passages``;
2. the devices all-gather their ``k`` candidates (``devices x queries x k`` scores and ids)
   and take the top-k of those.

Exactness and ties: scores are fp32 accumulations (``Precision.HIGHEST``, so TPUs do not
drop fp32 to one bf16 pass). ``lax.top_k`` keeps the lower index of equal values and every
merge puts lower passage ids first, so **of exactly equal scores the lowest ids are kept**.
faiss ``IndexFlatIP`` (1.15.1) lists a run of equal scores highest id first (its heap's pop
order), and `MeshIndex.search` lists them the same way, so a tied run wholly inside the top k
(duplicate passages) comes back id for id as from faiss. Which members of a run *cut* by the
k-th place faiss keeps depends on its heap's scan history (block sizes, thread split), not on
a rule, so there the ids may differ while the scores agree (both pinned by
``tests/retrieval/test_mesh.py``). Float summation order also differs from faiss's BLAS, so
two passages within ~1e-7 may swap; on the bundled data none do (fp32, 1,200 queries).

Padding: the passage count is padded up to ``devices x chunks x chunk`` with zero rows whose
scores are forced to -inf, so no passage is ever dropped and a pad row can never be returned
(k is capped at the corpus size). Ids → text happens on the host (`Corpus.rows`).

Devices: the trainer hands its own device mesh (``app.run`` → ``build_retriever(..., mesh=)`` →
`open_mesh`), so the index lies over the same devices as the model, sharded over every axis of
that mesh, or over the axes named by ``retrieval.mesh_axis`` only (replicated over the others).
Without a mesh (``--mode=serve``, ``--mode=eval``) it is this process's devices. Under
multi-process JAX (`placement_mesh`) each host holds a whole copy over its own devices of the
trainer's mesh and answers its own rollout's queries: the hosts' rollouts reach their searches at
different times, so the search call may hold no cross-host collective.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from llds_jax.errors import InputError
from llds_jax.retrieval.corpus import Corpus
from llds_jax.retrieval.hit import Hit, check_search_args

logger = logging.getLogger(__name__)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
PASSAGE_AXIS = "passages"
MIN_QUERY_ROWS = 8  # queries are padded to a power of two ≥ this: a bounded number of compiled programs


class MeshIndexError(InputError):
    """Vectors that cannot back a mesh index (wrong file type, metric, count or dimension); names file and field."""


def _pad_rows(n: int) -> int:
    return max(MIN_QUERY_ROWS, 1 << (max(n, 1) - 1).bit_length())


def padded_queries(n: int) -> int:
    """Rows a search of ``n`` queries computes (a power of two ≥ 8): what ``--mode=plan`` charges."""
    return _pad_rows(n)


def shard_layout(num_passages: int, num_shards: int, chunk: int) -> tuple[int, int, int]:
    """``(chunks, chunk, rows per shard)`` of a `MeshIndex`: each shard's rows split into equal chunks of at
    most ``chunk`` (padding < chunks rows a shard). Pure, so ``--mode=plan`` counts the same padded bytes."""
    per_shard = -(-num_passages // num_shards)
    chunks = -(-per_shard // chunk)
    even = -(-per_shard // chunks)
    return chunks, even, chunks * even


def faiss_tie_order(scores: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``ids`` (each row best first, equal scores lowest id first) with every run of exactly equal
    scores reversed: the order faiss ``IndexFlatIP`` returns ties in."""
    ids = ids.copy()
    for row in range(len(ids)):
        s = scores[row]
        start = 0
        for end in range(1, len(s) + 1):
            if end == len(s) or s[end] != s[start]:
                if end - start > 1:
                    ids[row, start:end] = ids[row, start:end][::-1]
                start = end
    return ids


class MeshIndex:
    """Passage vectors sharded over devices; `search` is exact inner-product top-k, like IndexFlatIP.

    ``vectors`` may be a memory map (an ``np.load(mmap_mode="r")`` file or a faiss index's
    buffer): each device's shard is read, cast and copied to its device one at a time, so
    host memory never holds a second full copy.
    """

    def __init__(self, vectors: np.ndarray, dtype: str = "float32", chunk: int = 4096,
                 mesh: jax.sharding.Mesh | None = None, axes: str | Sequence[str] | None = None,
                 source: str = "vectors"):
        if vectors.ndim != 2 or vectors.shape[0] < 1 or vectors.shape[1] < 1:
            raise MeshIndexError(f"{source}: expected a [passages, dim] matrix with at least one row, "
                                 f"got shape {tuple(vectors.shape)}")
        if dtype not in DTYPES:
            raise MeshIndexError(f"retrieval.mesh_dtype={dtype!r} must be one of {tuple(DTYPES)}")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise MeshIndexError(f"retrieval.mesh_chunk={chunk!r} must be a positive integer")
        if mesh is None:
            mesh = jax.make_mesh((len(jax.local_devices()),), (PASSAGE_AXIS,), devices=jax.local_devices(),
                                 axis_types=(jax.sharding.AxisType.Auto,))
        axes = tuple(mesh.axis_names) if not axes else ((axes,) if isinstance(axes, str) else tuple(axes))
        if unknown := [a for a in axes if a not in mesh.axis_names]:
            raise MeshIndexError(f"retrieval.mesh_axis names {unknown}, not axes of the mesh {mesh.axis_names}")
        self.mesh, self.axes, self.source = mesh, axes, source
        self.num_passages, self.dim = int(vectors.shape[0]), int(vectors.shape[1])
        self.dtype_name = dtype
        self.num_shards = math.prod(mesh.shape[a] for a in axes)
        self.num_chunks, self.chunk, self.rows_per_shard = shard_layout(self.num_passages, self.num_shards, chunk)
        self.padded_passages = self.rows_per_shard * self.num_shards
        self.sharding = NamedSharding(mesh, P(axes, None))
        self.vectors = self._place(vectors, DTYPES[dtype])
        self._search = self._compile_search()

    @property
    def bytes_per_device(self) -> int:
        return self.rows_per_shard * self.dim * jnp.dtype(DTYPES[self.dtype_name]).itemsize

    def _place(self, vectors: np.ndarray, dtype) -> jax.Array:
        """One host slice per device shard, zero rows past the end (the pads), cast on the host."""
        shape = (self.padded_passages, self.dim)

        def shard(index: tuple[slice, ...]) -> np.ndarray:
            rows = index[0]
            start, stop = rows.start or 0, shape[0] if rows.stop is None else rows.stop
            block = np.zeros((stop - start, self.dim), jnp.dtype(dtype))
            real = max(0, min(stop, self.num_passages) - start)
            if real:
                block[:real] = np.asarray(vectors[start : start + real], dtype=np.float32)
            if not np.isfinite(block[:real]).all():
                bad = start + int(np.argwhere(~np.isfinite(block[:real]))[0, 0])
                raise MeshIndexError(f"{self.source}: passage vector {bad} is not finite (NaN or inf)")
            return block

        return jax.make_array_from_callback(shape, self.sharding, shard)

    def _compile_search(self):
        axes, num_chunks, chunk = self.axes, self.num_chunks, self.chunk
        rows_per_shard, num_passages = self.rows_per_shard, self.num_passages
        high = jax.lax.Precision.HIGHEST

        def local_topk(queries, shard, k):
            """This device's best ``kl`` of its shard: a scan over chunks with a running top-k."""
            base = jax.lax.axis_index(axes) * rows_per_shard
            kl, kc = min(k, rows_per_shard), min(k, chunk)
            q = queries.astype(shard.dtype)

            def step(carry, c):
                best_s, best_i = carry
                block = jax.lax.dynamic_slice_in_dim(shard, c * chunk, chunk)
                scores = jnp.einsum("qd,pd->qp", q, block, precision=high, preferred_element_type=jnp.float32)
                ids = base + c * chunk + jnp.arange(chunk, dtype=jnp.int32)
                scores = jnp.where(ids < num_passages, scores, -jnp.inf)
                top_s, top_j = jax.lax.top_k(scores, kc)
                # running candidates first: they come from earlier chunks, so ties keep the lower id
                both_s = jnp.concatenate([best_s, top_s], axis=1)
                both_i = jnp.concatenate([best_i, base + c * chunk + top_j.astype(jnp.int32)], axis=1)
                keep_s, keep = jax.lax.top_k(both_s, kl)
                return (keep_s, jnp.take_along_axis(both_i, keep, axis=1)), None

            init = (jnp.full((q.shape[0], kl), -jnp.inf, jnp.float32),
                    jnp.full((q.shape[0], kl), jnp.iinfo(jnp.int32).max, jnp.int32))
            (best_s, best_i), _ = jax.lax.scan(step, init, jnp.arange(num_chunks))
            return best_s, best_i

        @functools.partial(jax.jit, static_argnums=(2,))
        def search(queries, vectors, k):
            def per_device(q, shard):
                s, i = local_topk(q, shard, k)
                # [shards, queries, kl] in shard order = passage order, so ties again keep the lower id
                all_s = jax.lax.all_gather(s, axes, axis=1, tiled=True)
                all_i = jax.lax.all_gather(i, axes, axis=1, tiled=True)
                top_s, pick = jax.lax.top_k(all_s, k)
                return top_s, jnp.take_along_axis(all_i, pick, axis=1)

            return jax.shard_map(per_device, mesh=self.mesh, in_specs=(P(), P(axes, None)), out_specs=(P(), P()),
                                 check_vma=False)(queries, vectors)

        return search

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``(scores [Q, k'], ids [Q, k'])`` with ``k' = min(k, passages)``, best first, as faiss's ``search``.

        A k past the corpus size returns every passage (as `DenseRetriever` does), never a pad row.
        """
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be a positive int, got {k!r}")
        queries = np.asarray(queries, np.float32)
        if queries.ndim != 2 or queries.shape[1] != self.dim:
            raise ValueError(f"queries must be [n, {self.dim}], got shape {queries.shape}")
        k = min(k, self.num_passages)
        if not len(queries):
            return np.zeros((0, k), np.float32), np.zeros((0, k), np.int64)
        padded = np.zeros((_pad_rows(len(queries)), self.dim), np.float32)
        padded[: len(queries)] = queries
        scores, ids = self._search(jnp.asarray(padded), self.vectors, k)
        scores, ids = np.asarray(scores)[: len(queries)], np.asarray(ids)[: len(queries)].astype(np.int64)
        return scores, faiss_tie_order(scores, ids)


def read_faiss_flat(path: str | os.PathLike) -> tuple[np.ndarray, object]:
    """The ``[ntotal, d]`` float32 vectors of a faiss Flat inner-product file (Search-R1's ``e5_Flat.index``).

    The file is memory-mapped (``IO_FLAG_MMAP``) and the vectors are a view of faiss's buffer, so
    reading a 64 GB wiki-18 index costs no RAM up front; the second value returned owns that
    buffer and must outlive the view. Anything but an exact inner-product Flat index is refused:
    IVF/PQ/HNSW files hold compressed or partial vectors, and an L2 index ranks differently.
    """
    import faiss

    path = Path(path)
    if not path.is_file():
        raise MeshIndexError(f"retrieval.mesh_index_file={str(path)!r}: no such file")
    try:
        raw = faiss.read_index(str(path), faiss.IO_FLAG_MMAP)  # owns the C++ index: keep it referenced
    except RuntimeError as exc:
        raise MeshIndexError(f"{path}: not a faiss index file ({str(exc).splitlines()[0][:200]})") from None
    index = faiss.downcast_index(raw)
    if not isinstance(index, faiss.IndexFlat):
        raise MeshIndexError(f"{path}: a {type(index).__name__}, not an exact Flat index; the mesh index needs the "
                             f"full vectors (build one with --mode=index, retrieval.faiss_factory=Flat)")
    if index.metric_type != faiss.METRIC_INNER_PRODUCT:
        raise MeshIndexError(f"{path}: metric_type={index.metric_type} is not METRIC_INNER_PRODUCT "
                             f"({faiss.METRIC_INNER_PRODUCT}); the mesh index ranks by inner product")
    vectors = faiss.rev_swig_ptr(index.get_xb(), index.ntotal * index.d).reshape(index.ntotal, index.d)
    return vectors, (raw, index)


class _ShardedRows:
    """The ``embeddings/shard_*.npy`` files of a dense index directory seen as one row-sliceable matrix."""

    def __init__(self, paths: Sequence[Path]):
        self.parts = [np.load(p, mmap_mode="r") for p in paths]
        self.starts = np.cumsum([0] + [len(part) for part in self.parts])
        dims = {part.shape[1] for part in self.parts if part.ndim == 2}
        if len(dims) != 1 or any(part.ndim != 2 for part in self.parts):
            raise MeshIndexError(f"{paths[0].parent}: embedding shards disagree on shape "
                                 f"({sorted({tuple(part.shape) for part in self.parts})})")
        self.shape, self.ndim = (int(self.starts[-1]), dims.pop()), 2

    def __getitem__(self, rows: slice) -> np.ndarray:
        start, stop = rows.start, min(rows.stop, self.shape[0])
        pieces = [part[max(start - lo, 0) : stop - lo] for part, lo, hi in zip(self.parts, self.starts, self.starts[1:])
                  if lo < stop and hi > start]
        return np.concatenate(pieces) if pieces else np.zeros((0, self.shape[1]), np.float32)


def read_index_dir(index_dir: str | os.PathLike) -> _ShardedRows:
    """Vectors of our own dense index directory (what ``--mode=index`` with method dense/mesh writes)."""
    from llds_jax.retrieval.dense import META_FILE

    index_dir = Path(index_dir)
    meta_path = index_dir / META_FILE
    if not meta_path.exists():
        raise FileNotFoundError(f"no dense index in {index_dir} (missing {META_FILE}); run --mode=index with "
                                f"retrieval.method=mesh, or set retrieval.mesh_index_file to an e5_Flat.index")
    meta = json.loads(meta_path.read_text())
    paths = sorted((index_dir / "embeddings").glob("shard_*.npy"))
    expected = -(-meta["num_docs"] // meta["shard_size"])
    if len(paths) != expected:
        raise MeshIndexError(f"{index_dir / 'embeddings'}: {len(paths)} shard files but meta.json's num_docs="
                             f"{meta['num_docs']} needs {expected}; finish it with --mode=index")
    rows = _ShardedRows(paths)
    if rows.shape != (meta["num_docs"], meta["dim"]):
        raise MeshIndexError(f"{index_dir / 'embeddings'}: shards hold {rows.shape} vectors but {meta_path} says "
                             f"num_docs={meta['num_docs']}, dim={meta['dim']}")
    return rows


def check_against(vectors_shape: tuple[int, int], source: str, corpus: Corpus, dim: int, encoder: str) -> None:
    """An index whose count is not the corpus's, or whose dimension is not the encoder's, is refused by name."""
    count, width = vectors_shape
    if count != len(corpus):
        raise MeshIndexError(f"{source}: ntotal={count} vectors but corpus {corpus.path} (retrieval.corpus_path) "
                             f"has {len(corpus)} rows; they must be the same passages in the same order")
    if width != dim:
        raise MeshIndexError(f"{source}: dimension d={width} but the encoder {encoder} (retrieval.encoder_path) "
                             f"produces {dim}-d vectors")


class MeshRetriever:
    """The `Retriever` over a `MeshIndex`: queries encoded by the dense retriever's embedder, same prefixes."""

    def __init__(self, embedder, index: MeshIndex, corpus: Corpus):
        if index.num_passages != len(corpus) or index.dim != embedder.dim:
            check_against((index.num_passages, index.dim), index.source, corpus, embedder.dim, "in use")
        self.embedder, self.index, self.corpus = embedder, index, corpus

    def search(self, queries: Sequence[str], topk: int) -> list[list[Hit]]:
        """One encoder pass and one mesh program for the whole batch (a rollout turn); text on the host.

        Empty queries are encoded as the dense path encodes them (prefix only) and get k hits;
        long ones are cut to the encoder's ``max_length`` tokens by its tokenizer.
        """
        queries = check_search_args(queries, topk)
        if not queries:
            return []
        scores, rows = self.index.search(self.embedder.encode_queries(queries), topk)
        results = []
        for row_ids, row_scores in zip(rows, scores):
            docs = self.corpus.rows(row_ids)
            results.append([Hit(id=i, contents=c, score=float(s)) for (i, c), s in zip(docs, row_scores)])
        return results


def placement_mesh(mesh: jax.sharding.Mesh | None, axes: Sequence[str] | None):
    """``(mesh, axes)`` the index is placed with: the trainer's ``mesh`` as given when this process addresses
    all of its devices; on several processes a one-axis mesh of this process's devices of it (each host a
    whole copy; ``axes`` then cannot apply and are dropped, with a log line); no mesh: this process's devices."""
    if mesh is None:
        return None, axes
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    if len(local) == mesh.devices.size:
        return mesh, axes
    if axes:
        logger.info("mesh index: retrieval.mesh_axis=%s applies on one process; on %d processes each holds a whole "
                    "copy over its %d devices of the trainer's mesh", ",".join(axes), jax.process_count(), len(local))
    return jax.make_mesh((len(local),), (PASSAGE_AXIS,), devices=local,
                         axis_types=(jax.sharding.AxisType.Auto,)), None


def open_mesh(r, mesh: jax.sharding.Mesh | None = None) -> MeshRetriever:
    """``retrieval.method="mesh"``: vectors from ``mesh_index_file`` (a faiss Flat file) or the dense index dir,
    placed over ``mesh`` (the trainer's; `placement_mesh`), queries encoded by the configured encoder."""
    from llds_jax.retrieval.config import resolve_index_path
    from llds_jax.retrieval.dense import embedder_from_config

    corpus = Corpus(r.corpus_path)
    keep_alive = None
    if r.get("mesh_index_file"):
        vectors, keep_alive = read_faiss_flat(r.mesh_index_file)
        source = str(r.mesh_index_file)
    else:
        vectors = read_index_dir(resolve_index_path(r))
        source = str(resolve_index_path(r) / "embeddings")
    if vectors.shape[0] != len(corpus):  # before the encoder's weights are loaded
        check_against(tuple(vectors.shape), source, corpus, vectors.shape[1], "")
    embedder, encoder_path = embedder_from_config(r)
    check_against(tuple(vectors.shape), source, corpus, embedder.dim, encoder_path)
    mesh, axes = placement_mesh(mesh, [a for a in str(r.mesh_axis).split(",") if a] or None)
    index = MeshIndex(vectors, dtype=r.mesh_dtype, chunk=r.mesh_chunk, mesh=mesh,
                      axes=axes, source=source)
    del keep_alive  # the vectors are on the devices now
    logger.info("mesh index: %d x %d %s over %d device shard(s) of mesh %s (axes %s), %.2f GB a device",
                index.num_passages, index.dim, index.dtype_name, index.num_shards, dict(index.mesh.shape),
                ",".join(index.axes), index.bytes_per_device / 1e9)
    return MeshRetriever(embedder, index, corpus)
