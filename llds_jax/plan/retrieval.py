"""The retriever in the plan: the mesh index's bytes per device, and a search's seconds per backend.

Why a model per backend: a flat 0.5 s a call hid the one cost that decides whether the paper's
retriever is usable at all. An exact (Flat) E5 search over wiki-18 is 2·Q·N·d FLOPs — ≈ 83 TFLOP
for a paper turn of 2,560 queries — which a host's CPUs take tens of seconds for and the
trainer's chips milliseconds (``retrieval.method="mesh"``, ``llds_jax.retrieval.mesh``).

Every search is charged as ``fixed + per_query × queries`` seconds a call (`SearchCost`):

* **faiss Flat on a host** (``retrieval.method="dense"``, ``faiss_factory="Flat"``; also a
  ``retrieval.url`` server): 2·N·d FLOPs a query at the host's FLOP/s — ``plan.host_flops``, or
  (0) faiss's own rate measured here per thread (`measured_faiss_flops`: a short IndexFlatIP run)
  times the target host's vCPUs (`HOST_VCPUS`). Linear in cores: optimistic for the host.
* **faiss IVF / IVF-PQ**: the coarse quantizer (2·nlist·d a query) plus Flat's FLOPs over the
  probed fraction ``ivf_nprobe / nlist``; PQ's table look-ups cost less than the 2·d FLOPs a
  vector charged here, so this is an upper bound.
* **BM25** (bm25s): `BM25_QUERY_S` + `BM25_PASSAGE_S` × N a query and thread, measured here
  (the bundled corpus at 1,500 / 6,169 / 24,676 rows), over the host's vCPUs.
* **mesh**: each host searches its own queries over its chips (``open_mesh`` shards over the
  trainer's mesh, or its ``retrieval.mesh_axis`` axes, on one host; each host's devices of it on
  several: `index_shards`): per chip, the matmul over its padded shard at peak × matmul
  efficiency (fp32 vectors: ``Precision.HIGHEST`` — 6 bf16 passes on TPU, the fp32 rate on GPU)
  or its shard read at HBM bandwidth × HBM efficiency, whichever is longer, plus the score
  tiles written and read back for ``top_k``, plus two all-gathers of every chip's k candidates
  (scores and ids) at the interconnect bandwidth (`INTERCONNECT`) and a stated latency each.
  Query encoding is not charged (the same for every dense backend).

Other faiss factories (HNSW, …) have no model here: they are charged ``plan.retrieval_s`` a call,
and so is every backend when ``plan.retrieval_s`` > 0 (the old flat charge, kept as an override).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import time
from pathlib import Path

# The paper's index when the configured one cannot be read (plan.index_passages / index_dim defaults).
WIKI18_PASSAGES, E5_DIM = 21_015_324, 768
# vCPUs of one host of each target: the retrieval host's cores (a Search-R1 server beside the trainer).
HOST_VCPUS = {
    "v5e": (112, "ct5lp-hightpu-4t, the 4-chip hosts of v5e slices: 112 vCPUs"),
    "v5p": (208, "ct5p-hightpu-4t: 208 vCPUs"),
    "H100": (208, "a3-highgpu-8g: 208 vCPUs"),
    "H200": (224, "a3-ultragpu-8g: 224 vCPUs"),
}
# Chip-to-chip bandwidth one way per chip (datasheets), for the mesh search's all-gather.
INTERCONNECT = {
    "v5e": (200e9, "TPU v5e ICI 1,600 Gbps per chip"),
    "v5p": (600e9, "TPU v5p ICI 4,800 Gbps per chip"),
    "H100": (450e9, "H100 SXM NVLink 900 GB/s bidirectional"),
    "H200": (450e9, "H200 NVLink 900 GB/s bidirectional"),
}
COLLECTIVE_LATENCY_S = (20e-6, "assumed: 20 us per all-gather (launch + hops), two a search")
# fp32 vectors: how much slower than the bf16 peak the HIGHEST-precision matmul runs.
FP32_SLOWDOWN = {"tpu": (6.0, "Precision.HIGHEST = 6 bf16 passes on the MXU"),
                 "gpu": (989 / 67, "H100/H200 SXM: 67 TFLOP/s fp32 vs 989 bf16 (datasheet)"),
                 "cpu": (1.0, "the CPU peak is measured in fp32")}
# bm25s 0.2, one thread, this VM (2 vCPUs, load 1.8-1.9), 1,000 bundled queries, k=3, over the bundled
# corpus at 1,500 / 6,169 / 24,676 rows (the last the corpus 4x): 108 / 148 / 192 us a query.
BM25_QUERY_S = 1.0e-4
BM25_PASSAGE_S = 2.4e-9
OTHER_BACKEND_S = 0.5  # a call of a backend without a model (HNSW, ...): the flat charge the plan made before
BM25_SOURCE = ("measured here: bm25s, 1 thread, 108/148/192 us a query at 1,500/6,169/24,676 bundled rows "
               "(load 1.9 on 2 vCPUs): 100 us + 2.4 ns a passage, linear in N")


@dataclasses.dataclass(frozen=True)
class IndexShape:
    """Passages and dimension of the index a run searches, and where they were read."""

    passages: int
    dim: int
    source: str


@dataclasses.dataclass(frozen=True)
class SearchCost:
    """Seconds of one batched search call of ``q`` queries (``q`` padded to a power of two ≥ 8 where
    ``pad``): ``fixed + per_query·q + max(floor, overlapped·q)`` — the last term a roofline (the mesh's
    shard read, ``floor``, overlaps its matmul, ``overlapped`` a query); ``why`` names the sources."""

    backend: str
    fixed: float
    per_query: float
    why: str
    floor: float = 0.0
    overlapped: float = 0.0
    pad: bool = False

    def seconds(self, queries: float) -> float:
        if queries <= 0:
            return 0.0
        if self.pad:
            from llds_jax.retrieval.mesh import padded_queries  # noqa: PLC0415

            queries = padded_queries(int(-(-queries // 1)))
        return self.fixed + self.per_query * queries + max(self.floor, self.overlapped * queries)

    def total(self, calls: int, queries: float) -> float:
        """Seconds of ``calls`` calls sharing ``queries`` evenly (exact for the affine terms)."""
        return calls * self.seconds(queries / calls) if calls > 0 and queries > 0 else 0.0


def index_shape(config) -> IndexShape:
    """The configured index's size when this host can read it (the mesh file's header, or the index
    directory's ``meta.json``), else ``plan.index_passages`` × ``plan.index_dim`` (wiki-18 × E5 by
    default). A ``retrieval.url`` server's index is never visible to the plan: the fields."""
    r, section = config.retrieval, config.plan
    fallback = IndexShape(int(section.index_passages), int(section.index_dim),
                          "plan.index_passages x plan.index_dim")
    if r.url:
        return dataclasses.replace(fallback, source=fallback.source + f" (served by {r.url})")
    try:
        if r.method == "mesh" and r.mesh_index_file and Path(r.mesh_index_file).is_file():
            import faiss  # noqa: PLC0415

            index = faiss.read_index(str(r.mesh_index_file), faiss.IO_FLAG_MMAP)
            return IndexShape(int(index.ntotal), int(index.d), str(r.mesh_index_file))
        from llds_jax.retrieval.config import resolve_index_path  # noqa: PLC0415

        meta_path = resolve_index_path(r) / "meta.json"
        if meta_path.is_file():
            meta = json.loads(meta_path.read_text())
            dim = int(meta["dim"]) if "dim" in meta else fallback.dim
            return IndexShape(int(meta["num_docs"]), dim, str(meta_path))
    except (OSError, RuntimeError, ValueError, KeyError):  # unreadable: the stated fields
        pass
    return fallback


