"""Temperature, top-k and top-p (nucleus) filtering, and drawing one token per row.

The order is HF's and vLLM's: divide by the temperature, keep the ``top_k`` largest
logits, then keep the smallest set of the remaining tokens (largest first) whose
probability mass reaches ``top_p``. Tokens tied with the last kept one are kept too.

Which filters run is a static property of the compiled program, its :class:`SamplingMode`
(greedy, plain temperature, top-k, top-p, or both), derived from the knobs when the caller
builds its ``SamplingParams``. Why not a run-time ``lax.cond`` on the knobs: XLA:GPU copies
each conditional's predicate to the host and waits for it, every token, and a greedy
program paid for compiling (and XLA's cost model charged it) the filtered draw it never
ran. The knob *values* stay traced, so a new temperature or top-p reuses the program; only
a change of mode compiles another. :attr:`SamplingMode.ANY` (all filters, each switched by
its knob with a select) serves callers whose knobs are traced.

Neither filter sorts the vocabulary: each finds its cut-off logit by a search over the 2³²
float32 values (a monotone integer key per logit), fused passes over the row that count
tokens (top-k) or sum probability mass (top-p) above candidate cut-offs: bisection on
XLA:CPU (32 passes), 31 candidates per pass in XLA on TPU/GPU (7 passes; see :func:`search_ways`).
The TPU/GPU draw (:func:`sample_tokens`) runs the search in a Pallas kernel instead
(:func:`_cut_off_kernel`): XLA wrote the keys and weights out once and every pass read both (20–23
reads of a ``[320, 151,936]`` row a token on an H100); it does not fuse a producer into a reduce
that uses it once per candidate (as a 32-operand variadic reduce, with per-pass copies, with an
``exp`` of cheap ops: 24–42 reads). Measured on XLA:CPU for 8 rows of SmolLM2's 49k vocabulary:
2.6 ms per token for top-p 0.95, against 75 ms for the ``jnp.sort`` it replaces. The result is
exact: the same kept set as sorting, whichever way the search runs (the mass above a cut-off is a
monotone function of the set of keys above it); a kernel sums the masses in its own order, so its
top-p set can differ from XLA's only where the boundary is within that rounding (the tests state it).

Reads of the ``[rows, V]`` logits per token; TPU: a block of 8 rows copied into VMEM once, the
searches bisect there (``filtering_tpu``); GPU: a Triton program per row, ``p`` = 8 passes of 16
ways, each reading the row once, the first finding the row's maximum too (a 608 KB row does not
fit shared memory; ``filtering_gpu``); GPU top-p alone: one kernel that brackets the boundary in
a first pass, sets the bracket's tokens aside in a second and searches and draws among them there
(``filtering_gpu.sample_top_p``; a row whose bracket overflows: the search and draw below)::

                    GPU                                                 TPU
    greedy          argmax, normaliser                           2      2
    temperature     max, draw, normaliser                        3      3
    top-k           p counts, kept mass, draw          2 + p   = 10     kernel, draw   2
    top-p           bracket, set aside + draw                   2     kernel, draw   2
                    (a bracket too full: + p masses, draw)
    top-k + top-p   p counts, p masses, draw           1 + 2p  = 17     kernel, draw   2

The cut-off kernels return the row maximum, the kept floor (an :func:`_ordered_key`) and the kept mass,
the draw's log-prob normaliser (the GPU top-p sampler the token and its log-prob too, drawn with the
noise XLA's draw would add); the draw stays XLA's and tests the floor on keys it derives from
the logits (:func:`_signed_key`), so it reads the logits alone and draws the tokens the XLA search
would for the same key and the same floor. XLA:CPU keeps its own sums and its bisection (32
passes), bit for bit.

``temperature <= 0`` means greedy. The log-prob returned for a token is under the
distribution it was drawn from (temperature-scaled and filtered); for greedy it is the
plain log-softmax of the logits, i.e. the model's own log-prob at temperature 1. Its
normaliser is summed so that a row's log-prob does not depend on the batch it was drawn
in (``models.reductions``): a rollout in waves of any size gets the same numbers. So are
the top-p masses, so a row's kept set does not depend on the batch either.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp

from llds_jax.models.reductions import row_sum, row_sum_of, target_platform

_NEG_INF = -jnp.inf
_KEY_BITS = 32  # a cut-off is one of 2³² float32 values (as uint32 order keys)


class SamplingMode(enum.Enum):
    """Which filters a compiled sampler runs; hashable, so a static (trace-time) property."""

    GREEDY = "greedy"
    TEMPERATURE = "temperature"
    TOP_K = "top-k"
    TOP_P = "top-p"
    TOP_K_TOP_P = "top-k+top-p"
    ANY = "any"  # every filter, each switched on and off by its traced knob (selects, no cond)

    @classmethod
    def of(cls, temperature: float, top_k: int, top_p: float) -> SamplingMode:
        """The mode that the concrete knobs need (``top_k <= 0`` and ``top_p >= 1`` are off)."""
        if float(temperature) <= 0:
            return cls.GREEDY
        k, p = int(top_k) > 0, float(top_p) < 1.0
        return {(False, False): cls.TEMPERATURE, (True, False): cls.TOP_K,
                (False, True): cls.TOP_P, (True, True): cls.TOP_K_TOP_P}[k, p]

    @property
    def top_k(self) -> bool:
        return self in (SamplingMode.TOP_K, SamplingMode.TOP_K_TOP_P, SamplingMode.ANY)

    @property
    def top_p(self) -> bool:
        return self in (SamplingMode.TOP_P, SamplingMode.TOP_K_TOP_P, SamplingMode.ANY)


def resolve_mode(mode: SamplingMode | None, temperature, top_k, top_p) -> SamplingMode:
    """``mode``, else the one the knobs need if they are concrete, else :attr:`SamplingMode.ANY`."""
    if mode is not None:
        return SamplingMode(mode)
    try:
        return SamplingMode.of(temperature, top_k, top_p)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError):
        return SamplingMode.ANY  # traced knobs: decided at run time, with selects


def _ordered_key(x: jax.Array) -> jax.Array:
    """uint32 keys in the order of the float32 values (-0.0 counted as +0.0; logits are not NaN).
    No logit has key 0 (the least is -inf's, ``0x007FFFFF``), so key 0 is below every logit."""
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _signed_key(x: jax.Array) -> jax.Array:
    """``_ordered_key(x) ^ 2³¹`` as int32: the same order (``_ordered_key(x) >= k`` is
    ``_signed_key(x) >= _signed(k)``), written with other ops. Why: the TPU/GPU draw tests the
    cut-off on the logits it reads; with ``_ordered_key`` XLA reused the keys it wrote out for the
    search and the draw read them too (a row more). Both start from ``where(x == 0, 0, x)``, so a
    platform that treats subnormals as zero does it alike in both."""
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def _signed(key: jax.Array) -> jax.Array:
    """An :func:`_ordered_key` as :func:`_signed_key` orders it."""
    return jax.lax.bitcast_convert_type(key ^ jnp.uint32(1 << 31), jnp.int32)


def search_ways() -> int:
    """Candidate cut-offs per pass: 2 on XLA:CPU, 32 on TPU/GPU.

    A pass reads the row's keys and weights once whatever the number of candidates, so on
    memory-bound TPU/GPU 31 candidates fix 5 bits of the cut-off per pass: ⌈32 / 5⌉ = 7 passes,
    against bisection's 32 (16 ways took ⌈32 / 4⌉ = 8). Each element costs a compare, a select
    and an add per candidate (~93 flops for 8 bytes read), about where an H100/H200 turns from
    memory- to compute-bound, so more ways (64: 6 passes) would not be cheaper.
    XLA:CPU writes the ``[B, 15, V]`` levels of the batch-invariant ``row_sum`` tree out (a pass at
    8 × 49k: 9.4 MB for 16 candidates; 281 MB at a 152k vocabulary), so it bisects: one candidate,
    its masked sum fused into the tree (``row_sum_of``), reads the 3.1 MB of keys and weights
    in 3.4 MB. Four ways draw no faster at 49 152 (8.3 ms for 8 rows, both) and slower at 151 936
    (44 against 41 ms).
    """
    return 2 if target_platform() == "cpu" else 32


def search_passes(ways: int) -> int:
    """Passes of :func:`_search` over 2³² keys with ``ways − 1`` candidates each: ⌈32 / ⌊log₂ ways⌋⌉."""
    return -(-_KEY_BITS // (ways.bit_length() - 1))


def _search(holds, lo: jax.Array, hi: jax.Array, ways: int) -> jax.Array:
    """The largest key ``t`` in ``[lo, hi)`` with ``holds(t)``, given ``holds(lo)``, not ``holds(hi)``,
    and ``holds`` true up to a point and false after it. ``holds`` maps candidates ``[..., m]`` to
    ``[..., m]`` booleans; each pass tries ``ways − 1`` evenly spaced candidates."""
    offsets = jnp.arange(1, ways, dtype=jnp.uint32)

    def step(_, bounds):
        lo, hi = bounds
        stride = (hi - lo - 1) // ways + 1  # ⌈(hi − lo) / ways⌉: never overflows uint32
        cuts = jnp.minimum(lo + stride * offsets, hi)
        holding = jnp.sum(holds(cuts) & (cuts < hi), axis=-1, keepdims=True)
        edges = jnp.concatenate([lo, cuts, hi], axis=-1)
        return (jnp.take_along_axis(edges, holding, axis=-1),
                jnp.take_along_axis(edges, holding + 1, axis=-1))

    # A loop, not unrolled: unrolled, XLA:CPU fuses the passes into one that recomputes each
    # pass's inputs (578 ms per token for top-p on 8 × 49k, against 2.6 ms as a loop). Its trip
    # count is static, so XLA:GPU runs it without reading a predicate back to the host.
    return jax.lax.fori_loop(0, search_passes(ways), step, (lo, hi))[0]


def _search_with_mass(masses, lo: jax.Array, hi: jax.Array, ways: int, top_p) -> tuple[jax.Array, jax.Array,
                                                                                          jax.Array]:
    """The top-p :func:`_search` that also sums the row's mass and the kept mass as it goes.

    ``masses(cuts)`` maps candidates ``[..., m]`` to the mass strictly above each. Every pass
    sums above ``lo`` too (one more candidate in the same reduce, no more reads): in the first pass
    that is the whole mass the filter starts from, so ``needed = top_p × total`` comes with the
    first pass instead of a pass of its own; the mass above the final lower edge is the kept
    tokens' mass, the draw's log-prob normaliser, so the draw needs no normaliser pass either.
    Returns ``(largest t with mass above t >= needed, mass above t, total)``.
    """
    offsets = jnp.arange(1, ways, dtype=jnp.uint32)

    def step(i, carry):
        lo, hi, _, total = carry
        stride = (hi - lo - 1) // ways + 1  # ⌈(hi − lo) / ways⌉: never overflows uint32
        cuts = jnp.minimum(lo + stride * offsets, hi)
        mass = masses(jnp.concatenate([lo, cuts], axis=-1))
        total = jnp.where(i == 0, mass[..., :1], total)  # the first pass's lower edge: the whole mass
        holding = jnp.sum((mass[..., 1:] >= top_p * total) & (cuts < hi), axis=-1, keepdims=True)
        edges = jnp.concatenate([lo, cuts, hi], axis=-1)
        return (jnp.take_along_axis(edges, holding, axis=-1), jnp.take_along_axis(edges, holding + 1, axis=-1),
                jnp.take_along_axis(mass, holding, axis=-1), total)

    zero = jnp.zeros(lo.shape, jnp.float32)
    lo, _, at_lo, total = jax.lax.fori_loop(0, search_passes(ways), step, (lo, hi, zero, zero))
    return lo, at_lo, total


def _kept_floor(scaled: jax.Array, top: jax.Array, top_k, top_p, mode: SamplingMode, ways: int) -> jax.Array:
    """The least kept key per row ``[..., 1]`` (keep ``key >= floor``) for ``mode``'s filters.

    ``top`` is the row maximum of ``scaled`` (``[..., 1]``): its key bounds both searches from
    above, and the top-p weights are ``exp(scaled − top)``. Both searches start from key 0, below
    every logit (no min pass). A filter whose knob is off (``top_k`` outside ``(0, V)``,
    ``top_p >= 1``) leaves the floor where it was through a select, so a mode that runs a filter
    is right for any knob values.
    """
    return _kept_floor_and_mass(scaled, top, top_k, top_p, mode, ways)[0]


def _kept_floor_and_mass(scaled: jax.Array, top: jax.Array, top_k, top_p, mode: SamplingMode, ways: int
                         ) -> tuple[jax.Array, jax.Array | None]:
    """:func:`_kept_floor`, and with top-p on TPU/GPU (``ways > 2``) the kept tokens' mass
    ``Σ exp(scaled − top)`` over ``key >= floor`` (``[..., 1]``; else None): the top-p search's
    last statistic (:func:`_search_with_mass`). XLA:CPU (bisection) keeps its separate normaliser
    sum, so the CPU job's log-probs stay bit for bit what they were."""
    keys = _ordered_key(scaled)
    highest = _ordered_key(top)
    floor = jnp.ones_like(highest)  # key 1: keeps every logit
    kept_mass = None
    if mode.top_k:
        def at_least_k_from(cuts):
            return jnp.sum(keys[..., None, :] >= cuts[..., None], axis=-1, dtype=jnp.int32) >= top_k

        kth_largest = _search(at_least_k_from, floor - 1, highest + 1, ways)
        floor = jnp.where((top_k > 0) & (top_k < scaled.shape[-1]), kth_largest, floor)
    if mode.top_p:
        weights = jnp.exp(scaled - top)
        if mode.top_k:
            weights = jnp.where(keys >= floor, weights, 0.0)
        def masses(cuts):  # the mass strictly above each cut-off
            return row_sum_of(lambda k, c, w: jnp.where(k > c, w, 0.0),
                              keys[..., None, :], cuts[..., None], weights[..., None, :])

        # the lowest cut-off whose mass strictly above it falls short of top_p
        if ways > 2:
            last, at_last, total = _search_with_mass(masses, floor - 1, highest, ways, top_p)
            kept_mass = jnp.where(top_p < 1.0, at_last, total)
            nucleus = last + 1
        else:
            needed = top_p * row_sum(weights, keepdims=True)
            nucleus = _search(lambda cuts: masses(cuts) >= needed, floor - 1, highest, ways) + 1
        floor = jnp.where(top_p < 1.0, nucleus, floor)
    return floor, kept_mass


def _truncate(scaled: jax.Array, top_k, top_p, ways: int | None = None,
              mode: SamplingMode = SamplingMode.TOP_K_TOP_P) -> jax.Array:
    """``scaled`` with the tokens ``mode``'s filters drop at -inf."""
    if not (mode.top_k or mode.top_p):
        return scaled
    top = jnp.max(scaled, axis=-1, keepdims=True)
    floor = _kept_floor(scaled, top, jnp.asarray(top_k, jnp.int32), jnp.asarray(top_p, jnp.float32), mode,
                        ways or search_ways())
    return jnp.where(_ordered_key(scaled) >= floor, scaled, _NEG_INF)


def _scale(logits: jax.Array, temperature) -> jax.Array:
    """``logits / temperature``, rounded before anything reads it; -0.0 as +0.0 (as the keys count it).

    Why the select: XLA turns the division into a multiply by the reciprocal and recomputes it
    inside each pass's fusion, where the backend contracts ``scaled − top`` (and the Gumbel
    ``noise + scaled``) into a fused multiply-add, rounded once instead of twice. The maximum
    found in one fusion then was not the one another fusion saw: at temperature 0.7 log-probs
    moved by an ulp and the argmax's came out positive. A select between the multiply and its
    readers leaves nothing to contract (``optimization_barrier`` did not: XLA:CPU drops it
    before fusing), so every pass reads the rounded quotient, as it did when ``scaled`` was a
    ``lax.cond`` operand written to memory.

    On TPU/GPU the select (and the divide) cost bytes: XLA:GPU does not repeat a ``[V]`` divide or
    select in each reader, it wrote the ``scaled == 0`` mask (or ``scaled`` itself) out and every
    pass read it back — 2.25 reads of the row a token at 320 × 151,936. There ``scaled`` is the
    multiply by the reciprocal (what XLA made of the divide anyway; the same at temperature 1), with
    no select: the keys count -0.0 as +0.0 themselves (:func:`_ordered_key`, :func:`_signed_key`). What a contraction can still do there is round ``scaled − top`` once instead of
    twice in the weights' fusion: ulps in the masses (within what the kept set is exact to), and a
    log-prob a rounding above 0, which :func:`sample_tokens` clamps to 0.
    """
    if target_platform() == "cpu":
        scaled = logits.astype(jnp.float32) / _positive(temperature)
    else:  # a bare multiply (see above): no [V]-sized select or divide for XLA to write out
        return logits.astype(jnp.float32) * _inverse_temperature(temperature)
    return jnp.where(scaled == 0, 0.0, scaled)


def _positive(temperature) -> jax.Array:
    """The temperature that scales: 1 where ``temperature <= 0`` (greedy, drawn apart)."""
    return jnp.asarray(jnp.where(jnp.asarray(temperature, jnp.float32) > 0, temperature, 1.0), jnp.float32)


def _inverse_temperature(temperature) -> jax.Array:
    """The TPU/GPU scale factor: one value that both XLA's ``scaled`` and the TPU sampler kernel
    multiply by, so the kernel's keys are those of the logits the draw filters."""
    return 1.0 / _positive(temperature)


def filter_logits(logits: jax.Array, temperature, top_k, top_p, mode: SamplingMode | None = None) -> jax.Array:
    """``[B, V]`` fp32 logits of the sampling distribution: scaled, with filtered tokens at -inf.

    ``mode`` (static): which filters run; by default the ones ``top_k`` and ``top_p`` ask for
    (:func:`resolve_mode`), at any temperature: ``temperature <= 0`` filters unscaled logits.
    """
    mode = resolve_mode(mode, 1.0, top_k, top_p)  # the temperature picks no filter here
    return _truncate(_scale(logits, temperature), top_k, top_p, mode=mode)


def _log_prob_at(x: jax.Array, index: jax.Array, top: jax.Array) -> jax.Array:
    """``models.reductions.log_softmax_at(x, index)`` bit for bit, given ``top``, the row maximum of
    ``x`` (``[..., 1]``) the caller already has: a maximum is exact, so it is the one
    ``log_softmax_at`` would find, and the pass that finds it again is saved."""
    top = jax.lax.stop_gradient(top)
    log_normaliser = jnp.log(row_sum(jnp.exp(x - top), keepdims=True))
    return ((jnp.take_along_axis(x, index[..., None], axis=-1) - top) - log_normaliser)[..., 0]


def _greedy(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The argmax and its plain log-softmax; the argmax's logit is the row maximum."""
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return tokens, _log_prob_at(logits, tokens, jnp.take_along_axis(logits, tokens[..., None], axis=-1))


def _cut_off_kernel():
    """The module whose Pallas kernel runs the cut-off search for the platform compiled for, or None
    (XLA:CPU: the XLA search, bit for bit as before). Imported where it runs."""
    platform = target_platform()
    if platform == "tpu":
        from llds_jax.sampling import filtering_tpu  # noqa: PLC0415

        return filtering_tpu
    if platform == "gpu":
        from llds_jax.sampling import filtering_gpu  # noqa: PLC0415

        return filtering_gpu
    return None


def _threefry_bits_of(key: jax.Array) -> jax.Array | None:
    """A key's two threefry words (uint32 ``[2]``) when its random bits are threefry's counter-based
    ones (jax's default: the ``threefry2x32`` implementation, ``jax_threefry_partitionable``), which
    the GPU sampler kernel reproduces per token; else None."""
    if not jax.config.jax_threefry_partitionable:
        return None
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if "threefry" not in str(jax.random.key_impl(key)):
            return None
        return jax.random.key_data(key)
    return key if jax.config.jax_default_prng_impl == "threefry2x32" and key.shape == (2,) else None


def sample_tokens(logits: jax.Array, key: jax.Array, temperature, top_k, top_p,
                  mode: SamplingMode | None = None) -> tuple[jax.Array, jax.Array]:
    """One token per row and its log-prob under the distribution it came from. ``[B]``, ``[B]``.

    ``logits``: any float dtype; the draw is from their fp32 values (a bf16 model's decode logits
    arrive in bf16: ``Decoder.forward_cached``).

    ``mode`` (static): which filters run, by default the one the knobs need (:func:`resolve_mode`);
    the program holds no conditional whatever the mode.
    """
    mode = resolve_mode(mode, temperature, top_k, top_p)
    # ``logits`` as the model wrote them (a bf16 model's in bf16): the kernels upcast as they read,
    # XLA fuses the upcast into each pass; an upcast copy would be a kernel operand written and read
    narrow, logits = logits, logits.astype(jnp.float32)
    if mode is SamplingMode.GREEDY:
        return _greedy(logits)
    kernel = _cut_off_kernel() if mode.top_k or mode.top_p else None
    key_bits = _threefry_bits_of(key) if mode is SamplingMode.TOP_P and hasattr(kernel, "sample_top_p") else None
    if key_bits is not None and logits.shape[:-1] == (1,):  # one row per key: its tokens' counters are their indices
        # GPU top-p: search and draw in one kernel, two reads of the row where the boundary's bin fits
        # its scratch (filtering_gpu.sample_top_p); the same token as the draw below for the same floor
        _, _, _, tokens, logprobs, _ = kernel.sample_top_p(narrow, _inverse_temperature(temperature), top_p, key_bits)
        return tokens[..., 0], logprobs[..., 0]
    scaled = _scale(logits, temperature)
    filtered, kept_mass = scaled, None
    if kernel is not None:  # TPU/GPU: the search in a Pallas kernel (filtering_tpu, filtering_gpu)
        top, floor, kept_mass = kernel.kept_floor_and_mass(narrow, _inverse_temperature(temperature), top_k, top_p,
                                                           top_k_on=mode.top_k, top_p_on=mode.top_p)
        filtered = jnp.where(_signed_key(scaled) >= _signed(floor), scaled, _NEG_INF)
    elif mode.top_k or mode.top_p:
        top = jnp.max(scaled, axis=-1, keepdims=True)
        ways = search_ways()
        floor, kept_mass = _kept_floor_and_mass(scaled, top, jnp.asarray(top_k, jnp.int32),
                                                jnp.asarray(top_p, jnp.float32), mode, ways)
        if ways > 2:  # TPU/GPU: the same test in other ops, so the draw reads the logits only
            filtered = jnp.where(_signed_key(scaled) >= _signed(floor), scaled, _NEG_INF)
        else:
            filtered = jnp.where(_ordered_key(scaled) >= floor, scaled, _NEG_INF)
    else:
        top = jnp.max(scaled, axis=-1, keepdims=True)
    tokens = jax.random.categorical(key, filtered, axis=-1).astype(jnp.int32)
    if kept_mass is None:
        logprobs = _log_prob_at(filtered, tokens, top)  # the maximum is always kept: ``filtered``'s is ``top``
    else:  # TPU/GPU: the kernel returned the kept mass: no normaliser pass
        chosen = jnp.take_along_axis(scaled, tokens[..., None], axis=-1)
        logprobs = jnp.minimum(((chosen - top) - jnp.log(kept_mass))[..., 0], 0.0)  # see _scale: a rounding above 0
    if mode is SamplingMode.ANY:  # greedy chosen at run time by a select: both are computed
        greedy = jnp.asarray(temperature, jnp.float32) <= 0
        greedy_tokens, greedy_logprobs = _greedy(logits)
        tokens = jnp.where(greedy, greedy_tokens, tokens)
        logprobs = jnp.where(greedy, greedy_logprobs, logprobs)
    return tokens, logprobs
