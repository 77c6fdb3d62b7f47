"""The batch-invariant row sums and maxima the sampler, the norms and the attention rely on
(``models.reductions``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llds_jax.models.reductions import log_softmax, log_softmax_at, row_max, row_sum, row_sum_of

pytestmark = [pytest.mark.unit, pytest.mark.codegen_sensitive]

F32_EPS = float(np.finfo(np.float32).eps)


@pytest.mark.parametrize("width", [1, 2, 3, 7, 64, 576, 49152, 151936])
def test_row_sum_is_the_sum(width):
    x = np.random.default_rng(width).normal(size=(3, width)).astype(np.float32)
    got = np.asarray(jax.jit(row_sum)(jnp.asarray(x)), np.float64)
    want = x.astype(np.float64).sum(axis=-1)
    # a pairwise tree: each sum rounds at most ⌈log2 width⌉ + 1 times, each by ≤ eps of |x| summed
    bound = (np.ceil(np.log2(width)) + 1) * F32_EPS * np.abs(x).astype(np.float64).sum(axis=-1)
    assert np.all(np.abs(got - want) <= bound), (got - want, bound)


@pytest.mark.parametrize("width", [576, 49152])
def test_a_rows_sum_does_not_depend_on_how_many_rows_there_are(width):
    """Bit for bit, on XLA:CPU, whose own reductions pick kernels by the row count."""
    rows = np.random.default_rng(0).normal(size=(64, width)).astype(np.float32) * 3
    alone = [np.asarray(jax.jit(row_sum)(jnp.asarray(rows[i:i + 1])))[0] for i in range(4)]
    for count in (4, 16, 64):
        together = np.asarray(jax.jit(row_sum)(jnp.asarray(rows[:count])))
        np.testing.assert_array_equal(together[:4], alone)


@pytest.mark.parametrize("width", [1, 2, 3, 7, 1187, 49152, 151936])
def test_row_sum_of_an_elementwise_function_is_row_sum_of_its_output_bit_for_bit(width):
    """The top-p search's masked sums, with a broadcast operand (the candidates) and a mask that
    keeps about half of each row, through the fused first level and through ``row_sum``."""
    rng = np.random.default_rng(width)
    keys = jnp.asarray(rng.integers(0, 2 ** 32, size=(4, 1, width), dtype=np.uint32))
    weights = jnp.asarray(rng.random(size=(4, 1, width)).astype(np.float32))
    cuts = jnp.asarray(rng.integers(2 ** 30, 3 * 2 ** 30, size=(4, 3, 1), dtype=np.uint32))

    def masked(k, c, w):
        return jnp.where(k > c, w, 0.0)

    fused = jax.jit(lambda *xs: row_sum_of(masked, *xs, keepdims=True))(keys, cuts, weights)
    plain = jax.jit(lambda *xs: row_sum(masked(*xs), keepdims=True))(keys, cuts, weights)
    assert fused.shape == plain.shape == (4, 3, 1)
    np.testing.assert_array_equal(np.asarray(fused), np.asarray(plain))
    if width > 7:  # the masks differ per candidate: a sum that ignored the cut would not
        assert len(np.unique(np.asarray(plain))) > 4


def test_log_softmax_at_is_log_softmax_then_take_bit_for_bit():
    x = jnp.asarray(np.random.default_rng(1).normal(size=(8, 49152)).astype(np.float32) * 4)
    index = jnp.asarray(np.random.default_rng(2).integers(0, 49152, size=8), jnp.int32)
    full = jax.jit(log_softmax)(x)
    np.testing.assert_array_equal(np.asarray(jax.jit(log_softmax_at)(x, index)),
                                  np.asarray(jnp.take_along_axis(full, index[:, None], axis=-1)[:, 0]))


@pytest.mark.parametrize("width", [1, 2, 3, 7, 128, 320, 1187])
def test_row_max_is_the_max_wherever_it_sits(width):
    """Exact, odd widths included: the maximum is planted at every position of some row."""
    x = np.random.default_rng(width).normal(size=(width, width)).astype(np.float32)
    x[np.arange(width), np.arange(width)] = 10.0 + np.arange(width)
    np.testing.assert_array_equal(np.asarray(jax.jit(row_max)(jnp.asarray(x))), x.max(axis=-1))
    np.testing.assert_array_equal(np.asarray(jax.jit(row_max)(jnp.asarray(x[:, None, :])))[:, 0], x.max(axis=-1))
