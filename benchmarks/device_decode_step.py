"""One decode step of the rollout, timed and profiled on a device: the engine's attention paths side by side.

    python benchmarks/device_decode_step.py --out OUT                 # on the GPU (≈ 4 min on one H200)
    python benchmarks/device_decode_step.py --dry-run --out OUT       # CPU, tiny model: wiring only

What it times, at the device check's shape (Qwen2.5-0.5B shapes, random bf16 weights, 320 rows whose
live contexts are Search-R1 3B's reference trajectories just before their last action, top-p 0.95 at
T = 1, the protocol's real stop-string table over the Qwen2 vocabulary):

* ``paged_xla`` — the slot engine (``SlotSession.decode``) with ``model.attention="xla_blockwise"``:
  the XLA loop over key blocks;
* ``paged_kernel`` — the slot engine with ``model.attention="auto"``: the backend's decode kernels
  (on GPU ``models/attention/decode_gpu.py`` and the gate/up kernel ``models/mlp_gpu.py``; ``paged_xla``
  keeps XLA's GEMMs there too);
* ``paged_kernel_split_k`` — the same, its decode program compiled without the engine's
  ``slots.DECODE_COMPILER_OPTIONS`` (K kept whole in the GEMMs, chosen on compile-only bytes): XLA:GPU
  free to split K as its autotuner likes, so the run says which is faster on the device.

* ``paged_kernel_flat_logits`` — ``paged_kernel`` at the random init's own logits (``--logit-std 0``).

The random weights' final norm is scaled so every logit row spreads ``--logit-std`` nats (default
``plan.step_time.TRAINED_LIKE_LOGIT_STD``, ``model.random_logit_std``): there the top-p sampler
(``sampling/filtering_gpu.sample_top_p``) takes its two-read path on nearly every row, as on a trained
model's logits. The init's own spread (0.6 nats) is near-flat: every row's boundary bin overflows and
takes the full-row search and draw, the sampler's worst case, which ``paged_kernel_flat_logits`` times.

Both rollout policies decode on this one engine (``rollout.engine="waves"`` is its turn-synchronous
policy: ``rollout/engine.py``), so there is no other session to compare: the dense-cache
``DecodeSession`` the waves ran on is gone.

Each variant prefills its rows once, decodes ``--steps`` tokens per call (one compile, one warm-up
call), then ``--calls`` timed calls; ms per step = a call's wall time / the steps it decoded (every
row decodes every step: no stop id, a budget past the timed tokens). The bytes bound is what one step
must read — the weights once plus every row's live k and v — over the copy bandwidth measured in the
same run. ``--profile`` traces one more call of each variant (``jax.profiler``, Perfetto JSON) and
sums device time per kernel name: the top kernels, their share, and device-busy / wall.

Writes ``OUT/decode_step.json`` and prints one table.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VARIANTS = ("paged_xla", "paged_kernel", "paged_kernel_split_k", "paged_kernel_flat_logits")


def live_lengths(rows: int, cap: int) -> list[int]:
    """Row ``r``'s live context: reference trajectory ``r``'s tokens before its last action (≤ ``cap``)."""
    from llds_jax.data.lengths import reference_lengths

    trajectories = reference_lengths()
    out = []
    for r in range(rows):
        t = trajectories[(r * 7919) % len(trajectories)]  # spread over the four benchmarks' records
        before_last = t.prompt + sum(t.actions[:-1]) + sum(t.feedback[: len(t.actions) - 1])
        out.append(max(1, min(before_last, cap)))
    return out


def copy_bandwidth(jax, jnp, nbytes: int) -> float:
    """Bytes/s of a device-to-device copy (read + write counted), median of 5."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a + 1.0)
    f(x).block_until_ready()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * x.nbytes / statistics.median(times)


