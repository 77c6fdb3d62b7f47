"""Actions as maximal runs of consecutive action tokens (the unit of the LLDS A-gate).

A trajectory is `y_0, o_0, y_1, o_1, ...`: feedback `o_t` (and padding) has
`action_mask = 0`, so every action `y_t` is a maximal run of ones in the mask. If the rollout
also supplies `action_index`, a change of index between two adjacent action tokens starts a
new run too, so two actions with no feedback between them are still told apart. Everything
is cumulative sums and a per-row `segment_sum` (vmapped): no Python loop over
rows or actions, and shapes are static.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def action_run_starts(action_mask: jax.Array, action_index: jax.Array | None = None) -> jax.Array:
    """[B, T] bool, True on the first token of every action run."""
    on = action_mask > 0
    prev_on = jnp.pad(on[:, :-1], ((0, 0), (1, 0)))
    starts = on & ~prev_on
    if action_index is not None:
        prev_index = jnp.pad(action_index[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
        starts = starts | (on & prev_on & (action_index != prev_index))
    return starts


def action_run_ids(action_mask: jax.Array, action_index: jax.Array | None = None) -> jax.Array:
    """[B, T] int32: 0 for the row's first action run, 1 for the second, ...; -1 off-action."""
    starts = action_run_starts(action_mask, action_index)
    ids = jnp.cumsum(starts.astype(jnp.int32), axis=1) - 1
    return jnp.where(action_mask > 0, ids, -1)


def sum_over_runs(values: jax.Array, run_ids: jax.Array) -> jax.Array:
    """[B, T]: on each action token, the sum of `values` over its whole run; 0 off-action.

    Vmapped over rows (a row has at most T runs), so the batch axis is never reshaped and
    keeps whatever sharding the caller gave it. Off-action tokens add 0 to run 0.
    """
    on = run_ids >= 0
    seg = jnp.maximum(run_ids, 0)

    def per_row(row_values: jax.Array, row_seg: jax.Array) -> jax.Array:
        totals = jax.ops.segment_sum(row_values, row_seg, num_segments=row_values.shape[0])
        return totals[row_seg]

    return jnp.where(on, jax.vmap(per_row)(jnp.where(on, values, 0.0), seg), 0.0)
