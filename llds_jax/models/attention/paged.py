"""Attention over a paged KV cache: a pool of key blocks per layer and a block table per row.

Why paged: a dense cache gives every row ``max_len`` slots whatever its length, so the number
of rows a device holds is set by the worst case. Here (vLLM's PagedAttention layout) a layer's
keys live in a pool ``[D, NB, KVH, block, Dh]`` — ``D`` sampler devices, ``NB`` blocks each —
and row ``b``'s ``j``-th block of slots is ``pool[device of b, table[b, j]]``. A row holds only
the blocks it has used; the rollout scheduler hands them out and takes them back.

The device axis is explicit so that every gather and scatter is batched over it: a row only
ever names blocks of its own device's pool, and under a mesh that splits rows and pools over
the same axis XLA's partitioner keeps each device's gather local (no collective; tested).

Reads: the loop runs over block-table columns ``0 .. ceil(live / block) - 1``, ``live`` the
furthest slot any *real* query of the call reaches, and gathers each row's block of that
column; keys past a query's own slot are masked per row. The ops and their order are the
dense blockwise kernel's (``blockwise_attention`` over a one-buffer cache with ``CACHED_BLOCK``-slot
key blocks): the same fp32 scores, the same online-softmax update per block, the same first block
peeled. A key block that a row has not reached scores ``MASKED_SCORE`` everywhere, whose
update is an exact no-op (``exp(MASKED_SCORE - m) = 0``, rescale ``exp(0) = 1``), so a row's
result does not depend on how many blocks the call visits, and equals the dense cache's bit
for bit (``tests/models/test_kv_cache.py``). That loop's trip count is traced, which XLA:GPU
drives from the host once per iteration per layer; a one-token decode therefore runs a Pallas
kernel instead where one is resolved (``attend_paged``: ``decode_tpu`` on TPU, ``decode_gpu``'s
Triton kernel on GPU), looping over each row's own live blocks inside the kernel.

Writes: a token at slot ``s`` goes to ``pool[d, table[b, s // block], :, s % block]``. Masked
tokens (padding, idle rows) and slots past the table are dropped, so a row whose table is
stale never writes into a block that now belongs to another row. Unallocated table entries
hold ``NB`` (out of range): a read gives zeros, a write is dropped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from llds_jax.models.attention.blockwise import _finish, _first_block, _masked_scores, _next_block
from llds_jax.models.reductions import target_platform


def unallocated(pool: jax.Array) -> int:
    """The table entry of a block a row does not hold: one past the pool (reads 0, writes dropped)."""
    return pool.shape[1]


def paged_write(pool: jax.Array, new: jax.Array, table: jax.Array, slots: jax.Array, token_mask: jax.Array) -> jax.Array:
    """``new`` [B, T, KVH, Dh] written at ``slots`` [B, T] of rows' paged caches; masked tokens dropped.

    ``pool`` [D, NB, KVH, block, Dh]; ``table`` [B, C] int32 (row ``b`` on device ``b // (B / D)``)."""
    devices, blocks, _, block, _ = pool.shape
    batch, length = slots.shape
    column = slots // block
    physical = jnp.take_along_axis(table, jnp.clip(column, 0, table.shape[1] - 1), axis=1)
    physical = jnp.where(token_mask & (column < table.shape[1]), physical, blocks)
    rows = batch // devices

    def one_device(p, index, offset, values):
        return p.at[index, :, offset].set(values.astype(p.dtype), mode="drop")

    return jax.vmap(one_device)(pool, physical.reshape(devices, rows, length),
                                (slots % block).reshape(devices, rows, length),
                                new.reshape(devices, rows, length, *new.shape[2:]))


def gather_column(pool: jax.Array, table: jax.Array, column) -> jax.Array:
    """Every row's block in table column ``column``: [B, KVH, block, Dh] (an unallocated one reads 0)."""
    devices = pool.shape[0]
    batch = table.shape[0]
    index = jax.lax.dynamic_index_in_dim(table, column, axis=1, keepdims=False).reshape(devices, batch // devices)
    taken = jax.vmap(lambda p, i: jnp.take(p, i, axis=0, mode="fill", fill_value=0))(pool, index)
    return taken.reshape(batch, *pool.shape[2:])


def paged_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, table: jax.Array, query_index: jax.Array,
                    real_queries: jax.Array) -> jax.Array:
    """q [B, T, H, Dh] at cache slots ``query_index`` [B, T] → [B, T, H, Dh]; a query sees every
    slot at or before its own (a row's tokens fill its slots from 0, so they are all real).

    ``real_queries`` [B, T] bounds the loop: only the blocks real queries reach are visited."""
    batch, length, heads, head_dim = q.shape
    block, kv_heads = k_pool.shape[3], k_pool.shape[2]
    grouped = q.reshape(batch, length, kv_heads, heads // kv_heads, head_dim).transpose(0, 2, 3, 1, 4)
    live = jnp.max(jnp.where(real_queries, query_index + 1, 1))
    columns = jnp.clip((live + block - 1) // block, 1, table.shape[1]).astype(jnp.int32)
    every = jnp.ones((batch, block), bool)

    def visit(j):
        k_blk = gather_column(k_pool, table, j).astype(q.dtype)
        v_blk = gather_column(v_pool, table, j).astype(q.dtype)
        ids = j * block + jnp.arange(block, dtype=jnp.int32)
        return _masked_scores(grouped, k_blk, ids, every, query_index), v_blk

    carry = _first_block(*visit(0))
    carry = jax.lax.fori_loop(1, columns, lambda j, carry: _next_block(carry, *visit(j)), carry)
    out = _finish(grouped, carry)[0]  # [B, KVH, G, T, Dh]
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, length, heads, head_dim)


def attend_paged(q: jax.Array, k: jax.Array, v: jax.Array, k_pool: jax.Array, v_pool: jax.Array, table: jax.Array,
                 slots: jax.Array, token_mask: jax.Array, backend: str = "xla_blockwise"
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Write a chunk's k, v [B, T, KVH, Dh] at ``slots`` and attend q over the paged cache:
    (attention, k_pool, v_pool). ``backend``: ``models.attention.resolve_paged_backend``'s.

    A one-token decode (T = 1) runs a Pallas kernel that reads each row's live blocks through its
    table: under ``splash`` (TPU) the one that also writes the new key/value by DMA
    (``decode_tpu.paged_decode_and_write``); under ``triton`` (GPU) the keys are written by the
    scatter below, into the donated pool, and ``decode_gpu.paged_decode_attention`` attends (in
    Pallas' interpreter when the program is not compiled for a GPU: tests). Shapes a kernel does
    not take, and prefill or appends (T > 1), run the XLA loop of :func:`paged_attention`."""
    if backend == "splash" and q.shape[1] == 1:
        from llds_jax.models.attention import decode_tpu  # noqa: PLC0415  (Pallas TPU dialect: TPU programs only)

        if k_pool.shape[3] % decode_tpu.row_tile(k_pool.dtype) == 0:
            return decode_tpu.paged_decode_and_write(q, k, v, k_pool, v_pool, table, slots[:, 0], token_mask[:, 0])
    k_pool = paged_write(k_pool, k, table, slots, token_mask)
    v_pool = paged_write(v_pool, v, table, slots, token_mask)
    if backend == "triton" and q.shape[1] == 1:
        from llds_jax.models.attention import decode_gpu  # noqa: PLC0415  (Pallas Triton: GPU programs only)

        if decode_gpu.supported(k_pool.shape[3], k_pool.shape[4]):
            lengths = jnp.where(token_mask[:, 0], slots[:, 0] + 1, 0).astype(jnp.int32)
            interpret = target_platform() not in ("gpu", "cuda", "rocm")
            out = decode_gpu.paged_decode_attention(q[:, 0], k_pool, v_pool, table, lengths, interpret=interpret)
            return out[:, None], k_pool, v_pool
    return paged_attention(q, k_pool, v_pool, table, slots, token_mask), k_pool, v_pool
