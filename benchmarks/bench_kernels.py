"""This CPU's ceilings for our programs, XLA:CPU (jitted JAX) against PyTorch's kernels in one run.

Why: the model benchmarks (``bench_forward``, ``bench_sampler``, ``bench_train_step``) can only
be as fast as the matrix products and memory streams under them, and which side wins those
depends on the CPU (torch's oneDNN / MKL kernels gain more from AVX-512 than XLA:CPU's do).
This script measures the ceilings themselves, so a ratio in a model benchmark can be read
against the kernels it is built from:

* ``matmul``: fp32 GEMMs, ``M x K x N`` (default: 1024³ and SmolLM2-135M's projections and
  tied head at 1024 tokens, the shapes of a 4 x 256 forward); GFLOP/s.
* ``decode``: the GEMMs of one SmolLM2-135M decode step at batch 8: 30 layers x 7 projections
  and the tied head, 211 distinct weights (538 MB fp32) applied in sequence, each read once per
  step, as the sampler does. Ours keeps the decoder's layouts (``[in, out]`` projections, the
  ``[vocab, hidden]`` table), torch ``nn.Linear``'s ``[out, in]``. At M = 8 a GEMM is bound by
  streaming its weight, so the rate is GB/s of weights, and batch / (the step's GEMM time) is
  the most tokens per second a decode built on these kernels can reach.
* ``stream``: a sum over a large fp32 array (default 1 GiB): the memory bandwidth a kernel
  can reach on this machine.

Sides alternate; load gate, ``--allow-noisy`` and ``--json`` from ``benchmarks/_harness.py``.

    python benchmarks/bench_kernels.py
    python benchmarks/bench_kernels.py --cases decode --decode-layers 30 --repeats 7
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import _harness  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

MATMULS = "1024x1024x1024,1024x576x1536,1024x1536x576,1024x576x576,1024x576x49152"
# SmolLM2-135M: hidden 576, MLP 1536, 9 query heads and 3 KV heads of 64, tied 49 152 x 576 head.
HIDDEN, MLP, KV_WIDTH, VOCAB = 576, 1536, 192, 49152
LAYER_SHAPES = ((HIDDEN, HIDDEN), (HIDDEN, KV_WIDTH), (HIDDEN, KV_WIDTH), (HIDDEN, HIDDEN),
                (HIDDEN, MLP), (HIDDEN, MLP), (MLP, HIDDEN))  # (in, out): q, k, v, o, gate, up, down
INNER = 5  # calls per timed sample, so a sample is well above the timer's and dispatch's resolution


def _torch_side(fn):
    @torch.no_grad()
    def run():
        for _ in range(INNER):
            fn()
    return run


def _jax_side(fn, *args):
    def run():
        out = None
        for _ in range(INNER):
            out = fn(*args)
        jax.block_until_ready(out)
    return run


def matmul_sides(m: int, k: int, n: int):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)
    ours = jax.jit(jnp.matmul)
    ja, jb, ta, tb = jnp.asarray(a), jnp.asarray(b), torch.from_numpy(a), torch.from_numpy(b)
    return {_harness.OURS: _jax_side(ours, ja, jb), "torch": _torch_side(lambda: ta @ tb)}


def _layer_stack(x, layers, project, widen):
    """One decode step's projections with a data dependency between them (no reordering, no reuse).
    ``widen`` zero-pads a [B, 192] k / v projection to [B, 576]."""
    for q, k, v, o, gate, up, down in layers:
        h = project(x, q) + widen(project(x, k)) + widen(project(x, v))
        x = x + 0.1 * project(h, o)
        g, u = project(x, gate), project(x, up)
        x = x + 0.1 * project(g / (1 + abs(g)) * u, down)  # a cheap gate: the GEMMs are what is measured
        x = x / (1 + abs(x).mean(-1)[:, None])
    return x


def _decode_gemms(x, layers, head, project, widen, unembed):
    return unembed(_layer_stack(x, layers, project, widen), head)


def decode_sides(layers: int, batch: int):
    rng = np.random.default_rng(0)
    weights = [[(0.02 * rng.standard_normal(shape)).astype(np.float32) for shape in LAYER_SHAPES]
               for _ in range(layers)]
    head = (0.02 * rng.standard_normal((VOCAB, HIDDEN))).astype(np.float32)  # tied: the embedding table
    x = rng.standard_normal((batch, HIDDEN)).astype(np.float32)
    ours_weights = jax.device_put(weights)  # [in, out], as the decoder stores them
    theirs_weights = [[torch.from_numpy(np.ascontiguousarray(w.T)) for w in layer] for layer in weights]  # [out, in]
    pad = HIDDEN - KV_WIDTH
    ours = jax.jit(lambda x, w, e: _decode_gemms(x, w, e, jnp.matmul, lambda y: jnp.pad(y, ((0, 0), (0, pad))),
                                                 lambda y, e: jnp.einsum("bd,vd->bv", y, e)))
    tx, theirs_head = torch.from_numpy(x), torch.from_numpy(head)
    linear = torch.nn.functional.linear
    theirs = lambda: _decode_gemms(tx, theirs_weights, theirs_head, linear,  # noqa: E731
                                   lambda y: torch.nn.functional.pad(y, (0, pad)), linear)
    sides = {_harness.OURS: _jax_side(ours, jnp.asarray(x), ours_weights, jnp.asarray(head)),
             "torch": _torch_side(theirs)}
    return sides, sum(w.nbytes for layer in weights for w in layer) + head.nbytes


def stream_sides(megabytes: int):
    values = np.random.default_rng(0).standard_normal(megabytes * 2**20 // 4, np.float32)
    ours = jax.jit(jnp.sum)
    jv, tv = jnp.asarray(values), torch.from_numpy(values)
    return {_harness.OURS: _jax_side(ours, jv), "torch": _torch_side(lambda: tv.sum())}, values.nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="matmul,decode,stream", help="any of matmul, decode, stream")
    parser.add_argument("--matmul", default=MATMULS, help="comma-separated MxKxN shapes")
    parser.add_argument("--decode-layers", type=int, default=30, help="SmolLM2-135M has 30")
    parser.add_argument("--decode-batch", type=int, default=8)
    parser.add_argument("--stream-mb", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--torch-threads", type=int, default=os.cpu_count() or 1)
    _harness.add_arguments(parser)
    args = parser.parse_args()
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = sorted(set(cases) - {"matmul", "decode", "stream"})
    if unknown:
        parser.error(f"--cases: unknown {unknown}; expected any of matmul, decode, stream")
    shapes = []
    for shape in args.matmul.split(","):
        try:
            m, k, n = (int(d) for d in shape.lower().split("x"))
        except ValueError:
            parser.error(f"--matmul: {shape!r} is not MxKxN")
        shapes.append((m, k, n))
    session = _harness.start("bench_kernels", args)
    torch.set_num_threads(args.torch_threads)

    if "matmul" in cases:
        for m, k, n in shapes:
            session.log(f"matmul {m}x{k}x{n} ...")
            times = _harness.alternate(matmul_sides(m, k, n), args.repeats)
            session.add_case(f"fp32 matmul {m}x{k}x{n}", times, tokens=INNER * 2 * m * k * n / 1e9, unit="GFLOP")
    if "decode" in cases:
        session.log(f"decode GEMMs: {args.decode_layers} layers x 7 projections, batch {args.decode_batch} ...")
        sides, nbytes = decode_sides(args.decode_layers, args.decode_batch)
        times = _harness.alternate(sides, args.repeats)
        row = session.add_case(f"decode-step GEMMs, SmolLM2-135M shapes, {args.decode_layers} layers, "
                               f"+ tied head, batch {args.decode_batch} ({nbytes / 1e6:.0f} MB of weights)", times,
                               tokens=INNER * nbytes / 1e9, unit="GB")
        step_s = {side: s["median_s"] / INNER for side, s in row["sides"].items()}
        session.results["decode_gemm_ms_per_step"] = {side: 1000 * t for side, t in step_s.items()}
        session.results["decode_tokens_per_s_ceiling"] = {side: args.decode_batch / t for side, t in step_s.items()}
        session.log("decode ceiling (batch / GEMM time of one step): " + ", ".join(
            f"{side} {args.decode_batch / t:.0f} tok/s" for side, t in step_s.items()))
    if "stream" in cases:
        session.log(f"stream: sum over {args.stream_mb} MiB ...")
        sides, nbytes = stream_sides(args.stream_mb)
        times = _harness.alternate(sides, args.repeats)
        session.add_case(f"fp32 sum over {nbytes / 2**20:.0f} MiB", times, tokens=INNER * nbytes / 1e9, unit="GB")
    session.finish()


if __name__ == "__main__":
    main()
