"""The Pallas cut-off searches (sampling/filtering_tpu.py: Mosaic, rows in VMEM; filtering_gpu.py:
Triton, a program per row), run in Pallas' interpreter on this CPU, against the XLA search they
replace (``filtering._kept_floor_and_mass``, 32 ways), and the sampler compiled for a v5e and for an
H100 (compile-only): one kernel, its declared reads of the rows, no loop or conditional around it.

Tolerance, from the quantity: both sides sum the fp32 weights ``exp(x − top)`` (the same XLA:CPU
``exp`` here), in different orders; the GPU kernel's first pass takes them against the running
maximum and rescales (its ``summation_depth`` counts those roundings too). A sum of non-negative
terms through at most ``d`` roundings is within ``γ_d · W`` of the exact sum (``γ_d = d·u / (1 − d·u)``, ``u = 2⁻²⁴``,
``W`` the row's mass); ``needed = top_p × total`` adds one rounding. So a search decides "mass above
the cut-off ≥ needed" as exact arithmetic would wherever the exact margin exceeds ``2·γ_{d+1}·W``;
the kept set can differ only where the boundary mass is closer than that to ``top_p × W``. ``d``:
the kernel's ``summation_depth`` (each module states its order), the reference's pairwise tree
``⌈log₂ V⌉ + 1`` (``models.reductions.row_sum_of`` on XLA:CPU). Top-k counts are exact: equal floors.
"""

from __future__ import annotations

import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llds_jax.plan.targets import target_installed
from llds_jax.sampling import filtering, filtering_gpu, filtering_tpu

pytestmark = pytest.mark.unit

U = 2.0 ** -24
KERNELS = pytest.mark.parametrize("kernel", [filtering_tpu, filtering_gpu], ids=["tpu", "gpu"])


def gamma(d: int) -> float:
    return d * U / (1 - d * U)


