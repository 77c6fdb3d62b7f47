"""GPU: the sampler's Pallas Triton kernels, one program per row: the top-p sampler (search and draw
in two reads of the row where it can), and the top-k / top-p cut-off search that reads the row once a
search pass and derives keys and weights in registers (top-k, top-k + top-p; the sampler's fallback).

**Top-p, the paper's mode** (:func:`sample_top_p`). A row of Qwen's 151,936 logits is 304 KB in bf16
(a bf16 model's decode logits; the kernels upcast as they read) and 608 KB in fp32, more than an SM's
shared memory either way, so each pass over it reads HBM; the cut-off search needs 8 and XLA's draw one
more (1.75 GB a token at 320 fp32 rows, once the 0.5B job's largest cost, with its 15 compares an
element near compute-bound too). The sampler brackets the boundary first and searches only the
tokens near it:

1. pass 1: the row's maximum and mass, and the mass at or above 16 cut-offs one nat apart below a
   reference that follows the running maximum on a one-nat grid (sums rescaled and shifted when it
   rises). The first cut-off whose mass reaches ``p`` of the row's puts the boundary in one bin;
2. pass 2, with the exact maximum: the mass above the bin (all kept), in it and in the row; the bin's
   tokens set aside (value and index) in a scratch of ``CANDIDATES`` per row; the Gumbel-max draw
   among the tokens above the bin;
3. in the scratch alone (L2-resident): the 16-way search for the boundary within the bin and the draw
   among the bin's kept tokens.

A bin fuller than the scratch, or pass 2's exact sums not bracketing the boundary where pass 1's put
it (a boundary within rounding of a cut-off; top-p 1), takes the full-row search and draw instead (8
reads and 1). The result is the cut-off search's: the same floor (the same definition, its own
summation order), and the draw is ``jax.random.categorical``'s over the row filtered at it — the same
Gumbel noise per token (threefry of the token's counter, reproduced in the kernel), so the same token.
How often a row falls back depends on the model: the bin holds the tokens within a nat of the boundary
(docs/performance.md measures it on real weights).

**The cut-off search.** Why a kernel: XLA:GPU writes the order keys and the weights ``exp(x − top)`` out once and every pass of its
32-way search (``filtering._kept_floor_and_mass``) reads both: 23 reads of a row a token at
320 × 151,936 (h100-qwen3b). It does not fuse a producer into a reduce that uses it once per
candidate. Here each pass loads the logits, computes key and weight, and compares with every
candidate in registers. A 608 KB row does not fit an SM's shared memory, so unlike the TPU kernel
(``filtering_tpu``, rows held in VMEM) the row is read again each pass.

Why 16 ways (8 passes) and not XLA's 32 (7): a pass costs ``ways − 1`` compares, selects and adds an
element; at 32 ways that is ≈ 93 operations for 4 bytes read, compute-bound on an H100 (≈ 1 ms at
320 rows). 16 ways halve the compares for one more read: about as much time in each.

Per row the kernel returns what :mod:`filtering_tpu` returns (``top``, the kept ``floor`` as a
uint32 ordered key, the kept mass), from the same definitions, so :func:`filtering.sample_tokens`
draws from them the same way. Passes over the row: ``p`` (8) for each search held, and for top-k
alone one more for the kept mass (top-p carries it: the mass above its final lower edge). The
row's maximum costs no pass of its own: the first pass finds it as it goes (its cut-offs span
every key, so they do not need it) and, for top-p, sums the weights against the running maximum,
rescaling the sums when it rises (online softmax): a read of the row a token less, 0.19 GB at
320 × 151,936 (h100-qwen3b). The sums' order: a block of ``BLOCK`` lanes reduced by Triton's tree
(≤ log₂ BLOCK levels), the blocks added in order (:func:`summation_depth`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from llds_jax.sampling.filtering_tpu import batched_rows

BLOCK = 1024   # logits a loop step loads (a power of two, as Triton needs)
WAYS = 16      # candidates a pass: 15 cut-offs between the edges
PASSES = -(-32 // (WAYS.bit_length() - 1))  # ⌈32 / 4⌉ = 8
NUM_WARPS = 8
KERNEL_NAME = "sampler_cut_off_gpu"
_SIGN = 1 << 31
_EVERYTHING = np.uint32(0xFF800001)  # above every logit's key (+inf's is the largest, 0xFF800000)


def summation_depth(vocab: int) -> int:
    """The most roundings one weight goes through in a row sum, as a count of unit roundoffs: the
    block's tree, then a step per block; in the first pass at most one rescale per block after
    it (the factor's ``exp`` and the product round once each); and the arguments: a weight taken
    against the running maximum, then rescaled, has its exponent rounded at other magnitudes than
    ``exp(x − top)``'s, up to ``(top − x)·u`` apart, whose mass-weighted mean is at most the row's
    entropy ≤ ln V."""
    blocks = -(-vocab // BLOCK)
    return int(math.log2(BLOCK)) + 3 * blocks + math.ceil(math.log(vocab))


def kept_floor_and_mass(logits: jax.Array, inv_temperature, top_k, top_p, *, top_k_on: bool, top_p_on: bool,
                        interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """As :func:`filtering_tpu.kept_floor_and_mass`, on GPU."""
    return _batched(top_k_on, top_p_on, interpret)(logits, jnp.asarray(inv_temperature, jnp.float32),
                                                     jnp.asarray(top_k, jnp.int32), jnp.asarray(top_p, jnp.float32))


@functools.cache
def _batched(top_k_on: bool, top_p_on: bool, interpret: bool):
    return batched_rows(functools.partial(_one_shard, top_k_on=top_k_on, top_p_on=top_p_on, interpret=interpret))


def reads(top_k_on: bool, top_p_on: bool) -> int:
    """Reads of the row a call makes: the searches held (the first also finds the maximum), the
    kept mass for top-k alone."""
    return PASSES * (top_k_on + top_p_on) + (not top_p_on)


def _one_shard(logits, inv_t, top_k, top_p, *, top_k_on: bool, top_p_on: bool, interpret: bool):
    rows, vocab = logits.shape
    blocks = -(-vocab // BLOCK)
    column = pl.BlockSpec((None, 1), lambda r: (r, 0))
    passes = reads(top_k_on, top_p_on)
    cost = pl.CostEstimate(flops=int(3 * (WAYS - 1) * PASSES * (top_k_on + top_p_on) * rows * vocab),
                           transcendentals=int(rows * vocab * (PASSES * top_p_on + (not top_p_on))),
                           bytes_accessed=int(passes * rows * vocab * jnp.dtype(logits.dtype).itemsize + 6 * rows * 4))
    top, floor, kept = pl.pallas_call(
        functools.partial(_kernel, vocab=vocab, top_k_on=top_k_on, top_p_on=top_p_on),
        grid=(rows,),
        in_specs=[pl.BlockSpec((None, blocks * BLOCK), lambda r: (r, 0)), column, column, column],
        out_specs=[column, column, column],
        out_shape=[jax.ShapeDtypeStruct((rows, 1), jnp.float32), jax.ShapeDtypeStruct((rows, 1), jnp.int32),
                   jax.ShapeDtypeStruct((rows, 1), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        cost_estimate=cost,
        interpret=interpret,
        # the name XLA:GPU's HLO shows (backend_config): the reads the kernel makes, which the bench
        # charges (Pallas Triton drops the CostEstimate: XLA sees no cost of a Triton call)
        name=f"{KERNEL_NAME}_{passes}_reads",
    )(logits, inv_t[:, None], top_k.astype(jnp.float32)[:, None], top_p[:, None])
    return top[:, 0], jax.lax.bitcast_convert_type(floor[:, 0], jnp.uint32), kept[:, 0]


def _signed_key(x):
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def _signed(ordered):
    return jax.lax.bitcast_convert_type(ordered ^ jnp.uint32(_SIGN), jnp.int32)


def _ordered(x):
    """``filtering._ordered_key(x)``: :func:`_signed_key`'s order as uint32 (the inverse of :func:`_signed`)."""
    return jax.lax.bitcast_convert_type(_signed_key(x), jnp.uint32) ^ np.uint32(_SIGN)


def _pick(values, index):
    """``values[index]`` for a traced scalar index (Triton lowers no dynamic slice of a vector)."""
    return jnp.sum(jnp.where(jnp.arange(WAYS) == index, values, jnp.zeros_like(values)))


class _Row:
    """One program's row: its scaled blocks, sums over them, and the ``WAYS``-way cut-off search."""

    def __init__(self, x_ref, inv_t, vocab: int):
        self.x_ref, self.inv_t, self.vocab = x_ref, inv_t, vocab
        self.blocks = -(-vocab // BLOCK)

    def scaled(self, i):
        """The logits × 1/T of block i, -inf past the row, and their indices."""
        index = i * BLOCK + jnp.arange(BLOCK)
        x = plgpu.load(self.x_ref.at[pl.ds(i * BLOCK, BLOCK)], mask=index < self.vocab, other=-jnp.inf)
        return x.astype(jnp.float32) * self.inv_t, index

    def over_row(self, per_block, top, *, weighted: bool):
        """Σ over blocks of ``per_block(keys, x, reference)`` → [WAYS], blocks in order (weights
        ``exp(x − reference)`` where ``weighted``), and the row's maximum. ``top`` None: the row's
        first pass, which finds the maximum as it goes: the reference is the running maximum, and
        weighted sums so far are rescaled when it rises (online softmax), so no pass is spent on the
        maximum alone."""
        def step(i, carry):
            acc, m = carry
            x, _ = self.scaled(i)
            if top is not None:
                return acc + per_block(_signed_key(x), x, top), m
            m_new = jnp.maximum(m, jnp.max(x))
            if not weighted:
                return acc + per_block(_signed_key(x), x, None), m_new
            reference = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row all -inf so far: weights 0, not NaN
            return acc * jnp.exp(m - reference) + per_block(_signed_key(x), x, reference), m_new

        start = (jnp.zeros((WAYS,), jnp.float32), jnp.float32(-jnp.inf) if top is None else top)
        return jax.lax.fori_loop(0, self.blocks, step, start)

    def masses(self, cuts, top):
        """The mass strictly above each cut-off, over the whole row."""
        return self.over_row(lambda keys, x, reference: jnp.sum(
            jnp.where(keys[None, :] > cuts[:, None], jnp.exp(x - reference)[None, :], 0.0), axis=1), top,
            weighted=True)


def _search(statistic, decide, lo, hi, top, total=None):
    """XLA's ``_search_with_mass`` with ``WAYS`` candidates: the largest t in [lo, hi) with
    ``decide(statistic(t), total)``; ``total`` (None: the first pass's statistic at ``lo``, the first
    pass also finding the row's maximum where ``top`` is None). Returns ``(t, statistic(t), total, top)``."""
    offsets = jnp.arange(WAYS, dtype=jnp.uint32)  # 0: the lower edge itself

    def cuts_of(lo, hi):
        stride = (hi - lo - 1) // WAYS + 1  # ⌈(hi − lo) / ways⌉: never overflows uint32
        return jnp.minimum(lo + stride * offsets, hi)

    def narrow(lo, hi, stat, total):  # the sub-range holding the answer, and the statistic at its lower edge
        cuts = cuts_of(lo, hi)
        holds = decide(stat, total) & (cuts < hi) & (offsets > 0)
        holding = jnp.sum(holds.astype(jnp.int32))
        new_hi = jnp.where(holding + 1 < WAYS, jnp.max(jnp.where(offsets == holding + 1, cuts, 0)), hi)
        return jnp.max(jnp.where(offsets == holding, cuts, 0)), new_hi, _pick(stat, holding)

    stat, top = statistic(_signed(cuts_of(lo, hi)), top)
    total = _pick(stat, 0) if total is None else total

    def step(_, carry):
        lo, hi, _ = carry
        stat, _ = statistic(_signed(cuts_of(lo, hi)), top)
        return narrow(lo, hi, stat, total)

    lo, _, at_lo = jax.lax.fori_loop(0, PASSES - 1, step, narrow(lo, hi, stat, total))
    return lo, at_lo, total, top


def _kernel(x_ref, inv_t_ref, top_k_ref, top_p_ref, top_out, floor_out, kept_out, *, vocab: int, top_k_on: bool,
            top_p_on: bool):
    row = _Row(x_ref, inv_t_ref[0], vocab)
    floor, top = jnp.uint32(1), None  # floor 1 keeps every logit; the maximum comes with the first pass
    if top_k_on:
        k = top_k_ref[0]

        def counts(cuts, top):  # tokens at or above each cut-off (exact in fp32: V < 2²⁴)
            return row.over_row(lambda keys, x, _: jnp.sum(jnp.where(keys[None, :] >= cuts[:, None], 1.0, 0.0), axis=1),
                                top, weighted=False)

        kth, _, _, top = _search(counts, lambda stat, total: stat >= k, floor - 1, _EVERYTHING, top)
        floor = jnp.where((k > 0) & (k < vocab), kth, floor)
    if top_p_on:
        p = top_p_ref[0]
        # the mass strictly above each cut-off (cuts start at floor − 1: top-k's set)
        last, at_last, total, top = _search(row.masses, lambda stat, total: stat >= p * total, floor - 1, _EVERYTHING,
                                            top)
        kept = jnp.where(p < 1.0, at_last, total)
        floor = jnp.where(p < 1.0, last + 1, floor)
    else:  # top-k alone: one more pass for the kept mass
        at_floor = _signed(floor)

        def kept_part(i, acc):
            x, _ = row.scaled(i)
            return acc + jnp.sum(jnp.where(_signed_key(x) >= at_floor, jnp.exp(x - top), 0.0))

        kept = jax.lax.fori_loop(0, row.blocks, kept_part, jnp.float32(0))
    top_out[0] = top
    floor_out[0] = jax.lax.bitcast_convert_type(floor, jnp.int32)
    kept_out[0] = kept


# The top-p sampler: two reads of the row on its fast path (sample_top_p).
BINS = 16            # cut-offs of the first pass's mass histogram, BIN_WIDTH apart below a running reference
BIN_WIDTH = 1.0      # nats: the boundary bin's width, so the tokens the second pass sets aside
CANDIDATES = 2048    # slots for the boundary bin's tokens a row (scratch); a fuller bin takes the full-row path
FAST_READS = 2
SAMPLER_NAME = "sampler_top_p_gpu"
SAMPLER_COLUMNS = 4 + 6  # [rows] 4-byte columns: inv_t, top_p, the key's two words in; six results out


def sample_top_p(logits: jax.Array, inv_temperature, top_p, key_data: jax.Array, *, interpret: bool = False
                 ) -> tuple[jax.Array, ...]:
    """``logits [..., N, V]`` → ``(top, floor, kept, token, logprob, fast)``, each ``[..., N, 1]``: the
    row maximum, the kept floor (uint32 ordered key) and mass as :func:`kept_floor_and_mass` defines
    them, a token drawn from the top-p set with its log-prob under it, and 1 where the row took the
    two-read path (0: the full-row search). ``key_data [..., 2]`` uint32: the
    row's threefry key; the draw is ``jax.random.categorical(key, filtered)``'s Gumbel-max, each
    token's noise from the same bits (see :func:`_gumbel_at`), so it picks the XLA draw's token."""
    key_data = jnp.asarray(key_data, jnp.uint32)
    outs = _sampler(interpret)(logits, jnp.asarray(inv_temperature, jnp.float32), jnp.asarray(top_p, jnp.float32),
                               key_data[..., 0], key_data[..., 1])
    top, floor, kept, token, logprob, fast = outs
    return top, jax.lax.bitcast_convert_type(floor, jnp.uint32), kept, token, logprob, fast


@functools.cache
def _sampler(interpret: bool):
    return batched_rows(functools.partial(_sampler_shard, interpret=interpret), outputs=6)


def sampler_scratch_bytes(vocab: int) -> int:
    """Bytes a row moves through its candidate scratch at most on the fast path: each candidate's
    value and index written, its value read by every search pass, value and index read by the draw."""
    return min(CANDIDATES, vocab) * (8 + 4 * PASSES + 8)


def _sampler_shard(logits, inv_t, top_p, k1, k2, *, interpret: bool):
    rows, vocab = logits.shape
    blocks = -(-vocab // BLOCK)
    column = pl.BlockSpec((None, 1), lambda r: (r, 0))
    scratch = pl.BlockSpec((None, CANDIDATES + BLOCK), lambda r: (r, 0))  # + a block of lanes that store nothing
    f32, i32 = jnp.float32, jnp.int32
    outs = pl.pallas_call(
        functools.partial(_sampler_kernel, vocab=vocab, interpret=interpret),
        grid=(rows,),
        in_specs=[pl.BlockSpec((None, blocks * BLOCK), lambda r: (r, 0))] + [column] * 4,
        out_specs=[column] * 6 + [scratch, scratch],
        out_shape=[jax.ShapeDtypeStruct((rows, 1), dtype) for dtype in (f32, i32, f32, i32, f32, i32)]
        + [jax.ShapeDtypeStruct((rows, CANDIDATES + BLOCK), f32), jax.ShapeDtypeStruct((rows, CANDIDATES + BLOCK), i32)],
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret,
        # the name XLA:GPU's HLO shows: the fast path's reads of the logits and the scratch's size,
        # which the bench charges (Pallas Triton drops a CostEstimate)
        name=f"{SAMPLER_NAME}_{FAST_READS}_reads_{CANDIDATES}_candidates",
    )(logits, inv_t[:, None], top_p[:, None], k1[:, None], k2[:, None])
    return tuple(x[:, 0] for x in outs[:6])


def _threefry_bits(k1, k2, index):
    """``jax.random.bits(key, (1, V), jnp.uint32)[0, index]`` for a threefry key ``(k1, k2)`` under
    ``jax_threefry_partitionable`` (jax's default): threefry-2x32 of the counter ``(0, index)``, its
    two words xored (``jax._src.random.threefry2x32``, unrolled)."""
    rotations = ((13, 15, 26, 6), (17, 29, 16, 24))
    ks = (k1, k2, k1 ^ k2 ^ np.uint32(0x1BD11BDA))
    x0, x1 = jnp.zeros_like(index) + ks[0], index + ks[1]
    for i in range(5):
        for r in rotations[i % 2]:
            x0 = x0 + x1
            x1 = x0 ^ ((x1 << np.uint32(r)) | (x1 >> np.uint32(32 - r)))
        x0 = x0 + ks[(i + 1) % 3]
        x1 = x1 + ks[(i + 2) % 3] + np.uint32(i + 1)
    return x0 ^ x1


def _gumbel_at(k1, k2, index):
    """``jax.random.gumbel``'s fp32 noise for the given token indices (its default mode): a uniform
    in [tiny, 1) from the bits' top 23, then ``-log(-log(u))``."""
    bits = _threefry_bits(k1, k2, index.astype(jnp.uint32))
    floats = jax.lax.bitcast_convert_type((bits >> np.uint32(9)) | np.uint32(0x3F800000), jnp.float32) - 1.0
    tiny = np.float32(np.finfo(np.float32).tiny)
    uniform = jnp.maximum(tiny, floats * (np.float32(1.0) - tiny) + tiny)
    return -jnp.log(-jnp.log(uniform))


def _draw(keep, x, index, k1, k2, best):
    """The Gumbel-max draw over the tokens ``keep`` marks, merged into ``best = (value, index, logit)``:
    the larger noisy value, the lower index on a tie (``jnp.argmax``'s first maximum)."""
    noisy = jnp.where(keep, x + _gumbel_at(k1, k2, index), -jnp.inf)
    value = jnp.max(noisy)
    at = jnp.min(jnp.where(noisy == value, index, np.int32(2**31 - 1)))
    logit = jnp.max(jnp.where(index == at, x, -jnp.inf))
    take = value > best[0]
    return tuple(jnp.where(take, new, old) for new, old in zip((value, at, logit), best, strict=True))


def _sampler_kernel(x_ref, inv_t_ref, top_p_ref, k1_ref, k2_ref, top_out, floor_out, kept_out, token_out,
                    logprob_out, fast_out, values_ref, indices_ref, *, vocab: int, interpret: bool):
    """Pass 1: the row's maximum and mass, and the mass at or above ``BINS`` cut-offs one nat apart
    below a reference that rises with the running maximum on a one-nat grid (sums rescaled and
    shifted as it rises). The first cut-off whose mass reaches ``p`` of the row's brackets the
    top-p boundary in one bin. Pass 2: with the exact maximum, the mass above the bin (kept
    whole), in it and in the row; the bin's tokens set aside in a scratch of ``CANDIDATES``; the draw
    among the tokens above the bin. Then, in the scratch alone, the ``WAYS``-way search for the
    boundary and the draw among the bin's kept tokens. A bin too full for the scratch, or sums that
    do not bracket the boundary as pass 1 said (a boundary within rounding of a cut-off, top-p 1),
    take the full-row search and draw instead: 8 more reads and one."""
    row = _Row(x_ref, inv_t_ref[0], vocab)
    p, k1, k2 = top_p_ref[0], k1_ref[0], k2_ref[0]
    bins = jnp.arange(BINS)
    below = bins.astype(jnp.float32) * BIN_WIDTH

    def histogram(i, carry):
        reference, top, mass, at_or_above = carry
        x, _ = row.scaled(i)
        block_top = jnp.max(x)
        rise = jnp.ceil((block_top - reference) / BIN_WIDTH)
        raised = (reference > -jnp.inf) & (block_top > reference)
        new_reference = jnp.where(reference == -jnp.inf, block_top, jnp.where(raised, reference + rise * BIN_WIDTH,
                                                                              reference))
        shift = jnp.where(reference == -jnp.inf, BINS, jnp.where(raised, jnp.minimum(rise, BINS), 0)).astype(jnp.int32)
        factor = jnp.where(reference == -jnp.inf, 0.0, jnp.exp(reference - new_reference))
        moved = jnp.sum(jnp.where(bins[:, None] == bins[None, :] + shift, at_or_above[None, :], 0.0), axis=1)
        base = jnp.where(new_reference == -jnp.inf, 0.0, new_reference)
        weights = jnp.exp(x - base)
        cuts = base - below
        at_or_above = moved * factor + jnp.sum(jnp.where(x[None, :] >= cuts[:, None], weights[None, :], 0.0), axis=1)
        return new_reference, jnp.maximum(top, block_top), mass * factor + jnp.sum(weights), at_or_above

    minus_inf = jnp.float32(-jnp.inf)
    reference, top, mass, at_or_above = jax.lax.fori_loop(
        0, row.blocks, histogram, (minus_inf, minus_inf, jnp.float32(0), jnp.zeros((BINS,), jnp.float32)))
    first = jnp.min(jnp.where(at_or_above >= p * mass, bins, BINS))  # BINS: no cut-off reaches it
    base = jnp.where(reference == -jnp.inf, 0.0, reference)
    lo_edge = base - first.astype(jnp.float32) * BIN_WIDTH
    hi_edge = jnp.where(first == 0, jnp.inf, lo_edge + BIN_WIDTH)
    safe_top = jnp.where(top == -jnp.inf, 0.0, top)
    none = (minus_inf, np.int32(0), minus_inf)

    def set_aside(i, carry):
        above, inside, total, count, best = carry
        x, index = row.scaled(i)
        weights = jnp.exp(x - safe_top)
        is_above = x >= hi_edge
        is_inside = (x >= lo_edge) & ~is_above
        slot = count + jnp.cumsum(is_inside.astype(jnp.int32)) - 1
        keep = is_inside & (slot < CANDIDATES)
        # a lane that stores nothing gets a slot of its own past the candidates': Pallas' interpreter
        # writes a masked lane's old value back, and a shared slot would undo a real store
        slot = jnp.where(keep, slot, CANDIDATES + jnp.arange(BLOCK))
        plgpu.store(values_ref.at[slot], x, mask=keep)
        plgpu.store(indices_ref.at[slot], index, mask=keep)
        best = jax.lax.cond(jnp.max(is_above.astype(jnp.int32)) > 0, lambda: _draw(is_above, x, index, k1, k2, best), lambda: best)
        return (above + jnp.sum(jnp.where(is_above, weights, 0.0)), inside + jnp.sum(jnp.where(is_inside, weights, 0.0)),
                total + jnp.sum(weights), count + jnp.sum(is_inside.astype(jnp.int32)), best)

    zero = jnp.float32(0)
    above, inside, total, count, best = jax.lax.fori_loop(0, row.blocks, set_aside,
                                                          (zero, zero, zero, np.int32(0), none))
    if not interpret:  # the scratch written by every thread of the program, read by every thread
        plgpu.debug_barrier()
    needed = p * total
    fast = (first < BINS) & (count <= CANDIDATES) & (p < 1.0) & (above < needed) & (above + inside >= needed)

    def candidates(c):
        valid = c * BLOCK + jnp.arange(BLOCK) < count
        x = plgpu.load(values_ref.at[pl.ds(c * BLOCK, BLOCK)], mask=valid, other=-jnp.inf)
        return x, valid

    def from_scratch():
        chunks = (count + BLOCK - 1) // BLOCK

        def masses(cuts, top):  # the mass above the bin plus the bin's tokens strictly above each cut-off
            def step(c, acc):
                x, _ = candidates(c)
                weights = jnp.exp(x - safe_top)
                return acc + jnp.sum(jnp.where(_signed_key(x)[None, :] > cuts[:, None], weights[None, :], 0.0), axis=1)
            return above + jax.lax.fori_loop(0, chunks, step, jnp.zeros((WAYS,), jnp.float32)), top

        hi = jnp.where(first == 0, _EVERYTHING, _ordered(hi_edge))
        last, kept, _, _ = _search(masses, lambda stat, total: stat >= p * total, _ordered(lo_edge) - 1, hi, top,
                                   total)
        floor = last + 1

        def draw(c, best):
            x, valid = candidates(c)
            index = plgpu.load(indices_ref.at[pl.ds(c * BLOCK, BLOCK)], mask=valid, other=0)
            keep = valid & (_signed_key(x) >= _signed(floor))
            return _draw(keep, x, index, k1, k2, best)  # the bin's tokens follow the ones above in value only

        return floor, kept, _merge(best, jax.lax.fori_loop(0, chunks, draw, none))

    def whole_row():
        last, at_last, whole, _ = _search(row.masses, lambda stat, total: stat >= p * total, np.uint32(0),
                                          _EVERYTHING, top)
        floor = jnp.where(p < 1.0, last + 1, np.uint32(1))

        def draw(i, best):
            x, index = row.scaled(i)
            return _draw(_signed_key(x) >= _signed(floor), x, index, k1, k2, best)

        return floor, jnp.where(p < 1.0, at_last, whole), jax.lax.fori_loop(0, row.blocks, draw, none)

    floor, kept, (_, token, logit) = jax.lax.cond(fast, from_scratch, whole_row)
    top_out[0] = top
    floor_out[0] = jax.lax.bitcast_convert_type(floor, jnp.int32)
    kept_out[0] = kept
    token_out[0] = token
    logprob_out[0] = jnp.minimum((logit - top) - jnp.log(kept), 0.0)  # a rounding above 0: see filtering._scale
    fast_out[0] = fast.astype(jnp.int32)


def _merge(first, second):
    """Two partial draws ``(value, index, logit)`` as one: the larger value, the lower index on a tie."""
    take = (second[0] > first[0]) | ((second[0] == first[0]) & (second[1] < first[1]))
    return tuple(jnp.where(take, b, a) for a, b in zip(first, second, strict=True))
