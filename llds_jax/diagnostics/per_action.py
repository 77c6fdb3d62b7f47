"""Token arrays → per-action sums, jit-friendly (SPEC §8: "per action index").

An *action* is a maximal run of consecutive action tokens (loss-mask 1) between two
feedback spans; action 0 is the first thing the model writes (usually the first search
query), action ``k`` follows the ``k``-th feedback. These helpers turn the token-level
arrays the trainer already has (log-probs, entropies, the loss mask) into ``[B, A]``
per-action sums that :func:`llds_jax.diagnostics.step_metrics.step_diagnostics` reads.
"""

from __future__ import annotations

import jax.numpy as jnp


def action_index(action_mask: jnp.ndarray) -> jnp.ndarray:
    """``[B, T]`` index of the action each token belongs to, −1 on non-action tokens.

    A new action starts wherever a mask-1 token follows a mask-0 token (or opens the
    response). Padding and feedback tokens (mask 0) get −1.
    """
    mask = action_mask.astype(jnp.int32)
    previous = jnp.pad(mask[:, :-1], ((0, 0), (1, 0)))
    starts = (mask == 1) & (previous == 0)
    index = jnp.cumsum(starts.astype(jnp.int32), axis=1) - 1
    return jnp.where(mask == 1, index, -1)


def per_action_sums(token_values: jnp.ndarray, action_ids: jnp.ndarray, num_actions: int) -> jnp.ndarray:
    """``[B, A]`` sums of ``token_values`` over each action's tokens (actions ≥ A are dropped).

    Used with log-probs (Σ logπ per action), with ones (token counts) and with
    ``logπ_new − logπ_old`` (Δ per action). One-hot over A is cheap: A = max_turns + 1.
    """
    one_hot = action_ids[..., None] == jnp.arange(num_actions)
    return jnp.sum(jnp.where(one_hot, token_values[..., None], 0.0), axis=1)


def ratio_statistics(
    log_ratio: jnp.ndarray,
    advantage: jnp.ndarray,
    action_mask: jnp.ndarray,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
) -> dict[str, jnp.ndarray]:
    """Importance-ratio statistics over action tokens (paper §5.2: ratios inflate in the spiral).

    ``log_ratio`` is ``logπ_θ − logπ_old`` per token ``[B, T]``; ``advantage`` is per
    response ``[B]`` or per token. ``ratio/clip_frac`` is the share of action tokens where
    the clipped branch of ``max(−Aρ, −A·clip(ρ))`` is the active (larger) one, i.e. where
    the token gets no gradient from the surrogate — the verl ``pg_clipfrac`` definition.
    """
    mask = action_mask.astype(jnp.float32)
    count = jnp.maximum(mask.sum(), 1.0)
    if advantage.ndim == 1:
        advantage = advantage[:, None]
    ratio = jnp.exp(log_ratio)
    clipped = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped_active = (-advantage * clipped) > (-advantage * ratio)
    on = mask > 0
    return {
        "ratio/max": jnp.max(jnp.where(on, ratio, -jnp.inf)),
        "ratio/min": jnp.min(jnp.where(on, ratio, jnp.inf)),
        "ratio/mean": jnp.sum(ratio * mask) / count,
        "ratio/clip_frac": jnp.sum(clipped_active * mask) / count,
    }
