"""The reference attention: materialises fp32 scores [B, KVH, G, T, S].

Kept as the test oracle (every other backend is checked against it) and for tiny
shapes; a training, log-prob or prefill program must not use it at real lengths.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from llds_jax.models.attention.mask import AttentionMask

MASKED_SCORE = -1e30  # finite: a query with no visible key gets a uniform row, never NaN


def naive_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask) -> jax.Array:
    """Grouped-query attention, HF numerics (fp32 softmax, probabilities cast to v's dtype).

    q [B, T, H, Dh]; k, v [B, S, KVH, Dh]. Query head h reads KV head h // (H / KVH),
    as in HF's ``repeat_kv``. Returns [B, T, H, Dh].
    """
    batch, length, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(batch, length, kv_heads, heads // kv_heads, head_dim)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(head_dim)
    scores = jnp.where(mask.dense()[:, None, None, :, :], scores, MASKED_SCORE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(batch, length, heads, head_dim)
