"""GPU: the top-k / top-p cut-off search as a Pallas Triton kernel, one program per row, that reads
the row's logits once a search pass and derives keys and weights in registers.

Why: XLA:GPU writes the order keys and the weights ``exp(x − top)`` out once and every pass of its
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
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from llds_jax.sampling.filtering_tpu import batched_rows

BLOCK = 1024   # logits a loop step loads (a power of two, as Triton needs)
WAYS = 16      # candidates a pass: 15 cut-offs between the edges
PASSES = -(-32 // (WAYS.bit_length() - 1))  # ⌈32 / 4⌉ = 8
NUM_WARPS = 8
KERNEL_NAME = "sampler_cut_off_gpu"
_SIGN = 1 << 31


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


def _pick(values, index):
    """``values[index]`` for a traced scalar index (Triton lowers no dynamic slice of a vector)."""
    return jnp.sum(jnp.where(jnp.arange(WAYS) == index, values, jnp.zeros_like(values)))


def _kernel(x_ref, inv_t_ref, top_k_ref, top_p_ref, top_out, floor_out, kept_out, *, vocab: int, top_k_on: bool,
            top_p_on: bool):
    inv_t = inv_t_ref[0]
    blocks = -(-vocab // BLOCK)
    everything = jnp.uint32(0xFF800001)  # above every logit's key (+inf's is the largest, 0xFF800000)

    def scaled(i):  # the logits × 1/T of block i, -inf past the row
        index = i * BLOCK + jnp.arange(BLOCK)
        x = plgpu.load(x_ref.at[pl.ds(i * BLOCK, BLOCK)], mask=index < vocab, other=-jnp.inf)
        return x.astype(jnp.float32) * inv_t

    def over_row(per_block, top, *, weighted: bool):
        """Σ over blocks of ``per_block(keys, x, reference)`` → [WAYS], blocks in order (weights
        ``exp(x − reference)`` where ``weighted``), and the row's maximum. ``top`` None: the row's
        first pass, which finds the maximum as it goes: the reference is the running maximum, and
        weighted sums so far are rescaled when it rises (online softmax), so no pass is spent on the
        maximum alone."""
        def step(i, carry):
            acc, m = carry
            x = scaled(i)
            if top is not None:
                return acc + per_block(_signed_key(x), x, top), m
            m_new = jnp.maximum(m, jnp.max(x))
            if not weighted:
                return acc + per_block(_signed_key(x), x, None), m_new
            reference = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row all -inf so far: weights 0, not NaN
            return acc * jnp.exp(m - reference) + per_block(_signed_key(x), x, reference), m_new

        start = (jnp.zeros((WAYS,), jnp.float32), jnp.float32(-jnp.inf) if top is None else top)
        return jax.lax.fori_loop(0, blocks, step, start)

    def search(statistic, decide, lo, hi, top):
        """XLA's ``_search_with_mass`` with ``WAYS`` candidates: the largest t in [lo, hi) with
        ``decide(statistic(t), total)``; ``total`` = the first pass's statistic at ``lo``, the first
        pass also finding the row's maximum where ``top`` is None. Returns ``(t, statistic(t), total,
        top)``."""
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
        total = _pick(stat, 0)

        def step(_, carry):
            lo, hi, _ = carry
            stat, _ = statistic(_signed(cuts_of(lo, hi)), top)
            return narrow(lo, hi, stat, total)

        lo, _, at_lo = jax.lax.fori_loop(0, PASSES - 1, step, narrow(lo, hi, stat, total))
        return lo, at_lo, total, top

    floor, top = jnp.uint32(1), None  # floor 1 keeps every logit; the maximum comes with the first pass
    if top_k_on:
        k = top_k_ref[0]

        def counts(cuts, top):  # tokens at or above each cut-off (exact in fp32: V < 2²⁴)
            return over_row(lambda keys, x, _: jnp.sum(jnp.where(keys[None, :] >= cuts[:, None], 1.0, 0.0), axis=1),
                            top, weighted=False)

        kth, _, _, top = search(counts, lambda stat, total: stat >= k, floor - 1, everything, top)
        floor = jnp.where((k > 0) & (k < vocab), kth, floor)
    if top_p_on:
        p = top_p_ref[0]

        def masses(cuts, top):  # the mass strictly above each cut-off (cuts start at floor − 1: top-k's set)
            return over_row(lambda keys, x, reference: jnp.sum(
                jnp.where(keys[None, :] > cuts[:, None], jnp.exp(x - reference)[None, :], 0.0), axis=1), top,
                weighted=True)

        last, at_last, total, top = search(masses, lambda stat, total: stat >= p * total, floor - 1, everything, top)
        kept = jnp.where(p < 1.0, at_last, total)
        floor = jnp.where(p < 1.0, last + 1, floor)
    else:  # top-k alone: one more pass for the kept mass
        at_floor = _signed(floor)

        def kept_part(i, acc):
            x = scaled(i)
            return acc + jnp.sum(jnp.where(_signed_key(x) >= at_floor, jnp.exp(x - top), 0.0))

        kept = jax.lax.fori_loop(0, blocks, kept_part, jnp.float32(0))
    top_out[0] = top
    floor_out[0] = jax.lax.bitcast_convert_type(floor, jnp.int32)
    kept_out[0] = kept