def mesh_index_bytes(config, shape: IndexShape, shards: int, queries: int) -> tuple[int, int]:
    """(index, search workspace) bytes per device of ``retrieval.method="mesh"``: the padded shard exactly
    as `MeshIndex` pads it, and the search's score tile plus top_k's copy (2 × queries × chunk × 4 B)."""
    from llds_jax.retrieval.mesh import padded_queries, shard_layout  # noqa: PLC0415

    r = config.retrieval
    _, chunk, rows = shard_layout(shape.passages, max(1, shards), int(r.mesh_chunk))
    itemsize = 2 if r.mesh_dtype == "bfloat16" else 4
    return rows * shape.dim * itemsize, 2 * padded_queries(queries) * chunk * 4


def host_vcpus(hardware: str) -> tuple[int, str]:
    """The target's host vCPUs, or (no table chip) this machine's own."""
    if hardware in HOST_VCPUS:
        return HOST_VCPUS[hardware]
    return os.cpu_count() or 1, "this machine's own CPUs (no target host)"


@functools.cache
def measured_faiss_flops() -> tuple[float, str]:
    """faiss IndexFlatIP's FLOP/s on one thread of this CPU (best of 3, 256 queries × 20,000 × 768, ≈ 0.3 s);
    numpy's fp32 matmul per core where faiss is not installed. Scaled by the target host's vCPUs, it is
    optimistic: two vCPUs are one core's hyperthreads, and memory bandwidth is shared."""
    import numpy as np  # noqa: PLC0415

    x = np.random.default_rng(0).standard_normal((20_000, E5_DIM), dtype=np.float32)
    queries = x[:256].copy()
    load = os.getloadavg()[0]
    try:
        import faiss  # noqa: PLC0415
    except ImportError:
        best = min(_timed(lambda: queries @ x.T) for _ in range(3))
        threads = os.cpu_count() or 1
        return 2 * 256 * 20_000 * E5_DIM / best / threads, (
            f"numpy fp32 matmul on this CPU / {threads} cores (faiss not installed), load {load:.1f}")
    index = faiss.IndexFlatIP(E5_DIM)
    index.add(x)
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)  # one thread: a core's own rate, not the other tenants' contention
    try:
        index.search(queries, 3)
        best = min(_timed(lambda: index.search(queries, 3)) for _ in range(3))
    finally:
        faiss.omp_set_num_threads(threads)
    return 2 * 256 * 20_000 * E5_DIM / best, (
        f"faiss {faiss.__version__} IndexFlatIP on this CPU, 1 thread, best of 3, load {load:.1f}")


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def host_flops(section, hardware: str) -> tuple[float, str]:
    """FLOP/s of the retrieval host on an exact search: ``plan.host_flops``, else measured per thread × vCPUs."""
    if float(section.host_flops) > 0:
        return float(section.host_flops), "plan.host_flops"
    per_thread, how = measured_faiss_flops()
    vcpus, host = host_vcpus(hardware)
    return per_thread * vcpus, f"{per_thread / 1e9:.1f} GFLOP/s a thread ({how}) x {vcpus} vCPUs ({host})"


