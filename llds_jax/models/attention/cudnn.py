"""GPU: cuDNN flash attention through ``jax.nn.dot_product_attention``.

cuDNN's fused kernel takes causal masking and per-row sequence lengths (right
padding), but any other mask only as a dense [T, S] bias — exactly what we must not
build. So each row is rotated left by its count of leading pads, which turns a
left-and-right padded row into a right-padded one (causal by index is unchanged among
real tokens, and RoPE was applied before, by position, not index); the output is
rotated back. A row with a hole in the middle cannot be written that way: when any row
has one, a ``lax.cond`` takes the blockwise kernel instead, so the answer is right for
every mask and the fused kernel serves the usual batches.

Packed rows (several trajectories per row, ``AttentionMask.key_start``) take cuDNN's packed
("THD") layout: each row's runs of one segment id become (offset, length) pairs and the kernel
attends causally inside each run. ``jax.nn.dot_product_attention`` (JAX 0.10–0.11) takes no
segment ids or offsets, so this calls ``jax._src.cudnn.fused_attention_stablehlo`` — a private
module, guarded by ``cudnn_packed_available`` (signature, cuDNN, Hopper), and the blockwise kernel
otherwise (docs/performance.md: attention alone on one H100, 15× the blockwise kernel's speed on
packed rows and 2.6× cuDNN's over the same trajectories one per row). A row with more than ``PACKED_RUNS`` runs
takes the blockwise kernel through a ``lax.cond``.
"""

from __future__ import annotations

import functools
import inspect
import math

import jax
import jax.numpy as jnp

from llds_jax.models.attention.blockwise import DEFAULT_BLOCK, blockwise_attention
from llds_jax.models.attention.mask import AttentionMask

# What the fused kernel accepts (``jax.nn.dot_product_attention`` raises on float32 queries):
# a float32 program under ``model.attention="auto"`` on GPU runs the blockwise kernel instead.
CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Runs (segments, padding runs included) a packed row may hold for the fused kernel: the THD
# arrays are [B, PACKED_RUNS]. Search-R1 trajectories (≈ 690 tokens) put ≈ 6 in a 4,096 row.
PACKED_RUNS = 64
_THD_ARGUMENTS = {"q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets", "mask_type", "qkv_layout"}


@functools.cache
def cudnn_available() -> bool:
    """True when this process drives real NVIDIA GPUs and cuDNN's fused attention loads."""
    if jax.default_backend() != "gpu":
        return False
    try:
        from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version  # noqa: PLC0415
        return check_cudnn_version() >= 8904  # the fused flash kernel's minimum
    except (ImportError, RuntimeError):
        return False


@functools.cache
def cudnn_packed_available() -> bool:
    """True when cuDNN's packed layout can run here: cuDNN loads, the GPU is Hopper or newer (the
    layout's requirement) and the private entry point still takes the THD arguments we pass."""
    if not cudnn_available():
        return False
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fused  # noqa: PLC0415
        return (_THD_ARGUMENTS <= set(inspect.signature(fused.dot_product_attention).parameters)
                and hasattr(fused.MaskType, "PADDING_CAUSAL") and fused.check_compute_capability("9.0"))
    except (ImportError, AttributeError, RuntimeError, ValueError):
        return False


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask,
                    block_size: int = DEFAULT_BLOCK, *, implementation: str = "cudnn",
                    packed_kernel=None) -> jax.Array:
    """q [B, T, H, Dh]; k, v [B, T, KVH, Dh] of one sequence → [B, T, H, Dh].

    ``implementation="xla"`` runs the same rotation through JAX's reference kernel
    (which does build scores): how the mapping is tested on a host without cuDNN.
    ``packed_kernel`` stands in for cuDNN's packed entry point (same arguments), likewise."""
    if not mask.self_attention:
        raise ValueError("cudnn_attention covers the full-sequence forward only (AttentionMask.causal)")
    if mask.key_start is not None:
        kernel = packed_kernel or (cudnn_packed_kernel() if cudnn_packed_available() else None)
        if kernel is None:
            return blockwise_attention(q, k, v, mask, block_size)
        offsets, lengths, runs = packed_runs(mask.key_start)
        return jax.lax.cond(jnp.all(runs <= offsets.shape[1] - 1),
                            lambda: packed_dot_product_attention(q, k, v, offsets, lengths, kernel),
                            lambda: blockwise_attention(q, k, v, mask, block_size))
    real = mask.key_valid

    def fused():
        return rotated_dot_product_attention(q, k, v, real, implementation)

    return jax.lax.cond(rows_are_contiguous(real), fused, lambda: blockwise_attention(q, k, v, mask, block_size))


