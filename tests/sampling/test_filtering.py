"""Temperature / top-k / top-p follow their definitions on a known distribution."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llds_jax.plan.targets import target_installed
from llds_jax.sampling import filtering

pytestmark = pytest.mark.unit

filter_logits = jax.jit(filtering.filter_logits)
sample_tokens = jax.jit(filtering.sample_tokens)

PROBS = np.array([0.05, 0.4, 0.1, 0.25, 0.2], np.float64)  # sorted: 1 (.4), 3 (.25), 4 (.2), 2 (.1), 0 (.05)
LOGITS = jnp.asarray(np.log(PROBS)[None, :], jnp.float32)


def kept(logits) -> set[int]:
    return set(np.flatnonzero(np.isfinite(np.asarray(logits)[0])).tolist())


@pytest.mark.codegen_sensitive
@pytest.mark.parametrize("top_k, expected", [(1, {1}), (2, {1, 3}), (4, {1, 3, 4, 2}), (0, {0, 1, 2, 3, 4}),
                                             (99, {0, 1, 2, 3, 4})])
def test_top_k_keeps_the_k_most_likely_tokens(top_k, expected):
    assert kept(filter_logits(LOGITS, 1.0, top_k, 1.0)) == expected


@pytest.mark.codegen_sensitive
@pytest.mark.parametrize("top_p, expected", [
    (0.3, {1}),              # 0.4 already reaches 0.3
    (0.39, {1}),
    (0.5, {1, 3}),           # 0.4 < 0.5 → add 0.25
    (0.8, {1, 3, 4}),        # 0.65 < 0.8 → add 0.2 (0.85)
    (0.9, {1, 3, 4, 2}),     # 0.85 < 0.9 → add 0.1
    (1.0, {0, 1, 2, 3, 4}),
])
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_p, expected):
    assert kept(filter_logits(LOGITS, 1.0, 0, top_p)) == expected


@pytest.mark.codegen_sensitive
def test_top_k_applies_before_top_p():
    # top-k 2 leaves {.4, .25} renormalised to {.615, .385}: top-p .6 needs only the first.
    assert kept(filter_logits(LOGITS, 1.0, 2, 0.6)) == {1}
    assert kept(filter_logits(LOGITS, 1.0, 2, 0.7)) == {1, 3}


@pytest.mark.codegen_sensitive
def test_temperature_scales_logits_before_filtering():
    hot = filter_logits(LOGITS, 2.0, 0, 1.0)
    np.testing.assert_allclose(np.asarray(hot), np.asarray(LOGITS) / 2.0, rtol=1e-6)
    # at T=0.5 the top token holds .4²/Σp² = .516 of the mass, so top-p .5 keeps only it
    assert kept(filter_logits(LOGITS, 0.5, 0, 0.5)) == {1}


@pytest.mark.codegen_sensitive
def test_sampling_frequencies_follow_the_filtered_distribution():
    n = 40_000
    logits = jnp.broadcast_to(LOGITS, (n, 5))
    tokens, logprobs = sample_tokens(logits, jax.random.key(0), 1.0, 0, 0.8)
    counts = np.bincount(np.asarray(tokens), minlength=5) / n
    expected = np.array([0, 0.4, 0, 0.25, 0.2]) / 0.85
    np.testing.assert_allclose(counts, expected, atol=0.01, err_msg=f"frequencies {counts} vs {expected}")
    np.testing.assert_allclose(np.exp(np.asarray(logprobs)), expected[np.asarray(tokens)], rtol=1e-5)


@pytest.mark.codegen_sensitive
def test_greedy_takes_argmax_and_reports_the_model_logprob():
    tokens, logprobs = sample_tokens(LOGITS, jax.random.key(0), 0.0, 0, 0.5)
    assert int(tokens[0]) == 1
    np.testing.assert_allclose(float(logprobs[0]), np.log(0.4), rtol=1e-5)


@pytest.mark.codegen_sensitive
def test_sampling_with_a_fixed_key_is_reproducible():
    logits = jax.random.normal(jax.random.key(1), (8, 1000))
    a = sample_tokens(logits, jax.random.key(7), 1.0, 50, 0.9)
    b = sample_tokens(logits, jax.random.key(7), 1.0, 50, 0.9)
    c = sample_tokens(logits, jax.random.key(8), 1.0, 50, 0.9)
    np.testing.assert_array_equal(a[0], b[0])
    assert not np.array_equal(np.asarray(a[0]), np.asarray(c[0]))


# --- the sort-free cut-offs against the definitions and against transformers' warpers -------------

def _kept_mask(logits: np.ndarray, top_k: int, top_p: float, ways: int | None = None) -> np.ndarray:
    if ways is None:  # the platform's own search, through the public entry point
        return np.isfinite(np.asarray(filter_logits(jnp.asarray(logits, jnp.float32), 1.0, top_k, top_p)))
    truncate = jax.jit(filtering._truncate, static_argnames="ways")
    return np.isfinite(np.asarray(truncate(jnp.asarray(logits, jnp.float32), jnp.int32(top_k), jnp.float32(top_p),
                                           ways=ways)))


def _definition(row: np.ndarray, top_k: int, top_p: float) -> tuple[np.ndarray, float]:
    """The kept set by the module docstring's definition, in float64 with a sort; and how far top_p
    is from the nearest cumulative mass (a cut-off closer than fp32 rounding is not decidable)."""
    values, counts = np.unique(row[np.isfinite(row)], return_counts=True)
    values, counts = values[::-1], counts[::-1]  # distinct values, largest first
    if 0 < top_k < row.size:  # down to the k-th largest value; ties with it are kept
        last = np.searchsorted(np.cumsum(counts), top_k) + 1
        values, counts = values[:last], counts[:last]
    mass = counts * np.exp(values - values[0])
    mass /= mass.sum()
    before = np.cumsum(mass) - mass
    keep_values = values[before < top_p] if top_p < 1.0 else values
    floor = keep_values[-1] if keep_values.size else values[0]  # top_p 0: the top token (HF keeps one)
    margin = float(np.min(np.abs(np.cumsum(mass) - top_p))) if 0.0 < top_p < 1.0 else np.inf
    return row >= floor, margin


@pytest.mark.codegen_sensitive
@pytest.mark.parametrize("ways", [2, 32])  # bisection (XLA:CPU) and the 32-way search TPU/GPU run
@pytest.mark.parametrize("vocab", [7, 1000, 49152])
@pytest.mark.parametrize("top_k, top_p", [(0, 0.95), (0, 0.5), (40, 1.0), (40, 0.9), (1, 0.7), (0, 0.0)])
def test_cut_offs_match_the_definition_with_ties_and_masked_tokens(vocab, top_k, top_p, ways):
    rng = np.random.default_rng(vocab + top_k)
    smooth = rng.normal(size=(6, vocab)) * np.array([[0.3], [1.0], [3.0], [8.0], [1.0], [1.0]])
    smooth[4] = np.round(smooth[4] * 2)  # many ties
    smooth[5, rng.random(vocab) < 0.4] = -np.inf  # tokens already filtered out
    logits = smooth.astype(np.float32)
    got = _kept_mask(logits, top_k, top_p, ways)
    for row, kept_row in zip(logits.astype(np.float64), got):
        want, margin = _definition(row, top_k, top_p)
        if margin < 1e-5:  # our masses are pairwise fp32 sums, off by ≲ log2(V)·eps ≈ 1e-6
            continue  # within rounding of the boundary: either answer is right
        np.testing.assert_array_equal(kept_row, want)
        assert kept_row.any(), "at least the top token is always kept"


@pytest.mark.codegen_sensitive
def test_top_p_one_keeps_every_token_after_top_k():
    """A wide top-k with top-p 1 keeps the whole row (the sort-based filter used to drop tail tokens
    whose cumulative mass rounded to 1.0 and so failed ``mass_before < 1``)."""
    logits = np.random.default_rng(3).normal(size=(4, 49152)).astype(np.float32) * 6
    assert _kept_mask(logits, 49152 + 5, 1.0).all()
    assert _kept_mask(logits, 0, 1.0).all()


def _search_passes(device=None) -> set[str]:
    """Trip counts of the while loops in top-p filtering compiled for ``device`` (default: this host)."""
    from llds_jax.parallel.mesh import make_mesh

    mesh = make_mesh((1, 1, 1), [device or jax.devices()[0]])
    logits = jax.ShapeDtypeStruct((8, 1000), jnp.float32, sharding=jax.NamedSharding(mesh, jax.P()))
    with jax.set_mesh(mesh):
        hlo = jax.jit(lambda x: filtering.filter_logits(x, 1.0, 0, 0.9)).lower(logits).compile().as_text()
    return set(re.findall(r'"known_trip_count":\{"n":"(\d+)"\}', hlo))


def test_xla_cpu_bisects_in_32_passes():
    assert _search_passes() == {"32"}


@pytest.mark.integration
@pytest.mark.skipif(bool(target_installed("gpu")), reason=target_installed("gpu") or "installed")
def test_xla_gpu_searches_32_ways_in_7_passes():
    """Compiled for an H100 from this host (the compile-only target ``--mode=plan`` uses)."""
    from llds_jax.plan.targets import gpu_target

    assert _search_passes(gpu_target("h100", 1, 1).devices[0]) == {"7"}


@pytest.mark.codegen_sensitive
@pytest.mark.parametrize("top_k, top_p", [(0, 0.95), (0, 0.6), (50, 1.0), (50, 0.8), (7, 0.99)])
def test_kept_sets_match_transformers_warpers(top_k, top_p):
    """transformers' TopKLogitsWarper then TopPLogitsWarper (what HF ``generate`` runs) keep the same
    tokens on tie-free logits, apart from rows whose cut-off is within fp32 rounding."""
    torch = pytest.importorskip("torch")
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    logits = (np.random.default_rng(top_k).normal(size=(16, 32000)) * 8.0).astype(np.float32)
    scores = torch.as_tensor(logits)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    theirs = torch.isfinite(scores).numpy()
    ours = _kept_mask(logits, top_k, top_p)
    compared = 0
    for row, ours_row, theirs_row in zip(logits.astype(np.float64), ours, theirs):
        if _definition(row, top_k, top_p)[1] < 1e-4:
            continue
        np.testing.assert_array_equal(ours_row, theirs_row)
        compared += 1
    assert compared >= 12


# --- static sampling modes: sort-based reference on adversarial ties, frequencies, no conditionals ----

MODES = {  # (temperature, top_k, top_p) → the mode SamplingParams.create derives
    "greedy": (0.0, 0, 1.0), "temperature": (0.7, 0, 1.0), "top-k": (1.0, 3, 1.0), "top-p": (1.0, 0, 0.8),
    "top-k+top-p": (1.3, 4, 0.7)}


def test_the_mode_follows_the_knobs():
    assert {name: filtering.SamplingMode.of(*knobs).value for name, knobs in MODES.items()} == \
        {name: name for name in MODES}
    assert filtering.resolve_mode(None, 1.0, jnp.int32(3), 0.9) is filtering.SamplingMode.TOP_K_TOP_P
    seen = []
    jax.jit(lambda p: seen.append(filtering.resolve_mode(None, 1.0, 0, p)) or p)(0.9)
    assert seen == [filtering.SamplingMode.ANY], "traced knobs pick their filters at run time"


def _sort_reference(logits: jax.Array, top_k: int, top_p: float) -> np.ndarray:
    """Kept tokens by sorting (HF / vLLM order, ties with the last kept kept), fp32; and each row's
    distance from top_p to the nearest cumulative mass (closer than rounding: undecidable)."""
    vocab = logits.shape[-1]
    x = logits.astype(jnp.float32)
    descending = -jnp.sort(-x, axis=-1)
    if 0 < top_k < vocab:
        x = jnp.where(x >= descending[:, top_k - 1:top_k], x, -jnp.inf)
        descending = -jnp.sort(-x, axis=-1)
    floor = jnp.full_like(descending[:, :1], -jnp.inf)  # no top-p: keep every token top-k left
    margin = np.full((x.shape[0],), np.inf)
    if top_p < 1.0:
        probs = jax.nn.softmax(descending, axis=-1)
        cumulative = jnp.cumsum(probs, axis=-1)
        kept = (cumulative - probs < top_p).at[:, 0].set(True)  # at least the top token
        floor = jnp.min(jnp.where(kept, descending, jnp.inf), axis=-1, keepdims=True)
        margin = np.min(np.abs(np.asarray(cumulative) - top_p), axis=-1)
    return np.asarray(x >= floor) & np.isfinite(np.asarray(x)), margin


def _adversarial_rows(vocab: int) -> np.ndarray:
    rng = np.random.default_rng(vocab)
    rows = [np.zeros(vocab)]                                    # all equal
    cut = np.full(vocab, -2.0)
    cut[0], cut[1:vocab // 2] = 3.0, 1.0                        # a block of equal logits at any cut
    rows.append(cut)
    masked = rng.normal(size=vocab) * 2
    masked[rng.random(vocab) < 0.5] = -np.inf                   # filtered out already
    masked[0] = 4.0
    rows.append(masked)
    rows.append(np.round(rng.normal(size=vocab) * 1.5))         # many ties everywhere
    rows.append(np.where(np.arange(vocab) < 3, 7.0, -np.inf))   # three equal tokens, the rest -inf
    return np.stack(rows).astype(np.float32)


@pytest.mark.parametrize("vocab", [9, 512])
@pytest.mark.parametrize("top_k", [0, 1, 5, "V"])
@pytest.mark.parametrize("top_p", [1e-6, 0.35, 0.9, 1.0])
def test_every_mode_keeps_the_sorted_reference_set_on_ties(vocab, top_k, top_p):
    top_k = vocab if top_k == "V" else top_k
    logits = jnp.asarray(_adversarial_rows(vocab))
    want, margin = _sort_reference(logits, top_k, top_p)
    mode = filtering.SamplingMode.of(1.0, top_k, top_p)
    static = jax.jit(filtering.filter_logits, static_argnames="mode")
    masks = {"own": static(logits, 1.0, top_k, top_p, mode=mode),
             "any": static(logits, 1.0, top_k, top_p, mode=filtering.SamplingMode.ANY)}
    truncate = jax.jit(filtering._truncate, static_argnames=("ways", "mode"))
    for ways in (2, 32):  # XLA:CPU's bisection and TPU/GPU's 32-way search, on this host
        masks[f"{ways} ways"] = truncate(logits, top_k, top_p, ways=ways, mode=mode)
    for name, filtered in masks.items():
        got = np.isfinite(np.asarray(filtered))
        for row, (g, w, m) in enumerate(zip(got, want, margin)):
            if m < 1e-6:
                continue  # top_p within rounding of a cumulative mass: either answer is right
            np.testing.assert_array_equal(g, w, err_msg=f"{name}, mode {mode.value}, row {row}")
    decided = margin >= 1e-6
    assert decided.sum() >= 3, f"the cases must decide most rows ({margin})"


def _six_token_row(temperature, top_k, top_p):
    """A 6-token row's logits [1, 6] and its filtered, renormalised distribution (the sort-based definition)."""
    logits = np.log(np.array([0.3, 0.22, 0.18, 0.12, 0.1, 0.08]))[None].astype(np.float32)
    scaled = logits[0].astype(np.float64) / temperature
    kept = _sort_reference(jnp.asarray(logits / temperature), top_k, top_p)[0][0]
    want = np.where(kept, np.exp(scaled - scaled.max()), 0.0)
    return logits, want / want.sum()


