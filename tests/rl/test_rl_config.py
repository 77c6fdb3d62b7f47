"""`config.rl` defaults are the reference's, and `validate` names the bad field and value."""

from __future__ import annotations

import pytest

from llds_jax import rl
from llds_jax.rl.rollout_correction import ROLLOUT_CORRECTIONS

pytestmark = pytest.mark.unit


def test_defaults_are_the_reference_settings():
    cfg = rl.default_config()
    rl.validate(cfg)
    assert (cfg.advantage_estimator, cfg.policy_loss, cfg.kl_estimator) == ("grpo", "ppo", "low_var_kl")
    assert (cfg.clip_low, cfg.clip_high, cfg.kl_coef, cfg.entropy_coef) == (0.2, 0.2, 0.001, 0.001)
    assert (cfg.aggregation, cfg.llds_gate, cfg.llds_coef, cfg.llds_denominator) == (
        "token-mean",
        "action",
        0.1,
        "action_tokens",
    )
    assert cfg.advantage_eps == 1e-6 and cfg.unbiased_std and not cfg.mask_answer
    assert cfg.llds_preserve == "non_negative"  # the official A ≥ 0 set


@pytest.mark.parametrize(
    "field, value, message",
    [
        (
            "llds_gate",
            "trajectory",
            "rl.llds_gate = 'trajectory' is not one of \\['action', 'response', 'token'\\]",
        ),
        ("aggregation", "mean", "rl.aggregation = 'mean'"),
        ("policy_loss", "grpo", "rl.policy_loss = 'grpo'"),
        ("kl_estimator", "k4", "rl.kl_estimator = 'k4'"),
        ("advantage_estimator", "gae", "rl.advantage_estimator = 'gae'"),
        ("loss_scope", "global", "rl.loss_scope = 'global'"),
        ("llds_denominator", "active_tokens", "rl.llds_denominator"),
        ("llds_preserve", "correct", "rl.llds_preserve = .correct. is not one of"),
        ("llds_coef", -0.1, "rl.llds_coef = -0.1 is outside"),
        ("clip_low", 1.5, "rl.clip_low = 1.5 is outside"),
        ("dual_clip_c", 0.5, "rl.dual_clip_c = 0.5 must be 0"),
    ],
)
def test_validate_names_the_bad_field_and_value(field, value, message):
    cfg = rl.default_config()
    cfg[field] = value
    with pytest.raises(ValueError, match=message):
        rl.validate(cfg)


def test_adaptive_ma_without_ma_is_rejected_instead_of_silently_ignored():
    cfg = rl.default_config()
    cfg.adaptive_ma = True
    with pytest.raises(ValueError, match="needs rl.mask_answer = True"):
        rl.validate(cfg)


def test_validate_rejects_unknown_and_missing_fields():
    cfg = rl.default_config()
    cfg.lambda_llds = 0.1
    with pytest.raises(ValueError, match="unknown fields \\['lambda_llds'\\]"):
        rl.validate(cfg)
    cfg = rl.default_config()
    del cfg["llds_gate"]
    with pytest.raises(ValueError, match="missing fields \\['llds_gate'\\]"):
        rl.validate(cfg)


@pytest.mark.parametrize(
    "registry, expected",
    [
        (rl.ADVANTAGE_ESTIMATORS, ["dr_grpo", "grpo", "reinforce_pp", "rloo"]),
        (ROLLOUT_CORRECTIONS, ["mis", "seq_mis", "seq_tis", "tis"]),
        (rl.POLICY_LOSSES, ["gspo", "ppo"]),
        (rl.KL_ESTIMATORS, ["abs", "k1", "k2", "k3", "kl", "low_var_kl", "mse"]),
        (rl.AGGREGATIONS, ["seq-mean-token-mean", "seq-mean-token-sum", "token-mean", "token-sum-norm"]),
        (rl.LLDS_GATES, ["action", "response", "token"]),
    ],
)
def test_registries_fail_on_unknown_names_listing_known_ones(registry, expected):
    assert registry.names() == expected
    with pytest.raises(ValueError, match=", ".join(expected)):
        registry.get("nope")
