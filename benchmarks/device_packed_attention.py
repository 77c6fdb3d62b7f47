"""Packed-row attention on a GPU: cuDNN's packed layout vs the blockwise kernel vs cuDNN one trajectory per row.

    python benchmarks/device_packed_attention.py [--rows 16] [--length 4096] [--lo 300] [--hi 1100]

Why: packed training rows (``train/packing.py``) need attention that keeps segments apart. On a
Hopper GPU ``cudnn_attention`` gives them cuDNN's packed layout (``models/attention/cudnn.py``),
elsewhere the blockwise kernel; the padded layout (one trajectory per row) takes cuDNN with per-row
lengths. This times the three on the same trajectories — Qwen2.5-0.5B attention (14 query heads,
2 KV heads of 64), bf16, forward + backward of ``sum(out * probe)``, median of 5 after a compile —
and reports cuDNN-packed vs blockwise max |Δ| of the output and the gradients on real tokens.
Trajectory lengths are uniform in [lo, hi) (Search-R1's mean is ≈ 700), packed in order into
``--rows`` rows. Needs an NVIDIA Hopper GPU; prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from llds_jax.models.attention import AttentionMask, blockwise_attention
from llds_jax.models.attention.cudnn import cudnn_attention, cudnn_packed_available

HEADS, KV_HEADS, HEAD_DIM = 14, 2, 64  # Qwen2.5-0.5B


def pack(rows: int, length: int, lo: int, hi: int) -> tuple[np.ndarray, list[int]]:
    """segment ids [rows, length] (0 = padding) and the trajectory lengths, packed in order."""
    rng = np.random.default_rng(0)
    segments, lengths = np.zeros((rows, length), np.int32), []
    for row in range(rows):
        at, segment = 0, 1
        while at + (n := int(rng.integers(lo, hi))) <= length:
            segments[row, at:at + n] = segment
            lengths.append(n)
            at, segment = at + n, segment + 1
    return segments, lengths


def value_and_grads(attention, probe):
    loss = lambda q, k, v: jnp.sum(attention(q, k, v).astype(jnp.float32) * probe)  # noqa: E731
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def median_seconds(fn, *args, repeats: int = 5) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def qkv_and_probe(rows: int, length: int, real: jax.Array):
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (rows, length, HEADS, HEAD_DIM), jnp.bfloat16)
    k, v = (jax.random.normal(key, (rows, length, KV_HEADS, HEAD_DIM), jnp.bfloat16) for key in keys[1:3])
    probe = jax.random.normal(keys[3], q.shape, jnp.float32) * real[:, :, None, None]
    return q, k, v, probe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--lo", type=int, default=300)
    parser.add_argument("--hi", type=int, default=1100)
    args = parser.parse_args()
    if not cudnn_packed_available():
        raise SystemExit("device_packed_attention: needs cuDNN's packed layout (an NVIDIA Hopper GPU)")
    segments, lengths = pack(args.rows, args.length, args.lo, args.hi)
    mask = AttentionMask.packed(jnp.asarray(segments))
    real = jnp.asarray(segments > 0)
    q, k, v, probe = qkv_and_probe(args.rows, args.length, real)
    kernels = {"cudnn_packed": lambda q, k, v: cudnn_attention(q, k, v, mask),
               "blockwise_packed": lambda q, k, v: blockwise_attention(q, k, v, mask)}
    packed, blockwise = (value_and_grads(kernel, probe) for kernel in kernels.values())
    result = dict(jax=jax.__version__, device=jax.devices()[0].device_kind, rows=args.rows, length=args.length,
                  trajectories=len(lengths), mean_length=float(np.mean(lengths)), fill=float(real.mean()))
    on_real = real[:, :, None, None]
    outs = [jax.jit(kernel)(q, k, v) for kernel in kernels.values()]
    result["out_max_abs_diff"] = float(jnp.max(jnp.where(on_real, jnp.abs(outs[0] - outs[1]).astype(jnp.float32), 0)))
    for name, got, want in zip(("dq", "dk", "dv"), packed(q, k, v)[1], blockwise(q, k, v)[1], strict=True):
        result[f"{name}_max_abs_diff"] = float(jnp.max(jnp.where(on_real, jnp.abs(got - want).astype(jnp.float32), 0)))
        result[f"{name}_max_abs"] = float(jnp.max(jnp.abs(want.astype(jnp.float32))))
    result["cudnn_packed_s"] = median_seconds(packed, q, k, v)
    result["blockwise_packed_s"] = median_seconds(blockwise, q, k, v)
    # The padded layout: the same trajectories one per row, right-padded, cuDNN with per-row lengths.
    count, per_row = len(lengths), jnp.asarray(lengths, jnp.int32)
    real_padded = jnp.arange(args.length)[None, :] < per_row[:, None]
    qp, kp, vp, probe_padded = qkv_and_probe(count, args.length, real_padded)
    padded = value_and_grads(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn", query_seq_lengths=per_row,
        key_value_seq_lengths=per_row), probe_padded)
    result["cudnn_one_per_row_s"] = median_seconds(padded, qp, kp, vp)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