def rows_are_contiguous(real: jax.Array) -> jax.Array:
    """Scalar bool: every row of ``real`` [B, T] is pads, real tokens, pads (no hole)."""
    positions = jnp.arange(real.shape[1], dtype=jnp.int32)
    count = jnp.sum(real, axis=1, dtype=jnp.int32)
    first = jnp.argmax(real, axis=1).astype(jnp.int32)
    last = jnp.max(jnp.where(real, positions[None, :], -1), axis=1)
    return jnp.all((count == 0) | (last + 1 - first == count))


def rotated_dot_product_attention(q, k, v, real: jax.Array, implementation: str) -> jax.Array:
    """Causal attention over rows with no holes: rotate to right padding, run the fused
    kernel with per-row lengths, rotate back. Wrong for a row with a hole (see module doc)."""
    length = real.shape[1]
    positions = jnp.arange(length, dtype=jnp.int32)
    count = jnp.maximum(jnp.sum(real, axis=1, dtype=jnp.int32), 1)  # an all-pad row: token 0 reads itself
    first = jnp.argmax(real, axis=1).astype(jnp.int32)
    gather = (positions[None, :] + first[:, None]) % length  # rotated index -> original index
    scatter = (positions[None, :] - first[:, None]) % length
    rotate = functools.partial(_take_rows, gather)
    out = jax.nn.dot_product_attention(rotate(q), rotate(k), rotate(v), is_causal=True,
                                       implementation=implementation,
                                       query_seq_lengths=count, key_value_seq_lengths=count)
    return _take_rows(scatter, out)


def _take_rows(index, x):
    """x[b, index[b, t]] for x [B, T, N, Dh]."""
    return jnp.take_along_axis(x, index[:, :, None, None], axis=1)


def cudnn_packed_kernel():
    """cuDNN's packed-layout attention (the private entry point; see ``cudnn_packed_available``)."""
    from jax._src.cudnn import fused_attention_stablehlo as fused  # noqa: PLC0415

    return functools.partial(fused.dot_product_attention, mask_type=fused.MaskType.PADDING_CAUSAL,
                             qkv_layout="BTNH")


def packed_runs(key_start: jax.Array, max_runs: int = PACKED_RUNS) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The THD description of packed rows from ``key_start`` [B, T] (each token's run start).

    Every maximal run of one segment id is a sequence — padding runs too, so every token is
    covered and its output is finite (padding reads padding, as in the blockwise kernel).
    Returns offsets [B, max_runs + 1] (run starts, then -1), lengths [B, max_runs] (-1 past the
    row's runs) and runs [B], the row's run count; a row with more runs than ``max_runs`` keeps its
    first ``max_runs`` only (the caller then takes another kernel)."""
    batch, length = key_start.shape
    index = jnp.arange(length, dtype=jnp.int32)
    starts = key_start == index[None, :]
    runs = jnp.sum(starts, axis=1, dtype=jnp.int32)
    rank = jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1
    column = jnp.where(starts & (rank < max_runs), rank, max_runs + 1)  # out of range: dropped
    rows = jnp.arange(batch)[:, None]
    offsets = jnp.full((batch, max_runs + 1), -1, jnp.int32).at[rows, column].set(
        jnp.broadcast_to(index, (batch, length)), mode="drop")
    begin, following = offsets[:, :max_runs], offsets[:, 1:]
    end = jnp.where(following >= 0, following, length)
    lengths = jnp.where(begin >= 0, end - begin, -1)
    return offsets, lengths, runs


def packed_dot_product_attention(q, k, v, offsets: jax.Array, lengths: jax.Array, kernel) -> jax.Array:
    """Causal attention inside each (offset, length) run of every row, by ``kernel`` (cuDNN's
    packed entry point or a stand-in with its arguments); q [B, T, H, Dh], k, v [B, T, KVH, Dh]."""
    return kernel(q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets, kv_offsets=offsets,
                  scale=1.0 / math.sqrt(q.shape[-1]))
