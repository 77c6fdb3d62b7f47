"""Multi-turn rollout throughput with a real model and a real BM25 index, and where the time goes.

Three measurements, one process:

1. ``run_rollouts`` with SmolLM2-135M-Instruct (JAX, fp32), its own tokenizer and chat
   template, BM25 over a wiki-18 cut, ``--max-turns`` search turns + the final turn.
   Reported after a warm-up rollout (compilation): trajectories/s and the share of wall
   time in prefill, decode, feedback append, retrieval and host work. SmolLM2 does not
   follow the tag protocol zero-shot (docs/decisions.md: the format warm-up), so its actions are mostly invalid and get
   the invalid-action message as feedback: the decode/append path is exercised, retrieval
   hardly.
2. The same batch shape with a scripted policy that searches every turn: retrieval and host
   time of a search-heavy rollout, without a model.
3. Cache continuation vs re-prefill: appending a feedback chunk to live decode slots
   (``slots.SlotSession.append``, the paged cache) versus feeding freshly reset slots the whole
   history plus the chunk (what a loop without cache continuation does every turn), for several
   history lengths.

    .venv/bin/python benchmarks/bench_rollout.py --questions 8 --n-samples 4 --max-turns 3 \
        --max-action-tokens 64

``--paper-schedule`` instead simulates the schedule of one paper step (no model, no timing:
``llds_jax/rollout/schedule_sim.py`` driven by the engine's own scheduler) with Search-R1's
3B reference lengths, waves + turn barrier against the engine, at the slot counts the
planner's memory arithmetic derives for each target; ``--json`` prints
``{"targets": {name: {"waves": {...}, "engine": {...}}}, "settings": {...}}``.

    .venv/bin/python benchmarks/bench_rollout.py --paper-schedule [--json]

``--decode-program`` compiles one token step of the engine's ``decode_segment`` with the real
XLA:GPU (H100) and XLA:TPU (v5e) compilers, compile-only, at the engine's shapes per device, and
prints ``{"targets": {name: {"dynamic_loops", "conditionals", "kernels", "bytes", "ideal_bytes",
...}}, "settings": {...}}`` (``benchmarks/_decode_step.py`` says how each is counted; no timing,
so no load gate). ``--tiny``: the tiny test model instead of the paper's three targets.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_rollout.py --decode-program --json

``--default-job`` takes the default job's rollout section and prompt count
(``configs/cpu_smoke.py``) instead of the flags and times only measurement 1, ``--engines`` side by
side (the question a default-engine choice needs; 2 and 3 do not depend on the engine).

Every measurement records wall and CPU seconds; append and re-prefill alternate per repeat.
Refuses to run on a loaded machine unless ``--allow-noisy`` (benchmarks/_harness.py);
``--json`` prints one JSON object.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import time
from pathlib import Path

import _harness  # benchmarks/ is on sys.path when run as a script
import jax
import numpy as np
from flax import nnx

from llds_jax.models import from_pretrained
from llds_jax.models.gguf_tokenizer import load_gguf_tokenizer
from llds_jax.retrieval import BM25Retriever, Corpus
from llds_jax.rollout import default_config, run_rollouts
from llds_jax.rollout.action_stop import action_stop_table
from llds_jax.rollout.scripted_policy import ScriptedPolicy
from llds_jax.sampling import SamplingParams, vocab_bytes
from llds_jax.utils.assets import smollm2_gguf_path

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ROOT / "llds_jax" / "data" / "bundled"
# name -> (config file, hardware, devices, hosts): the paper step's targets.
PAPER_TARGETS = {"qwen3b-v5e-64": ("qwen3b.py", "v5e", 64, 16), "qwen3b-8xh100": ("qwen3b.py", "H100", 8, 1),
                 "qwen7b-8xh100": ("qwen7b.py", "H100", 8, 1)}


def load_questions(path: Path, count: int) -> list[str]:
    rows = [json.loads(line) for line in path.read_text().splitlines()[:count]]
    return [row["question"] for row in rows]


def shares(timings: dict[str, float]) -> dict[str, float]:
    """Share of the rollout's wall time per phase (from ``RolloutBatch.timings``)."""
    total = timings["total_s"]
    return {k.removesuffix("_s"): v / total for k, v in timings.items() if k.endswith("_s") and k != "total_s"}