@pytest.mark.parametrize("mode", ["temperature", "top-k", "top-p", "top-k+top-p"])
def test_sampled_frequencies_match_the_filtered_softmax(mode):
    """4,000 draws from a 6-token row: every token's frequency within 4.5 binomial standard
    deviations of its filtered, renormalised probability (fixed seed: a fluke fails forever or never)."""
    temperature, top_k, top_p = MODES[mode]
    logits, want = _six_token_row(temperature, top_k, top_p)
    n = 4000
    draw = jax.jit(filtering.sample_tokens, static_argnames="mode")
    tokens, logprobs = draw(jnp.broadcast_to(jnp.asarray(logits), (n, 6)), jax.random.key(2024), temperature, top_k,
                            top_p, mode=filtering.SamplingMode(mode))
    tokens = np.asarray(tokens)
    freq = np.bincount(tokens, minlength=6) / n
    bound = 4.5 * np.sqrt(want * (1 - want) / n) + 1e-12
    assert np.all(np.abs(freq - want) <= bound), f"{mode}: frequencies {freq} vs {want} (bound {bound})"
    assert (want > 0).sum() < 6 or mode == "temperature", "the case must filter something"
    np.testing.assert_allclose(np.exp(np.asarray(logprobs)), want[tokens], rtol=1e-5)


