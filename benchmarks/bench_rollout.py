"""Multi-turn rollout throughput with a real model and a real BM25 index, and where the time goes.

Three measurements, one process:

1. ``run_rollouts`` with SmolLM2-135M-Instruct (JAX, fp32), its own tokenizer and chat
   template, BM25 over a wiki-18 cut, ``--max-turns`` search turns + the final turn.
   Reported after a warm-up rollout (compilation): trajectories/s and the share of wall
   time in prefill, decode, feedback append, retrieval and host work. SmolLM2 does not
   follow the tag protocol zero-shot (STACK.md), so its actions are mostly invalid and get
   the invalid-action message as feedback: the decode/append path is exercised, retrieval
   hardly.
2. The same batch shape with a scripted policy that searches every turn: retrieval and host
   time of a search-heavy rollout, without a model.
3. Cache continuation vs re-prefill: appending a feedback chunk to a live KV cache versus
   prefilling the whole history plus the chunk into a fresh cache (what a loop without
   cache continuation does every turn), for several history lengths.

    .venv/bin/python benchmarks/bench_rollout.py --questions 8 --n-samples 4 --max-turns 3 \
        --max-action-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from llds_jax.models import from_pretrained
from llds_jax.models.gguf_tokenizer import load_gguf_tokenizer
from llds_jax.retrieval import BM25Retriever, Corpus
from llds_jax.rollout import default_config, run_rollouts
from llds_jax.rollout.action_stop import action_stop_table
from llds_jax.rollout.scripted_policy import ScriptedPolicy
from llds_jax.sampling import bucket, decode_loop, vocab_bytes
from llds_jax.utils.assets import smollm2_gguf_path

BUNDLED = Path(__file__).resolve().parents[1] / "llds_jax" / "data" / "bundled"


def load_questions(path: Path, count: int) -> list[str]:
    rows = [json.loads(line) for line in path.read_text().splitlines()[:count]]
    return [row["question"] for row in rows]


def shares(timings: dict[str, float]) -> str:
    total = timings["total_s"]
    parts = [f"{k.removesuffix('_s')} {100 * v / total:.0f}%" for k, v in timings.items() if k != "total_s"]
    return ", ".join(parts)


def rollout_with_model(model, tokenizer, questions, retriever, cfg):
    run_rollouts(model, tokenizer, questions, retriever, cfg, key=jax.random.key(0))  # compile
    start = time.perf_counter()
    batch = run_rollouts(model, tokenizer, questions, retriever, cfg, key=jax.random.key(1))
    wall = time.perf_counter() - start
    print(f"[model] {batch.size} trajectories in {wall:.2f} s = {batch.size / wall:.2f} traj/s; "
          f"{shares(batch.timings)}")
    stats = batch.stats()
    print(f"        turns {stats['rollout/turns']:.2f}, searches {stats['rollout/searches']:.2f}, "
          f"action tokens {stats['rollout/action_tokens']:.0f}, response tokens {stats['rollout/response_tokens']:.0f}, "
          f"decoded {int(batch.action_mask.sum())} tokens = {batch.action_mask.sum() / batch.timings['decode_s']:.0f} "
          f"tok/s in decode")


def rollout_scripted_search(tokenizer, questions, retriever, cfg):
    n = len(questions) * cfg.n_samples
    turns = [tokenizer.encode(f"<search> {q} </search>", add_special_tokens=False) for q in questions]
    streams = [[turns[row // cfg.n_samples]] * (cfg.max_turns + 1) for row in range(n)]
    policy = ScriptedPolicy(streams, action_stop_table(vocab_bytes(tokenizer)))
    start = time.perf_counter()
    batch = run_rollouts(policy, tokenizer, questions, retriever, cfg)
    wall = time.perf_counter() - start
    print(f"[all-search, no model] {batch.size} trajectories, {int(batch.searches.sum())} searches in "
          f"{cfg.max_turns} batched calls: {wall:.2f} s; {shares(batch.timings)}")


def append_and_reprefill_seconds(graphdef, params, batch: int, history: int, chunk: int, repeats: int):
    """Median seconds to (a) append ``chunk`` tokens to a cache holding ``history``, (b) prefill both afresh."""
    config = nnx.merge(graphdef, params).config
    rng = np.random.default_rng(history)
    cache_len = bucket(history + chunk, 16)
    hist_ids = jnp.asarray(rng.integers(1, config.vocab_size, (batch, history)), jnp.int32)
    chunk_ids = jnp.asarray(rng.integers(1, config.vocab_size, (batch, chunk)), jnp.int32)
    full_ids = jnp.concatenate([hist_ids, chunk_ids], axis=1)

    def prefill(ids):
        cache = decode_loop.new_cache(config, batch, cache_len)
        return jax.block_until_ready(decode_loop.extend(graphdef, params, ids, jnp.ones_like(ids, bool), cache))

    def append(cache):
        return jax.block_until_ready(decode_loop.extend(graphdef, params, chunk_ids, jnp.ones_like(chunk_ids, bool),
                                                        cache))

    append(prefill(hist_ids)[1])  # compile both shapes
    prefill(full_ids)
    t_append, t_full = [], []
    for _ in range(repeats):
        live = prefill(hist_ids)[1]
        start = time.perf_counter()
        append(live)
        t_append.append(time.perf_counter() - start)
        start = time.perf_counter()
        prefill(full_ids)
        t_full.append(time.perf_counter() - start)
    return statistics.median(t_append), statistics.median(t_full)


def continuation_vs_reprefill(model, batch: int, chunk: int, histories: list[int], repeats: int):
    graphdef, params = nnx.split(model)
    print(f"[append vs re-prefill] batch {batch}, feedback chunk {chunk} tokens, median of {repeats}")
    for history in histories:
        a, f = append_and_reprefill_seconds(graphdef, params, batch, history, chunk, repeats)
        print(f"        history {history:5d}: append {1000 * a:8.1f} ms, re-prefill {1000 * f:8.1f} ms "
              f"({f / a:.1f}x)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--n-samples", type=int, default=4)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--max-action-tokens", type=int, default=64)
    parser.add_argument("--max-context", type=int, default=2048)
    parser.add_argument("--corpus", default=str(BUNDLED / "corpus.jsonl"))
    parser.add_argument("--question-file", default=str(BUNDLED / "nq_dev.jsonl"))
    parser.add_argument("--histories", default="256,512,1024")
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"jax {jax.__version__} ({jax.default_backend()}), cpus={os.cpu_count()}, "
          f"load avg {os.getloadavg()[0]:.1f}")

    start = time.perf_counter()
    retriever = BM25Retriever.build(Corpus(args.corpus))
    print(f"BM25 over {len(retriever.corpus)} passages built in {time.perf_counter() - start:.1f} s")
    gguf = smollm2_gguf_path()
    tokenizer = load_gguf_tokenizer(gguf)
    model = from_pretrained(gguf)
    questions = load_questions(Path(args.question_file), args.questions)
    cfg = default_config()
    cfg.update(dict(n_samples=args.n_samples, max_turns=args.max_turns, max_action_tokens=args.max_action_tokens,
                    max_context=args.max_context))
    print(f"{len(questions)} questions x {cfg.n_samples} samples, max_turns {cfg.max_turns} (+ final turn), "
          f"≤ {cfg.max_action_tokens} tokens/action, T={cfg.temperature}, top-p {cfg.top_p}")
    rollout_with_model(model, tokenizer, questions, retriever, cfg)
    rollout_scripted_search(tokenizer, questions, retriever, cfg)
    continuation_vs_reprefill(model, batch=len(questions) * cfg.n_samples, chunk=args.chunk,
                              histories=[int(h) for h in args.histories.split(",")], repeats=args.repeats)


if __name__ == "__main__":
    main()
