"""Group-relative advantages: GRPO / Dr. GRPO / RLOO against a loop-over-groups numpy reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llds_jax import rl

pytestmark = pytest.mark.unit


def numpy_advantages(rewards, group_ids, valid, estimator, eps=1e-6, unbiased_std=True):
    """SPEC §4 read literally, one group at a time."""
    out = np.zeros_like(rewards)
    for g in np.unique(group_ids[valid]):
        members = np.flatnonzero((group_ids == g) & valid)
        r = rewards[members].astype(np.float64)
        n = len(r)
        if n == 1:
            mean, std = 0.0, 1.0
        else:
            mean, std = r.mean(), r.std(ddof=1 if unbiased_std else 0)
        if n > 1 and np.all(r == r[0]):
            out[members] = 0.0
        elif estimator == "grpo":
            out[members] = (r - mean) / (std + eps)
        elif estimator == "dr_grpo":
            out[members] = r - mean
        else:
            out[members] = (r - mean) * (n / (n - 1) if n > 1 else 1.0)
    return out


def random_groups(seed, n=24):
    rng = np.random.default_rng(seed)
    rewards = rng.choice([0.0, 1.0, 0.3, 0.7], size=n).astype(np.float32)
    group_ids = rng.integers(0, 7, size=n) * 1_000_003  # sparse, arbitrary keys (prompt uids)
    valid = rng.random(n) > 0.2
    return rewards, group_ids, valid


@pytest.mark.codegen_sensitive
@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("unbiased_std", [True, False])
def test_estimators_match_loop_over_groups_reference(estimator, unbiased_std):
    fn = jax.jit(
        lambda r, g, v: rl.compute_advantages(r, g, v, estimator=estimator, unbiased_std=unbiased_std)
    )
    for seed in range(4):
        rewards, group_ids, valid = random_groups(seed)
        got = np.asarray(fn(rewards, group_ids, valid))
        want = numpy_advantages(rewards, group_ids, valid, estimator, unbiased_std=unbiased_std)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5, err_msg=f"{estimator} seed={seed}")
    assert fn._cache_size() == 1, "compute_advantages must jit once per shape"


@pytest.mark.codegen_sensitive
def test_grpo_uses_unbiased_std_by_default():
    got = rl.compute_advantages(jnp.array([1.0, 0.0]), jnp.array([5, 5]), jnp.array([True, True]))
    std = np.std([1.0, 0.0], ddof=1)
    np.testing.assert_allclose(np.asarray(got), [0.5 / (std + 1e-6), -0.5 / (std + 1e-6)], rtol=1e-6)


@pytest.mark.codegen_sensitive
def test_group_of_one_has_mean_zero_and_std_one():
    got = rl.compute_advantages(jnp.array([1.0, 0.0]), jnp.array([0, 1]), jnp.array([True, True]))
    np.testing.assert_allclose(np.asarray(got), [1.0 / (1.0 + 1e-6), 0.0], rtol=1e-7)


@pytest.mark.codegen_sensitive
def test_constant_reward_group_gets_exactly_zero_even_for_inexact_floats():
    rewards = jnp.full((5,), 0.1, jnp.float32)  # 0.1 is inexact: a float std would be ~1e-9, not 0
    got = rl.compute_advantages(rewards, jnp.zeros(5, jnp.int32), jnp.ones(5, bool))
    assert np.all(np.asarray(got) == 0.0), got


@pytest.mark.codegen_sensitive
def test_padding_rows_get_zero_and_do_not_shift_their_group():
    rewards = jnp.array([1.0, 0.0, 1.0, 100.0])
    group_ids = jnp.array([3, 3, 3, 3])
    valid = jnp.array([True, True, True, False])
    got = np.asarray(rl.compute_advantages(rewards, group_ids, valid))
    want = numpy_advantages(np.asarray(rewards), np.asarray(group_ids), np.asarray(valid), "grpo")
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert got[3] == 0.0


@pytest.mark.codegen_sensitive
def test_two_prompts_with_different_ids_are_never_merged():
    rewards = jnp.array([1.0, 1.0, 0.0, 0.0])
    got = rl.compute_advantages(rewards, jnp.array([10, 10, 11, 11]), jnp.ones(4, bool))
    assert np.all(np.asarray(got) == 0.0), f"each prompt's group is constant, got {got}"


def test_unknown_estimator_lists_known_ones():
    with pytest.raises(ValueError, match="dr_grpo, grpo, reinforce_pp, rloo"):
        rl.compute_advantages(jnp.ones(2), jnp.zeros(2, jnp.int32), jnp.ones(2, bool), estimator="ppo")


_grpo = jax.jit(lambda r, g, v: rl.compute_advantages(r, g, v))


@pytest.mark.codegen_sensitive
@settings(max_examples=30, deadline=None)
@given(
    rewards=st.lists(st.sampled_from([0.0, 0.25, 1.0]), min_size=16, max_size=16),
    groups=st.lists(st.integers(0, 4), min_size=16, max_size=16),
    valid=st.lists(st.booleans(), min_size=16, max_size=16),
    perm_seed=st.integers(0, 2**31 - 1),
)
def test_grpo_advantages_sum_to_zero_per_group_and_follow_row_permutations(rewards, groups, valid, perm_seed):
    rewards, groups, valid = np.asarray(rewards, np.float32), np.asarray(groups), np.asarray(valid)
    adv = np.asarray(_grpo(rewards, groups, valid))
    for g in np.unique(groups[valid]):
        members = (groups == g) & valid
        if members.sum() > 1:
            assert abs(adv[members].sum()) < 1e-4, (g, adv[members])
    assert np.all(adv[~valid] == 0.0)
    perm = np.random.default_rng(perm_seed).permutation(16)
    np.testing.assert_allclose(
        np.asarray(_grpo(rewards[perm], groups[perm], valid[perm])), adv[perm], rtol=1e-6, atol=1e-6
    )
