"""Actions are maximal runs of action tokens; the A-gate needs their ids and per-run sums."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rl_torch_reference import action_runs

from llds_jax import rl

pytestmark = pytest.mark.unit


def test_feedback_spans_split_a_row_into_numbered_actions():
    mask = jnp.array([[0, 1, 1, 0, 0, 1, 0, 1, 1, 0], [1, 1, 1, 1, 0, 0, 0, 0, 0, 0]], jnp.float32)
    np.testing.assert_array_equal(
        np.asarray(rl.action_run_ids(mask)),
        [[-1, 0, 0, -1, -1, 1, -1, 2, 2, -1], [0, 0, 0, 0, -1, -1, -1, -1, -1, -1]],
    )


def test_a_change_of_action_index_splits_adjacent_actions():
    mask = jnp.ones((1, 6), jnp.float32)
    index = jnp.array([[0, 0, 1, 1, 1, 2]])
    np.testing.assert_array_equal(np.asarray(rl.action_run_ids(mask, index)), [[0, 0, 1, 1, 1, 2]])
    np.testing.assert_array_equal(np.asarray(rl.action_run_ids(mask)), [[0, 0, 0, 0, 0, 0]])


@pytest.mark.codegen_sensitive
def test_sum_over_runs_gives_each_action_token_its_run_total_and_zero_elsewhere():
    mask = jnp.array([[1, 1, 0, 1, 0, 1]], jnp.float32)
    values = jnp.array([[1.0, 2.0, 100.0, 4.0, 100.0, -8.0]])
    got = rl.sum_over_runs(values, rl.action_run_ids(mask))
    np.testing.assert_array_equal(np.asarray(got), [[3.0, 3.0, 0.0, 4.0, 0.0, -8.0]])


_run_sums = jax.jit(lambda values, mask: rl.sum_over_runs(values, rl.action_run_ids(mask)))


@pytest.mark.codegen_sensitive
@settings(max_examples=40, deadline=None)
@given(
    mask=st.lists(st.lists(st.integers(0, 1), min_size=12, max_size=12), min_size=3, max_size=3),
    seed=st.integers(0, 2**31 - 1),
)
def test_run_sums_match_a_loop_over_runs(mask, seed):
    mask = np.asarray(mask, np.float32)
    values = np.random.default_rng(seed).normal(size=mask.shape).astype(np.float32)
    want = np.zeros_like(values)
    for b in range(mask.shape[0]):
        for run in action_runs(mask[b]):
            want[b, run] = values[b, run].sum()
    np.testing.assert_allclose(np.asarray(_run_sums(values, mask)), want, rtol=1e-6, atol=1e-6)
