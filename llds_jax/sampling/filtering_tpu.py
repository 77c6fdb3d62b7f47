"""TPU: the top-k / top-p cut-off search as a Pallas (Mosaic) kernel that reads each row's logits
from HBM once.

Why a kernel: in XLA the search (``filtering._kept_floor_and_mass``, 32 ways, 7 passes) reads the
``[rows, V]`` row from HBM every pass, twice (XLA writes the keys and weights out and each pass
reads both): 20–23 reads of a row per token. Here a block of 8 rows (one sublane tile; 2.4 MB of
Qwen's 151,936 logits in bf16, a bf16 model's decode dtype, 4.9 MB in fp32) is copied into VMEM once, its order keys and weights are written to
VMEM scratch, and every search pass runs over VMEM. HBM sees one read of the row and three
``[rows, 128]`` outputs: the row maximum, the kept floor and the kept mass.

Why bisection here (32 passes, one candidate each) where XLA takes 31 candidates a pass: once the
row is in VMEM a pass costs no HBM bytes, only vector work, and that work is ``candidates ×
passes`` compares, selects and adds an element: 32 for bisection against 217 for 31 × 7. The
result is the same: the search looks for the largest key with a monotone property (count, or mass
above it, summed in a fixed order so it is monotone in the set too), and any search finds it.

What the kernel computes, per row, with ``x = logits × inv_temperature`` (the same fp32 multiply
``filtering._scale`` makes on TPU, so the keys are those of the draw's ``scaled``):

* ``top``: the row maximum of ``x``;
* ``floor``: the least kept key (``filtering._ordered_key`` order, returned as uint32): top-k's
  k-th largest key when ``0 < top_k < V``, then top-p's nucleus above it when ``top_p < 1``;
  ``1`` (keep everything) when both are off;
* ``kept``: ``Σ exp(x − top)`` over ``key >= floor``, the draw's log-prob normaliser.

Numerics against the XLA search: top-k's floor is exact (counts are exact), so identical. Top-p
sums the same fp32 weights in another order, so a mass differs by its rounding; the kept set
differs only where the boundary mass is within that rounding of ``top_p × total``
(``tests/sampling/test_filtering_tpu.py`` states the bound from the summation depth). The sums'
depth here: each lane accumulates ``ceil(V / CHUNK)`` chunk slices, then a fixed tree of
``CHUNK / 128`` vregs, then the 128 lanes of the row (:func:`summation_depth`).

Rows not a multiple of 8 are a partial last block (its extra rows are not written back); a
vocabulary that is not a multiple of 128 lanes is padded with -inf (a copy of the row in XLA:
Qwen's 151,936 = 1,187 × 128 and SmolLM2's 49,152 need none). Inside ``vmap`` (the engine draws
per row: ``decode_loop.sample_rows``) the rows are gathered back into one call
(``custom_vmap``), so a block still holds 8 rows.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from llds_jax.parallel.rules import current_rules

LANES = 128
ROWS = 8                 # one fp32 sublane tile
CHUNK = 8 * LANES        # lanes a loop step reads from VMEM: 8 vregs of [8, 128]
_INT_MIN = -(2 ** 31)    # the signed key below every logit (filtering._ordered_key's 0)
_SEARCH_PASSES = 32      # bisection over 2³² keys
_MIB = 1 << 20


def summation_depth(vocab: int) -> int:
    """The most rounded additions one weight goes through in the kernel's row sum: the chunk loop
    (a step per chunk, the tail one more), the tree over a chunk's 8 vregs, the 128-lane reduce
    (counted as if sequential, since Mosaic's order is not ours to fix)."""
    padded = -(-vocab // LANES) * LANES
    return -(-padded // CHUNK) + int(math.log2(CHUNK // LANES)) + LANES - 1


def kept_floor_and_mass(logits: jax.Array, inv_temperature, top_k, top_p, *, top_k_on: bool, top_p_on: bool,
                        interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``logits [..., N, V]`` (any float dtype) → ``(top, floor, kept)``, each ``[..., N, 1]``
    (fp32, uint32 ordered key, fp32); see the module docstring. ``top_k_on`` / ``top_p_on``
    (static): which searches the kernel holds (``filtering.SamplingMode``); the traced knobs
    switch a held one off (``top_k`` outside ``(0, V)``, ``top_p >= 1``) as the XLA path does.
    ``interpret=True`` runs the kernel in Pallas' interpreter (any backend; tests)."""
    return _batched(top_k_on, top_p_on, interpret)(logits, jnp.asarray(inv_temperature, jnp.float32),
                                                     jnp.asarray(top_k, jnp.int32), jnp.asarray(top_p, jnp.float32))


@functools.cache
def _batched(top_k_on: bool, top_p_on: bool, interpret: bool):
    return batched_rows(functools.partial(_one_shard, top_k_on=top_k_on, top_p_on=top_p_on, interpret=interpret))


def batched_rows(one_shard, outputs: int = 3):
    """``one_shard(logits [N, V], *knobs [N]) → outputs × [N]`` (the cut-off searches: knobs ``inv_t,
    top_k, top_p`` → ``top, floor, kept``) as a call on ``[..., N, V]`` logits and scalar knobs, with a
    vmap rule that folds the mapped axis into the rows (one kernel over all rows instead of Pallas'
    default: a grid axis over the mapped rows, one row per program), inside ``shard_map`` over the
    rows' batch axes under a mesh (a custom call is not partitioned by XLA: it would gather every row
    to every device). Shared with the GPU kernels (``filtering_gpu``)."""
    def run(logits, *knobs):
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:
            return one_shard(logits, *knobs)
        rows = jax.P(current_rules().spec(("batch",), logits.shape[:1], mesh)[0])
        return jax.shard_map(one_shard, mesh=mesh, in_specs=(jax.P(rows[0], None), *(rows,) * len(knobs)),
                             out_specs=(rows,) * outputs, check_vma=False)(logits, *knobs)

    @jax.custom_batching.custom_vmap
    def call(logits, *knobs):
        lead = logits.shape[:-1]
        flat = logits.reshape(-1, logits.shape[-1])
        knobs = [jnp.broadcast_to(k, flat.shape[:1]) for k in knobs]
        return tuple(x.reshape(*lead, 1) for x in run(flat, *knobs))

    @call.def_vmap
    def _rule(axis_size, in_batched, logits, *knobs):
        if not in_batched[0]:
            logits = jnp.broadcast_to(logits, (axis_size, *logits.shape))
        per_map = math.prod(logits.shape[1:-1])  # rows in one mapped instance
        knobs = [jnp.repeat(k, per_map) if batched else jnp.broadcast_to(k, (axis_size * per_map,))
                 for k, batched in zip(knobs, in_batched[1:], strict=True)]
        outs = run(logits.reshape(-1, logits.shape[-1]), *knobs)
        return tuple(x.reshape(*logits.shape[:-1], 1) for x in outs), (True,) * outputs

    return call


def _one_shard(logits, inv_t, top_k, top_p, *, top_k_on: bool, top_p_on: bool, interpret: bool):
    rows, vocab = logits.shape
    if vocab % LANES:
        logits = jnp.pad(logits, ((0, 0), (0, LANES - vocab % LANES)), constant_values=-jnp.inf)
    knobs = [jnp.broadcast_to(k[:, None], (rows, LANES)) for k in (inv_t, top_k.astype(jnp.float32), top_p)]
    top, floor, kept = _call(logits, *knobs, vocab=vocab, top_k_on=top_k_on, top_p_on=top_p_on,
                             interpret=interpret)
    floor = jax.lax.bitcast_convert_type(floor[:, 0], jnp.uint32) ^ jnp.uint32(1 << 31)  # signed → ordered key
    return top[:, 0], floor, kept[:, 0]


def _call(logits, inv_t, top_k, top_p, *, vocab: int, top_k_on: bool, top_p_on: bool, interpret: bool):
    rows, padded = logits.shape
    block = min(ROWS, rows)
    itemsize = jnp.dtype(logits.dtype).itemsize
    row_tile = pl.BlockSpec((block, LANES), lambda i: (i, 0))
    scratch = [pltpu.VMEM((block, padded), jnp.int32)] + ([pltpu.VMEM((block, padded), jnp.float32)] if top_p_on else [])
    # the double-buffered input block, the scratch rows, a margin for Mosaic's own (v5e's default
    # scoped limit, 16 MiB, is below what 8 rows of a 152k vocabulary need)
    vmem = 2 * block * padded * itemsize + len(scratch) * block * padded * 4 + 4 * _MIB
    passes = 2 + (_SEARCH_PASSES if top_k_on else 0) + (_SEARCH_PASSES + 2 if top_p_on else 0)
    small = 6 * rows * LANES * 4  # three knob tiles in, three result tiles out
    cost = pl.CostEstimate(flops=int(3 * passes * rows * padded), transcendentals=int(rows * padded),
                           bytes_accessed=int(rows * padded * itemsize + small))
    kernel = functools.partial(_kernel, vocab=vocab, top_k_on=top_k_on, top_p_on=top_p_on)
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(rows, block),),
        in_specs=[pl.BlockSpec((block, padded), lambda i: (i, 0)), row_tile, row_tile, row_tile],
        out_specs=[row_tile, row_tile, row_tile],
        out_shape=[jax.ShapeDtypeStruct((rows, LANES), jnp.float32), jax.ShapeDtypeStruct((rows, LANES), jnp.int32),
                   jax.ShapeDtypeStruct((rows, LANES), jnp.float32)],
        scratch_shapes=scratch,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",), vmem_limit_bytes=int(vmem)),
        cost_estimate=cost,
        interpret=interpret,
        name="sampler_cut_off",
    )(logits, inv_t, top_k, top_p)


def _signed_key(x: jax.Array) -> jax.Array:
    """``filtering._signed_key``: int32 keys in the order of the float32 values, -0.0 as +0.0."""
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def _over_row(padded: int, init, fold):
    """``fold(acc, start)`` over every 128-lane slice ``start`` of the row, into ``CHUNK // LANES``
    accumulators (independent chains: slice ``w`` of each chunk goes to chain ``w``); the caller
    combines them with :func:`_combine`, a fixed tree."""
    ways = CHUNK // LANES
    full, tail = divmod(padded, CHUNK)

    def step(c, accs):
        base = pl.multiple_of(c * CHUNK, CHUNK)
        return tuple(fold(acc, base + w * LANES) for w, acc in enumerate(accs))

    accs = jax.lax.fori_loop(0, full, step, (init,) * ways)
    accs = list(accs)
    for w in range(tail // LANES):  # the tail's slices, one more step in the first chains
        accs[w] = fold(accs[w], full * CHUNK + w * LANES)
    return accs


def _combine(accs, op):
    while len(accs) > 1:
        accs = [op(accs[i], accs[i + 1]) for i in range(0, len(accs), 2)]
    return accs[0]


def _kernel(logits_ref, inv_t_ref, top_k_ref, top_p_ref, top_out, floor_out, kept_out, keys_ref, *weights_ref,
            vocab: int, top_k_on: bool, top_p_on: bool):
    block, padded = logits_ref.shape
    shape = (block, LANES)
    inv_t = inv_t_ref[...]

    def scaled(start):
        return logits_ref[:, pl.ds(start, LANES)].astype(jnp.float32) * inv_t

    def row_total(acc, reduce):  # [8, 128] per-lane partials → the row's value on every lane
        return jnp.broadcast_to(reduce(acc, axis=1, keepdims=True), shape)

    # pass 1: keys to VMEM, the row maximum (of the floats, and of the keys: the same element)
    def keys_and_max(acc, start):
        x = scaled(start)
        keys_ref[:, pl.ds(start, LANES)] = _signed_key(x)
        return jnp.maximum(acc, x)

    top = row_total(_combine(_over_row(padded, jnp.full(shape, -jnp.inf, jnp.float32), keys_and_max),
                             jnp.maximum), jnp.max)
    highest = _signed_key(top)

    def keys_at(start):
        return keys_ref[:, pl.ds(start, LANES)]

    def search(holds, lo, hi):
        """The largest key t in [lo, hi) with holds(t) (holds(lo) given, holds monotone), by bisection."""
        def halve(_, bounds):
            lo, hi = bounds
            mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # ⌊(lo + hi) / 2⌋ without int32 overflow
            ok = holds(mid)
            return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

        return jax.lax.fori_loop(0, _SEARCH_PASSES, halve, (lo, hi))[0]

    zero = jnp.zeros(shape, jnp.float32)
    floor = jnp.full(shape, _INT_MIN + 1, jnp.int32)  # ordered key 1: keeps every logit
    if top_k_on:
        k = top_k_ref[...]

        def at_least_k_from(cut):
            count = _over_row(padded, zero, lambda acc, start: acc + jnp.where(keys_at(start) >= cut, 1.0, 0.0))
            return row_total(_combine(count, jnp.add), jnp.sum) >= k  # counts ≤ V < 2²⁴: exact in fp32

        kth = search(at_least_k_from, floor - 1, highest + 1)
        floor = jnp.where((k > 0) & (k < vocab), kth, floor)

    if top_p_on:
        weights = weights_ref[0]

        def write_weights(acc, start):
            weights[:, pl.ds(start, LANES)] = jnp.exp(scaled(start) - top)
            return acc

        _over_row(padded, zero, write_weights)

        def mass_above(cut):  # the mass strictly above ``cut``: cuts start at floor − 1, so top-k's cut holds
            parts = _over_row(padded, zero, lambda acc, start: acc + jnp.where(
                keys_at(start) > cut, weights[:, pl.ds(start, LANES)], 0.0))
            return row_total(_combine(parts, jnp.add), jnp.sum)

        p = top_p_ref[...]
        needed = p * mass_above(floor - 1)
        last = search(lambda cut: mass_above(cut) >= needed, floor - 1, highest)
        floor = jnp.where(p < 1.0, last + 1, floor)

    # the kept mass over the final set: the draw's normaliser
    def kept_weights(acc, start):
        w = weights_ref[0][:, pl.ds(start, LANES)] if top_p_on else jnp.exp(scaled(start) - top)
        return acc + jnp.where(keys_at(start) >= floor, w, 0.0)

    kept = row_total(_combine(_over_row(padded, zero, kept_weights), jnp.add), jnp.sum)
    top_out[...] = top
    floor_out[...] = floor
    kept_out[...] = kept
