"""Rollout correction against verl's formulas, written out here in numpy (values and gradients).

verl (``rollout_corr_helper.py``): δ = log π_old − log π_rollout; token ρ_t = exp(clip(δ_t, ±20)),
sequence ρ = exp(clip(Σ_t δ_t, ±20)); TIS weight min(ρ, C) on the policy-gradient loss; masked IS
drops tokens (rows) with ρ outside [lower, C] from the response mask (so from every denominator).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llds_jax import rl
from llds_jax.rl.config import RLConfigError
from llds_jax.rl.rollout_correction import host_metrics, rollout_correction

pytestmark = pytest.mark.unit

B, T = 4, 6


def make_cfg(**overrides):
    cfg = rl.default_config()
    cfg.update({"kl_coef": 0.0, "entropy_coef": 0.0, "llds_coef": 0.0, **overrides})
    return cfg


def sample(seed=0):
    rng = np.random.default_rng(seed)
    mask = (rng.random((B, T)) < 0.8).astype(np.float32)
    mask[:, 0] = 1.0
    delta = rng.normal(0.0, 0.8, (B, T)).astype(np.float32)
    delta[0, 1] = 30.0  # beyond verl's SAFETY_BOUND
    old = -rng.random((B, T)).astype(np.float32) * 3
    adv = rng.normal(size=B).astype(np.float32)
    return mask, delta, old, adv


def reference_weights(delta, mask, mode, cap, lower=0.0):
    """(weight, keep) as verl defines them, per token; rows of a sequence mode share one value."""
    if mode.startswith("seq"):
        rho = np.exp(np.clip((delta * mask).sum(axis=1, keepdims=True), -20, 20)) * np.ones_like(delta)
    else:
        rho = np.exp(np.clip(delta, -20, 20))
    if mode.endswith("tis"):
        return np.minimum(rho, cap) * mask, mask
    keep = ((rho >= lower) & (rho <= cap)) * mask
    return np.minimum(rho, cap) * keep, keep


def pg_loss_and_grad(cfg, mask, delta, old, adv):
    """The objective's token-mean pg term and d/d logp, evaluated on-policy (logp = old: ratio 1)."""
    masks = rl.LossMasks(action_mask=jnp.asarray(mask), rollout_log_ratio=jnp.asarray(delta))

    def loss(logp):
        return rl.objective(logp, jnp.asarray(old), None, None, jnp.asarray(adv), masks, cfg)[0]

    value, grad = jax.value_and_grad(loss)(jnp.asarray(old))
    return float(value), np.asarray(grad)


@pytest.mark.codegen_sensitive
@pytest.mark.parametrize("mode", ["tis", "seq_tis", "mis", "seq_mis"])
def test_weights_match_verl_formulas(mode):
    mask, delta, _, _ = sample()
    cfg = make_cfg(rollout_correction=mode, rollout_correction_cap=2.0, rollout_correction_lower=0.5)
    corr = rollout_correction(jnp.asarray(delta), jnp.asarray(mask), cfg)
    weight, keep = reference_weights(delta, mask, mode, 2.0, 0.5)
    np.testing.assert_allclose(np.asarray(corr.weight), weight, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(corr.keep), keep)
    assert np.asarray(corr.weight).max() <= 2.0 and np.isfinite(np.asarray(corr.weight)).all()


@pytest.mark.codegen_sensitive
@pytest.mark.parametrize("mode", ["tis", "seq_tis", "mis", "seq_mis"])
def test_pg_loss_and_gradient_are_the_weighted_surrogate(mode):
    """On-policy the PPO surrogate is −A·ρ with ρ = 1: loss = −Σ w A m / Σ keep, ∂/∂logp_t = −w_t A / Σ keep."""
    mask, delta, old, adv = sample(1)
    cfg = make_cfg(rollout_correction=mode, rollout_correction_cap=1.5)
    weight, keep = reference_weights(delta, mask, mode, 1.5)
    value, grad = pg_loss_and_grad(cfg, mask, delta, old, adv)
    denominator = keep.sum()
    np.testing.assert_allclose(value, -(weight * adv[:, None]).sum() / denominator, rtol=1e-5)
    np.testing.assert_allclose(grad, -weight * adv[:, None] / denominator, rtol=1e-5, atol=1e-8)
    if mode.endswith("mis"):
        assert keep.sum() < mask.sum(), "the sample must reject something for this test to mean anything"
        assert np.all(grad[(mask > 0) & (keep == 0)] == 0)


