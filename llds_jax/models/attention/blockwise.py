"""Flash-style attention in plain XLA: key blocks, online softmax, recomputing backward.

Why: the naive form holds fp32 scores [B, H, T, S], which at long contexts is the
largest buffer of a training step. Here the forward walks the keys one block at a
time, keeping a running max ``m``, normaliser ``l`` and un-normalised output per query,
so its temporaries are O(T x block) per head (running max ``m``, sum ``total``); a ``jax.custom_vjp`` saves only the
output and the log-sum-exp [B, H, T] and recomputes each block's probabilities in the
backward (FlashAttention-2's dq/dk/dv recurrences), so the gradient is bounded too. Those residuals
carry ``checkpoint_name``s, so a layer remat policy can keep them ("minimal" does) instead of
rerunning the forward.

Packed rows (``mask.key_start``): a query reads only its own segment, and the key loop starts at
the block of the smallest segment start among its queries, so a piece never visits key blocks
that hold no segment of it.

The loop runs over key blocks below ``mask.live_keys()`` only — a dynamic trip count —
so one-token decode over a large cache reads the blocks rows have reached, not the
whole cache. When S is not a multiple of the block the last block is shifted back to
end at S (no padded copy of the cache) and its already-covered keys are masked out.

Layout: the loop works heads-major — q as [B, KVH, G, T, Dh], keys and values as
[B, KVH, S, Dh] — because that is the layout a batched dot wants (batch dims leading,
the contracted and the kept axes contiguous). A KV cache is stored heads-major
(``kv_heads_major=True``), so a key block is one strided read of the live slots and
no step transposes the cache; a full-sequence forward transposes its k and v once. The paged
cache (``paged.py``) runs the same ops per key block through its block table.

Numerics: scores fp32 (``s / sqrt(Dh)`` as in the oracle), masked scores the oracle's
finite MASKED_SCORE, so a query with at least one visible key matches the oracle to
fp32 rounding. A query with no visible key (a left pad in a full-sequence forward) gets
a finite uniform average over the keys of the blocks read — the oracle averages over
all S keys — which is meaningless either way and never used.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from llds_jax.models.attention.mask import AttentionMask
from llds_jax.models.attention.naive import MASKED_SCORE
from llds_jax.models.reductions import row_max, row_sum
from llds_jax.parallel.rules import constrain

DEFAULT_BLOCK = 512
# Queries per piece of a full-sequence (causal self-attention) forward. Query block i can only
# see keys before its own end, so it runs over that prefix alone: at T = 512 four pieces do
# 10/16 of the score work of one [T, T] pass (the upper triangle was computed, then masked).
QUERY_BLOCK = 128
# At most this many pieces: each is its own key loop forward and backward, and compile time grows
# with them (a 4096-token update compiled in 40 s as one piece, ~200 s as 32). Longer sequences
# get longer pieces, which still walk keys QUERY_BLOCK at a time, so the live score tile
# [piece, QUERY_BLOCK] grows linearly with T, never quadratically; eight pieces skip at least
# 28/64 of the [T, T] score work.
MAX_QUERY_PIECES = 8


def query_piece(length: int, query_block: int = QUERY_BLOCK) -> int:
    """Queries per piece of a full-sequence forward of ``length`` tokens (≤ MAX_QUERY_PIECES pieces)."""
    return max(query_block, -(-length // MAX_QUERY_PIECES))
# The key block of a cached forward (prefill into a cache, decode, appends). Smaller than
# DEFAULT_BLOCK because a one-token decode step reads every slot of the blocks below the
# furthest row: its cost follows the live length in steps of this many slots.
CACHED_BLOCK = 128
# ``checkpoint_name``s of what the backward needs from the attention: its inputs in the kernel's layout
# and the custom VJP's residuals, so a layer remat policy can keep them (models.decoder.MINIMAL_SAVED_NAMES).
ATTENTION_RESIDUALS = Q_RESIDUAL, KV_RESIDUAL, OUT_RESIDUAL, LSE_RESIDUAL = (
    "attention_q", "attention_kv", "attention_out", "attention_lse")
_STAT_AXES = ("batch", "act_kv_heads", None, "seq")  # m, l, lse: [B, KVH, G, T]
_KV_AXES = ("batch", "act_kv_heads", None, None)  # keys / values heads-major: [B, KVH, S, Dh]


def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask,
                        block_size: int = DEFAULT_BLOCK, *, kv_heads_major: bool = False,
                        query_block: int = QUERY_BLOCK) -> jax.Array:
    """Same contract as ``naive_attention``: q [B, T, H, Dh]; k, v [B, S, KVH, Dh] → [B, T, H, Dh].

    ``kv_heads_major``: k and v come as [B, KVH, S, Dh] (a KV cache's layout). A full-sequence
    mask (``mask.self_attention``) is served in pieces of ``query_piece(T, query_block)`` queries,
    each walking ``query_block`` keys at a time up to its own last query: no work above the
    diagonal's blocks.
    Every piece reads the same k and v arrays (no per-piece copies to keep for the backward).
    """
    if block_size < 1 or query_block < 1:
        raise ValueError(f"block_size={block_size}, query_block={query_block}: must be positive")
    batch, length, heads, head_dim = q.shape
    if not kv_heads_major:
        k, v = (constrain(x.transpose(0, 2, 1, 3), _KV_AXES) for x in (k, v))
    kv_heads, slots = k.shape[1], k.shape[2]
    grouped = q.reshape(batch, length, kv_heads, heads // kv_heads, head_dim).transpose(0, 2, 3, 1, 4)
    grouped = checkpoint_name(grouped, Q_RESIDUAL)
    k, v = checkpoint_name(k, KV_RESIDUAL), checkpoint_name(v, KV_RESIDUAL)
    piece = query_piece(length, query_block)
    if mask.self_attention and length > piece:
        # query_index[b, t] == t, so the key loop of queries [start, stop) ends at the block
        # holding key stop - 1 (its trip count follows the largest query index it is given).
        block = min(query_block, slots)
        starts = mask.key_start
        pieces = [_flash(grouped[:, :, :, start:start + piece], k, v, mask.query_index[:, start:start + piece],
                         mask.key_valid, None if starts is None else starts[:, start:start + piece], block)
                  for start in range(0, length, piece)]
        out = jnp.concatenate(pieces, axis=3)
    else:
        out = _flash(grouped, k, v, mask.query_index, mask.key_valid, mask.key_start,
                     min(block_size, slots))  # [B, KVH, G, T, Dh]
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, length, heads, head_dim)


def _key_block(i, block: int, k, v, key_valid):
    """Block i of the keys; the last one is shifted back to end at S, and keys an
    earlier block already covered are flagged invalid so none is counted twice."""
    slots = k.shape[2]
    start = jnp.minimum(i * block, slots - block)
    ids = start + jnp.arange(block, dtype=jnp.int32)
    k_blk = jax.lax.dynamic_slice_in_dim(k, start, block, axis=2)
    v_blk = jax.lax.dynamic_slice_in_dim(v, start, block, axis=2)
    valid = jax.lax.dynamic_slice_in_dim(key_valid, start, block, axis=1) & (ids >= i * block)[None, :]
    return start, ids, k_blk, v_blk, valid


def _masked_scores(grouped, k_blk, ids, valid, query_index, key_start=None):
    """fp32 scores [B, KVH, G, T, block] with invisible keys at MASKED_SCORE (``key_start``: a packed
    row's queries also read nothing before their own segment's first slot)."""
    scores = jnp.einsum("bkgtd,bksd->bkgts", grouped, k_blk, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(grouped.shape[-1])
    visible = valid[:, None, :] & (ids[None, None, :] <= query_index[:, :, None])  # [B, T, block]
    if key_start is not None:
        visible &= ids[None, None, :] >= key_start[:, :, None]
    return jnp.where(visible[:, None, None], scores, MASKED_SCORE)


def _num_blocks(query_index, slots: int, block: int):
    live = jnp.clip(jnp.max(query_index) + 1, 1, slots)
    return (live + block - 1) // block


def _first_key_block(key_start, block: int):
    """The first key block any of these queries can read: 0, or below the smallest segment start
    of a packed piece (blocks that hold no segment of the query block are never visited)."""
    if key_start is None:
        return 0
    return (jnp.min(key_start) // block).astype(jnp.int32)


def _first_block(scores, v_blk):
    """The running (max, normaliser, un-normalised output) after the first key block.

    Block 0 is peeled off the loop: the running statistics start from its values, not from
    constant -inf / zero buffers. In an unrolled stack of layers (the cached forward) XLA
    fuses every layer's identical constant initialisers into one multi-output fusion that
    runs first, so all layers' fp32 [B, KVH, G, T, Dh] accumulators were alive at once
    (measured: ~8 KB per prefill token per layer, 39 GB of Qwen2.5-3B's prefill on H100).
    Same numbers: the loop's first step computes exactly these (exp(-inf) = 0 times 0, plus them).
    """
    m = constrain(row_max(scores), _STAT_AXES)
    probs = jnp.exp(scores - m[..., None])
    total = constrain(row_sum(probs), _STAT_AXES)
    acc = constrain(jnp.einsum("bkgts,bksd->bkgtd", probs.astype(v_blk.dtype), v_blk, preferred_element_type=jnp.float32),
                    (*_STAT_AXES, None))
    return m, total, acc


def _next_block(carry, scores, v_blk):
    """The online-softmax update of ``carry`` by one more key block."""
    m, total, acc = carry
    m_new = jnp.maximum(m, row_max(scores))
    probs = jnp.exp(scores - m_new[..., None])
    rescale = jnp.exp(m - m_new)
    total = rescale * total + row_sum(probs)
    update = jnp.einsum("bkgts,bksd->bkgtd", probs.astype(v_blk.dtype), v_blk, preferred_element_type=jnp.float32)
    return m_new, total, rescale[..., None] * acc + update


def _finish(grouped, carry):
    m, total, acc = carry
    return (acc / total[..., None]).astype(grouped.dtype), m + jnp.log(total)


def _forward(grouped, k, v, query_index, key_valid, key_start, block: int):
    def visit(i):  # block i's masked scores, and the keys' values
        _, ids, k_blk, v_blk, valid = _key_block(i, block, k, v, key_valid)
        return _masked_scores(grouped, k_blk, ids, valid, query_index, key_start), v_blk

    first = _first_key_block(key_start, block)
    carry = _first_block(*visit(first))
    carry = jax.lax.fori_loop(first + 1, _num_blocks(query_index, k.shape[2], block),
                              lambda i, carry: _next_block(carry, *visit(i)), carry)
    return _finish(grouped, carry)


@partial(jax.custom_vjp, nondiff_argnums=(6,))
def _flash(grouped, k, v, query_index, key_valid, key_start, block: int):
    return _forward(grouped, k, v, query_index, key_valid, key_start, block)[0]


def _flash_fwd(grouped, k, v, query_index, key_valid, key_start, block: int):
    out, lse = _forward(grouped, k, v, query_index, key_valid, key_start, block)
    out, lse = checkpoint_name(out, OUT_RESIDUAL), checkpoint_name(lse, LSE_RESIDUAL)
    return out, (grouped, k, v, query_index, key_valid, key_start, out, lse)


def _flash_bwd(block: int, residuals, d_out):
    grouped, k, v, query_index, key_valid, key_start, out, lse = residuals
    scale = 1.0 / math.sqrt(grouped.shape[-1])
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, KVH, G, T]
    d_q = jnp.zeros(grouped.shape, jnp.float32)
    d_k = jnp.zeros(k.shape, jnp.float32)
    d_v = jnp.zeros(v.shape, jnp.float32)

    def step(i, carry):
        d_q, d_k, d_v = carry
        start, ids, k_blk, v_blk, valid = _key_block(i, block, k, v, key_valid)
        probs = jnp.exp(_masked_scores(grouped, k_blk, ids, valid, query_index, key_start) - lse[..., None])
        d_v_blk = jnp.einsum("bkgts,bkgtd->bksd", probs.astype(d_out.dtype), d_out,
                             preferred_element_type=jnp.float32)
        d_probs = jnp.einsum("bkgtd,bksd->bkgts", d_out, v_blk, preferred_element_type=jnp.float32)
        d_scores = (probs * (d_probs - delta[..., None]) * scale).astype(grouped.dtype)
        d_q = d_q + jnp.einsum("bkgts,bksd->bkgtd", d_scores, k_blk, preferred_element_type=jnp.float32)
        d_k_blk = jnp.einsum("bkgts,bkgtd->bksd", d_scores, grouped, preferred_element_type=jnp.float32)
        d_k = jax.lax.dynamic_update_slice_in_dim(
            d_k, jax.lax.dynamic_slice_in_dim(d_k, start, block, axis=2) + d_k_blk, start, axis=2)
        d_v = jax.lax.dynamic_update_slice_in_dim(
            d_v, jax.lax.dynamic_slice_in_dim(d_v, start, block, axis=2) + d_v_blk, start, axis=2)
        return d_q, d_k, d_v

    d_q, d_k, d_v = jax.lax.fori_loop(_first_key_block(key_start, block), _num_blocks(query_index, k.shape[2], block),
                                      step, (d_q, d_k, d_v))
    return d_q.astype(grouped.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)
