"""GPU: cuDNN flash attention through ``jax.nn.dot_product_attention``.

cuDNN's fused kernel takes causal masking and per-row sequence lengths (right
padding), but any other mask only as a dense [T, S] bias — exactly what we must not
build. So each row is rotated left by its count of leading pads, which turns a
left-and-right padded row into a right-padded one (causal by index is unchanged among
real tokens, and RoPE was applied before, by position, not index); the output is
rotated back. A row with a hole in the middle cannot be written that way: when any row
has one, a ``lax.cond`` takes the blockwise kernel instead, so the answer is right for
every mask and the fused kernel serves the usual batches.

Packed rows (several trajectories per row, ``AttentionMask.key_start``) take the blockwise
kernel: ``jax.nn.dot_product_attention`` (JAX 0.10) takes causal masking, per-row
``query_seq_lengths`` / ``key_value_seq_lengths`` and a sliding window, but no segment ids or
per-segment offsets (the THD ``q_offsets`` of cuDNN exist only behind a private module), and a
dense [T, S] mask is what we must not build.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from llds_jax.models.attention.blockwise import DEFAULT_BLOCK, blockwise_attention
from llds_jax.models.attention.mask import AttentionMask

# What the fused kernel accepts (``jax.nn.dot_product_attention`` raises on float32 queries):
# a float32 program under ``model.attention="auto"`` on GPU runs the blockwise kernel instead.
CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


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


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask,
                    block_size: int = DEFAULT_BLOCK, *, implementation: str = "cudnn") -> jax.Array:
    """q [B, T, H, Dh]; k, v [B, T, KVH, Dh] of one sequence → [B, T, H, Dh].

    ``implementation="xla"`` runs the same rotation through JAX's reference kernel
    (which does build scores): how the mapping is tested on a host without cuDNN."""
    if not mask.self_attention:
        raise ValueError("cudnn_attention covers the full-sequence forward only (AttentionMask.causal)")
    if mask.key_start is not None:  # packed rows: the public API takes no segment ids (module doc)
        return blockwise_attention(q, k, v, mask, block_size)
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
