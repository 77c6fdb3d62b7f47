"""Per-token policy-gradient losses: PPO-clip (GRPO's surrogate) and GSPO.

Each returns a `PolicyTerms` of [B, T] arrays; aggregation over tokens happens elsewhere,
so the same per-token loss serves every aggregation mode and micro-batching scheme.

PPO-clip (SPEC §4): `rho = exp(logp - old_logp)`,
`loss = max(-A rho, -A clip(rho, 1 - clip_low, 1 + clip_high))`.
Reference details kept behind config:
* `ratio_max`: the official LLDS code's `ratio = clamp(exp(log_ratio), max=100)`, upper side
  only, no gradient above it (default 100). Computed as `exp(min(log_ratio, log ratio_max))`:
  the same value and gradient wherever the reference is finite, and no overflow where its
  `exp` would give inf (and its backward 0 · inf = NaN). On a token with ρ > 100 and A < 0
  this is what bounds the gradient (a ±20 log-ratio clamp lets ρ reach e²⁰).
* `log_ratio_clamp`: the log-ratio clamped to `[-c, c]` before `exp` (newer verl, c = 20);
  0 = off (default, as the official code).
* `dual_clip_c`: dual-clip for A < 0 (verl's `clip_ratio_c = 3`; Search-R1's verl had none,
  so 0 = off by default).

GSPO (Zheng et al. 2025): one ratio per sequence, `s_i = exp(mean_t log(pi/pi_old))` over
the response's action tokens, applied token-wise as `sg(s_i) * pi_t / sg(pi_t)` so every
token's gradient is scaled by the same sequence ratio. The paper pairs it with
`aggregation = "seq-mean-token-mean"` and much tighter clips (3e-4 / 4e-4).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from llds_jax.rl.registry import Registry

POLICY_LOSSES: Registry = Registry("policy loss")


class PolicyTerms(NamedTuple):
    loss: jax.Array  # [B, T] per-token loss (unmasked)
    ratio: jax.Array  # [B, T] importance ratio actually used (token or sequence level)
    clipped_high: jax.Array  # [B, T] bool: A > 0 and ratio above 1 + clip_high (no gradient)
    clipped_low: jax.Array  # [B, T] bool: A < 0 and ratio below 1 - clip_low (no gradient)


def _ratio(log_ratio: jax.Array, cfg) -> jax.Array:
    if cfg.log_ratio_clamp > 0:
        log_ratio = jnp.clip(log_ratio, -cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    if cfg.ratio_max > 0:
        log_ratio = jnp.minimum(log_ratio, math.log(cfg.ratio_max))
    return jnp.exp(log_ratio)


def _clipped_surrogate(ratio: jax.Array, advantages: jax.Array, cfg) -> PolicyTerms:
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    # `where`, not `maximum`: at ties jnp.maximum splits the gradient 0.5/0.5.
    loss = jnp.where(clipped > unclipped, clipped, unclipped)
    if cfg.dual_clip_c > 0:
        floor = -advantages * cfg.dual_clip_c
        loss = jnp.where((advantages < 0) & (floor < loss), floor, loss)
    return PolicyTerms(
        loss=loss,
        ratio=ratio,
        clipped_high=(advantages > 0) & (ratio > 1.0 + cfg.clip_high),
        clipped_low=(advantages < 0) & (ratio < 1.0 - cfg.clip_low),
    )


@POLICY_LOSSES.register("ppo")
def ppo_clip_loss(logp, old_logp, advantages, action_mask, cfg) -> PolicyTerms:
    del action_mask
    ratio = _ratio(logp - old_logp, cfg)
    return _clipped_surrogate(ratio, advantages, cfg)


@POLICY_LOSSES.register("gspo")
def gspo_loss(logp, old_logp, advantages, action_mask, cfg) -> PolicyTerms:
    mask = (action_mask > 0).astype(logp.dtype)
    length = jnp.maximum(mask.sum(axis=-1, keepdims=True), 1.0)
    seq_log_ratio = jax.lax.stop_gradient(((logp - old_logp) * mask).sum(axis=-1, keepdims=True) / length)
    log_ratio = logp - jax.lax.stop_gradient(logp) + seq_log_ratio
    ratio = _ratio(log_ratio, cfg)
    return _clipped_surrogate(ratio, advantages, cfg)