def rollout_with_model(session, model, tokenizer, questions, retriever, cfg, repeats: int, engines=("waves",)):
    """The rollout per ``rollout.engine`` in ``engines``, alternated per repeat (same key: same trajectories)."""
    last = {}

    def runner(engine):
        config = cfg.copy_and_resolve_references()
        config.engine = engine

        def run():
            last[engine] = run_rollouts(model, tokenizer, questions, retriever, config, key=jax.random.key(1))
        return run

    times = _harness.alternate({engine: runner(engine) for engine in engines}, repeats)  # warm-up call compiles
    for engine in engines:
        _record_rollout(session, f"rollout ({engine}), SmolLM2-135M + BM25", {engine: times[engine]}, last[engine])
    if len(engines) > 1:
        first = last[engines[0]]
        session.settings["engines_same_ids"] = all(
            np.array_equal(first.input_ids, last[e].input_ids) for e in engines[1:])


def _record_rollout(session, name, times, batch):
    stats = batch.stats()
    session.add_case(name, times, tokens=batch.size, unit="trajectories",
                     phase_shares=shares(batch.timings), turns=stats["rollout/turns"],
                     searches=stats["rollout/searches"], action_tokens=stats["rollout/action_tokens"],
                     decoded_tokens=int(batch.action_mask.sum()),
                     decode_tokens_per_s=float(batch.action_mask.sum() / batch.timings["decode_s"]))


