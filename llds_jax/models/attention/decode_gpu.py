"""GPU: one-token decode attention over the paged KV cache as one Pallas (Triton) kernel per layer.

Why a kernel: the XLA path (``paged.paged_attention``) walks the block-table columns in a
``lax.fori_loop`` whose trip count is the longest live row, a traced value. XLA:GPU runs such a
``while`` from the host: every iteration launches its body's kernels and copies the loop
predicate back to the host to decide whether to go on, for every layer of every token. On the
one GPU this code met, a decode step took 29.5 ms where its bytes need about 3 ms (issue #57).
Here the loop is inside one Triton program per (row, KV head[, key split]): the trip count is
the row's own ``ceil(length / block)``, read from device memory by the kernel, so the host
launches one kernel per layer and never waits on a predicate, and a row reads its own live
slots only: its live blocks, the last one's loads masked to the slots the row holds (an idle or
finished row, length 0, reads no block at all).

Layout (``attention/paged.py``): pools ``[D, NB, KVH, block, Dh]``, ``table [B, C]`` with ``NB``
for an unallocated entry, rows split over the ``D`` device pools in contiguous groups. The
``D`` pools of one program are folded into one ``[D * NB, ...]`` array (a free reshape) and row
``b``'s entries become ``d * NB + table`` (``d = b // (B / D)``); under a mesh that splits rows
and pools the kernel runs per device inside ``jax.shard_map`` on that device's rows and pools
(as ``decode_tpu`` does), so no pool crosses devices. An unallocated entry inside a row's live
length reads zeros, as the XLA gather's ``mode="fill"`` does (the scheduler never leaves one
there; the case is kept exact rather than reading another row's block or out of bounds).

Numerics are the XLA path's (``blockwise._masked_scores`` and the online-softmax update):
keys cast to the query dtype, fp32 scores ``(q·k) / sqrt(Dh)``, invisible keys at
``MASKED_SCORE``, probabilities cast to the value dtype for the second matmul, fp32
accumulators. Only the summation order inside the dots differs (Triton's tiles, not XLA's).

Triton's ``dot`` needs 16 rows or more and power-of-two tiles: a program loads the G = H / KVH
query heads of its KV head straight from the row's ``[H, Dh]`` queries as a tile of G' rows (G
padded to a power of two ≥ 16; the padding rows' loads are masked: they read nothing and hold
zeros) and stores the G real rows of its output the same way, masked, into ``[B, H, Dh]``. So no
padded copy of the queries is written before the kernel and none of the output sliced after it
(at G = 7, Qwen2.5-0.5B and 7B: 0.10 GB a token at the 0.5B job's 320 rows). The kernel runs
only for power-of-two ``block`` and ``Dh`` of 16 or more (:func:`supported`); other shapes keep
the XLA path.

Key splits (flash-decoding): with few rows, ``B x KVH`` programs leave most of the GPU's SMs
idle, so each row's table columns are cut into ``splits`` contiguous ranges, one program each;
a split past a row's live blocks reads nothing. The kernel then writes unnormalised fp32 partial
outputs and their (max, sum), which a small XLA epilogue combines.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from llds_jax.models.attention.naive import MASKED_SCORE
from llds_jax.parallel.rules import current_rules

MIN_DOT_ROWS = 16  # Triton's tensor-core dot: M, N, K of at least 16
# Programs one kernel launch aims for before it splits rows' keys: about two per SM of an
# H100/H200 (132 SMs), so a handful of rows still fills the GPU.
TARGET_PROGRAMS = 256
NUM_WARPS, NUM_STAGES = 4, 2


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def padded_group(heads: int, kv_heads: int) -> int:
    """Query rows of one program: G = H / KVH padded to a power of two of at least 16."""
    group = heads // kv_heads
    return max(MIN_DOT_ROWS, 1 << (group - 1).bit_length())


def supported(block: int, head_dim: int) -> bool:
    """Whether the kernel takes a pool of ``block``-slot blocks with ``head_dim`` (Triton's tiles)."""
    return _pow2(block) and _pow2(head_dim) and block >= MIN_DOT_ROWS and head_dim >= MIN_DOT_ROWS


def decode_splits(rows: int, kv_heads: int, columns: int) -> int:
    """Key splits per (row, KV head): enough programs for :data:`TARGET_PROGRAMS`, at most one
    split per table column (1 when rows alone fill the GPU)."""
    return int(max(1, min(columns, TARGET_PROGRAMS // max(1, rows * kv_heads))))


def decode_read_bytes(lengths, kv_heads: int, head_dim: int, block: int, itemsize: int, heads: int,
                      *, splits: int = 1) -> int:
    """Bytes the kernel moves at the given live ``lengths`` (one per row, keys visible; pure Python).

    Per program (row, KV head, split): its length (4 B) and its G query heads read (the tile's
    padding rows are masked loads), its output written (the G heads in ``itemsize`` with one split;
    fp32 partials plus fp32 max and sum of the padded tile with more); per live block of the row, its
    table entry (4 B); per live slot, its key and value (``head_dim x itemsize`` each: the last
    block's loads are masked to the row's slots). A row of length 0 reads no block. ``itemsize`` is
    the pools', the queries' and the output's (the same dtype in the decoder)."""
    lengths = [int(n) for n in lengths]
    group, padded = heads // kv_heads, padded_group(heads, kv_heads)
    programs = len(lengths) * kv_heads * splits
    written = group * head_dim * itemsize if splits == 1 else padded * head_dim * 4 + 2 * padded * 4
    per_program = 4 + group * head_dim * itemsize + written
    live_blocks = sum(-(-n // block) for n in lengths if n > 0)
    live_slots = sum(n for n in lengths if n > 0)
    return programs * per_program + kv_heads * (4 * live_blocks + 2 * live_slots * head_dim * itemsize)


def paged_decode_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, table: jax.Array,
                           lengths: jax.Array, *, splits: int | None = None, interpret: bool = False) -> jax.Array:
    """q [B, H, Dh] (one query per row) over the paged cache → [B, H, Dh] in q's dtype.

    ``k_pool``, ``v_pool`` [D, NB, KVH, block, Dh] (bf16 or fp32, any dtype Triton loads);
    ``table`` [B, C] int32 (``NB`` = unallocated); ``lengths`` [B] int32: keys visible to the row
    (its query's slot + 1); 0 reads nothing and gives 0. ``splits``: key splits per row (None:
    :func:`decode_splits`). ``interpret=True`` runs Pallas' interpreter (any backend; tests)."""
    batch, heads, head_dim = q.shape
    devices, _, kv_heads, block, _ = k_pool.shape
    if heads % kv_heads or batch % devices:
        raise ValueError(f"paged_decode_attention: {heads} heads over {kv_heads} KV heads, {batch} rows "
                         f"over {devices} device pools")
    if not supported(block, head_dim):
        raise ValueError(f"paged_decode_attention: block={block}, head_dim={head_dim} must be powers of two ≥ "
                         f"{MIN_DOT_ROWS} (see supported)")
    run = functools.partial(_per_device, splits=splits, interpret=interpret)
    args = (q, k_pool, v_pool, table.astype(jnp.int32), lengths.astype(jnp.int32))
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return run(*args)
    # The pools' device axis and the rows split over the same mesh axes (a spec that divides D
    # divides B = D x rows per pool): each device attends its own rows over its own pools.
    rows = jax.P(current_rules().spec(("batch",), (devices,), mesh)[0])
    return jax.shard_map(run, mesh=mesh, in_specs=(rows,) * len(args), out_specs=rows, check_vma=False)(*args)


def _per_device(q, k_pool, v_pool, table, lengths, *, splits: int | None, interpret: bool):
    """One device (or the whole program without a mesh): fold its ``D`` pools and run the kernel."""
    batch, heads, head_dim = q.shape
    devices, blocks, kv_heads, block, _ = k_pool.shape
    columns = table.shape[1]
    splits = decode_splits(batch, kv_heads, columns) if splits is None else max(1, min(int(splits), columns))
    device = (jnp.arange(batch, dtype=jnp.int32) // (batch // devices))[:, None]
    physical = jnp.where((table >= 0) & (table < blocks), table + device * blocks, -1)  # -1: reads zeros
    pools = [p.reshape(devices * blocks, kv_heads, block, head_dim) for p in (k_pool, v_pool)]
    out = _kernel_call(lengths, physical, q, *pools, splits=splits, interpret=interpret)
    if splits == 1:
        return out  # [B, H, Dh]: each program stored its G heads
    return _combine(*out).astype(q.dtype)[:, :, :heads // kv_heads].reshape(batch, heads, head_dim)


def _kernel(lengths_ref, table_ref, q_ref, k_ref, v_ref, *out_refs, block: int, columns: int, per_split: int,
            group: int, padded: int):
    row, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    length = lengths_ref[row]
    head_dim = q_ref.shape[-1]
    # the KV head's G query heads of the row's [H, Dh] as a [G', Dh] tile; the padding rows read nothing
    heads = pl.ds(kv_head * group, padded)
    real = jax.lax.broadcasted_iota(jnp.int32, (padded, head_dim), 0) < group
    q = plgpu.load(q_ref.at[heads], mask=real, other=0)  # [G', Dh]
    live = jnp.minimum((length + block - 1) // block, columns)
    first = split * per_split
    last = jnp.minimum(first + per_split, live)

    def fold(j, carry):
        m, total, acc = carry
        entry = table_ref[j]
        page = jnp.maximum(entry, 0)
        # the block's slots the row holds: a masked load fetches none of the others (an unallocated
        # entry: none), so the row's last block costs its live slots, not the whole block
        slots = j * block + jax.lax.broadcasted_iota(jnp.int32, (block, head_dim), 0)
        read = (entry >= 0) & (slots < length)
        k = plgpu.load(k_ref.at[page], mask=read, other=0).astype(q.dtype)  # [block, Dh]
        v = plgpu.load(v_ref.at[page], mask=read, other=0).astype(q.dtype)
        scores = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        scores = scores / math.sqrt(head_dim)
        ids = j * block + jax.lax.broadcasted_iota(jnp.int32, scores.shape, 1)
        scores = jnp.where(ids < length, scores, MASKED_SCORE)
        m_new = jnp.maximum(m, jnp.max(scores, axis=1))
        probs = jnp.exp(scores - m_new[:, None])
        rescale = jnp.exp(m - m_new)
        total = rescale * total + jnp.sum(probs, axis=1)
        update = jax.lax.dot_general(probs.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                     preferred_element_type=jnp.float32)
        return m_new, total, rescale[:, None] * acc + update

    rows = q.shape[0]
    start = (jnp.full((rows,), MASKED_SCORE, jnp.float32), jnp.zeros((rows,), jnp.float32),
             jnp.zeros(q.shape, jnp.float32))
    m, total, acc = jax.lax.fori_loop(first, jnp.maximum(first, last), fold, start)
    if len(out_refs) == 1:  # one split: the normalised output (a row that read nothing: 0), its G heads
        out = (acc / jnp.where(total > 0, total, 1.0)[:, None]).astype(out_refs[0].dtype)
        plgpu.store(out_refs[0].at[heads], out, mask=real)
    else:
        o_ref, m_ref, total_ref = out_refs
        o_ref[...] = acc
        m_ref[...] = m
        total_ref[...] = total


def _kernel_call(lengths, physical, q, k_pool, v_pool, *, splits: int, interpret: bool):
    """lengths [b], physical [b, C] (-1: reads zeros), q [b, H, Dh], pools [P, KVH, block, Dh]; with
    one split the output is [b, H, Dh], with more the padded partials (:func:`_combine`)."""
    batch, heads, head_dim = q.shape
    pages, kv_heads, block, _ = k_pool.shape
    group, padded = heads // kv_heads, padded_group(heads, kv_heads)
    columns = physical.shape[1]
    per_split = -(-columns // splits)
    row = pl.BlockSpec((None, heads, head_dim), lambda b, h, s: (b, 0, 0))  # a program takes its G heads of it
    pool = pl.BlockSpec((pages, None, block, head_dim), lambda b, h, s: (0, h, 0, 0))
    in_specs = [pl.BlockSpec(lengths.shape, lambda b, h, s: (0,)),
                pl.BlockSpec((None, columns), lambda b, h, s: (b, 0)), row, pool, pool]
    if splits == 1:
        out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
        out_specs = row
    else:
        partial = (splits, batch, kv_heads, padded)
        out_shape = (jax.ShapeDtypeStruct((*partial, head_dim), jnp.float32),
                     jax.ShapeDtypeStruct(partial, jnp.float32), jax.ShapeDtypeStruct(partial, jnp.float32))
        out_specs = (pl.BlockSpec((None, None, None, padded, head_dim), lambda b, h, s: (s, b, h, 0, 0)),
                     pl.BlockSpec((None, None, None, padded), lambda b, h, s: (s, b, h, 0)),
                     pl.BlockSpec((None, None, None, padded), lambda b, h, s: (s, b, h, 0)))
    # The bytes at full tables (a static upper bound; the real read follows the live lengths).
    itemsize = jnp.dtype(k_pool.dtype).itemsize
    full = decode_read_bytes([columns * block] * batch, kv_heads, head_dim, block, itemsize, heads, splits=splits)
    cost = pl.CostEstimate(flops=4 * batch * kv_heads * padded * columns * block * head_dim,
                           transcendentals=batch * kv_heads * padded * columns * block, bytes_accessed=full)
    kernel = functools.partial(_kernel, block=block, columns=columns, per_split=per_split, group=group, padded=padded)
    return pl.pallas_call(
        kernel,
        grid=(batch, kv_heads, splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
        cost_estimate=cost,
        interpret=interpret,
        name="paged_decode_attention_gpu",
    )(lengths, physical, q, k_pool, v_pool)


def _combine(acc, m, total):
    """The splits' partial outputs [S, b, KVH, G', Dh] into one (flash-decoding's last step)."""
    top = jnp.max(m, axis=0)
    weight = jnp.exp(m - top)  # a split that read nothing: m = MASKED_SCORE, total = acc = 0
    total = jnp.sum(weight * total, axis=0)
    acc = jnp.sum(weight[..., None] * acc, axis=0)
    return acc / jnp.where(total > 0, total, 1.0)[..., None]