@pytest.mark.codegen_sensitive
def test_masked_tokens_leave_every_term_and_its_denominator():
    """verl replaces the response mask: the KL term's token mean runs over kept tokens only."""
    mask, delta, old, adv = sample(2)
    cfg = make_cfg(rollout_correction="mis", rollout_correction_cap=1.5, kl_coef=1.0, kl_estimator="k1")
    gap = np.linspace(0.1, 2.0, B * T, dtype=np.float32).reshape(B, T)
    ref = old - gap
    masks = rl.LossMasks(action_mask=jnp.asarray(mask), rollout_log_ratio=jnp.asarray(delta))
    _, metrics = rl.objective(jnp.asarray(old), jnp.asarray(old), jnp.asarray(ref), None, jnp.asarray(adv), masks,
                              cfg)
    _, keep = reference_weights(delta, mask, "mis", 1.5)
    assert keep.sum() < mask.sum()
    np.testing.assert_allclose(float(metrics["kl/mean"]), (gap * keep).sum() / keep.sum(), rtol=1e-5)
    assert abs((gap * keep).sum() / keep.sum() - (gap * mask).sum() / mask.sum()) > 1e-3


@pytest.mark.codegen_sensitive
def test_none_ignores_the_log_ratio_and_is_the_default():
    mask, delta, old, adv = sample(3)
    cfg = make_cfg()
    assert cfg.rollout_correction == "none"
    with_ratio = pg_loss_and_grad(cfg, mask, delta, old, adv)
    masks = rl.LossMasks(action_mask=jnp.asarray(mask))
    without = rl.objective(jnp.asarray(old), jnp.asarray(old), None, None, jnp.asarray(adv), masks, cfg)[0]
    assert with_ratio[0] == float(without)


@pytest.mark.codegen_sensitive
def test_batch_constants_drop_masked_tokens_from_the_denominator():
    mask, delta, _, adv = sample(4)
    cfg = make_cfg(rollout_correction="mis", rollout_correction_cap=1.5)
    masks = rl.LossMasks(action_mask=jnp.asarray(mask), rollout_log_ratio=jnp.asarray(delta))
    constants = rl.batch_constants(jnp.asarray(adv), masks, cfg)
    assert float(constants.denominators["pg"]) == reference_weights(delta, mask, "mis", 1.5)[1].sum()


def test_a_correction_without_sampler_logprobs_fails_by_name():
    mask, _, old, adv = sample()
    with pytest.raises(ValueError, match="rollout_log_ratio"):  # LossMasks.rollout_log_ratio is None
        rl.objective(jnp.asarray(old), jnp.asarray(old), None, None, jnp.asarray(adv),
                     rl.LossMasks(action_mask=jnp.asarray(mask)), make_cfg(rollout_correction="tis"))


@pytest.mark.parametrize("bad", [dict(rollout_correction="is"), dict(rollout_correction_cap=1.0),
                                 dict(rollout_correction_lower=-1.0),
                                 dict(rollout_correction_cap=2.0, rollout_correction_lower=3.0)])
def test_bad_settings_fail_naming_the_field(bad):
    with pytest.raises(RLConfigError, match="rollout_correction"):
        rl.validate(make_cfg(**bad))


@pytest.mark.codegen_sensitive
def test_host_metrics_report_what_token_tis_would_cap_when_off():
    mask, delta, old, _ = sample(5)
    sampler = old - delta
    wide_old = np.pad(old, ((0, 0), (0, 3)))  # the trainer's fixed length is wider than the rollout
    got = host_metrics(sampler, wide_old, mask, make_cfg())
    weight, keep = reference_weights(delta, mask, "tis", 2.0)
    rho = np.exp(np.clip(delta, -20, 20))
    assert got["rollout_corr/capped_frac"] == pytest.approx(((rho > 2.0) * mask).sum() / mask.sum())
    assert got["rollout_corr/weight_mean"] == pytest.approx(weight.sum() / mask.sum(), rel=1e-5)
    assert got["rollout_corr/masked_frac"] == 0.0
    masked = host_metrics(sampler, wide_old, mask, make_cfg(rollout_correction="mis"))
    assert masked["rollout_corr/masked_frac"] == pytest.approx(1 - reference_weights(delta, mask, "mis", 2.0)[1].sum()
                                                              / mask.sum())
