"""The `config.rl` section: every RL-objective choice as a named field, validated up front.

Defaults reproduce Search-R1 + the official LLDS code (SPEC §4-5) except where noted; each
field's comment says which value selects the paper's text instead. `validate` names the bad
field and the allowed values, so a typo fails before anything is compiled.
"""

from __future__ import annotations

import ml_collections

from llds_jax.errors import InputError
from llds_jax.rl.advantages import ADVANTAGE_ESTIMATORS
from llds_jax.rl.aggregation import AGGREGATIONS
from llds_jax.rl.kl import KL_ESTIMATORS
from llds_jax.rl.llds import LLDS_GATES
from llds_jax.rl.policy_losses import POLICY_LOSSES
from llds_jax.rl.rollout_correction import NAMES as ROLLOUT_CORRECTION_NAMES

LOSS_SCOPES = ("mini_batch", "micro_batch")


class RLConfigError(InputError):
    """A bad ``config.rl`` field; the message names it and the allowed values."""

LLDS_DENOMINATORS = ("action_tokens", "preserved_tokens")
LLDS_PRESERVE = ("non_negative", "positive")
MA_SEARCH_COUNTS = ("batch_written", "minibatch_executed")


def default_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    # Advantages (SPEC §4).
    c.advantage_estimator = "grpo"  # grpo | dr_grpo | rloo | reinforce_pp (token-level, batch-normalised)
    # REINFORCE++'s β: k1 KL to π_ref subtracted from the return per token (advantages.py). The same
    # strength as kl_coef's default; the paper moves the KL into the reward, so pair it with kl_coef = 0.
    c.reinforce_pp_kl_coef = 0.001
    c.advantage_eps = 1e-6
    c.unbiased_std = True  # reference: torch.std (unbiased)
    # Policy-gradient surrogate.
    c.policy_loss = "ppo"  # ppo (token ratio) | gspo (sequence ratio)
    c.clip_low = 0.2
    c.clip_high = 0.2
    c.ratio_max = 100.0  # rho = min(rho, ratio_max), no gradient above (official LLDS code: 100); 0 = off
    c.log_ratio_clamp = 0.0  # |log rho| clamp before exp (newer verl: 20); 0 = off (official LLDS code)
    c.dual_clip_c = 0.0  # dual-clip bound for A < 0 (verl clip_ratio_c = 3); 0 = off (Search-R1)
    # Rollout correction with the sampler's log-probs (rollout_correction.py, verl's decoupled mode).
    c.rollout_correction = "none"  # none | tis | seq_tis (truncated IS) | mis | seq_mis (masked IS)
    c.rollout_correction_cap = 2.0  # C: weights truncated at C (tis), tokens/rows above C dropped (mis)
    c.rollout_correction_lower = 0.0  # mis drops ratios below this too (verl's seq_mis preset: 0)
    # KL to the frozen reference and entropy bonus.
    c.kl_estimator = "low_var_kl"  # k1|kl, k2|mse, k3|low_var_kl, abs
    c.kl_coef = 0.001
    c.entropy_coef = 0.001
    # How token losses become one scalar (LLDS has its own denominator, below).
    c.aggregation = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum | token-sum-norm
    c.token_sum_norm_length = 0  # token-sum-norm divides by rows * this; 0 = the padded length T
    c.loss_scope = "mini_batch"  # mini_batch: exact over all micro-batches; micro_batch: reference
    # LLDS family (SPEC §5).
    c.llds_coef = 0.1  # lambda: paper 0.1, released scripts 0.2, 0 = plain GRPO
    c.llds_gate = "action"  # token (LLD) | response (R-gate, paper v1) | action (A-gate, official)
    c.llds_denominator = "action_tokens"  # action_tokens (official, SPEC) | preserved_tokens (paper eq. 5)
    # Which responses LLDS protects: non_negative = A >= 0 (official code, SPEC §5; includes the
    # zero-advantage rows of uniform groups), positive = A > 0 only (the correct responses of mixed
    # groups, the set the paper's LLD analysis is about; issue 43's control).
    c.llds_preserve = "non_negative"
    c.mask_answer = False  # LLDS-MA: answer tokens get min(answer_weight, llds_coef)
    c.answer_weight = 0.0  # w_ans; 0 removes answer tokens from the penalty
    c.adaptive_ma = False  # w_ans * max(mean_searches - 1, 0), still capped at llds_coef
    # What adaptive MA's mean_searches counts. batch_written (official LLDS code's valid_search_mean):
    # actions parsed as a search, including one in the final turn that is not executed, averaged
    # over the whole rollout batch. minibatch_executed: searches run, averaged over the mini-batch.
    c.ma_search_count = "batch_written"
    c.answer_in_gate = True  # answer tokens count in the gate's signed sum under MA
    return c


