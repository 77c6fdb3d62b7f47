"""Rollout correction: importance weights from the sampler's own log-probs (verl's decoupled mode).

The sampler (``llds_jax.sampling``) and the trainer's π_old forward are different programs, so
log π_sampler(y_t) ≠ log π_old(y_t) even at equal weights (dtype, kernels, top-p renormalisation);
"When Speed Kills Stability" (Liu, Li et al. 2025) blames GRPO collapse on ignoring that gap, and
verl, SkyRL and slime correct it. We follow verl's ``rollout_corr_helper.py``
(``compute_rollout_correction_weights`` / ``compute_rollout_rejection_mask``, docs/algo/rollout_corr.md),
decoupled mode: PPO's ratio stays π_θ/π_old and the policy-gradient term of each action token is
multiplied by a stop-gradient weight of π_old/π_sampler. With ``δ_t = log π_old(y_t) − log π_sampler(y_t)``
on action tokens and ``m_t`` the action mask:

* token level:    ``ρ_t = exp(clip(δ_t, −20, 20))``
* sequence level: ``ρ_i = exp(clip(Σ_t m_t δ_t, −20, 20))``, the same for every token of row i
* ``tis`` / ``seq_tis`` (truncated IS): ``w = min(ρ, C)``; every token stays in the loss.
* ``mis`` / ``seq_mis`` (masked IS, verl's rejection sampling with ``rollout_rs_threshold = C`` and
  lower bound ``rl.rollout_correction_lower``; verl's ``seq_mis`` preset uses 0): tokens (rows) with
  ρ outside ``[lower, C]`` leave the loss — the keep mask multiplies the action mask, so they leave
  every term's denominator too, as verl's ``modified_response_mask`` does — and the kept ones carry
  ``w = min(ρ, C) = ρ``.

The ±20 clip is verl's ``SAFETY_BOUND`` (no overflow in the exp). The weights multiply the policy
term only (verl: ``pg_losses * rollout_is_weights``); KL, entropy and LLDS are unweighted. δ is
fixed for a rollout step (π_old and π_sampler do not move), so it is computed once from the
precomputed π_old and every mini-batch sees the same weights and masks.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from llds_jax.rl.registry import Registry

ROLLOUT_CORRECTIONS: Registry = Registry("rollout correction")
SAFETY_BOUND = 20.0  # verl's rollout_corr_helper.SAFETY_BOUND: |log ρ| clip before exp


class Correction(NamedTuple):
    weight: jax.Array  # [B, T] stop-gradient weight on the policy term; 0 off action tokens
    keep: jax.Array  # [B, T] 1 where the token stays in the loss (mis: inside [lower, C]); 0 off action tokens
    above_cap: jax.Array  # [B, T] 1 on action tokens whose ρ > C (truncated by tis, masked by mis)


def _token_ratio(log_ratio: jax.Array, mask: jax.Array) -> jax.Array:
    del mask
    return jnp.exp(jnp.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))


def _sequence_ratio(log_ratio: jax.Array, mask: jax.Array) -> jax.Array:
    total = (log_ratio * mask).sum(axis=-1, keepdims=True)
    return jnp.broadcast_to(jnp.exp(jnp.clip(total, -SAFETY_BOUND, SAFETY_BOUND)), log_ratio.shape)


def _truncated(ratio_fn):
    def correct(log_ratio, mask, cap: float, lower: float) -> Correction:
        del lower
        ratio = ratio_fn(log_ratio, mask)
        return Correction(jnp.minimum(ratio, cap) * mask, mask, (ratio > cap) * mask)
    return correct


def _masked(ratio_fn):
    def correct(log_ratio, mask, cap: float, lower: float) -> Correction:
        ratio = ratio_fn(log_ratio, mask)
        keep = ((ratio >= lower) & (ratio <= cap)) * mask
        return Correction(jnp.minimum(ratio, cap) * keep, keep, (ratio > cap) * mask)
    return correct


ROLLOUT_CORRECTIONS.register("tis")(_truncated(_token_ratio))
ROLLOUT_CORRECTIONS.register("seq_tis")(_truncated(_sequence_ratio))
ROLLOUT_CORRECTIONS.register("mis")(_masked(_token_ratio))
ROLLOUT_CORRECTIONS.register("seq_mis")(_masked(_sequence_ratio))
NAMES = ("none", *ROLLOUT_CORRECTIONS.names())


def rollout_correction(log_ratio: jax.Array, action_mask: jax.Array, cfg) -> Correction | None:
    """The weights and keep mask of ``cfg.rollout_correction`` (None for ``"none"``).

    ``log_ratio`` [B, T] = log π_old − log π_sampler, aligned with ``action_mask`` [B, T] (any
    alignment, as long as both agree); values off action tokens are ignored.
    """
    if cfg.rollout_correction == "none":
        return None
    mask = (action_mask > 0).astype(jnp.float32)
    log_ratio = jax.lax.stop_gradient(jnp.where(mask > 0, log_ratio.astype(jnp.float32), 0.0))
    correct = ROLLOUT_CORRECTIONS.get(cfg.rollout_correction)
    out = correct(log_ratio, mask, float(cfg.rollout_correction_cap), float(cfg.rollout_correction_lower))
    return jax.tree.map(jax.lax.stop_gradient, out)


def correction_metrics(log_ratio: jax.Array, action_mask: jax.Array, cfg) -> dict[str, jax.Array]:
    """``rollout_corr/*`` of one step as traceable scalars (the learner reduces them on device).

    Logged whatever ``rl.rollout_correction`` is: with ``"none"`` they say what token-level TIS
    at ``rl.rollout_correction_cap`` would do (verl's metrics-only mode), so a run shows the
    sampler/trainer mismatch before anyone turns a correction on. ``log_ratio`` = log π_old −
    log π_sampler, token-aligned with ``action_mask``.
    """
    mask = action_mask > 0
    settings = {key: cfg[key] for key in ("rollout_correction_cap", "rollout_correction_lower")}
    settings["rollout_correction"] = "tis" if cfg.rollout_correction == "none" else cfg.rollout_correction
    corr = rollout_correction(log_ratio, mask.astype(jnp.float32), _Fields(settings))
    count = mask.sum()
    tokens = jnp.maximum(count, 1).astype(jnp.float32)
    return {"rollout_corr/capped_frac": corr.above_cap.sum() / tokens,
            "rollout_corr/masked_frac": jnp.where(count > 0, 1.0 - corr.keep.sum() / tokens, 0.0),
            "rollout_corr/weight_mean": corr.weight.sum() / tokens}


def host_metrics(sampler_logp, old_logp, action_mask, cfg) -> dict[str, float]:
    """:func:`correction_metrics` from host arrays; ``old_logp`` may be wider than the rollout (the
    trainer's fixed length): its extra columns are padding."""
    mask = np.asarray(action_mask) > 0
    width = mask.shape[1]
    log_ratio = np.asarray(old_logp, np.float32)[:, :width] - np.asarray(sampler_logp, np.float32)
    return {k: float(v) for k, v in correction_metrics(jnp.asarray(log_ratio), jnp.asarray(mask), cfg).items()}


class _Fields(dict):
    """A dict read by attribute, as the ConfigDict the correction functions take."""

    __getattr__ = dict.__getitem__