def _rows(vocab: int, count: int) -> np.ndarray:
    """``count`` rows: random scales, ties, -inf, all-equal, signed zeros, a tied block at any cut."""
    rng = np.random.default_rng(vocab + count)
    rows = [np.zeros(vocab), np.where(np.arange(vocab) < 3, 7.0, -np.inf)]       # all equal; 3 tied, rest -inf
    signed = rng.normal(size=vocab)
    signed[: vocab // 3] = 0.0
    signed[vocab // 3: 2 * vocab // 3] = -0.0                                   # -0.0 and +0.0 are one value
    rows.append(signed)
    block = np.full(vocab, -2.0)
    block[0], block[1: vocab // 2] = 3.0, 1.0
    rows.append(block)
    rows.append(np.round(rng.normal(size=vocab) * 1.5))                        # ties everywhere
    while len(rows) < count:
        row = rng.normal(size=vocab) * rng.choice([0.5, 3.0, 8.0])
        row[rng.random(vocab) < 0.2] = -np.inf
        row[rng.integers(vocab)] = 5.0
        rows.append(row)
    return np.stack(rows[:count]).astype(np.float32)


def _kernel(kernel, logits, top_k, top_p, mode):
    run = jax.jit(lambda x, k, p: kernel.kept_floor_and_mass(
        x, 1.0, k, p, top_k_on=mode.top_k, top_p_on=mode.top_p, interpret=True))
    return [np.asarray(a) for a in run(logits, top_k, top_p)]


def _reference(logits, top_k, top_p, mode):
    run = jax.jit(lambda x, k, p: filtering._kept_floor_and_mass(x, jnp.max(x, -1, keepdims=True), k, p, mode, 32))
    floor, mass = run(logits, jnp.int32(top_k), jnp.float32(top_p))
    return np.asarray(floor), None if mass is None else np.asarray(mass)


def _exact(logits, floor_k, top_p):
    """Per row: the mass W above ``floor_k − 1`` of the fp32 weights, summed in float64, and the exact
    top-p boundary margin ``min(M(t*) − pW, pW − M(t* + 1))`` (distinct values kept whole)."""
    keys = np.asarray(filtering._ordered_key(jnp.asarray(logits)))
    weights = np.asarray(jnp.exp(logits - jnp.max(logits, -1, keepdims=True)), np.float64)
    totals, margins = [], []
    for k, w, f in zip(keys, weights, floor_k[:, 0], strict=True):
        kept = k >= f
        total = w[kept].sum()
        values, inverse = np.unique(k[kept], return_inverse=True)
        group = np.bincount(inverse, weights=w[kept])[::-1]   # mass of each distinct key, largest first
        cumulative = np.cumsum(group)
        needed = top_p * total
        last = int(np.searchsorted(cumulative, needed))        # first prefix reaching needed
        above = cumulative[min(last, len(group) - 1)] - needed
        # the top group is kept whatever the sums: no search asks about the mass above the highest key
        below = needed - cumulative[last - 1] if last else np.inf
        totals.append(total)
        margins.append(min(above, below))
    return np.array(totals), np.array(margins)


def assert_a_top_p_set_up_to(logits, floor_k, floor, top_p, bound):
    """Every row's kept set ``key >= floor`` is the top-p set up to ``bound``: its exact mass reaches
    ``top_p × W − bound``, and without its lowest kept value it stays below ``top_p × W + bound``."""
    keys = np.asarray(filtering._ordered_key(jnp.asarray(logits)))
    weights = np.asarray(jnp.exp(logits - jnp.max(logits, -1, keepdims=True)), np.float64)
    for row, (k, w, fk, f, b) in enumerate(zip(keys, weights, floor_k[:, 0], floor[:, 0], bound, strict=True)):
        needed = top_p * w[k >= fk].sum()
        kept = k >= f
        lowest = k == k[kept].min()
        assert w[kept].sum() >= needed - b, f"row {row}: kept mass short of top_p"
        assert w[kept & ~lowest].sum() < needed + b or (kept == lowest).all(), f"row {row}: a value kept too many"


CASES = [(7, 1.0, "top-k"), (0, 0.9, "top-p"), (0, 1e-6, "top-p"), (40, 0.8, "top-k+top-p"), (0, 1.0, "top-k+top-p"),
         ("V", 0.5, "top-k+top-p")]


@pytest.mark.codegen_sensitive
@KERNELS
@pytest.mark.parametrize("top_k, top_p, mode", CASES)
@pytest.mark.parametrize("vocab, count", [(1000, 11), (4096, 8)])
def test_the_kernel_keeps_the_xla_searchs_set(kernel, vocab, count, top_k, top_p, mode):
    """Rows not a multiple of 8 and a vocabulary not a multiple of 128 (padded with -inf) included;
    knobs off (top-k 0 or V, top-p 1) inside a mode that holds the filter."""
    top_k = vocab if top_k == "V" else top_k
    mode = filtering.SamplingMode(mode)
    logits = _rows(vocab, count)
    top, floor, kept = _kernel(kernel, jnp.asarray(logits), top_k, top_p, mode)
    np.testing.assert_array_equal(top, logits.max(-1, keepdims=True))
    ref_floor, ref_kept = _reference(jnp.asarray(logits), top_k, top_p, mode)
    k_mode = filtering.SamplingMode.TOP_K if mode.top_k else None
    floor_k = _reference(jnp.asarray(logits), top_k, 1.0, k_mode)[0] if k_mode else np.ones_like(ref_floor)
    if not (mode.top_p and top_p < 1):
        np.testing.assert_array_equal(floor, ref_floor)  # counts are exact
    total, margin = _exact(logits, floor_k, top_p)
    depth = max(kernel.summation_depth(vocab), math.ceil(math.log2(vocab)) + 1)
    bound = 2 * gamma(depth + 1) * total
    decided = margin > bound
    if mode.top_p and top_p < 1:
        assert decided.all(), f"these cases decide every row (margins {margin}, bounds {bound})"
        np.testing.assert_array_equal(floor, ref_floor)
        assert_a_top_p_set_up_to(logits, floor_k, floor, top_p, bound)
    keys = np.asarray(filtering._ordered_key(jnp.asarray(logits)))
    weights = np.asarray(jnp.exp(logits - logits.max(-1, keepdims=True)), np.float64)
    exact_kept = np.where(keys >= floor, weights, 0.0).sum(-1, keepdims=True)
    kernel_bound = gamma(kernel.summation_depth(vocab)) * total[:, None]
    assert np.all(np.abs(kept - exact_kept) <= kernel_bound), f"kept mass {kept[:, 0]} vs {exact_kept[:, 0]}"
    if ref_kept is not None:  # the XLA search's carried mass, where both kept the same set
        same = (floor == ref_floor)[:, 0]
        ref_bound = kernel_bound + gamma(math.ceil(math.log2(vocab)) + 1) * total[:, None]
        assert np.all(np.abs(kept - ref_kept)[same] <= ref_bound[same])


@pytest.mark.codegen_sensitive
@KERNELS
def test_the_kernel_at_qwens_vocabulary(kernel):
    """151,936 = 1,187 lanes of 128 (TPU: no padding, a chunk tail of 3 vregs; GPU: a partial last
    block of 384), 9 rows (TPU: a partial block)."""
    vocab = 151_936
    logits = _rows(vocab, 9)
    mode = filtering.SamplingMode.TOP_K_TOP_P
    for top_k, top_p in ((50, 0.95), (0, 0.95)):
        _, floor, kept = _kernel(kernel, jnp.asarray(logits), top_k, top_p, mode)
        ref_floor, ref_kept = _reference(jnp.asarray(logits), top_k, top_p, mode)
        floor_k = _reference(jnp.asarray(logits), top_k, 1.0, filtering.SamplingMode.TOP_K)[0]
        total, margin = _exact(logits, floor_k, top_p)
        bound = 2 * gamma(kernel.summation_depth(vocab) + 1) * total
        decided = margin > bound  # at top-p 0.95 without top-k two rows' boundaries fall within the bound
        np.testing.assert_array_equal(floor[decided], ref_floor[decided])
        assert_a_top_p_set_up_to(logits, floor_k, floor, top_p, bound)  # the undecided rows too
        ref_bound = (gamma(kernel.summation_depth(vocab)) + gamma(math.ceil(math.log2(vocab)) + 1)) * total
        assert np.all(np.abs(kept - ref_kept)[decided, 0] <= ref_bound[decided])


@pytest.mark.codegen_sensitive
@KERNELS
@pytest.mark.parametrize("mode, dtype", [("top-k", "float32"), ("top-p", "float32"), ("top-k+top-p", "float32"),
                                         ("top-p", "bfloat16")])
def test_the_kernel_sampler_draws_the_xla_paths_tokens_per_row(monkeypatch, kernel, mode, dtype):
    """``sample_tokens`` as the engine calls it (``vmap`` over rows, one key each) with the platform's
    kernel (in the interpreter) and with the XLA 32-way search (the kernel lookup switched off), the
    same draw: the same tokens, and log-probs within the two normalisers' rounding. bf16: logits as a
    bf16 model's decode step writes them (rounded: ties everywhere), which the kernel upcasts as it
    reads and XLA as it fuses."""
    temperature, top_k, top_p = {"top-k": (0.7, 20, 1.0), "top-p": (1.0, 0, 0.9), "top-k+top-p": (1.3, 50, 0.8)}[mode]
    logits = jnp.asarray(_rows(2048, 13)[5:], dtype)  # the random rows: every boundary decided by a wide margin
    keys = jax.random.split(jax.random.key(7), logits.shape[0])
    mode = filtering.SamplingMode(mode)
    platform = "tpu" if kernel is filtering_tpu else "gpu"
    monkeypatch.setattr(filtering, "target_platform", lambda: platform)
    batched = kernel._batched
    monkeypatch.setattr(kernel, "_batched", lambda top_k_on, top_p_on, interpret: batched(top_k_on, top_p_on, True))
    if hasattr(kernel, "_sampler"):  # GPU top-p: the search and the draw in one kernel (filtering_gpu.sample_top_p)
        sampler = kernel._sampler
        monkeypatch.setattr(kernel, "_sampler", lambda interpret: sampler(True))

    def draw():
        run = jax.jit(jax.vmap(lambda row, key: filtering.sample_tokens(row[None], key, temperature, top_k, top_p,
                                                                        mode=mode)))
        return [np.asarray(a)[:, 0] for a in run(logits, keys)]

    tokens, logprobs = draw()
    monkeypatch.setattr(filtering, "_cut_off_kernel", lambda: None)
    want_tokens, want_logprobs = draw()
    np.testing.assert_array_equal(tokens, want_tokens)
    # the normalisers sum the kept weights (each within γ_d of it, relatively), then a log and a
    # subtraction round once each, at the log-prob's magnitude
    normalisers = gamma(kernel.summation_depth(2048)) + gamma(math.ceil(math.log2(2048)) + 1)
    bound = 2 * normalisers + 2 * np.spacing(np.maximum(np.abs(want_logprobs), 1).astype(np.float32))
    assert np.all(np.abs(logprobs - want_logprobs) <= bound), np.abs(logprobs - want_logprobs) / bound


def test_the_gpu_samplers_noise_is_jax_randoms_bit_for_bit():
    """The kernel's threefry bits and Gumbel noise per token index are ``jax.random.bits`` and
    ``jax.random.gumbel`` of the row's key over ``(1, V)`` (partitionable threefry, jax's default)."""
    key = jax.random.fold_in(jax.random.key(11), 5)
    k1, k2 = jax.random.key_data(key)
    index = jnp.arange(3000)
    np.testing.assert_array_equal(filtering_gpu._threefry_bits(k1, k2, index.astype(jnp.uint32)),
                                  jax.random.bits(key, (1, 3000), jnp.uint32)[0])
    np.testing.assert_array_equal(filtering_gpu._gumbel_at(k1, k2, index), jax.random.gumbel(key, (1, 3000))[0])


@pytest.mark.codegen_sensitive
@pytest.mark.parametrize("vocab, count", [(1000, 11), (4096, 12)])
def test_the_gpu_top_p_sampler_keeps_the_searchs_set_and_draws_xlas_token(vocab, count):
    """``filtering_gpu.sample_top_p`` in the interpreter, one call over the rows at top-p 0.9, 0.95,
    1e-6 and 1 (a knob per row): its floor is the XLA search's wherever the boundary is decided
    (every row here), its kept mass within its sums' rounding, and its token the one
    ``jax.random.categorical`` draws from the row filtered at that floor with the same key. Rows
    whose boundary bin fits the scratch take the two-read path, the others (4,096 equal logits: more
    than ``CANDIDATES`` in one bin; top-p 1) the full-row search: both are taken."""
    top_ps = (0.9, 0.95, 1e-6, 1.0)
    rows = _rows(vocab, count)
    logits = jnp.asarray(np.concatenate([rows] * len(top_ps)))
    top_p = jnp.repeat(jnp.asarray(top_ps, jnp.float32), count)
    keys = jax.random.split(jax.random.key(3), logits.shape[0])
    run = jax.jit(lambda x, p, k: filtering_gpu.sample_top_p(x, 1.0, p, jax.vmap(jax.random.key_data)(k),
                                                             interpret=True))
    top, floor, kept, token, logprob, fast = [np.asarray(a)[:, 0] for a in run(logits, top_p, keys)]
    np.testing.assert_array_equal(top, np.asarray(logits).max(-1))
    depth = filtering_gpu.summation_depth(vocab)
    for group, p in enumerate(top_ps):
        part = slice(group * count, (group + 1) * count)
        ref_floor, _ = _reference(jnp.asarray(rows), 0, p, filtering.SamplingMode.TOP_P)
        total, margin = _exact(rows, np.ones_like(ref_floor), p)
        if p < 1:
            assert (margin > 2 * gamma(depth + 1) * total).all(), "these cases decide every row"
            assert fast[part].any() and (vocab <= filtering_gpu.CANDIDATES or not fast[part].all()), fast[part]
        else:
            assert not fast[part].any()  # top-p 1 keeps every token: the full-row path
        np.testing.assert_array_equal(floor[part], ref_floor[:, 0], err_msg=f"top-p {p}")
    keys_of = np.asarray(filtering._ordered_key(logits))
    weights = np.exp(np.asarray(logits, np.float64) - np.asarray(logits).max(-1, keepdims=True))
    exact_kept = np.where(keys_of >= floor[:, None], weights, 0.0).sum(-1)
    assert np.all(np.abs(kept - exact_kept) <= gamma(depth) * weights.sum(-1))
    filtered = jnp.where(jnp.asarray(keys_of) >= jnp.asarray(floor)[:, None], logits, -jnp.inf)
    want = jax.vmap(lambda k, row: jax.random.categorical(k, row[None])[0])(keys, filtered)
    np.testing.assert_array_equal(token, want)
    chosen = np.take_along_axis(np.asarray(logits), token[:, None], -1)[:, 0]
    want_logprob = np.minimum(chosen - top - np.log(exact_kept), 0)
    assert np.all(np.abs(logprob - want_logprob) <= 2 * gamma(depth)
                  + 2 * np.spacing(np.maximum(np.abs(want_logprob), 1).astype(np.float32)))


@pytest.mark.integration
@pytest.mark.skipif(bool(target_installed("tpu")), reason=target_installed("tpu") or "installed")
@pytest.mark.parametrize("mode", ["top-p", "top-k+top-p"])
def test_the_v5e_sampler_reads_the_rows_once_in_one_kernel(mode):
    """``sample_tokens`` vmapped over 40 rows of Qwen's vocabulary, compiled by XLA:TPU for a v5e
    (compile-only): the search is one ``sampler_cut_off`` custom call over all 40 rows, declaring
    one read of them; the XLA search's loop is gone (no while loop left: the draw is straight-line)."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compile-only: claim no chip
    from llds_jax.parallel.mesh import make_mesh
    from llds_jax.plan.targets import tpu_target

    mesh = make_mesh((1, 1, 1), [tpu_target("v5e:2x2").devices[0]])  # the platform the sampler sees
    here = jax.NamedSharding(mesh, jax.P())
    rows, vocab = 40, 151_936  # bf16, as a bf16 model's decode step writes them (Decoder.forward_cached)
    logits = jax.ShapeDtypeStruct((rows, vocab), jnp.bfloat16, sharding=here)
    keys = jax.ShapeDtypeStruct((rows,), jax.random.key(0).dtype, sharding=here)
    knobs = [jax.ShapeDtypeStruct((), dtype, sharding=here) for dtype in (jnp.float32, jnp.int32, jnp.float32)]
    sample = jax.vmap(lambda row, key, t, k, p: filtering.sample_tokens(row[None], key, t, k, p,
                                                                         mode=filtering.SamplingMode(mode)),
                      in_axes=(0, 0, None, None, None))
    with jax.set_mesh(mesh):
        hlo = jax.jit(sample).lower(logits, keys, *knobs).compile().as_text()
    calls = [line for line in hlo.splitlines() if "custom-call(" in line and "sampler_cut_off" in line]
    assert len(calls) == 1, calls
    assert f"bf16[{rows},{vocab}]" in calls[0]  # the kernel upcasts as it reads: no fp32 copy for it
    declared = int(re.search(r'bytes_accessed\\?":\\?"(\d+)', calls[0])[1])
    assert declared == rows * vocab * 2 + 6 * rows * 128 * 4  # the rows once; three knob tiles in, three results out
    assert " while(" not in hlo


@pytest.mark.integration
@pytest.mark.skipif(bool(target_installed("gpu")), reason=target_installed("gpu") or "installed")
@pytest.mark.parametrize("mode", ["top-k", "top-p", "top-k+top-p"])
def test_the_h100_sampler_is_one_triton_kernel_named_by_its_reads(mode):
    """``sample_tokens`` vmapped over 320 rows of Qwen's vocabulary, compiled by XLA:GPU for an H100
    (compile-only): the search is one Triton call over all rows, whose name states the reads the
    bench charges (8 passes a search, the first finding the maximum too; top-k alone a kept-mass pass;
    top-p alone: the sampler kernel's two and its scratch, the draw inside it); no while loop and no
    conditional (XLA:GPU would read their predicates back to the host)."""
    from llds_jax.parallel.mesh import make_mesh
    from llds_jax.plan.targets import gpu_target

    mesh = make_mesh((1, 1, 1), [gpu_target("h100", 1, 1).devices[0]])
    here = jax.NamedSharding(mesh, jax.P())
    rows, vocab = 320, 151_936  # bf16, as a bf16 model's decode step writes them (Decoder.forward_cached)
    logits = jax.ShapeDtypeStruct((rows, vocab), jnp.bfloat16, sharding=here)
    keys = jax.ShapeDtypeStruct((rows,), jax.random.key(0).dtype, sharding=here)
    knobs = [jax.ShapeDtypeStruct((), dtype, sharding=here) for dtype in (jnp.float32, jnp.int32, jnp.float32)]
    mode = filtering.SamplingMode(mode)
    sample = jax.vmap(lambda row, key, t, k, p: filtering.sample_tokens(row[None], key, t, k, p, mode=mode),
                      in_axes=(0, 0, None, None, None))
    with jax.set_mesh(mesh):
        hlo = jax.jit(sample).lower(logits, keys, *knobs).compile().as_text()
    calls = [line for line in hlo.splitlines() if "__gpu$xla.gpu.triton" in line]
    assert len(calls) == 1 and f"bf16[{rows},{vocab}]" in calls[0]  # the kernel upcasts as it reads
    assert f"f32[{rows},{vocab}]" not in calls[0]
    if mode is filtering.SamplingMode.TOP_P:  # search and draw in one kernel: no XLA fusion reads the logits
        assert f'sampler_top_p_gpu_2_reads_{filtering_gpu.CANDIDATES}_candidates' in calls[0]
        assert not [line for line in hlo.splitlines() if f"[{rows},{vocab}]" in line and " fusion(" in line]
    else:
        want = {filtering.SamplingMode.TOP_K: 9, filtering.SamplingMode.TOP_K_TOP_P: 16}
        assert f'sampler_cut_off_gpu_{want[mode]}_reads' in calls[0]
        assert filtering_gpu.reads(mode.top_k, mode.top_p) == want[mode]
    assert " while(" not in hlo and not re.search(r"\bconditional\(", hlo)
