"""Per-token KL estimators between the trained policy and the frozen reference.

Given the sampled token's log-probs only, these are Schulman's k1/k2/k3 estimators of
KL(pi_theta || pi_ref) (names as in verl's `kl_penalty`). The default is k3
("low_var_kl"): with `x = log pi_ref - log pi_theta`, `kl = exp(x) - x - 1`, always >= 0,
clamped to [-10, 10] as in the reference so one wild token cannot dominate the loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from llds_jax.rl.registry import Registry

KL_ESTIMATORS: Registry = Registry("KL estimator")

LOW_VAR_KL_CLAMP = 10.0


@KL_ESTIMATORS.register("k1", "kl")
def k1_kl(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    """Unbiased, high variance, can be negative per token."""
    return logp - ref_logp


@KL_ESTIMATORS.register("abs")
def abs_kl(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    return jnp.abs(logp - ref_logp)


@KL_ESTIMATORS.register("k2", "mse")
def k2_kl(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    """Half squared log-ratio; its gradient is the true KL gradient to first order."""
    return 0.5 * jnp.square(logp - ref_logp)


@KL_ESTIMATORS.register("k3", "low_var_kl")
def k3_kl(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    """Low-variance, non-negative estimator (the reference's `low_var_kl`)."""
    x = ref_logp - logp
    return jnp.clip(jnp.exp(x) - x - 1.0, -LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)
