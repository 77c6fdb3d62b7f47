"""Outcome advantages: one scalar per response, normalised inside its prompt group.

GRPO (SPEC §4): `A_i = (r_i - mean_g) / (std_g + eps)`, unbiased std by default as in the
reference. Conventions shared by every estimator, chosen so no batch can produce NaN/inf:

* Groups are keyed by an explicit id per prompt. Ids may be any integers (a prompt uid, a
  hash): they are densified inside, so two prompts never share a group by accident (the
  reference keyed by a per-dataset index and sometimes merged two questions).
* A group of one has mean 0 and std 1 (the reference's convention), so `A = r / (1 + eps)`.
* A group whose valid rewards are all equal gets exactly 0 (decided by max == min, not by a
  float std that round-off can leave at 1e-9 and `eps` would blow up to O(0.01)).
* Invalid rows (padding) are excluded from every statistic and get advantage 0.

Everything is segment ops with `num_segments = N` (static), so it jits once per N.

REINFORCE++ (Hu et al. 2025, arXiv:2501.03262, eqs. 8-10; OpenRLHF's ``reinforce`` estimator) is
the one token-level estimator: no group baseline (so an all-equal group is *not* zeroed — its
reward still differs from the batch's), the token-level KL to the reference subtracted from the
return, and one normalisation over every action token of the global batch
(:func:`reinforce_pp_token_advantages`, run by the update once π_old and π_ref exist).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from llds_jax.rl.registry import Registry

ADVANTAGE_ESTIMATORS: Registry = Registry("advantage estimator")


class GroupStats(NamedTuple):
    """Per-row statistics of the row's own group (valid rows only)."""

    count: jax.Array  # [N] float, valid rows in the group
    mean: jax.Array  # [N] 0 for a group of one
    std: jax.Array  # [N] 1 for a group of one; unbiased or biased per `unbiased_std`


def dense_group_ids(keys: jax.Array) -> jax.Array:
    """Map arbitrary integer keys [N] to dense ids in [0, N) (equal keys -> equal ids)."""
    n = keys.shape[0]
    _, inverse = jnp.unique(keys, return_inverse=True, size=n, fill_value=jnp.iinfo(keys.dtype).max)
    return inverse.reshape(n)


def group_stats(
    rewards: jax.Array, group_ids: jax.Array, valid: jax.Array, *, unbiased_std: bool
) -> GroupStats:
    n = rewards.shape[0]
    weight = valid.astype(rewards.dtype)
    seg = dense_group_ids(group_ids)
    count = jax.ops.segment_sum(weight, seg, num_segments=n)[seg]
    total = jax.ops.segment_sum(weight * rewards, seg, num_segments=n)[seg]
    mean = total / jnp.maximum(count, 1.0)
    sq_dev = jax.ops.segment_sum(weight * (rewards - mean) ** 2, seg, num_segments=n)[seg]
    dof = count - 1.0 if unbiased_std else count
    std = jnp.sqrt(sq_dev / jnp.maximum(dof, 1.0))
    singleton = count <= 1.0
    return GroupStats(count=count, mean=jnp.where(singleton, 0.0, mean), std=jnp.where(singleton, 1.0, std))


def _constant_group(rewards: jax.Array, group_ids: jax.Array, valid: jax.Array) -> jax.Array:
    """True for rows whose group has >= 2 valid rows that all carry the same reward."""
    n = rewards.shape[0]
    seg = dense_group_ids(group_ids)
    hi = jax.ops.segment_max(jnp.where(valid, rewards, -jnp.inf), seg, num_segments=n)[seg]
    lo = jax.ops.segment_min(jnp.where(valid, rewards, jnp.inf), seg, num_segments=n)[seg]
    count = jax.ops.segment_sum(valid.astype(jnp.int32), seg, num_segments=n)[seg]
    return (hi == lo) & (count >= 2)


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo_advantage(rewards: jax.Array, stats: GroupStats, eps: float) -> jax.Array:
    """Group-normalised reward (DeepSeekMath / Search-R1)."""
    return (rewards - stats.mean) / (stats.std + eps)


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
def dr_grpo_advantage(rewards: jax.Array, stats: GroupStats, eps: float) -> jax.Array:
    """Dr. GRPO: mean-centred only; dividing by std up-weights near-constant groups."""
    del eps
    return rewards - stats.mean


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo_advantage(rewards: jax.Array, stats: GroupStats, eps: float) -> jax.Array:
    """Leave-one-out baseline: r_i - mean_{j != i} r_j = n/(n-1) (r_i - mean)."""
    del eps
    scale = jnp.where(stats.count > 1.0, stats.count / jnp.maximum(stats.count - 1.0, 1.0), 1.0)
    return scale * (rewards - stats.mean)