def backend_of(r) -> str:
    """The backend a ``retrieval`` section searches with: bm25, flat, ivf, mesh, or other (no model)."""
    if r.method in ("bm25", "mesh"):
        return str(r.method)
    factory = str(r.faiss_factory)
    return "flat" if factory == "Flat" else "ivf" if re.match(r"IVF\d+", factory) else "other"


def search_cost(config, backend: str, shape: IndexShape, *, hardware: str, platform: str, peak, shards: int,
                matmul: float, hbm: float, dtype: str = "") -> SearchCost:
    """Seconds of one search call of ``backend`` over ``shape`` (module docstring); ``shards``: the mesh
    index's chips per host; ``dtype`` replaces ``retrieval.mesh_dtype``."""
    section, r = config.plan, config.retrieval
    n, d = shape.passages, shape.dim
    if float(section.retrieval_s) > 0:
        return SearchCost(backend, float(section.retrieval_s), 0.0, f"{float(section.retrieval_s):g} s a call "
                          "(plan.retrieval_s)")
    if backend == "other":
        return SearchCost(backend, OTHER_BACKEND_S, 0.0, f"{OTHER_BACKEND_S:g} s a call: no model of "
                          f"retrieval.faiss_factory={r.faiss_factory!r} (set plan.retrieval_s)")
    if backend == "bm25":
        vcpus, host = host_vcpus(hardware)
        return SearchCost(backend, 0.0, (BM25_QUERY_S + BM25_PASSAGE_S * n) / vcpus,
                          f"BM25 over {n:,} passages: {BM25_SOURCE}; over {vcpus} vCPUs ({host})")
    if backend in ("flat", "ivf"):
        rate, how = host_flops(section, hardware)
        per_query, what = 2.0 * n * d, f"faiss Flat: 2·N·d = {2.0 * n * d:.3g} FLOP a query"
        if backend == "ivf":
            nlist = int(re.match(r"IVF(\d+)", str(r.faiss_factory)).group(1))
            probed = min(1.0, int(r.ivf_nprobe) / nlist)
            per_query = 2.0 * nlist * d + 2.0 * n * d * probed
            what = (f"faiss {r.faiss_factory}: coarse 2·nlist·d + 2·N·d x nprobe/nlist ({probed:.4f}) "
                    f"= {per_query:.3g} FLOP a query (an upper bound for PQ codes)")
        return SearchCost(backend, 0.0, per_query / rate, f"{what}, at {rate / 1e12:.2f} TFLOP/s: {how}")
    # mesh: per chip of the host's local shard
    from llds_jax.retrieval.mesh import shard_layout  # noqa: PLC0415

    _, chunk, rows = shard_layout(n, max(1, shards), int(r.mesh_chunk))
    dtype = dtype or str(r.mesh_dtype)
    itemsize = 2 if dtype == "bfloat16" else 4
    slowdown, slow_why = (1.0, "bf16") if itemsize == 2 else FP32_SLOWDOWN.get(platform, FP32_SLOWDOWN["cpu"])
    rate, bandwidth = peak.flops * matmul / slowdown, peak.bytes_per_s * hbm
    link, link_why = INTERCONNECT.get(hardware, (peak.bytes_per_s, "no table chip: the device's memory bandwidth"))
    latency, latency_why = COLLECTIVE_LATENCY_S
    k = int(r.topk)
    return SearchCost(
        backend, fixed=2 * latency if shards > 1 else 0.0,
        per_query=2 * rows * 4 / bandwidth + (shards - 1) * k * 8 / link,
        floor=rows * d * itemsize / bandwidth, overlapped=2.0 * rows * d / rate, pad=True, why=(
            f"mesh ({dtype}): {rows:,} padded rows x {d} a chip, {shards} chip(s) per host; the matmul at "
            f"{rate / 1e12:.1f} TFLOP/s ({matmul:.2f} of peak; {slow_why}) or the shard read at "
            f"{bandwidth / 1e9:.0f} GB/s, the longer; fp32 score tiles 2·Q·rows·4 B at that bandwidth; all-gather "
            f"of k={k} x 8 B a query a chip at {link / 1e9:.0f} GB/s ({link_why}); {latency_why}"))


