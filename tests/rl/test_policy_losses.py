"""PPO-clip, GSPO, dual-clip and the KL estimators on hand-checkable numbers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rl_batches import rollout_batch

from llds_jax import rl

pytestmark = [pytest.mark.unit, pytest.mark.codegen_sensitive]


def cfg_with(**overrides):
    cfg = rl.default_config()
    cfg.update(overrides)
    return cfg


def test_ppo_clip_uses_separate_low_and_high_clips():
    cfg = cfg_with(clip_low=0.1, clip_high=0.3)
    ratio = jnp.array([[0.5, 0.5, 1.5, 1.5, 1.0]])
    adv = jnp.array([[1.0, -1.0, 1.0, -1.0, 2.0]])
    out = rl.POLICY_LOSSES.get("ppo")(jnp.log(ratio), jnp.zeros_like(ratio), adv, jnp.ones_like(ratio), cfg)
    # A>0: min(rho, clip) A; A<0: max(rho, clip) * A  (then negated)
    np.testing.assert_allclose(np.asarray(out.loss), [[-0.5, 0.9, -1.3, 1.5, -2.0]], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(out.clipped_high), [[False, False, True, False, False]])
    np.testing.assert_array_equal(np.asarray(out.clipped_low), [[False, True, False, False, False]])


def test_log_ratio_clamp_keeps_the_ratio_finite():
    cfg = cfg_with(log_ratio_clamp=20.0, ratio_max=0.0)
    out = rl.POLICY_LOSSES.get("ppo")(
        jnp.array([[0.0]]), jnp.array([[-200.0]]), jnp.array([[-1.0]]), jnp.ones((1, 1)), cfg
    )
    np.testing.assert_allclose(float(out.ratio[0, 0]), np.exp(20.0), rtol=1e-6)


def test_ratio_max_is_the_official_upper_clamp_in_value_and_gradient():
    """Official LLDS code: ``ratio = torch.clamp(torch.exp(log_prob - old_log_prob), max=100)``.

    Ratios 0.5 … 400 under both signs of A: loss and d loss / d logp equal torch's to fp32
    rounding; the symmetric ±20 log-ratio clamp differs wherever ρ > 100 and A < 0.
    """
    torch = pytest.importorskip("torch")
    log_ratio = np.log(np.array([0.5, 1.1, 50.0, 99.0, 101.0, 400.0] * 2, np.float32))[None]
    adv = np.repeat(np.array([1.0, -1.0], np.float32), 6)[None]

    def ours(cfg):
        fn = lambda lp: rl.POLICY_LOSSES.get("ppo")(lp, jnp.zeros_like(lp), jnp.asarray(adv), jnp.ones_like(lp), cfg)
        return np.asarray(fn(jnp.asarray(log_ratio)).loss), np.asarray(jax.grad(lambda lp: fn(lp).loss.sum())(
            jnp.asarray(log_ratio)))

    lp = torch.tensor(log_ratio, requires_grad=True)
    ratio = torch.clamp(torch.exp(lp), max=100.0)
    a = torch.tensor(adv)
    loss = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 0.8, 1.2))
    loss.sum().backward()
    official_loss, official_grad = loss.detach().numpy(), lp.grad.numpy()

    loss_ours, grad_ours = ours(cfg_with())
    np.testing.assert_allclose(loss_ours, official_loss, rtol=2e-6)
    np.testing.assert_allclose(grad_ours, official_grad, rtol=2e-6, atol=1e-6)
    loss_sym, grad_sym = ours(cfg_with(ratio_max=0.0, log_ratio_clamp=20.0))
    assert not np.allclose(grad_sym, official_grad), "the ±20 log-ratio clamp should differ above ρ = 100"


def test_ratio_max_never_overflows_where_the_reference_exp_would():
    cfg = cfg_with()
    fn = lambda lp: rl.POLICY_LOSSES.get("ppo")(lp, jnp.zeros((1, 1)), -jnp.ones((1, 1)), jnp.ones((1, 1)), cfg).loss
    big = jnp.array([[200.0]])  # exp(200) is inf in fp32
    assert float(fn(big)[0, 0]) == pytest.approx(100.0)
    assert float(jax.grad(lambda lp: fn(lp).sum())(big)[0, 0]) == 0.0


def test_dual_clip_bounds_the_loss_of_negative_advantages():
    cfg = cfg_with(dual_clip_c=3.0)
    out = rl.POLICY_LOSSES.get("ppo")(
        jnp.log(jnp.array([[10.0, 10.0]])), jnp.zeros((1, 2)), jnp.array([[-1.0, 1.0]]), jnp.ones((1, 2)), cfg
    )
    np.testing.assert_allclose(np.asarray(out.loss), [[3.0, -1.2]], rtol=1e-6)


def test_gspo_gives_every_token_of_a_response_the_same_sequence_ratio():
    cfg = cfg_with()
    logp = jnp.array([[-1.0, -2.0, -3.0, -9.0]])
    old = jnp.array([[-1.1, -1.8, -3.3, 0.0]])
    mask = jnp.array([[1.0, 1.0, 1.0, 0.0]])
    out = rl.POLICY_LOSSES.get("gspo")(logp, old, jnp.ones((1, 4)), mask, cfg)
    seq_ratio = np.exp(np.mean([0.1, -0.2, 0.3]))
    np.testing.assert_allclose(np.asarray(out.ratio)[0, :3], seq_ratio, rtol=1e-6)

    def total(lp):
        return (rl.POLICY_LOSSES.get("gspo")(lp, old, jnp.ones((1, 4)), mask, cfg).loss * mask).sum()

    grad = np.asarray(jax.grad(total)(logp))
    np.testing.assert_allclose(
        grad[0, :3], -seq_ratio, rtol=1e-6, err_msg="each token's gradient is -A * s_i"
    )


@pytest.mark.parametrize(
    "name, want",
    [
        ("k1", 0.5),
        ("kl", 0.5),
        ("abs", 0.5),
        ("k2", 0.125),
        ("mse", 0.125),
        ("k3", np.exp(-0.5) + 0.5 - 1),
        ("low_var_kl", np.exp(-0.5) + 0.5 - 1),
    ],
)
def test_kl_estimators_on_one_token(name, want):
    got = rl.KL_ESTIMATORS.get(name)(jnp.array(-1.0), jnp.array(-1.5))
    np.testing.assert_allclose(float(got), want, rtol=1e-6)


def test_low_var_kl_is_clamped_at_ten():
    assert float(rl.KL_ESTIMATORS.get("low_var_kl")(jnp.array(-30.0), jnp.array(0.0))) == 10.0


def test_gspo_objective_with_sequence_mean_aggregation_is_pure_entropy_bonus_on_policy():
    cfg = cfg_with(policy_loss="gspo", aggregation="seq-mean-token-mean", clip_low=3e-4, clip_high=4e-4)
    b = rollout_batch(0)  # the (8, 24) shape the other objective tests already compiled
    masks = rl.LossMasks(jnp.asarray(b["action_mask"]), row_weight=jnp.asarray(b["row_weight"]))
    logp = jnp.asarray(b["old_logp"])
    loss, metrics = rl.objective(
        logp, logp, logp, jnp.ones_like(logp), jnp.asarray(b["rewards"] - 0.5), masks, cfg
    )
    # pi = pi_old = pi_ref: every ratio is 1, pg = mean over rows of -A, KL = 0, entropy 1.
    rows = (np.asarray(b["action_mask"]).sum(-1) > 0) & (np.asarray(b["row_weight"]) > 0)
    want_pg = -np.mean((b["rewards"] - 0.5)[rows])
    np.testing.assert_allclose(float(loss), want_pg - cfg.entropy_coef, rtol=1e-6, atol=1e-7)
    assert float(metrics["ratio/max"]) == 1.0 and float(metrics["ratio/min"]) == 1.0
