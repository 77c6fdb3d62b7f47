"""The step over packed rows (``train.packing``): the π_old/π_ref pass and a mini-batch's gradient accumulation.

Why a module of its own: packed rows hold several trajectories each (segment ids, positions restarting
per trajectory), but the objective must keep seeing one trajectory per row. This module is that bridge,
beside the padded path (``train.forward.logprobs``, ``train.micro_loss``), so the update
(``train.step``) picks one of the two and reads the same.

π_old, π_ref and the update's forward read ``batch.packed`` one micro-batch of rows per iteration of a
loop whose trip count is the number of micro-batches the batch (π_old / π_ref) or the mini-batch
(update) uses, so lengths vary without a recompile. Each row's LM head computes its listed action
targets; ``trajectory_view`` reads them back into every trajectory's own ``[M, K]`` compact view
(trajectories of other micro-batches: row weight 0, log π = π_old), so ``micro_batch_loss`` and
``batch_constants`` see exactly the padded layout's arrays: advantages, the A-gate's per-action sums,
sequence aggregations, GSPO's sequence ratio, KL, entropy and every denominator are per trajectory as
before, and the accumulated sums equal the padded step's up to summation order
(``tests/train/test_packing.py``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from llds_jax.models import params_in_compute_dtype
from llds_jax.models.logprobs import scored_positions
from llds_jax.parallel.rules import ShardingRules
from llds_jax.rl.objective import BatchConstants
from llds_jax.train.batch import TrainBatch, next_token_targets, token_aligned
from llds_jax.train.forward import constrain_rows, forward_logprobs, objective_view, scatter_targets
from llds_jax.train.micro_loss import add_micro_batch, empty_terms, entropy_term, policy_objective
from llds_jax.train.packing import PackedRows
from llds_jax.train.step_settings import StepSettings


def packed_micro_batch(packed: PackedRows, slot, rules: ShardingRules):
    """(input_ids, segment_ids, score_positions) [P, ...] of micro-batch ``slot`` (axis 0 is unsharded: a local index)."""
    take = lambda x: jax.lax.dynamic_index_in_dim(x, slot, 0, keepdims=False)
    return constrain_rows((take(packed.input_ids), take(packed.segment_ids), take(packed.score_positions)), rules)


def trajectory_view(row_values, row, score_start, valid):
    """Packed LM-head outputs → each trajectory's own compact view [N, K]: entry k is its k-th action target.

    ``row_values`` [R, Kp] (one micro-batch's rows, or [S, P, Kp] with ``row`` already the global
    row slot·P + row); ``row`` / ``score_start`` [N] from ``PackedRows``; ``valid`` [N, K] marks the
    entries that exist (others read entry 0 and must be masked by the caller).
    """
    width = row_values.shape[-1]
    index = (row * width + score_start)[:, None] + jnp.arange(valid.shape[1], dtype=jnp.int32)[None, :]
    return jnp.take(row_values.reshape(-1), jnp.where(valid, index, 0), axis=0)


def packed_logprobs(graphdef, settings: StepSettings, params, packed: PackedRows, action_mask):
    """``forward.logprobs`` over packed rows: one micro-batch of rows per iteration, as many as the batch uses.

    Each row's LM head computes its ``packing.scored`` listed targets; the results come back as
    every trajectory's token-aligned log-probs, 0 off its action tokens, as the padded pass gives.
    """
    rules, mesh = settings.rules, settings.mesh
    params = params_in_compute_dtype(params, settings.compute_dtype)
    buffer_sharding = NamedSharding(mesh, rules.spec((None, "batch", None), packed.score_positions.shape, mesh))

    def one(slot, out):
        ids, segments, positions = packed_micro_batch(packed, slot, rules)
        logp, _ = forward_logprobs(graphdef, params, ids, None, temperature=settings.temperature,
                                   chunk_size=settings.chunk_size, with_entropy=False, positions=positions,
                                   segment_ids=segments)
        return jax.lax.dynamic_update_index_in_dim(out, logp, slot, 0)

    out = jax.lax.with_sharding_constraint(jnp.zeros(packed.score_positions.shape, jnp.float32), buffer_sharding)
    out = jax.lax.fori_loop(0, packed.mini_count.sum(), one, out)
    positions, valid = scored_positions(next_token_targets(action_mask), settings.sizes.scored_positions)
    rows = packed.slot * settings.packing.rows + packed.row
    logp = jnp.where(valid, trajectory_view(out, rows, packed.score_start, valid), 0.0)
    logp = scatter_targets(logp, positions, valid, action_mask.shape[1] - 1)
    return jax.lax.stop_gradient(constrain_rows(token_aligned(logp), rules))


def packed_micro_loss(graphdef, settings: StepSettings, params, rows, slot, where, view, advantages,
                      constants: BatchConstants, on_policy, num_micro):
    """One packed micro-batch's share of the loss, on the mini-batch's per-trajectory view.

    The forward runs on the packed rows; their action targets are read back into each
    trajectory's own [M, K] view (``trajectory_view``), where trajectories of other micro-batches
    have row weight 0 and log π = π_old (no gradient, ratio 1). So the objective sees the padded
    layout's arrays — every per-response reduction (sequence aggregation, GSPO's ratio, the
    LLDS gates, LLDS-MA counts) is per trajectory as before — and the sums over micro-batches
    add up to the mini-batch's (rounding order aside).
    """
    ids, segments, positions = rows
    row, score_start, traj_slot = where
    target_positions, masks, precomputed_old, ref_logp = view  # ``positions``: the packed rows' RoPE positions
    logp_rows, entropy_rows = forward_logprobs(graphdef, params, ids, None, temperature=settings.temperature,
                                               chunk_size=settings.chunk_size, with_entropy=settings.with_entropy,
                                               positions=positions, segment_ids=segments)
    here = traj_slot == slot
    present = here[:, None] & (masks.action_mask > 0)
    logp = jnp.where(present, trajectory_view(logp_rows, row, score_start, present), precomputed_old)
    entropy = None
    if entropy_rows is not None:
        entropy = entropy_term(jnp.where(present, trajectory_view(entropy_rows, row, score_start, present), 0.0),
                               settings.rl)
    masks = masks._replace(row_weight=masks.row_weight * here)
    return policy_objective(logp, entropy, (target_positions, masks, precomputed_old, ref_logp), present,
                            advantages, constants, on_policy, settings.rl, num_micro)


def packed_accumulation(graphdef, settings: StepSettings, params, packed: PackedRows, mini: TrainBatch, where,
                        first, count, advantages, constants: BatchConstants, on_policy, zero_grads):
    """(grads, loss, terms, gap) of one mini-batch over its ``count`` packed micro-batches (a dynamic trip count).

    The mini-batch's view is always compacted to ``sizes.scored_positions``: entry k of a trajectory
    must be its k-th action target, the order of the packed rows' listed targets.
    """
    rules = settings.rules
    grad_fn = jax.value_and_grad(functools.partial(packed_micro_loss, graphdef, settings), has_aux=True)
    view = objective_view(mini, settings.sizes.scored_positions)
    num_micro = count.astype(jnp.float32)  # rl.loss_scope = micro_batch: the mean over the micro-batches used

    def step(slot, carry):
        rows = packed_micro_batch(packed, slot, rules)
        return add_micro_batch(carry, grad_fn(params, rows, slot, where, view, advantages, constants, on_policy,
                                              num_micro))

    shapes = jax.eval_shape(grad_fn, params, packed_micro_batch(packed, first, rules), first, where, view,
                            advantages, constants, on_policy, num_micro)[0][1][0]
    zero = jnp.zeros((), jnp.float32)
    return jax.lax.fori_loop(first, first + count, step, (zero_grads, zero, empty_terms(shapes), zero))
