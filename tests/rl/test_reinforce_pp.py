"""REINFORCE++ advantages against the paper's equations 8-10, written out here in numpy.

Hu et al. 2025 (arXiv:2501.03262): A_t = r − β Σ_{i≥t} KL_i, KL_i = log π_old(y_i) − log π_SFT(y_i),
then (A − mean) / std over every action token of the batch (OpenRLHF: biased variance, 1e-8 floor).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llds_jax import rl
from llds_jax.rl.advantages import ADVANTAGE_ESTIMATORS, reinforce_pp_token_advantages, row_summary

pytestmark = pytest.mark.unit


def reference(rewards, mask, old, ref, beta, row_weight):
    """Eqs. 8-10 token by token, with explicit loops (no cumsum)."""
    n, t = mask.shape
    m = mask * row_weight[:, None]
    adv = np.zeros((n, t))
    for i in range(n):
        for j in range(t):
            kl_to_go = sum((old[i, k] - ref[i, k]) * m[i, k] for k in range(j, t))
            adv[i, j] = rewards[i] - beta * kl_to_go
    mean = (adv * m).sum() / m.sum()
    std = np.sqrt((((adv - mean) ** 2) * m).sum() / m.sum())
    return (adv - mean) / std * m


def batch(seed=0, n=6, t=7):
    rng = np.random.default_rng(seed)
    mask = (rng.random((n, t)) < 0.7).astype(np.float32)
    mask[:, 1] = 1.0
    old = -rng.random((n, t)).astype(np.float32) * 2
    ref = old - rng.normal(0, 0.3, (n, t)).astype(np.float32)
    rewards = (rng.random(n) < 0.5).astype(np.float32)
    rewards[:2] = 1.0  # rows 0-1: an all-correct group
    rewards[2:4] = (0.0, 1.0)  # a mixed group
    row_weight = np.ones(n, np.float32)
    row_weight[-1] = 0.0  # a padding row
    return rewards, mask, old, ref, row_weight


def test_registered_beside_the_group_estimators():
    assert {"grpo", "dr_grpo", "rloo", "reinforce_pp"} <= set(ADVANTAGE_ESTIMATORS.names())
    cfg = rl.default_config()
    cfg.advantage_estimator = "reinforce_pp"
    rl.validate(cfg)


@pytest.mark.codegen_sensitive
@pytest.mark.parametrize("beta", [0.0, 0.05, 1.0])
def test_token_advantages_match_the_paper(beta):
    rewards, mask, old, ref, row_weight = batch(1)
    returns = rl.compute_advantages(jnp.asarray(rewards), jnp.array([0, 0, 1, 1, 2, 2]), jnp.asarray(row_weight > 0),
                                    estimator="reinforce_pp")
    got = reinforce_pp_token_advantages(returns, jnp.asarray(mask), jnp.asarray(old), jnp.asarray(ref), beta,
                                        jnp.asarray(row_weight))
    want = reference(rewards * row_weight, mask, old, ref, beta, row_weight)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    m = mask * row_weight[:, None]
    assert abs((np.asarray(got) * m).sum() / m.sum()) < 1e-5  # globally centred
    if beta > 0:  # the KL-to-go makes advantages vary inside a row
        assert np.ptp(np.asarray(got)[2][mask[2] > 0]) > 1e-4


@pytest.mark.codegen_sensitive
def test_an_all_equal_group_keeps_its_signal_unlike_grpo():
    rewards, mask, old, ref, row_weight = batch(2)
    groups = jnp.array([0, 0, 1, 1, 2, 2])
    grpo = rl.compute_advantages(jnp.asarray(rewards), groups, jnp.asarray(row_weight > 0))
    returns = rl.compute_advantages(jnp.asarray(rewards), groups, jnp.asarray(row_weight > 0), estimator="reinforce_pp")
    assert np.all(np.asarray(grpo)[:2] == 0.0)
    token = reinforce_pp_token_advantages(returns, jnp.asarray(mask), jnp.asarray(old), None, 0.1,
                                          jnp.asarray(row_weight))
    assert np.all(np.asarray(row_summary(token, jnp.asarray(mask)))[:2] != 0.0)


@pytest.mark.codegen_sensitive
def test_advantages_carry_no_gradient_into_the_log_probs():
    rewards, mask, old, ref, row_weight = batch(3)
    grad = jax.grad(lambda o: reinforce_pp_token_advantages(jnp.asarray(rewards), jnp.asarray(mask), o,
                                                            jnp.asarray(ref), 0.5, jnp.asarray(row_weight)).sum())(
        jnp.asarray(old))
    assert np.all(np.asarray(grad) == 0.0)


@pytest.mark.codegen_sensitive
def test_the_objective_reads_token_advantages_as_given():
    """Token-level advantages enter the pg term per token: on-policy ∂loss/∂logp_t = −A_t / Σ mask."""
    rewards, mask, old, ref, row_weight = batch(4)
    adv = reinforce_pp_token_advantages(jnp.asarray(rewards), jnp.asarray(mask), jnp.asarray(old), jnp.asarray(ref),
                                        0.2, jnp.asarray(row_weight))
    cfg = rl.default_config()
    cfg.update({"advantage_estimator": "reinforce_pp", "kl_coef": 0.0, "entropy_coef": 0.0, "llds_coef": 0.0})
    masks = rl.LossMasks(action_mask=jnp.asarray(mask), row_weight=jnp.asarray(row_weight))
    grad = jax.grad(lambda lp: rl.objective(lp, jnp.asarray(old), None, None, adv, masks, cfg)[0])(jnp.asarray(old))
    m = mask * row_weight[:, None]
    np.testing.assert_allclose(np.asarray(grad), -np.asarray(adv) * m / m.sum(), rtol=1e-5, atol=1e-8)
