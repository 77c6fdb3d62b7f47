"""Temperature / top-k / top-p follow their definitions on a known distribution."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llds_jax.sampling import filtering

filter_logits = jax.jit(filtering.filter_logits)
sample_tokens = jax.jit(filtering.sample_tokens)

PROBS = np.array([0.05, 0.4, 0.1, 0.25, 0.2], np.float64)  # sorted: 1 (.4), 3 (.25), 4 (.2), 2 (.1), 0 (.05)
LOGITS = jnp.asarray(np.log(PROBS)[None, :], jnp.float32)


def kept(logits) -> set[int]:
    return set(np.flatnonzero(np.isfinite(np.asarray(logits)[0])).tolist())


@pytest.mark.parametrize("top_k, expected", [(1, {1}), (2, {1, 3}), (4, {1, 3, 4, 2}), (0, {0, 1, 2, 3, 4}),
                                             (99, {0, 1, 2, 3, 4})])
def test_top_k_keeps_the_k_most_likely_tokens(top_k, expected):
    assert kept(filter_logits(LOGITS, 1.0, top_k, 1.0)) == expected


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


def test_top_k_applies_before_top_p():
    # top-k 2 leaves {.4, .25} renormalised to {.615, .385}: top-p .6 needs only the first.
    assert kept(filter_logits(LOGITS, 1.0, 2, 0.6)) == {1}
    assert kept(filter_logits(LOGITS, 1.0, 2, 0.7)) == {1, 3}


def test_temperature_scales_logits_before_filtering():
    hot = filter_logits(LOGITS, 2.0, 0, 1.0)
    np.testing.assert_allclose(np.asarray(hot), np.asarray(LOGITS) / 2.0, rtol=1e-6)
    # at T=0.5 the top token holds .4²/Σp² = .516 of the mass, so top-p .5 keeps only it
    assert kept(filter_logits(LOGITS, 0.5, 0, 0.5)) == {1}


def test_sampling_frequencies_follow_the_filtered_distribution():
    n = 40_000
    logits = jnp.broadcast_to(LOGITS, (n, 5))
    tokens, logprobs = sample_tokens(logits, jax.random.key(0), 1.0, 0, 0.8)
    counts = np.bincount(np.asarray(tokens), minlength=5) / n
    expected = np.array([0, 0.4, 0, 0.25, 0.2]) / 0.85
    np.testing.assert_allclose(counts, expected, atol=0.01, err_msg=f"frequencies {counts} vs {expected}")
    np.testing.assert_allclose(np.exp(np.asarray(logprobs)), expected[np.asarray(tokens)], rtol=1e-5)


def test_greedy_takes_argmax_and_reports_the_model_logprob():
    tokens, logprobs = sample_tokens(LOGITS, jax.random.key(0), 0.0, 0, 0.5)
    assert int(tokens[0]) == 1
    np.testing.assert_allclose(float(logprobs[0]), np.log(0.4), rtol=1e-5)


def test_sampling_with_a_fixed_key_is_reproducible():
    logits = jax.random.normal(jax.random.key(1), (8, 1000))
    a = sample_tokens(logits, jax.random.key(7), 1.0, 50, 0.9)
    b = sample_tokens(logits, jax.random.key(7), 1.0, 50, 0.9)
    c = sample_tokens(logits, jax.random.key(8), 1.0, 50, 0.9)
    np.testing.assert_array_equal(a[0], b[0])
    assert not np.array_equal(np.asarray(a[0]), np.asarray(c[0]))
