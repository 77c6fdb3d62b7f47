"""TPU: Pallas splash attention for the full-sequence forward (training, log-probs).

Splash evaluates a static causal mask block by block and skips blocks above the
diagonal; padding enters as segment ids (real tokens 1, pads 0) because a key may be
read only by a query of the same segment. On real tokens "causal by array index and
same segment" is exactly our ``key_valid[s] & s <= t``; a pad query reads earlier pads
instead of nothing (always at least itself, so splash never sees an empty row) and its
output is meaningless either way. Packed rows (``AttentionMask.packed``) give each trajectory
its own segment id (``AttentionMask.segment_ids``), so no query reads another trajectory. The sequence is padded up to a multiple of the block
(128-lane multiples, as the kernel requires) with segment-0 tokens and cut back after.

The kernel is a ``pallas_call`` that GSPMD cannot partition, so under a mesh it runs
in ``jax.shard_map`` over the batch axes and, when both query and KV heads divide it,
the tensor axis — the same layout the rules table gives q/k/v around it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from llds_jax.models.attention.mask import AttentionMask
from llds_jax.parallel.rules import current_rules

LANES = 128  # splash's block sizes must be multiples of the TPU lane width
DEFAULT_BLOCK = 512


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask,
                     block_size: int = DEFAULT_BLOCK, *, interpret: bool = False) -> jax.Array:
    """q [B, T, H, Dh]; k, v [B, T, KVH, Dh] of the same sequence → [B, T, H, Dh].

    ``interpret=True`` runs the kernel in Pallas' interpreter (any backend; tests)."""
    if not mask.self_attention:
        raise ValueError("splash_attention covers the full-sequence forward only "
                         "(AttentionMask.causal); cached forwards use the blockwise kernel")
    batch, length, heads, head_dim = q.shape
    block = _block_for(length, block_size)
    padded = -(-length // block) * block
    scale = 1.0 / math.sqrt(head_dim)
    segments = jnp.pad(mask.segment_ids(), ((0, 0), (0, padded - length)))

    def heads_major(x):  # [B, T, N, Dh] → [B, N, padded T, Dh]
        return jnp.pad(x, ((0, 0), (0, padded - length), (0, 0), (0, 0))).transpose(0, 2, 1, 3)

    q_h = heads_major((q.astype(jnp.float32) * scale).astype(q.dtype))
    out = _sharded(_kernel_call(block, interpret), q_h, heads_major(k), heads_major(v), segments)
    return out.transpose(0, 2, 1, 3)[:, :length]


def _block_for(length: int, block_size: int) -> int:
    """The largest lane multiple <= block_size that is not longer than the padded sequence."""
    block = max(LANES, (block_size // LANES) * LANES)
    return min(block, -(-length // LANES) * LANES)


def _kernel_call(block: int, interpret: bool):
    from jax.experimental.pallas.ops.tpu import splash_attention as splash  # noqa: PLC0415  (TPU-only deps)

    def run(q, k, v, segments):
        """Per-shard: q [b, h, T, Dh], k/v [b, kvh, T, Dh], segments [b, T]."""
        heads, length = q.shape[1], q.shape[2]
        causal = splash.MultiHeadMask([splash.CausalMask((length, length)) for _ in range(heads)])
        sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                                  block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                                  block_q_dq=block, block_kv_dq=block)
        kernel = splash.make_splash_mha(causal, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                        interpret=interpret)
        return jax.vmap(kernel)(q, k, v, splash.SegmentIds(q=segments, kv=segments))

    return run


def _sharded(run, q, k, v, segments):
    """``run`` inside shard_map over the ambient mesh (plain call without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return run(q, k, v, segments)
    rules = current_rules()
    q_spec = rules.spec(("batch", "act_heads", None, None), q.shape, mesh)
    kv_spec = rules.spec(("batch", "act_kv_heads", None, None), k.shape, mesh)
    if q_spec[1] != kv_spec[1]:  # heads must split alike or the head grouping breaks per shard
        q_spec = jax.P(q_spec[0], None, None, None)
        kv_spec = jax.P(kv_spec[0], None, None, None)
    seg_spec = jax.P(q_spec[0], None)
    return jax.shard_map(run, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, seg_spec), out_specs=q_spec,
                         check_vma=False)(q, k, v, segments)
