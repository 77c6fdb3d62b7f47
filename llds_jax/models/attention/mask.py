"""The O(T + S) description of which keys a query sees, shared by every attention backend.

``visible[b, t, s] = key_valid[b, s] & (s <= query_index[b, t])``: slot order is time
order, so one integer per query and one flag per key describe causal masking, left and
right padding and holes in a KV cache without ever building a [T, S] array. Only the
naive oracle expands it; the other backends evaluate it one key block at a time.
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

    @classmethod
    def causal(cls, attention_mask: jax.Array) -> AttentionMask:
        """Full-sequence causal attention over a [B, T] padding mask (True = real token)."""
        batch, length = attention_mask.shape
        index = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32)[None, :], (batch, length))
        return cls(index, attention_mask.astype(bool), self_attention=True)

    @classmethod
    def cached(cls, query_slots: jax.Array, slot_valid: jax.Array) -> AttentionMask:
        """Queries written at ``query_slots`` [B, T] of a cache whose slots are ``slot_valid`` [B, S]."""
        return cls(query_slots.astype(jnp.int32), slot_valid.astype(bool), self_attention=False)

    def dense(self) -> jax.Array:
        """visible [B, T, S] bool — T x S, for the naive oracle and tests only."""
        slots = jnp.arange(self.key_valid.shape[1], dtype=jnp.int32)
        return self.key_valid[:, None, :] & (slots[None, None, :] <= self.query_index[:, :, None])

    def live_keys(self) -> jax.Array:
        """Scalar: no query sees a slot at or beyond this (max query slot + 1, capped at S).
        Decode over a big cache reads only the key blocks below it."""
        return jnp.minimum(jnp.max(self.query_index) + 1, self.key_valid.shape[1]).astype(jnp.int32)
