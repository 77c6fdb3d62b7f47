"""TPU: one-token decode as a Pallas kernel that writes the new key/value into the cache in place
and attends over each row's live slots only.

Why a kernel: in plain XLA the decode step writes its keys with a scatter (each row at its own
slot) and attention reads the cache in a key-block loop. XLA:TPU gives the scatter a cache
layout of its own and brackets it with two whole-cache ``copy`` ops per layer per token, and
it copies a cache that an inner loop reads while the decode loop updates it (60 cache-sized
copies per token for SmolLM2-135M's 30 layers; docs/decisions.md, Models and attention). Here the
cache is an aliased HBM operand: the kernel DMAs the live key blocks in (double-buffered),
folds them into FlashAttention's online softmax, and DMAs the one new row out. No XLA op
touches the cache, so nothing copies it.

A row reads ``ceil(slot / block)`` blocks: its own live length, not the cache's size or the
longest row's. The new key is folded in from VMEM (the cache slot it goes to is still stale
while the blocks are read, so that slot is masked and its DMA runs after the reads).

Grid: over the engine's paged pool (``paged_decode_and_write``), one program per
``ROWS_PER_PROGRAM`` rows and every KV head, the block copies of a TensorCore's programs one
double-buffered stream across row and program boundaries (``_paged_rows_kernel``: 5 programs a
layer at the paper's v5e shape; one per (row, KV head) would be 80). The dense cache's kernel
went with the dense rollout cache: the dense ``KVCache`` is only the reference now.

Numerics are the blockwise kernel's: fp32 scores ``q·k / sqrt(Dh)``, invisible keys at
``MASKED_SCORE``, probabilities cast to the value dtype for the second matmul. Only the
order in which keys are summed differs (the new key first).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from llds_jax.models.attention.naive import MASKED_SCORE
from llds_jax.parallel.rules import current_rules

_READ, _WRITE = 0, 1  # semaphore rows
# Rows one paged-decode program serves (issue 57: ≥ 8, so a step at the paper's v5e shape is a
# handful of programs, not one per row and KV head).
ROWS_PER_PROGRAM = 8


def row_tile(dtype) -> int:
    """Rows of one (8 sublanes × 128 lanes) TPU memory tile: 8 of 4-byte values, 16 of 2-byte ones."""
    return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


def _new_key_state(q, k_new, v_new, new_visible, scale: float):
    """The online softmax's running (max, total, accumulator) after the new key alone: q [G, Dh],
    k_new / v_new [1, Dh]. A masked new key is wiped by the first visible key (its max is
    ``MASKED_SCORE``). A one-key product on the vector unit: Mosaic does not lower an N = 1 matmul."""
    k_new = k_new.astype(q.dtype).astype(jnp.float32)
    new_score = jnp.sum(q.astype(jnp.float32) * k_new, axis=-1, keepdims=True) * scale  # [G, 1]
    m = jnp.where(new_visible, new_score, MASKED_SCORE)
    return m, jnp.ones_like(m), jnp.broadcast_to(v_new.astype(q.dtype).astype(jnp.float32), q.shape)


def _fold_block(q, carry, keys, values, visible, scale: float):
    """One key block [block, Dh] folded into the running (max, total, accumulator) of q [G, Dh]:
    fp32 scores ``q·k * scale``, invisible keys at ``MASKED_SCORE``, probabilities cast to the value
    dtype for the second matmul. Both kernels run exactly these ops, so their results agree bit for bit."""
    m, total, acc = carry
    scores = jax.lax.dot_general(q, keys.astype(q.dtype), (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32) * scale  # [G, block]
    scores = jnp.where(visible, scores, MASKED_SCORE)
    m_new = jnp.maximum(m, jnp.max(scores, axis=-1, keepdims=True))
    probs = jnp.exp(scores - m_new)
    rescale = jnp.exp(m - m_new)
    total = rescale * total + jnp.sum(probs, axis=-1, keepdims=True)
    values = values.astype(q.dtype)
    weighted = jax.lax.dot_general(probs.astype(values.dtype), values, (((1,), (0,)), ((), ())),
                                   preferred_element_type=jnp.float32)
    return m_new, total, rescale * acc + weighted


def paged_decode_and_write(q: jax.Array, k_new: jax.Array, v_new: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                           table: jax.Array, slot: jax.Array, real: jax.Array, *,
                           rows_per_program: int = ROWS_PER_PROGRAM, streams: int | None = None,
                           interpret: bool = False
                           ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The decode kernel over a paged cache (``attention/paged.py``): q [B, 1, H, Dh]; k_new, v_new
    [B, 1, KVH, Dh]; pools [D, NB, KVH, block, Dh] (donated); ``table`` [B, C]; ``slot`` [B] the
    new token's slot; ``real`` [B] whether the row's token is real (else the row reads and writes
    nothing and its output, unused, is its new value). A real row reads blocks
    ``table[b, :ceil(slot / block)]`` by DMA — only its own live blocks, every KV head in one copy —
    and writes the new key/value into block ``table[b, slot // block]``; a slot past the table is
    dropped and not attended (as ``paged_write`` drops it). Per row and head: the new key first,
    then the blocks in order.

    One program serves ``rows_per_program`` rows (the rows are padded to a multiple with rows
    that read nothing), and the programs form ``streams`` sequences of block copies, each loading
    its next block while folding one (default: one per TensorCore of the target chip, 1 in the
    interpreter): see :func:`_paged_rows_kernel` for why."""
    batch, length, heads, head_dim = q.shape
    devices, blocks, kv_heads, block, _ = k_pool.shape
    if length != 1:
        raise ValueError(f"paged_decode_and_write serves one query per row; got T={length}")
    if block % row_tile(k_pool.dtype):
        raise ValueError(f"paged_decode_and_write: a {block}-token block is not a multiple of the "
                         f"{row_tile(k_pool.dtype)}-row memory tile of {jnp.dtype(k_pool.dtype).name}")
    if rows_per_program < ROWS_PER_PROGRAM:
        raise ValueError(f"paged_decode_and_write: rows_per_program={rows_per_program} < {ROWS_PER_PROGRAM}")
    slot = slot.astype(jnp.int32)
    columns = table.shape[1]
    column = jnp.minimum(slot // block, columns - 1)
    target = jnp.take_along_axis(table, column[:, None], axis=1)[:, 0]
    in_table = slot < columns * block
    writes = real & in_table & (target < blocks)
    live = jnp.where(real, jnp.clip(-(-slot // block), 0, columns), 0)
    scalars = (live, slot, (real & in_table).astype(jnp.int32), jnp.where(writes, target, -1).astype(jnp.int32),
               table.astype(jnp.int32))
    grouped = q.reshape(batch, kv_heads, heads // kv_heads, head_dim)
    k_new, v_new = (x.astype(k_pool.dtype).transpose(0, 2, 1, 3) for x in (k_new, v_new))  # [B, KVH, 1, Dh]
    if streams is None:
        streams = 1 if interpret else pltpu.get_tpu_info().num_cores  # the chip the program is compiled for
    run = functools.partial(_paged_call, rows_per_program=rows_per_program, streams=streams, interpret=interpret)
    mesh = jax.sharding.get_abstract_mesh()
    if devices == 1 or mesh.empty:
        if devices != 1:
            raise ValueError(f"paged_decode_and_write: {devices} device pools without a mesh to split them over")
        out, k_pool, v_pool = run(scalars, grouped, k_new, v_new, k_pool[0], v_pool[0])
        return out.reshape(batch, 1, heads, head_dim), k_pool[None], v_pool[None]
    rows_spec = current_rules().spec(("batch",), (batch,), mesh)[0]
    rows, pool = jax.P(rows_spec), jax.P(rows_spec)

    def per_device(scalars, grouped, k_new, v_new, k_pool, v_pool):
        out, k_pool, v_pool = run(scalars, grouped, k_new, v_new, k_pool[0], v_pool[0])
        return out, k_pool[None], v_pool[None]

    out, k_pool, v_pool = jax.shard_map(per_device, mesh=mesh, in_specs=((rows,) * len(scalars), rows, rows, rows, pool,
                                                                         pool),
                                        out_specs=(rows, pool, pool), check_vma=False)(
        scalars, grouped, k_new, v_new, k_pool, v_pool)
    return out.reshape(batch, 1, heads, head_dim), k_pool, v_pool


def _paged_rows_kernel(live_ref, slot_ref, visible_ref, target_ref, first_ref, following_ref, table_ref,
                       q_ref, k_new_ref, v_new_ref, k_hbm, v_hbm, o_ref, k_out, v_out,
                       k_buf, v_buf, k_tiles, v_tiles, sems, *, rows: int, block: int, columns: int, scale: float):
    """Program (s, k): the ``rows`` consecutive rows of program ``s * K + k``, every KV head. Why: at
    the paper's v5e shape (40 rows, 2 KV heads, 36 layers) a (row, KV head) program per grid cell is
    2,880 programs a step, each waiting on its own first block copy and its own tile round trip.

    Here stream ``s``'s K programs run in order on one TensorCore ("arbitrary"; the streams are
    "parallel", one per core) and their (row, block) copies are one double-buffered sequence, each
    block [KVH, block, Dh] in one DMA: the copy of the next reading row's first block is issued
    while this row's last block is folded (``following_ref``), also when that row is the next
    program's (the scratch buffers and semaphores outlive a program), so a stream waits on a cold
    copy once, at its first block. The buffer of a row's i-th block is the parity of its place in
    the stream (``first_ref``: the blocks the stream's earlier rows read).

    The new rows' memory tiles (read, patched, written back: a DMA offset is tile-aligned) are read
    at the start, behind the first block, and written after every block read of the program; a row's
    slot is masked while it is read, and no other row reads its blocks, so the order is safe."""
    base = (pl.program_id(0) * pl.num_programs(1) + pl.program_id(1)) * rows
    kv_heads, tile = k_tiles.shape[1], k_tiles.shape[2]

    def block_copies(row, i, buf):
        physical = table_ref[row * columns + i]
        return (pltpu.make_async_copy(k_hbm.at[physical], k_buf.at[buf], sems.at[_READ, 0, buf]),
                pltpu.make_async_copy(v_hbm.at[physical], v_buf.at[buf], sems.at[_READ, 1, buf]))

    def tile_copies(j, into_vmem: bool):
        row = base + j
        start = pl.multiple_of((slot_ref[row] % block) // tile * tile, tile)
        # k_out / v_out alias k_hbm / v_hbm (one buffer on TPU; the interpreter copies the input in
        # and returns the output, so both sides of the patch go through the output).
        pairs = ((k_out, k_tiles, 0), (v_out, v_tiles, 1))
        if into_vmem:
            return [pltpu.make_async_copy(pool.at[target_ref[row], :, pl.ds(start, tile)], tiles.at[j],
                                          sems.at[_WRITE, which, 0]) for pool, tiles, which in pairs]
        return [pltpu.make_async_copy(tiles.at[j], pool.at[target_ref[row], :, pl.ds(start, tile)],
                                      sems.at[_WRITE, which, 1]) for pool, tiles, which in pairs]

    leader = jnp.where(live_ref[base] > 0, base, following_ref[base])  # the stream's first reading row

    pl.when((pl.program_id(1) == 0) & (leader >= 0))(lambda: _start_all(block_copies(leader, 0, 0)))

    def each_writing_row(action):
        def body(j, carry):
            pl.when(target_ref[base + j] >= 0)(functools.partial(action, j))
            return carry
        jax.lax.fori_loop(0, rows, body, 0)

    each_writing_row(lambda j: _start_all(tile_copies(j, True)))

    def attend_row(j, carry):
        row = base + j
        live, first, following, slot = live_ref[row], first_ref[row], following_ref[row], slot_ref[row]
        queries = [q_ref[j, h] for h in range(kv_heads)]  # [G, Dh] each

        def fold(i, states):
            buf = (first + i) % 2

            pl.when(i + 1 < live)(lambda: _start_all(block_copies(row, i + 1, 1 - buf)))
            pl.when((i + 1 == live) & (following >= 0))(lambda: _start_all(block_copies(following, 0, 1 - buf)))
            _wait_all(block_copies(row, i, buf))
            visible = i * block + jax.lax.broadcasted_iota(jnp.int32, (queries[0].shape[0], block), 1) < slot
            return tuple(_fold_block(q, state, k_buf[buf, h], v_buf[buf, h], visible, scale)
                         for h, (q, state) in enumerate(zip(queries, states, strict=True)))

        states = tuple(_new_key_state(q, k_new_ref[j, h], v_new_ref[j, h], visible_ref[row] != 0, scale)
                       for h, q in enumerate(queries))
        states = jax.lax.fori_loop(0, live, fold, states)
        for h, (_, total, acc) in enumerate(states):
            o_ref[j, h] = (acc / total).astype(o_ref.dtype)
        return carry

    jax.lax.fori_loop(0, rows, attend_row, 0)

    def patch_and_write(j):
        _wait_all(tile_copies(j, True))
        here = jax.lax.broadcasted_iota(jnp.int32, k_tiles.shape[2:], 0) == slot_ref[base + j] % tile
        for tiles, new in ((k_tiles, k_new_ref), (v_tiles, v_new_ref)):
            for h in range(kv_heads):
                tiles[j, h] = jnp.where(here, new[j, h], tiles[j, h])
        _start_all(tile_copies(j, False))

    each_writing_row(patch_and_write)
    each_writing_row(lambda j: _wait_all(tile_copies(j, False)))


def _start_all(copies) -> None:
    for copy in copies:
        copy.start()


def _wait_all(copies) -> None:
    for copy in copies:
        copy.wait()


def _paged_call(scalars, grouped, k_new, v_new, k_pool, v_pool, *, rows_per_program: int, streams: int,
                interpret: bool):
    """One device: scalars (live, slot, visible, target, table [b, C]) per row, grouped [b, kvh, G, Dh],
    k/v_new [b, kvh, 1, Dh], pools [NB, kvh, block, Dh]. Pads the rows to a multiple of
    ``rows_per_program`` programs in each of ``streams`` (padding reads and writes nothing) and
    derives each row's place in its stream's copies (``first``) and the next row there that reads
    a block (``following``)."""
    batch, kv_heads, group, head_dim = grouped.shape
    block = k_pool.shape[2]
    rows = rows_per_program
    per_stream = -(-batch // (rows * streams))  # programs
    padded = streams * per_stream * rows
    live, slot, visible, target, table = (jnp.pad(x, [(0, padded - batch)] + [(0, 0)] * (x.ndim - 1),
                                                   constant_values=-1 if i == 3 else 0)
                                          for i, x in enumerate(scalars))
    grouped, k_new, v_new = (jnp.pad(x, [(0, padded - batch), (0, 0), (0, 0), (0, 0)]) for x in (grouped, k_new, v_new))
    per_row = live.reshape(streams, -1)
    first = (jnp.cumsum(per_row, axis=1) - per_row).reshape(-1)
    reading = jnp.where(per_row > 0, jnp.arange(padded, dtype=jnp.int32).reshape(streams, -1), padded)
    at_or_after = jax.lax.cummin(reading, axis=1, reverse=True)
    after = jnp.concatenate([at_or_after[:, 1:], jnp.full((streams, 1), padded, jnp.int32)], axis=1)
    following = jnp.where(after < padded, after, -1).reshape(-1)
    columns = table.shape[1]
    scalars = (live, slot, visible, target, first.astype(jnp.int32), following, table.reshape(-1))
    tile = row_tile(k_pool.dtype)
    by_rows = lambda width: pl.BlockSpec((rows, kv_heads, width, head_dim),  # noqa: E731
                                         lambda s, k, *_: (s * per_stream + k, 0, 0, 0))
    in_hbm = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(scalars),
        grid=(streams, per_stream),
        in_specs=[by_rows(group), by_rows(1), by_rows(1), in_hbm, in_hbm],
        out_specs=[by_rows(group), in_hbm, in_hbm],
        scratch_shapes=[pltpu.VMEM((2, kv_heads, block, head_dim), k_pool.dtype),
                        pltpu.VMEM((2, kv_heads, block, head_dim), v_pool.dtype),
                        pltpu.VMEM((rows, kv_heads, tile, head_dim), k_pool.dtype),
                        pltpu.VMEM((rows, kv_heads, tile, head_dim), v_pool.dtype),
                        pltpu.SemaphoreType.DMA((2, 2, 2))],
    )
    first_pool = len(scalars) + 3
    kernel = functools.partial(_paged_rows_kernel, rows=rows, block=block, columns=columns,
                               scale=1.0 / math.sqrt(head_dim))
    out, k_pool, v_pool = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=(jax.ShapeDtypeStruct(grouped.shape, grouped.dtype),
                   jax.ShapeDtypeStruct(k_pool.shape, k_pool.dtype),
                   jax.ShapeDtypeStruct(v_pool.shape, v_pool.dtype)),
        input_output_aliases={first_pool: 1, first_pool + 1: 2},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="paged_decode_attention",
    )(*scalars, grouped, k_new, v_new, k_pool, v_pool)
    return out[:batch], k_pool, v_pool


def decode_read_bytes(lengths, kv_heads: int, head_dim: int, block: int, itemsize: int, heads: int) -> int:
    """HBM bytes one :func:`paged_decode_and_write` call (one layer) reads for rows whose new
    token goes to slot ``lengths[b]`` (the slots already live): the kernel's declared cost, which
    XLA's cost analysis cannot see inside a ``tpu_custom_call``.

    Per (row, KV head), from ``_paged_rows_kernel``'s schedule: ``ceil(length / block)`` key blocks
    and as many value blocks DMA'd in, the new slot's memory tile of ``row_tile`` rows read for k
    and for v (it is patched and written back), and the BlockSpec inputs: its ``heads / kv_heads``
    query heads and the new key and value — for the rows padded to a multiple of
    ``ROWS_PER_PROGRAM`` (a program's inputs are read whole; one copy stream, as on a v5e's one
    TensorCore). The writes (the two tiles back, the
    output heads) are not reads and are left out. Same signature as
    ``decode_gpu.decode_read_bytes``, so a report prices either kernel the same way."""
    row = head_dim * itemsize
    tile = 8 * max(1, 4 // itemsize)  # row_tile of an itemsize-byte dtype
    blocks = sum(-(-int(length) // block) for length in lengths)
    rows = len(lengths)
    padded = -(-rows // ROWS_PER_PROGRAM) * ROWS_PER_PROGRAM
    inputs = (heads // kv_heads) * row + 2 * row
    return kv_heads * (2 * blocks * block * row + rows * 2 * tile * row + padded * inputs)
