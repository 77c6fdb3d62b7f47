"""The O(T + S) description of which keys a query sees, shared by every attention backend.

``visible[b, t, s] = key_valid[b, s] & (s <= query_index[b, t])``: slot order is time
order, so one integer per query and one flag per key describe causal masking, left and
right padding and holes in a KV cache without ever building a [T, S] array. Only the
naive oracle expands it; the other backends evaluate it one key block at a time.

Packed rows (several trajectories per row, ``AttentionMask.packed``) add one more integer
per query, ``key_start[b, t]``: the first slot of the query's own segment. Segments are
contiguous, so "same segment and causal" is ``key_start[t] <= s <= t`` — still O(T), and a
kernel can skip every key block below the smallest ``key_start`` of its queries.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMask:
    """Which keys each query may read.

    query_index [B, T] int32: the key slot of query t (it sees slots ``<=`` it).
    key_valid [B, S] bool: the slot holds a real token (False: padding, a hole).
    self_attention (static): queries and keys are the same sequence and
    ``query_index[b, t] == t`` — the full-sequence forward, which fused kernels
    (splash, cuDNN) can express as causal-by-index plus padding.
    """

    query_index: jax.Array
    key_valid: jax.Array
    self_attention: bool = dataclasses.field(default=False, metadata=dict(static=True))
    # [B, T] int32 or None: the first key slot query t may read (its segment's first token);
    # None = 0 for every query (one sequence per row).
    key_start: jax.Array | None = None

    @classmethod
    def causal(cls, attention_mask: jax.Array) -> AttentionMask:
        """Full-sequence causal attention over a [B, T] padding mask (True = real token)."""
        batch, length = attention_mask.shape
        index = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32)[None, :], (batch, length))
        return cls(index, attention_mask.astype(bool), self_attention=True)

    @classmethod
    def packed(cls, segment_ids: jax.Array) -> AttentionMask:
        """Full-sequence causal attention over packed rows: ``segment_ids`` [B, T] int (0 = padding,
        each trajectory a contiguous run of one positive id). A query reads only earlier keys of
        its own segment; padding reads padding (a finite, unused value)."""
        batch, length = segment_ids.shape
        index = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32)[None, :], (batch, length))
        return cls(index, segment_ids > 0, self_attention=True, key_start=segment_starts(segment_ids))

    @classmethod
    def cached(cls, query_slots: jax.Array, slot_valid: jax.Array) -> AttentionMask:
        """Queries written at ``query_slots`` [B, T] of a cache whose slots are ``slot_valid`` [B, S]."""
        return cls(query_slots.astype(jnp.int32), slot_valid.astype(bool), self_attention=False)

    def dense(self) -> jax.Array:
        """visible [B, T, S] bool — T x S, for the naive oracle and tests only."""
        slots = jnp.arange(self.key_valid.shape[1], dtype=jnp.int32)
        visible = self.key_valid[:, None, :] & (slots[None, None, :] <= self.query_index[:, :, None])
        if self.key_start is not None:
            visible &= slots[None, None, :] >= self.key_start[:, :, None]
        return visible

    def segment_ids(self) -> jax.Array:
        """[B, S] int32 segment labels for kernels that take segment ids (splash): a packed row's
        segments are labelled by their first slot + 1, padding 0; without ``key_start``, real 1 / pad 0."""
        if self.key_start is None:
            return self.key_valid.astype(jnp.int32)
        return jnp.where(self.key_valid, self.key_start + 1, 0).astype(jnp.int32)

    def live_keys(self) -> jax.Array:
        """Scalar: no query sees a slot at or beyond this (max query slot + 1, capped at S).
        Decode over a big cache reads only the key blocks below it."""
        return jnp.minimum(jnp.max(self.query_index) + 1, self.key_valid.shape[1]).astype(jnp.int32)


def segment_starts(segment_ids: jax.Array) -> jax.Array:
    """[B, T] int32: the index of the first token of each token's segment (a change of id starts one)."""
    length = segment_ids.shape[1]
    index = jnp.arange(length, dtype=jnp.int32)[None, :]
    changed = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]],
                              axis=1)
    return jax.lax.cummax(jnp.where(changed, index, 0), axis=1).astype(jnp.int32)


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """RoPE positions that restart at 0 with every segment of a packed row (padding: its run's index)."""
    return (jnp.arange(segment_ids.shape[1], dtype=jnp.int32)[None, :] - segment_starts(segment_ids)).astype(jnp.int32)
