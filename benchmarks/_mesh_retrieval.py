"""``bench_retrieval.py --mesh``: the mesh index vs faiss-cpu ``IndexFlatIP``, and a paper turn's predicted seconds.

    python benchmarks/bench_retrieval.py --mesh --json            # 8 simulated CPU devices, bundled corpus

One run, one machine, both sides on the same vectors (`HashedEmbedder` over the bundled
corpus: the check is the search, and the BERT encoder would dominate a CPU run):
* ``id_agreement``: share of queries whose top-k ids equal faiss Flat's, in order;
* ``qps_mesh`` / ``qps_faiss_flat``: queries per second of one batched search of all queries
  (query vectors given, no encoding), median of ``--repeats`` alternating runs after a warm-up;
* ``turn_seconds``: the predicted search time of one paper turn — 2,560 queries against
  wiki-18 (21,015,324 passages x 768 dims, E5-base) — per target, from this model:
  - ``faiss_flat_host``: the turn's 2·Q·N·d FLOPs at the GFLOP/s faiss reached here, per vCPU,
    times the target host's vCPUs (one retrieval host answers the turn, as Search-R1 deploys it;
    linear scaling in cores is an upper bound on the host, so the host figure is optimistic);
  - ``mesh``: per chip, the matmul at the chip's peak bf16 FLOP/s or its bf16 shard read at HBM
    bandwidth, whichever is longer, plus writing and reading back the fp32 score tiles for top_k
    (2·Q·N/chips·4 bytes) at HBM bandwidth (``llds_jax.utils.flops.PEAKS``, the plan's table).
    The merge's all-gather (chips·Q·k·8 bytes) and the query encoding are left out (< 1 ms).
Prints exactly one JSON object under ``--json`` (progress to stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import _harness

REPO = Path(__file__).resolve().parents[1]
PAPER_QUERIES = 512 * 5
WIKI18_PASSAGES = 21_015_324
E5_DIM = 768
# Targets: chips, PEAKS row, and the vCPUs of one of the target's hosts (the retrieval host).
TARGETS = {
    "v5e:8x8": {"chips": 64, "hardware": "v5e", "host_vcpus": 112,
                "host": "ct5lp-hightpu-4t (the 4-chip hosts of a v5e-64 slice): 112 vCPUs"},
    "8xH100": {"chips": 8, "hardware": "H100", "host_vcpus": 208, "host": "a3-highgpu-8g: 208 vCPUs"},
}


def turn_model(faiss_gflops_per_vcpu: float, queries: int = PAPER_QUERIES, passages: int = WIKI18_PASSAGES,
               dim: int = E5_DIM) -> dict:
    """Predicted seconds of one turn's exact search per target: host faiss Flat vs the mesh index (bf16)."""
    from llds_jax.utils.flops import PEAKS

    flops = 2.0 * queries * passages * dim
    out = {}
    for name, t in TARGETS.items():
        _, peak_flops, hbm = PEAKS[t["hardware"]]
        rows = -(-passages // t["chips"])
        matmul = max(flops / t["chips"] / peak_flops, rows * dim * 2 / hbm)
        scores = 2 * queries * rows * 4 / hbm
        out[name] = {"faiss_flat_host": flops / (faiss_gflops_per_vcpu * 1e9 * t["host_vcpus"]),
                     "mesh": matmul + scores}
    return out


def timed(search, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        search()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mesh", action="store_true", required=True)
    parser.add_argument("--corpus", type=Path, default=REPO / "llds_jax/data/bundled/corpus.jsonl")
    parser.add_argument("--queries", type=int, default=1200)
    parser.add_argument("--rows", type=int, default=0, help="first N corpus rows only (0 = all); for smoke runs")
    parser.add_argument("--dim", type=int, default=E5_DIM)
    parser.add_argument("--topk", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--chunk", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    _harness.add_arguments(parser)
    args = parser.parse_args(argv)
    session = _harness.start("bench_retrieval --mesh", args)

    import faiss
    import jax
    import numpy as np

    from llds_jax.retrieval import Corpus
    from llds_jax.retrieval.hashed import HashedEmbedder, bundled_queries
    from llds_jax.retrieval.mesh import MeshIndex

    corpus = Corpus(args.corpus)
    rows = min(args.rows or len(corpus), len(corpus))
    embedder = HashedEmbedder(dim=args.dim)
    session.log(f"embedding {rows} passages and {args.queries} queries ({args.dim}-d hashed projection)")
    passages = embedder.encode_passages(list(corpus.iter_contents(0, rows)))
    queries = embedder.encode_queries(bundled_queries(corpus, args.queries))
    flat = faiss.IndexFlatIP(args.dim)
    flat.add(passages)
    mesh = MeshIndex(passages, dtype=args.dtype, chunk=args.chunk)
    want_scores, want_ids = flat.search(queries, args.topk)
    scores, ids = mesh.search(queries, args.topk)  # also the warm-up (compiles)
    agreement = float((ids == want_ids).all(axis=1).mean())

    session.log(f"timing {args.repeats} alternating batched searches of {len(queries)} queries")
    mesh_times, faiss_times = [], []
    for _ in range(args.repeats):
        mesh_times.append(timed(lambda: mesh.search(queries, args.topk), 1))
        faiss_times.append(timed(lambda: flat.search(queries, args.topk), 1))
    mesh_s, faiss_s = statistics.median(mesh_times), statistics.median(faiss_times)
    threads = faiss.omp_get_max_threads()
    faiss_gflops = 2.0 * len(queries) * rows * args.dim / faiss_s / 1e9
    record = {
        "queries": len(queries), "devices": mesh.num_shards, "id_agreement": agreement,
        "qps_mesh": len(queries) / mesh_s, "qps_faiss_flat": len(queries) / faiss_s,
        "turn_seconds": turn_model(faiss_gflops / threads),
        "passages": rows, "dim": args.dim, "topk": args.topk, "dtype": args.dtype,
        "max_abs_score_diff": float(np.abs(scores - want_scores).max()),
        "faiss_gflops_measured": faiss_gflops, "faiss_threads": threads,
        "device_kind": jax.devices()[0].device_kind,
        "model": {"turn": f"{PAPER_QUERIES} queries x {WIKI18_PASSAGES:,} passages x {E5_DIM} dims (E5-base, wiki-18)",
                  "faiss_flat_host": "measured GFLOP/s here / faiss threads x target host vCPUs",
                  "mesh": "max(2QNd/chips / peak bf16, bf16 shard / HBM) + 2 x Q x N/chips x 4 B scores / HBM",
                  "targets": TARGETS},
        "git_commit": _harness.git_commit(), "noisy": session.noisy, "load_average_start": list(session.load_start),
        "load_average_end": list(os.getloadavg()),
    }
    print(json.dumps(record) if args.json else json.dumps(record, indent=2), flush=True)
    return record


if __name__ == "__main__":
    main(sys.argv[1:])
