"""Retrieval quality, speed and memory on the shared wiki-18 cut: BM25 vs MiniLM Flat / HNSW / IVF-PQ.

    # 1. embed the corpus once (resumable; run it in several processes to share the work):
    python -m llds_jax.main --mode=index --config=configs/retriever.py \
        --config.retrieval.method=dense --config.retrieval.corpus_path=../shared/data/corpus/wiki18_subset.jsonl \
        --config.retrieval.index_path=$HOME/.cache/llds_jax/bench/wiki18_minilm --config.retrieval.shard_size=1024
    # 2. measure (builds the HNSW / IVF-PQ indexes from the same embeddings):
    python benchmarks/bench_retrieval.py --index_dir=$HOME/.cache/llds_jax/bench/wiki18_minilm

Reports, in one run on one machine:
* recall@k for the first ``--num_questions`` NQ dev questions whose gold answer occurs in
  some corpus passage (SPEC §3 normalisation, whole-word match) — BM25, Flat, HNSW, IVF-PQ;
* queries/s and p50/p99 latency of ``search`` for single queries and batches, our
  retrievers side by side with the Search-R1 design (transformers PyTorch encoder + faiss Flat);
  and BM25 behind the real HTTP service with 8 concurrent clients × 50 requests;
* encoder passages/s, JAX vs PyTorch, both fp32, wall and CPU time (the CPU figure is the
  one to trust on a shared machine);
* bytes per passage of each index on disk, projected to 21M wiki-18 passages at 768-d (E5-base).

``--mesh`` runs ``benchmarks/_mesh_retrieval.py`` instead: the in-mesh exact index vs faiss Flat
on 8 simulated CPU devices, and a paper turn's predicted seconds per target (issue #59).

Refuses to run on a loaded machine unless ``--allow-noisy`` (benchmarks/_harness.py); the
encoder sides alternate batch by batch. ``--json`` prints one JSON object (the harness record,
these results under ``results``); otherwise the encoder table, then the results as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if "--mesh" in sys.argv[1:]:  # before anything imports JAX: the tests' 8 simulated CPU devices
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import _harness  # noqa: E402  # benchmarks/ is on sys.path when run as a script
import numpy as np  # noqa: E402

from llds_jax.retrieval import BM25Retriever, Corpus, DenseRetriever
from llds_jax.retrieval.dense import build_dense_index, faiss_file
from llds_jax.retrieval.embedder import EmbedderOptions, TextEmbedder
from llds_jax.rollout.reward import normalize_answer
from llds_jax.utils.assets import minilm_dir

REPO = Path(__file__).resolve().parents[1]
WIKI18_PASSAGES = 21_015_324
E5_BASE_DIM = 768


def answerable_questions(corpus: Corpus, questions_path: Path, limit: int) -> list[dict]:
    """The first ``limit`` questions with a gold answer somewhere in the corpus (else recall is capped)."""
    padded = [f" {normalize_answer(text)} " for text in corpus.iter_contents()]
    chosen = []
    for line in questions_path.read_text().splitlines():
        row = json.loads(line)
        answers = [f" {normalize_answer(a)} " for a in row["golden_answers"] if normalize_answer(a)]
        if any(any(a in p for p in padded) for a in answers):
            chosen.append(row | {"normalized_answers": answers})
            if len(chosen) == limit:
                break
    return chosen


def recall_at_k(retriever, questions: list[dict], k: int) -> float:
    results = retriever.search([q["question"] for q in questions], k)
    found = 0
    for question, hits in zip(questions, results):
        texts = [f" {normalize_answer(h.contents)} " for h in hits]
        found += any(a in t for a in question["normalized_answers"] for t in texts)
    return found / len(questions)


def latency_profile(retriever, queries: list[str], k: int, batch: int) -> dict:
    """Single-query latencies (p50/p99) and batched throughput, after an untimed pass over every shape.

    The warm-up runs the exact calls timed below, so no jit compilation lands in a timing.
    """
    for query in queries:
        retriever.search([query], k)
    for i in range(0, len(queries), batch):
        retriever.search(queries[i : i + batch], k)
    latencies = []
    cpu_start = time.process_time()
    for query in queries:
        start = time.perf_counter()
        retriever.search([query], k)
        latencies.append(time.perf_counter() - start)
    single_cpu = time.process_time() - cpu_start
    start, cpu_start = time.perf_counter(), time.process_time()
    for i in range(0, len(queries), batch):
        retriever.search(queries[i : i + batch], k)
    batched_seconds, batched_cpu = time.perf_counter() - start, time.process_time() - cpu_start
    ordered = sorted(latencies)
    return {
        "single_qps": len(queries) / sum(latencies),
        "p50_ms": 1e3 * statistics.median(ordered),
        "p99_ms": 1e3 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "single_cpu_ms_per_query": 1e3 * single_cpu / len(queries),
        f"batch{batch}_qps": len(queries) / batched_seconds,
        f"batch{batch}_cpu_ms_per_query": 1e3 * batched_cpu / len(queries),
    }


class TorchSearchR1Retriever:
    """Search-R1's retrieval_server.py design: HF PyTorch encoder, mean pooling, faiss Flat."""

    def __init__(self, model_dir: Path, index, corpus: Corpus, max_length: int):
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.torch, self.index, self.corpus, self.max_length = torch, index, corpus, max_length
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.model = AutoModel.from_pretrained(str(model_dir)).eval()

    def encode(self, texts: list[str]) -> np.ndarray:
        torch = self.torch
        batch = self.tokenizer(texts, max_length=self.max_length, padding=True, truncation=True, return_tensors="pt")
        with torch.no_grad():
            hidden = self.model(**batch).last_hidden_state
        mask = batch["attention_mask"][..., None].float()
        vectors = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
        return vectors.numpy().astype(np.float32)

    def search(self, queries: list[str], topk: int):
        from llds_jax.retrieval import Hit

        scores, rows = self.index.search(self.encode(queries), topk)
        return [[Hit(*self.corpus.row(int(r)), score=float(s)) for r, s in zip(rr, ss)] for rr, ss in zip(rows, scores)]


