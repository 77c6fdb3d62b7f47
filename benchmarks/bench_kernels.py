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
* ``update``: every matrix product of one ``bench_train_step`` update of SmolLM2-135M (16 x 256
  in 4 micro-batches of 4 x 256, ``remat="minimal"``, 80 scored targets a row), each on its own
  operands: per layer and micro-batch the 7 projections forward, their input gradients and
  their weight gradients, and the causal attention's 128 x 128 block products (3 blocks below
  the diagonal: 2 forward, 5 backward each, as ``attention.blockwise``); per micro-batch the
  tied head forward and backward at the 320 scored positions. Nothing else: the time is the
  floor an update built on these kernels cannot go below, on each side's kernels, and
  ``update_products_floor_s`` says how fast the whole update could at best be against a
  PyTorch step (``bench_train_step.py``) measured in the same hour.
* ``stream``: a sum over a large fp32 array (default 1 GiB): the memory bandwidth a kernel
  can reach on this machine.

Sides alternate; load gate, ``--allow-noisy`` and ``--json`` from ``benchmarks/_harness.py``.

    python benchmarks/bench_kernels.py
    python benchmarks/bench_kernels.py --cases decode --decode-layers 30 --repeats 7
    python benchmarks/bench_kernels.py --cases update --repeats 3
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

from llds_jax.models.attention.blockwise import QUERY_BLOCK  # noqa: E402

MATMULS = "1024x1024x1024,1024x576x1536,1024x1536x576,1024x576x576,1024x576x49152"
# SmolLM2-135M: hidden 576, MLP 1536, 9 query heads and 3 KV heads of 64, tied 49 152 x 576 head.
HIDDEN, MLP, VOCAB = 576, 1536, 49152
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
KV_WIDTH = KV_HEADS * HEAD_DIM
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