def rollout_scripted_search(session, tokenizer, questions, retriever, cfg, repeats: int):
    n = len(questions) * cfg.n_samples
    turns = [tokenizer.encode(f"<search> {q} </search>", add_special_tokens=False) for q in questions]
    streams = [[turns[row // cfg.n_samples]] * (cfg.max_turns + 1) for row in range(n)]
    last = {}

    def run():
        policy = ScriptedPolicy(streams, action_stop_table(vocab_bytes(tokenizer)))
        last["batch"] = run_rollouts(policy, tokenizer, questions, retriever, cfg)

    times = _harness.alternate({"scripted_policy": run}, repeats, warmup=False)
    batch = last["batch"]
    session.add_case(f"all-search rollout, no model ({cfg.max_turns} batched retrieval calls)", times,
                     tokens=batch.size, unit="trajectories", searches=int(batch.searches.sum()),
                     phase_shares=shares(batch.timings))


def append_and_reprefill_times(graphdef, params, batch: int, history: int, chunk: int, repeats: int):
    """Seconds to (a) append ``chunk`` tokens to slots holding ``history``, (b) feed freshly reset
    slots the whole history plus the chunk: ``slots.SlotSession.append``, the rollout's own append
    (the paged cache, each slot its own blocks), on one session of ``batch`` slots.

    Alternating per repeat; the live rows (a) appends to are built untimed before each call.
    """
    from llds_jax.sampling.generate import resolve_stop_table
    from llds_jax.sampling.slots import SlotSession

    config = nnx.merge(graphdef, params).config
    rng = np.random.default_rng(history)
    hist_ids = rng.integers(1, config.vocab_size, (batch, history)).tolist()
    chunk_ids = rng.integers(1, config.vocab_size, (batch, chunk)).tolist()
    sampling = SamplingParams.create(temperature=1.0, top_k=0, top_p=1.0, stop_token_ids=(),
                                     stop_table=resolve_stop_table((), None, config.vocab_size))
    session = SlotSession((graphdef, params), sampling, slots=batch, max_action_tokens=16, key=jax.random.key(0),
                          max_tokens=history + chunk)

    def fresh(ids):  # every slot emptied (a new trajectory, its own blocks), then fed ``ids``
        for slot in range(batch):
            session.reset(slot, slot, 0)
            session.set_blocks(slot, np.arange(slot * session.columns, (slot + 1) * session.columns))
        session.append({slot: ids[slot] for slot in range(batch)})
        jax.block_until_ready((session.logits, session.k, session.v))

    def append(_live=None):  # the setup's rows (built by ``fresh``, on the session): nothing to pass
        session.append({slot: chunk_ids[slot] for slot in range(batch)})
        jax.block_until_ready((session.logits, session.k, session.v))

    full_ids = [h + c for h, c in zip(hist_ids, chunk_ids, strict=True)]
    fresh(hist_ids)  # compile both shapes
    append()
    fresh(full_ids)
    return _harness.alternate({"append": append, "re-prefill": lambda: fresh(full_ids)}, repeats, warmup=False,
                              setup={"append": lambda: fresh(hist_ids)})


def continuation_vs_reprefill(session, model, batch: int, chunk: int, histories: list[int], repeats: int):
    graphdef, params = nnx.split(model)
    for history in histories:
        session.log(f"append vs re-prefill, history {history} ...")
        times = append_and_reprefill_times(graphdef, params, batch, history, chunk, repeats)
        session.add_case(f"append {chunk} tokens to {history}-token slots vs re-prefill, batch {batch}", times,
                         reprefill_over_append=times["re-prefill"].median_s / times["append"].median_s)


def _load_config(name: str):
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), ROOT / "configs" / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def paper_schedule(reference: str, segment: int | None, retrieval_steps: int) -> dict:
    """Waves + barrier vs the engine on one paper step, per target (see the module docstring).

    Waves: the rows the planner derives today (``rollout_rows_per_wave`` on the target's
    memory and data devices, as ``plan/run.py``). Engine: ``kv_plan.engine_memory`` slots and
    KV blocks per device; on several hosts each host schedules its own contiguous rows.
    """
    from llds_jax.data.lengths import load_lengths
    from llds_jax.models.loading import decoder_config
    from llds_jax.parallel.mesh import resolve_mesh_shape
    from llds_jax.plan.config import HARDWARE
    from llds_jax.plan.step_time import step_lengths
    from llds_jax.rollout.kv_plan import engine_memory, rollout_rows_per_wave
    from llds_jax.rollout.schedule_sim import simulate_engine, simulate_engine_groups

    out = {}
    for name, (config_file, hardware, devices, hosts) in PAPER_TARGETS.items():
        config = _load_config(config_file)
        rollout, model = config.rollout, decoder_config(config.model)
        segment = int(rollout.segment_tokens) if segment is None else segment  # what the engine would run
        trajectories = config.train.prompts_per_step * rollout.n_samples
        # the plan's own draw (plan.step_time.step_lengths): the same trajectories, so its step counts agree
        lengths = step_lengths(config, load_lengths(str(reference)), trajectories, seed=int(config.seed))
        shape = resolve_mesh_shape(config.mesh.shape, devices)
        dp = shape[0] * shape[1]
        device_bytes = int(HARDWARE[hardware][1])
        rows = rollout_rows_per_wave(model, rollout, device_bytes, dp)
        rows = max(dp, min(rows, trajectories) // dp * dp)  # as plan/run.py rounds it
        memory = engine_memory(model, rollout, device_bytes, math.ceil(trajectories / dp))
        group_devices = dp // hosts if dp >= hosts else 1
        engine = simulate_engine_groups(
            lengths, hosts, memory.slots_per_device * group_devices, segment=segment,
            prefill_chunk=int(rollout.prefill_chunk), retrieval_steps=retrieval_steps,
            max_tokens=int(rollout.max_context), kv_blocks=memory.kv_blocks_per_device, devices=group_devices,
            block_size=memory.block_tokens)
        engine.update(slots_per_device=memory.slots_per_device, kv_blocks_per_device=memory.kv_blocks_per_device)
        waves = simulate_engine(lengths, rows, segment=int(rollout.max_action_tokens),
                                prefill_chunk=int(rollout.prefill_chunk), retrieval_steps=retrieval_steps,
                                max_tokens=int(rollout.max_context), waves=True)
        waves["rows_per_device"] = rows // dp
        dense = simulate_engine_groups(  # the engine on today's dense rows (what runs until the cache is paged)
            lengths, hosts, max(1, rows // hosts), segment=segment, prefill_chunk=int(rollout.prefill_chunk),
            retrieval_steps=retrieval_steps, max_tokens=int(rollout.max_context))
        out[name] = dict(waves=waves, engine=engine, engine_dense_rows=dense, trajectories=trajectories, data_devices=dp, hosts=hosts,
                         mesh=list(shape), hardware=hardware,
                         decode_steps_ratio=round(waves["decode_steps"] / engine["decode_steps"], 2))
    return out


def paper_schedule_main(args) -> None:
    targets = paper_schedule(args.reference, args.segment, args.retrieval_steps)
    segment = {t["engine"]["segment"] for t in targets.values()}
    settings = dict(reference=str(args.reference), segment_tokens=sorted(segment), retrieval_steps=args.retrieval_steps,
                    unit="decode steps (one token for every active row)")
    if args.json:
        print(json.dumps(dict(targets=targets, settings=settings)))
        return
    print(f"one paper step, reference lengths {args.reference or 'searchr1_3b (bundled)'}; engine segment {sorted(segment)} tokens, "
          f"retrieval {args.retrieval_steps} decode steps per batch")
    header = (f"{'target':<15} {'schedule':<17} {'slots':>6} {'decode':>7} {'bound':>6} {'eff':>6} "
              f"{'prefill':>8} {'retr.wait':>9} {'retr.batches':>12} {'preempt':>7}")
    print(header)
    print("-" * len(header))
    for name, target in targets.items():
        for kind in ("waves", "engine_dense_rows", "engine"):
            r = target[kind]
            print(f"{name:<15} {kind:<17} {r['slots']:>6} {r['decode_steps']:>7} {r['lower_bound_steps']:>6} "
                  f"{r['efficiency']:>6.3f} {r['prefill_chunks']:>8} {r['retrieval_wait_steps']:>9} "
                  f"{r['retrieval_batches']:>12} {r.get('preemptions', 0):>7}")
        print(f"{'':<15} waves/engine decode steps: {target['decode_steps_ratio']}x")


def decode_program_main(args) -> None:
    """``--decode-program``: the compile-only GPU target needs a CPU-only JAX process, so the
    platform is pinned to CPU before any backend starts (nothing here runs on a device)."""
    jax.config.update("jax_platforms", "cpu")
    import _decode_step  # noqa: PLC0415  (benchmarks/; pulls in tools/roofline's HLO readers)

    report = _decode_step.decode_program_report(_decode_step.tiny_targets() if args.tiny
                                                else _decode_step.paper_targets())
    if args.json:
        print(json.dumps(report))
        return
    for name, t in report["targets"].items():
        print(f"{name:<15} dynamic_loops {t['dynamic_loops']:>3}  conditionals {t['conditionals']:>2}  kernels "
              f"{t['kernels']:>5}  bytes {t['bytes'] / 1e9:8.3f} GB  ideal {t['ideal_bytes'] / 1e9:7.3f} GB  "
              f"({t['rows']} rows, live mean {t['live_lengths']['mean']})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--paper-schedule", action="store_true", help="simulate one paper step's schedule and exit")
    parser.add_argument("--decode-program", action="store_true",
                        help="compile the engine's per-token decode step for H100 and v5e (compile-only) and exit")
    parser.add_argument("--tiny", action="store_true", help="--decode-program on the tiny test model (tests)")
    parser.add_argument("--reference", default="", help="plan.length_source: '' = Search-R1 3B's (bundled), "
                        "a reference file, or a run directory")
    parser.add_argument("--segment", type=int, default=None,
                        help="engine: decode steps per device call (default: the configs' rollout.segment_tokens)")
    parser.add_argument("--retrieval-steps", type=int, default=8, help="a retrieval batch's latency in decode steps")
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
    parser.add_argument("--rollout-repeats", type=int, default=1, help="timed rollouts (after one warm-up)")
    parser.add_argument("--engines", default="waves,continuous", help="rollout.engine values to time side by side")
    parser.add_argument("--default-job", action="store_true",
                        help="the default job's rollout settings and prompts per step (configs/cpu_smoke.py)")
    _harness.add_arguments(parser)
    args = parser.parse_args()
    if args.paper_schedule:
        paper_schedule_main(args)
        return
    if args.decode_program:
        decode_program_main(args)
        return
    session = _harness.start("bench_rollout", args)

    start = time.perf_counter()
    retriever = BM25Retriever.build(Corpus(args.corpus))
    session.settings["bm25_build_s"] = time.perf_counter() - start
    session.settings["passages"] = len(retriever.corpus)
    gguf = smollm2_gguf_path()
    tokenizer = load_gguf_tokenizer(gguf)
    model = from_pretrained(gguf)
    if args.default_job:
        job = _load_config("cpu_smoke.py")
        questions = load_questions(Path(args.question_file), int(job.train.prompts_per_step))
        cfg = job.rollout.copy_and_resolve_references()
        session.settings["config"] = "configs/cpu_smoke.py (rollout section, train.prompts_per_step)"
    else:
        questions = load_questions(Path(args.question_file), args.questions)
        cfg = default_config()
        cfg.update(dict(n_samples=args.n_samples, max_turns=args.max_turns, max_action_tokens=args.max_action_tokens,
                        max_context=args.max_context))
    session.settings.update(temperature=cfg.temperature, top_p=cfg.top_p)
    session.log(f"{len(questions)} questions x {cfg.n_samples} samples, max_turns {cfg.max_turns} (+ final turn) ...")
    rollout_with_model(session, model, tokenizer, questions, retriever, cfg, args.rollout_repeats,
                       engines=tuple(args.engines.split(",")))
    if args.default_job:
        session.finish()
        return
    rollout_scripted_search(session, tokenizer, questions, retriever, cfg, args.rollout_repeats)
    continuation_vs_reprefill(session, model, batch=len(questions) * cfg.n_samples, chunk=args.chunk,
                              histories=[int(h) for h in args.histories.split(",")], repeats=args.repeats)
    session.finish()


if __name__ == "__main__":
    main()