def encoder_times(encoders: dict, passages: list[str], batch: int) -> dict[str, _harness.SideTimes]:
    """Wall and CPU seconds of encoding all ``passages``, the encoders alternating batch by batch."""
    for encode in encoders.values():
        encode(passages[:batch])  # compile / warm up
    times = {name: _harness.SideTimes([0.0], [0.0]) for name in encoders}
    for i in range(0, len(passages), batch):
        for name, encode in encoders.items():
            wall, cpu = time.perf_counter(), _harness.cpu_seconds()
            encode(passages[i : i + batch])
            times[name].cpu_s[0] += _harness.cpu_seconds() - cpu
            times[name].wall_s[0] += time.perf_counter() - wall
    return times


def first_rows_cut(corpus_path: Path, index_dir: Path, rows: int, shard_size: int, work_dir: Path) -> tuple[Path, Path]:
    """A corpus of the first ``rows`` rows and an index dir sharing the full one's embedding shards.

    Lets the comparison run on the part of the corpus embedded so far: every retriever
    then searches the same cut, so the numbers compare like with like.
    """
    if rows % shard_size:
        raise ValueError(f"--max_rows {rows} must be a multiple of the shard size {shard_size}")
    work_dir.mkdir(parents=True, exist_ok=True)
    cut_corpus = work_dir / f"{corpus_path.stem}.first{rows}.jsonl"
    if not cut_corpus.exists():
        with open(corpus_path, "rb") as src, open(cut_corpus, "wb") as dst:
            dst.writelines(line for _, line in zip(range(rows), src))
    cut_index = work_dir / f"index.first{rows}"
    (cut_index / "embeddings").mkdir(parents=True, exist_ok=True)
    for shard in range(rows // shard_size):
        name = f"shard_{shard:05d}.npy"
        if not (index_dir / "embeddings" / name).exists():
            raise FileNotFoundError(f"{index_dir / 'embeddings' / name} not embedded yet")
        link = cut_index / "embeddings" / name
        if not link.exists():
            link.symlink_to(index_dir / "embeddings" / name)
    return cut_corpus, cut_index


def http_profile(corpus_path: Path, index_dir: Path, queries: list[str], clients: int, requests: int) -> dict:
    """BM25 behind the real service (subprocess): concurrent clients, one query per request."""
    import subprocess
    import threading

    from llds_jax.retrieval import HttpRetriever
    from llds_jax.retrieval.server import READY_BANNER

    command = [sys.executable, "-m", "llds_jax.main", "--mode=serve", f"--config={REPO / 'configs/retriever.py'}",
               f"--config.retrieval.corpus_path={corpus_path}", f"--config.retrieval.index_path={index_dir}",
               "--config.retrieval.port=0"]
    server = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        url = next(line.split()[-1] for line in server.stdout if READY_BANNER in line)
        latencies: list[float] = []

        def client(offset: int) -> None:
            with HttpRetriever(url, timeout=120) as retriever:
                for i in range(requests):
                    start = time.perf_counter()
                    retriever.search([queries[(offset + i) % len(queries)]], 3)
                    latencies.append(time.perf_counter() - start)

        threads = [threading.Thread(target=client, args=(c * 7,)) for c in range(clients)]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - start
    finally:
        server.terminate()
        server.wait(timeout=30)
    ordered = sorted(latencies)
    return {"clients": clients, "requests": len(ordered), "qps": len(ordered) / wall,
            "p50_ms": 1e3 * statistics.median(ordered), "p99_ms": 1e3 * ordered[int(0.99 * (len(ordered) - 1))]}


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def main(argv=None) -> dict:
    if "--mesh" in (sys.argv[1:] if argv is None else argv):
        import _mesh_retrieval

        return _mesh_retrieval.main(argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=REPO.parent / "shared/data/corpus/wiki18_subset.jsonl")
    parser.add_argument("--questions", type=Path, default=REPO.parent / "shared/data/eval/nq.dev200.jsonl")
    parser.add_argument("--index_dir", type=Path, required=True, help="dense index dir built by --mode=index")
    parser.add_argument("--skip_dense", action="store_true", help="BM25 (in-process and HTTP) only")
    parser.add_argument("--num_questions", type=int, default=50)
    parser.add_argument("--topk", type=int, default=3)
    parser.add_argument("--batch", type=int, default=50)
    parser.add_argument("--encoder_passages", type=int, default=256)
    parser.add_argument("--ann", nargs="*", default=["HNSW32", "IVF256,PQ32"])
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON")
    parser.add_argument("--max_rows", type=int, default=0,
                        help="use only the first N rows (a multiple of 1024) of corpus and embeddings")
    _harness.add_arguments(parser)
    args = parser.parse_args(argv)
    session = _harness.start("bench_retrieval", args)
    session.settings = {k: str(v) if isinstance(v, Path) else v for k, v in session.settings.items()}
    if args.max_rows:
        args.corpus, args.index_dir = first_rows_cut(args.corpus, args.index_dir, args.max_rows, 1024,
                                                     args.index_dir.parent / "cuts")

    report: dict = {"command": " ".join([Path(sys.executable).name, *sys.argv])}
    corpus = Corpus(args.corpus)
    questions = answerable_questions(corpus, args.questions, args.num_questions)
    report["corpus"] = {"path": str(args.corpus), "rows": len(corpus)}
    report["questions"] = {"file": str(args.questions), "answerable_used": len(questions)}
    queries = [q["question"] for q in questions] * 4  # 200 timed queries

    start = time.perf_counter()
    bm25 = BM25Retriever.build(corpus)
    report["bm25_build_s"] = time.perf_counter() - start
    bm25_dir = Path(args.index_dir) / "bm25"
    bm25.save(bm25_dir)

    retrievers = {"bm25": bm25}
    dense_factories = [] if args.skip_dense else ["Flat", *args.ann]
    embedder = TextEmbedder.from_pretrained(minilm_dir(), EmbedderOptions(batch_size=64)) if dense_factories else None
    for factory in dense_factories:
        if not faiss_file(args.index_dir, factory).exists():
            start = time.perf_counter()
            build_dense_index(corpus, embedder, args.index_dir, factory, shard_size=1024,
                              encoder_name=str(minilm_dir()), show_progress=False)
            report[f"{factory}_build_s"] = time.perf_counter() - start
        retrievers[factory] = DenseRetriever.load(args.index_dir, factory, embedder, corpus)
    if dense_factories:
        retrievers["searchr1_torch_Flat"] = TorchSearchR1Retriever(minilm_dir(), retrievers["Flat"].index, corpus, 256)

    report["recall_at_k"] = {name: recall_at_k(r, questions, args.topk) for name, r in retrievers.items()}
    report["latency"] = {name: latency_profile(r, queries, args.topk, args.batch) for name, r in retrievers.items()}

    report["http_bm25"] = http_profile(args.corpus, bm25_dir, queries, clients=8, requests=50)

    if dense_factories:
        passages = list(corpus.iter_contents(0, args.encoder_passages))
        times = encoder_times({_harness.OURS: embedder.encode_passages,
                               "torch": retrievers["searchr1_torch_Flat"].encode}, passages, 64)
        session.add_case(f"MiniLM encoder fp32, {len(passages)} passages in batches of 64", times,
                         tokens=len(passages), unit="passages")

    memory = {"corpus_offsets": 8.0, "bm25": directory_bytes(bm25_dir) / len(corpus)}
    for factory in dense_factories:
        memory[factory] = faiss_file(args.index_dir, factory).stat().st_size / len(corpus)
    report["bytes_per_passage"] = memory
    session.results = report
    record = session.finish()
    if not args.json:
        print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    return record


if __name__ == "__main__":
    main()