def _check_choice(cfg, field: str, allowed) -> None:
    value = cfg[field]
    if value not in allowed:
        known = allowed.names() if hasattr(allowed, "names") else list(allowed)
        raise RLConfigError(f"rl.{field} = {value!r} is not one of {known}")


def _check_range(cfg, field: str, low: float, high: float | None = None) -> None:
    value = cfg[field]
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise RLConfigError(f"rl.{field} must be a number, got {value!r}")
    if value < low or (high is not None and value > high):
        raise RLConfigError(f"rl.{field} = {value!r} is outside [{low}, {high if high is not None else 'inf'}]")


def validate(cfg) -> None:
    """Raise ValueError naming the first missing/unknown field or bad value of `cfg` (config.rl)."""
    expected = set(default_config().keys())
    present = set(cfg.keys())
    if missing := sorted(expected - present):
        raise RLConfigError(f"rl config is missing fields {missing}")
    if unknown := sorted(present - expected):
        raise RLConfigError(f"rl config has unknown fields {unknown}; known: {sorted(expected)}")
    _check_choice(cfg, "advantage_estimator", ADVANTAGE_ESTIMATORS)
    _check_choice(cfg, "policy_loss", POLICY_LOSSES)
    _check_choice(cfg, "kl_estimator", KL_ESTIMATORS)
    _check_choice(cfg, "aggregation", AGGREGATIONS)
    _check_choice(cfg, "llds_gate", LLDS_GATES)
    _check_choice(cfg, "loss_scope", LOSS_SCOPES)
    _check_choice(cfg, "llds_denominator", LLDS_DENOMINATORS)
    _check_choice(cfg, "llds_preserve", LLDS_PRESERVE)
    _check_choice(cfg, "ma_search_count", MA_SEARCH_COUNTS)
    _check_choice(cfg, "rollout_correction", ROLLOUT_CORRECTION_NAMES)
    _check_range(cfg, "rollout_correction_lower", 0.0)
    if not cfg.rollout_correction_cap > max(1.0, cfg.rollout_correction_lower):
        raise RLConfigError(f"rl.rollout_correction_cap = {cfg.rollout_correction_cap!r} must be above 1 and above "
                            f"rl.rollout_correction_lower = {cfg.rollout_correction_lower!r}")
    _check_range(cfg, "advantage_eps", 0.0)
    _check_range(cfg, "clip_low", 0.0, 1.0)
    _check_range(cfg, "clip_high", 0.0)
    _check_range(cfg, "log_ratio_clamp", 0.0)
    _check_range(cfg, "ratio_max", 0.0)
    if 0 < cfg.ratio_max <= 1.0 + cfg.clip_high:
        raise RLConfigError(f"rl.ratio_max = {cfg.ratio_max!r} must be 0 (off) or above 1 + rl.clip_high "
                         f"= {1.0 + cfg.clip_high}: below it the clamp would replace PPO's clip")
    _check_range(cfg, "kl_coef", 0.0)
    _check_range(cfg, "reinforce_pp_kl_coef", 0.0)
    _check_range(cfg, "entropy_coef", 0.0)
    _check_range(cfg, "token_sum_norm_length", 0)
    _check_range(cfg, "llds_coef", 0.0)
    _check_range(cfg, "answer_weight", 0.0)
    if cfg.dual_clip_c != 0 and not cfg.dual_clip_c > 1.0:
        raise RLConfigError(f"rl.dual_clip_c = {cfg.dual_clip_c!r} must be 0 (off) or > 1")
    for flag in ("unbiased_std", "mask_answer", "adaptive_ma", "answer_in_gate"):
        if not isinstance(cfg[flag], bool):
            raise RLConfigError(f"rl.{flag} must be a bool, got {cfg[flag]!r}")
    if cfg.adaptive_ma and not cfg.mask_answer:
        raise RLConfigError(
            "rl.adaptive_ma = True scales the MA answer weight, so it needs rl.mask_answer = True"
        )