@ADVANTAGE_ESTIMATORS.register("reinforce_pp")
def reinforce_pp_return(rewards: jax.Array, stats: GroupStats, eps: float) -> jax.Array:
    """REINFORCE++: the outcome reward itself, r(x, y); the KL and the batch normalisation come per token."""
    del stats, eps
    return rewards


TOKEN_LEVEL_ESTIMATORS = frozenset({"reinforce_pp"})


def reinforce_pp_token_advantages(
    returns: jax.Array, action_mask: jax.Array, old_logp: jax.Array, ref_logp: jax.Array | None,
    kl_coef: float, row_weight: jax.Array,
) -> jax.Array:
    """REINFORCE++ token advantages [N, T] (paper eqs. 8-10), aligned with ``action_mask`` [N, T].

    ``A_t = r − β Σ_{i ≥ t} KL_i`` with ``KL_i = log π_old(y_i) − log π_ref(y_i)`` (eq. 9, k1) on
    action tokens (γ = 1: OpenRLHF's ``get_cumulative_returns`` over rewards that are −β·KL per
    token plus r on the last), then ``(A − mean) / std`` over all action tokens of real rows
    (eq. 10; OpenRLHF: biased variance, ``rsqrt(max(var, 1e-8))``). ``ref_logp`` None means β·KL = 0.
    """
    mask = (action_mask > 0).astype(jnp.float32) * row_weight.astype(jnp.float32)[:, None]
    advantages = jnp.broadcast_to(returns.astype(jnp.float32)[:, None], mask.shape)
    if ref_logp is not None and kl_coef > 0:
        kl = (old_logp.astype(jnp.float32) - ref_logp.astype(jnp.float32)) * mask
        kl_to_go = jnp.flip(jnp.cumsum(jnp.flip(kl, axis=-1), axis=-1), axis=-1)
        advantages = advantages - kl_coef * kl_to_go
    count = jnp.maximum(mask.sum(), 1.0)
    mean = (advantages * mask).sum() / count
    var = (((advantages - mean) ** 2) * mask).sum() / count
    return jax.lax.stop_gradient((advantages - mean) * jax.lax.rsqrt(jnp.maximum(var, 1e-8)) * mask)


def row_summary(token_advantages: jax.Array, action_mask: jax.Array) -> jax.Array:
    """[N] mean token advantage over each row's action tokens (what per-row logs and diagnostics read)."""
    mask = (action_mask > 0).astype(jnp.float32)
    return (token_advantages * mask).sum(axis=-1) / jnp.maximum(mask.sum(axis=-1), 1.0)


def compute_advantages(
    rewards: jax.Array,
    group_ids: jax.Array,
    valid: jax.Array,
    *,
    estimator: str = "grpo",
    eps: float = 1e-6,
    unbiased_std: bool = True,
) -> jax.Array:
    """Per-response advantages [N] (fp32) from scalar rewards [N] and prompt-group ids [N].

    `valid` [N] bool marks real rows; padded rows get 0 and do not enter any group
    statistic. Jit-safe; the estimator name and flags are static.
    """
    estimate = ADVANTAGE_ESTIMATORS.get(estimator)
    rewards = rewards.astype(jnp.float32)
    valid = valid.astype(bool)
    stats = group_stats(rewards, group_ids, valid, unbiased_std=unbiased_std)
    advantages = estimate(rewards, stats, eps)
    if estimator not in TOKEN_LEVEL_ESTIMATORS:
        advantages = jnp.where(_constant_group(rewards, group_ids, valid), 0.0, advantages)
    return jnp.where(valid, advantages, 0.0)