def index_shards(config, devices: int, hosts: int) -> int:
    """Devices one copy of the mesh index is split over, as ``open_mesh`` places it on the trainer's mesh:
    on one host every device, or the product of the ``retrieval.mesh_axis`` axes' sizes in ``mesh.shape``
    (replicated over the rest); on several hosts each host's devices (a whole copy each)."""
    if hosts > 1:
        return max(1, devices // hosts)
    from llds_jax.parallel.mesh import MESH_AXES, resolve_mesh_shape  # noqa: PLC0415

    named = [a for a in str(config.retrieval.mesh_axis).split(",") if a]
    if not named:
        return max(1, devices)
    sizes = dict(zip(MESH_AXES, resolve_mesh_shape(tuple(config.mesh.shape), devices)))
    return max(1, math.prod(sizes.get(a, 1) for a in named))


def index_memory(config, devices: int, hosts: int) -> tuple[dict[str, int], str]:
    """What the retriever holds on each device for the whole run, and a note for the plan.

    ``retrieval.method="mesh"``: the index's padded shard over `index_shards` devices and the search's
    workspace for a call of the host's trajectories; any other method: nothing on the devices (the
    note says where it is).
    """
    r, shape = config.retrieval, index_shape(config)
    local = index_shards(config, devices, hosts)
    if r.method != "mesh" or r.url:
        where = f"served by {r.url}" if r.url else "host memory"
        return {}, (f"retrieval: {r.method} ({where}), nothing on the devices; index {shape.passages:,} x "
                    f"{shape.dim} ({shape.source})")
    queries = -(-int(config.train.prompts_per_step) * int(config.rollout.n_samples) // max(1, hosts))
    index, workspace = mesh_index_bytes(config, shape, local, queries)
    return {"retrieval_index": index, "retrieval_search": workspace}, (
        f"retrieval index (retrieval.method='mesh', retrieval.mesh_dtype={r.mesh_dtype!r}): {shape.passages:,} x "
        f"{shape.dim} ({shape.source}) split over {local} device(s), {index / 1e9:.2f} GB a device padded, + "
        f"{workspace / 1e6:.0f} MB search workspace ({queries} queries x retrieval.mesh_chunk); counted in every phase")


def refuse_index(config, devices: int, hosts: int, limit: int) -> str:
    """The refusal's line when the mesh index alone does not fit ``limit`` bytes a device ("" if it does)."""
    held, _ = index_memory(config, devices, hosts)
    if not held or sum(held.values()) <= limit:
        return ""
    r = config.retrieval
    return (f"  retrieval index: {sum(held.values()) / 1e9:.2f} GB per device (retrieval.method='mesh', "
            f"retrieval.mesh_dtype={r.mesh_dtype!r}, index {held['retrieval_index']:,} B + search "
            f"{held['retrieval_search']:,} B) > {limit / 1e9:.2f} GB before the model; use "
            "retrieval.mesh_dtype='bfloat16', more devices, or retrieval.method='dense' (host faiss)")