def kernel_summary(trace_dir: str, top: int = 12) -> dict:
    """Device time per kernel name from the Perfetto trace ``jax.profiler`` wrote under ``trace_dir``."""
    files = sorted(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True))
    if not files:
        return {"note": "no Perfetto trace written"}
    with gzip.open(files[-1], "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    device = {pid for pid, name in names.items() if "/device:" in name and "CPU" not in name.upper()}
    spans = [e for e in events if e.get("ph") == "X" and e.get("pid") in device and "dur" in e]
    if not spans:
        return {"note": "no device events in the trace", "processes": sorted(set(names.values()))[:10]}
    by_name: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for e in spans:
        by_name[e["name"]] += e["dur"]
        count[e["name"]] += 1
    busy = sum(by_name.values())
    first = min(e["ts"] for e in spans)
    last = max(e["ts"] + e["dur"] for e in spans)
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    return {"device_busy_us": busy, "device_span_us": last - first, "launches": sum(count.values()),
            "top": [{"name": n[:120], "us": round(us, 1), "share": round(us / busy, 4), "launches": count[n]}
                    for n, us in ranked]}


def decoder_config(args, attention: str = "auto"):
    """The timed model's shapes: ``--model``'s in bf16 (weights and compute, as the sampler's copy), or tiny."""
    from llds_jax.models.loading import known_config
    from llds_jax.models.testing import tiny_config

    if args.dry_run:
        return tiny_config("qwen2", vocab_size=args.vocab, attention=attention)
    return known_config(args.model, attention=attention, dtype="bfloat16", param_dtype="bfloat16")


def build(variant: str, args):
    """``variant``'s model: random weights whose logits spread ``--logit-std`` nats (the init's own for
    ``paged_kernel_flat_logits``); ``paged_xla`` forces the XLA attention loop."""
    from llds_jax.models.loading import random_model

    logit_std = 0.0 if variant == "paged_kernel_flat_logits" else args.logit_std
    return random_model(decoder_config(args, "xla_blockwise" if variant == "paged_xla" else "auto"), None, seed=0,
                        logit_std=logit_std)


def run_variant(name: str, args, lengths: list[int], sampling, out: Path, label: str = "") -> dict:
    """``name``: a variant, or ``variant@steps`` to time it at another call length (the engine's segment);
    ``label``: the variant its profile is filed under (default: ``name``'s)."""
    import jax
    import numpy as np

    variant, _, steps = name.partition("@")
    if variant not in VARIANTS:
        raise ValueError(f"--variants: {variant!r} is not one of {VARIANTS}")
    args = argparse.Namespace(**{**vars(args), "steps": int(steps or args.steps)})

    from llds_jax.sampling import slots

    if variant == "paged_kernel_split_k":  # this variant's calls only: the engine's program without the options
        engine_program = slots.decode_segment
        slots.decode_segment = jax.jit(engine_program.__wrapped__, static_argnames=("graphdef", "steps"),
                                       donate_argnames=("state",))
        try:
            return run_variant(f"paged_kernel@{args.steps}", args, lengths, sampling, out, label=variant) | {
                "variant": name}
        finally:
            slots.decode_segment = engine_program
    model = build(variant, args)
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    prompts = [rng.integers(min(1000, vocab // 2), min(vocab, 100_000), n).tolist() for n in lengths]
    budget = max(int(v.partition("@")[2] or args.steps) for v in args.variants.split(",")) * (args.calls + 3)
    key = jax.random.key(0)
    t0 = time.perf_counter()
    restarted: list[int] = []
    session = slots.SlotSession(model, sampling, slots=len(prompts), max_action_tokens=budget, key=key, max_tokens=args.slots)
    per_row = session.columns
    for slot, _ in enumerate(prompts):
        session.reset(slot, slot, 0)
        session.set_blocks(slot, np.arange(slot * per_row, (slot + 1) * per_row) % session.kv_blocks)
    session.append({slot: ids for slot, ids in enumerate(prompts)})
    for slot in range(len(prompts)):
        session.start_action(slot, budget)
    jax.block_until_ready(session.k)
    prefill_s = time.perf_counter() - t0

    def one_call():  # a row whose action ended (a stop string a random policy completed) starts another
        ended = session.decode(args.steps)
        for slot in ended:
            if session.rows_end[slot] + budget <= session.max_tokens:
                session.start_action(slot, budget)
        restarted.append(len(ended))
        return args.steps

    t0 = time.perf_counter()
    one_call()  # compiles
    compile_s = time.perf_counter() - t0
    one_call()  # warm-up
    times = []
    for _ in range(args.calls):
        t0 = time.perf_counter()
        steps = one_call()
        times.append((time.perf_counter() - t0) / steps)
    result = {"variant": name, "rows_ended": sum(restarted), "prefill_s": round(prefill_s, 3), "first_call_s": round(compile_s, 3),
              "ms_per_step": round(1e3 * statistics.median(times), 3),
              "ms_per_step_all": [round(1e3 * t, 3) for t in times]}
    if args.profile:
        trace_dir = str(Path(args.trace_dir or out) / f"trace_{label or variant}_{args.steps}")
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            one_call()
        result["profile"] = kernel_summary(trace_dir)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="Qwen2.5-0.5B")
    parser.add_argument("--rows", type=int, default=320)
    parser.add_argument("--slots", type=int, default=4096, help="a row's context cap (cache slots)")
    parser.add_argument("--steps", type=int, default=64, help="tokens per timed call")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated; VARIANT@STEPS times a call "
                        "of STEPS tokens (e.g. paged_kernel@8: the engine's segment)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--trace-dir", default="", help="where the profiler writes (default: --out)")
    parser.add_argument("--tokenizer", default="", help="Qwen2 tokenizer dir: the protocol's real stop table")
    parser.add_argument("--dry-run", action="store_true", help="tiny model, few rows, on whatever backend")
    parser.add_argument("--vocab", type=int, default=512, help="--dry-run's vocabulary")
    parser.add_argument("--logit-std", type=float, default=None,
                        help="nats the random logits spread (default plan.step_time.TRAINED_LIKE_LOGIT_STD; 0: the init's)")
    args = parser.parse_args()
    if args.logit_std is None:
        from llds_jax.plan.step_time import TRAINED_LIKE_LOGIT_STD

        args.logit_std = TRAINED_LIKE_LOGIT_STD
    if not 0 <= args.logit_std < float("inf"):
        parser.error(f"--logit-std {args.logit_std}: expected a finite number >= 0")
    if args.dry_run:
        args.rows, args.slots, args.steps, args.calls = min(args.rows, 4), min(args.slots, 512), min(args.steps, 8), 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from llds_jax.models.decoder import Decoder
    from llds_jax.sampling.decode_loop import SamplingParams
    from llds_jax.sampling.stop_strings import build_stop_table

    config = decoder_config(args)
    if args.tokenizer:
        from transformers import AutoTokenizer

        from llds_jax.rollout.action_stop import action_stop_table
        from llds_jax.sampling.token_bytes import vocab_bytes

        table = action_stop_table(vocab_bytes(AutoTokenizer.from_pretrained(args.tokenizer), config.vocab_size))
        stop_table = table.transitions
    else:
        stop_table = build_stop_table(tuple(bytes([i % 256]) for i in range(config.vocab_size)),
                                      ("</search>", "</answer>")).transitions
    sampling = SamplingParams.create(temperature=1.0, top_k=0, top_p=0.95, stop_token_ids=[], stop_table=stop_table)
    budget = max(int(v.partition("@")[2] or args.steps) for v in args.variants.split(",")) * (args.calls + 3)
    lengths = live_lengths(args.rows, args.slots - budget)
    itemsize = jnp.dtype(config.dtype).itemsize
    abstract = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(abstract)))
    kv_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize
    live_kv = kv_per_token * (sum(lengths) + len(lengths) * budget // 2)
    bandwidth = copy_bandwidth(jax, jnp, 64 << 20 if args.dry_run else 4 << 30)
    header = {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(), "jax": jax.__version__,
              "model": "tiny:qwen2" if args.dry_run else args.model, "rows": args.rows, "slots": args.slots,
              "steps_per_call": args.steps, "logit_std": args.logit_std,
              "mean_live_tokens": round(float(np.mean(lengths)), 1),
              "weight_bytes": weights, "live_kv_bytes_mid": live_kv,
              "copy_bandwidth_GBps": round(bandwidth / 1e9, 1),
              "bytes_bound_ms": round(1e3 * (weights + live_kv) / bandwidth, 3)}
    print(json.dumps(header), flush=True)
    results = []
    for variant in args.variants.split(","):
        try:
            results.append(run_variant(variant, args, lengths, sampling, out))
        except Exception as err:  # one variant failing leaves the others' numbers
            results.append({"variant": variant, "error": f"{type(err).__name__}: {err}"[:2000]})
        print(json.dumps(results[-1]), flush=True)
    (out / "decode_step.json").write_text(json.dumps({"header": header, "results": results}, indent=1))
    print(f"\n| variant | ms/step | × bytes bound ({header['bytes_bound_ms']} ms) | first call s | top kernel (share) |")
    print("|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['variant']} | error | | | {r['error'][:80]} |")
            continue
        top = (r.get("profile", {}).get("top") or [{}])[0]
        print(f"| {r['variant']} | {r['ms_per_step']} | {r['ms_per_step'] / header['bytes_bound_ms']:.2f} | "
              f"{r['first_call_s']} | {top.get('name', '')[:50]} ({top.get('share', '')}) |")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