CONDITIONAL = re.compile(r"\bconditional\(")  # the op (HLO text also holds source names)


def _compiled_sampler(mode: str, device=None) -> str:
    from llds_jax.parallel.mesh import make_mesh

    mesh = make_mesh((1, 1, 1), [device or jax.devices()[0]])
    replicated = jax.NamedSharding(mesh, jax.P())
    logits = jax.ShapeDtypeStruct((4, 1000), jnp.float32, sharding=replicated)
    knobs = [jax.ShapeDtypeStruct((), dtype, sharding=replicated) for dtype in (jnp.float32, jnp.int32, jnp.float32)]
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=replicated)
    with jax.set_mesh(mesh):
        return jax.jit(filtering.sample_tokens, static_argnames="mode").lower(
            logits, key, *knobs, mode=filtering.SamplingMode(mode)).compile().as_text()


@pytest.mark.parametrize("mode", [*MODES, "any"])
def test_compiled_samplers_hold_no_conditional(mode):
    """Traced knobs, static mode: no ``conditional`` (XLA:GPU reads its predicate back to the host).
    Greedy runs no loop at all (no draw, no search); each filter adds one search loop."""
    hlo = _compiled_sampler(mode)
    assert not CONDITIONAL.search(hlo)
    searches = re.findall(r'"known_trip_count":\{"n":"32"\}', hlo)  # XLA:CPU bisects in 32 passes
    assert len(searches) == {"greedy": 0, "temperature": 0, "top-k": 1, "top-p": 1, "top-k+top-p": 2, "any": 2}[mode]
    if mode == "greedy":
        assert " while(" not in hlo, "a greedy program draws no noise and searches nothing"