# One update of bench_train_step.py: 4 micro-batches of 4 x 256 tokens through 30 layers, 80 scored targets a row.
UPDATE_MICRO_BATCHES, UPDATE_ROWS, UPDATE_LENGTH, UPDATE_SCORED = 4, 4, 256, 80
KEY_BLOCK = QUERY_BLOCK  # a full-sequence forward's query pieces, each walking keys this many at a time
# (lhs shape, rhs shape, einsum) of one attention block pair: q [B, KVH, G, 128, Dh] against a 128-key block
# [B, KVH, 128, Dh]. Forward: scores, probabilities x values. Backward (the scores recomputed): d_v, d_probs,
# d_q, d_k, with the operand layouts of ``blockwise._flash_bwd``.
_Q = (UPDATE_ROWS, KV_HEADS, HEADS // KV_HEADS, KEY_BLOCK, HEAD_DIM)
_K = (UPDATE_ROWS, KV_HEADS, KEY_BLOCK, HEAD_DIM)
_P = (UPDATE_ROWS, KV_HEADS, HEADS // KV_HEADS, KEY_BLOCK, KEY_BLOCK)
ATTENTION_PRODUCTS = ((_Q, _K, "bkgtd,bksd->bkgts"), (_P, _K, "bkgts,bksd->bkgtd"),  # forward
                      (_Q, _K, "bkgtd,bksd->bkgts"), (_P, _Q, "bkgts,bkgtd->bksd"),  # scores again, d_v
                      (_Q, _K, "bkgtd,bksd->bkgts"), (_P, _K, "bkgts,bksd->bkgtd"),  # d_probs, d_q
                      (_P, _Q, "bkgts,bkgtd->bksd"))  # d_k
_PIECES = UPDATE_LENGTH // KEY_BLOCK
CAUSAL_BLOCK_PAIRS = _PIECES * (_PIECES + 1) // 2  # query piece i reads key blocks 0 .. i


def layer_products(tokens: int) -> list[tuple[tuple[int, ...], tuple[int, ...], str]]:
    """(lhs, rhs, einsum) of every product of one layer in one micro-batch, in the decoder's layouts."""
    products = []
    for d_in, d_out in LAYER_SHAPES:
        products += [((tokens, d_in), (d_in, d_out), "ti,io->to"),  # forward
                     ((tokens, d_out), (d_in, d_out), "to,io->ti"),  # input gradient
                     ((tokens, d_in), (tokens, d_out), "ti,to->io")]  # weight gradient
    return products + list(ATTENTION_PRODUCTS) * CAUSAL_BLOCK_PAIRS


def head_products(scored: int) -> list[tuple[tuple[int, ...], tuple[int, ...], str]]:
    """The tied head's forward, input gradient and weight gradient on the scored positions."""
    return [((scored, HIDDEN), (VOCAB, HIDDEN), "td,vd->tv"), ((scored, VOCAB), (VOCAB, HIDDEN), "tv,vd->td"),
            ((scored, VOCAB), (scored, HIDDEN), "tv,td->vd")]


def _flops(lhs, rhs, spec: str) -> int:
    sizes = {}
    for names, shape in zip(spec.split("->")[0].split(","), (lhs, rhs), strict=True):
        sizes.update(zip(names, shape, strict=True))
    return 2 * int(np.prod(list(sizes.values())))


# Distinct operands for this many layers, cycled through the 30: ~0.9 GB a side, far beyond the caches, so no call
# finds its operands cached by the previous one, without holding 30 layers' worth (5 GB) twice.
LAYER_GROUP = 5


def update_sides(layers: int = 30):
    """Both sides run the same products on their own copies of the same operands; every output is fresh, as in a step."""
    layer = layer_products(UPDATE_ROWS * UPDATE_LENGTH)
    head = head_products(UPDATE_ROWS * UPDATE_SCORED)
    rng = np.random.default_rng(0)

    def operands(products):
        return [(rng.standard_normal(lhs, np.float32), rng.standard_normal(rhs, np.float32)) for lhs, rhs, _ in products]

    layer_ops = [operands(layer) for _ in range(min(LAYER_GROUP, layers))]
    head_ops = operands(head)

    def program(products):
        specs = [spec for _, _, spec in products]
        return jax.jit(lambda ops: [jnp.einsum(spec, a, b) for spec, (a, b) in zip(specs, ops, strict=True)])

    ours_layer, ours_head = program(layer), program(head)
    ours_layer_ops, ours_head_ops = jax.device_put(layer_ops), jax.device_put(head_ops)
    to_torch = lambda ops: [(torch.from_numpy(a), torch.from_numpy(b)) for a, b in ops]  # noqa: E731
    theirs_layer_ops, theirs_head_ops = [to_torch(ops) for ops in layer_ops], to_torch(head_ops)

    def ours_update():
        for _ in range(UPDATE_MICRO_BATCHES):
            for i in range(layers):
                jax.block_until_ready(ours_layer(ours_layer_ops[i % LAYER_GROUP]))
            jax.block_until_ready(ours_head(ours_head_ops))

    def run_torch(products, ops):
        return [torch.einsum(spec, a, b) for (_, _, spec), (a, b) in zip(products, ops, strict=True)]

    @torch.no_grad()
    def theirs_update():
        for _ in range(UPDATE_MICRO_BATCHES):
            for i in range(layers):
                run_torch(layer, theirs_layer_ops[i % LAYER_GROUP])
            run_torch(head, theirs_head_ops)

    flops = UPDATE_MICRO_BATCHES * (layers * sum(_flops(*p) for p in layer) + sum(_flops(*p) for p in head))
    return {_harness.OURS: ours_update, "torch": theirs_update}, flops


def stream_sides(megabytes: int):
    values = np.random.default_rng(0).standard_normal(megabytes * 2**20 // 4, np.float32)
    ours = jax.jit(jnp.sum)
    jv, tv = jnp.asarray(values), torch.from_numpy(values)
    return {_harness.OURS: _jax_side(ours, jv), "torch": _torch_side(lambda: tv.sum())}, values.nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="matmul,decode,stream", help="any of matmul, decode, update, stream")
    parser.add_argument("--matmul", default=MATMULS, help="comma-separated MxKxN shapes")
    parser.add_argument("--decode-layers", type=int, default=30, help="SmolLM2-135M has 30")
    parser.add_argument("--decode-batch", type=int, default=8)
    parser.add_argument("--update-layers", type=int, default=30, help="layers of the update's products (SmolLM2: 30)")
    parser.add_argument("--stream-mb", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--torch-threads", type=int, default=os.cpu_count() or 1)
    _harness.add_arguments(parser)
    args = parser.parse_args()
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = sorted(set(cases) - {"matmul", "decode", "update", "stream"})
    if unknown:
        parser.error(f"--cases: unknown {unknown}; expected any of matmul, decode, update, stream")
    shapes = []
    for shape in args.matmul.split(","):
        try:
            m, k, n = (int(d) for d in shape.lower().split("x"))
        except ValueError:
            parser.error(f"--matmul: {shape!r} is not MxKxN")
        shapes.append((m, k, n))
    if args.update_layers < 1:
        parser.error(f"--update-layers={args.update_layers}: must be >= 1")
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
    if "update" in cases:
        session.log(f"update products: {UPDATE_MICRO_BATCHES} micro-batches x ({args.update_layers} layers x "
                    "(21 GEMMs + 21 attention block products) + the head) ...")
        sides, flops = update_sides(args.update_layers)
        times = _harness.alternate(sides, args.repeats)
        row = session.add_case(f"every matrix product of one SmolLM2-135M GRPO+LLDS update 16x256 (bench_train_step), "
                               f"{args.update_layers} layers",
                               times, tokens=flops / 1e9, unit="GFLOP")
        floor = {side: s["median_s"] for side, s in row["sides"].items()}
        session.results["update_products_floor_s"] = floor
        session.log("update floor (its products alone): " + ", ".join(f"{side} {t:.2f} s" for side, t in floor.items())
                    + f"; a PyTorch step must take >= {1.5 * floor[_harness.OURS]:.1f} s for ours to reach 1.5x")
    if "stream" in cases:
        session.log(f"stream: sum over {args.stream_mb} MiB ...")
        sides, nbytes = stream_sides(args.stream_mb)
        times = _harness.alternate(sides, args.repeats)
        session.add_case(f"fp32 sum over {nbytes / 2**20:.0f} MiB", times, tokens=INNER * nbytes / 1e9, unit="GB")
    session.finish()


if __name__ == "__main__":
    main()