@pytest.mark.integration
@pytest.mark.skipif(bool(target_installed("gpu")), reason=target_installed("gpu") or "installed")
@pytest.mark.parametrize("mode", ["greedy", "top-p", "top-k+top-p"])
def test_xla_gpu_samplers_hold_no_conditional(mode):
    from llds_jax.plan.targets import gpu_target

    hlo = _compiled_sampler(mode, gpu_target("h100", 1, 1).devices[0])
    assert not CONDITIONAL.search(hlo)
    # the searches run inside one Triton kernel (filtering_gpu): no XLA loop is left
    assert " while(" not in hlo
    assert hlo.count("__gpu$xla.gpu.triton") == {"greedy": 0, "top-p": 1, "top-k+top-p": 1}[mode]


@pytest.mark.parametrize("mode", ["top-p", "top-k+top-p"])
def test_the_accelerator_search_carries_the_kept_mass_as_the_log_prob_normaliser(monkeypatch, mode):
    """TPU/GPU (32 ways) take the draw's normaliser from the top-p search's last statistic, the mass
    above the cut-off it found, instead of summing the kept tokens again: forced on this host, the
    log-probs are the filtered softmax's to fp32 rounding (a few ulps of a sum over the row), and
    the draws follow it (4.5 binomial standard deviations, fixed seed)."""
    monkeypatch.setattr(filtering, "search_ways", lambda: 32)
    temperature, top_k, top_p = MODES[mode]
    logits, want = _six_token_row(temperature, top_k, top_p)
    n = 4000
    # a function of its own: jax.jit's trace cache must not hand back another test's 2-way trace
    draw = jax.jit(lambda *args, mode: filtering.sample_tokens(*args, mode=mode), static_argnames="mode")
    tokens, logprobs = draw(jnp.broadcast_to(jnp.asarray(logits), (n, 6)), jax.random.key(2024), temperature, top_k,
                            top_p, mode=filtering.SamplingMode(mode))
    tokens = np.asarray(tokens)
    freq = np.bincount(tokens, minlength=6) / n
    bound = 4.5 * np.sqrt(want * (1 - want) / n) + 1e-12
    assert np.all(np.abs(freq - want) <= bound), f"{mode}: frequencies {freq} vs {want} (bound {bound})"
    np.testing.assert_allclose(np.asarray(logprobs), np.log(want[tokens]), rtol=0, atol=8 * np.finfo(np.float32).eps)
    # a wide row: the carried mass against the normaliser summed over the kept set
    wide = jnp.asarray(np.random.default_rng(5).normal(size=(4, 49152)).astype(np.float32) * 3)
    tokens, logprobs = draw(wide, jax.random.key(1), temperature, top_k, top_p, mode=filtering.SamplingMode(mode))
    filtered = np.asarray(jax.jit(lambda *args: filtering.filter_logits(*args))(wide, temperature, top_k, top_p),
                          np.float64)
    top = filtered.max(axis=-1, keepdims=True)
    reference = filtered - top - np.log(np.exp(filtered - top).sum(axis=-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(logprobs), np.take_along_axis(reference, np.asarray(tokens)[:, None], -1)[:, 0],
                               rtol=0, atol=64 * np.finfo(np.float32).eps)


def test_the_draws_signed_keys_keep_the_same_tokens_as_the_search_keys():
    """The TPU/GPU draw tests ``_signed_key(x) >= _signed(floor)`` instead of ``_ordered_key(x) >= floor``:
    the same set for every logit (signed zeros, subnormals, ±inf) and every floor a search can end on
    (key 1, keys next to logits' keys, random keys), both computed by XLA as the sampler computes them."""
    rng = np.random.default_rng(11)
    special = np.array([0.0, -0.0, np.inf, -np.inf, 1e-45, -1e-45, 1e-38, -3.4e38, 3.4e38], np.float32)
    x = np.concatenate([special, (rng.normal(size=4000) * rng.choice([1e-30, 1e-3, 1.0, 1e3], 4000)).astype(np.float32)])
    keys = np.asarray(filtering._ordered_key(jnp.asarray(x)))
    floors = np.unique(np.concatenate([keys, keys + 1, keys - 1, [1, 2, 0x007FFFFF, 0x00800000, 0xFFFFFFFF],
                                       rng.integers(1, 2**32, 2000, dtype=np.uint64)]).astype(np.uint32))

    @jax.jit
    def both(x, floors):
        return (filtering._ordered_key(x)[None, :] >= floors[:, None],
                filtering._signed_key(x)[None, :] >= filtering._signed(floors)[:, None])

    by_key, by_signed = map(np.asarray, both(jnp.asarray(x), jnp.asarray(floors)))
    bad = np.argwhere(by_key != by_signed)
    assert bad.size == 0, f"floor {floors[bad[0][0]]:#x} on logit {x[bad[0][1]]!r}"
