"""The jitted pieces of one GRPO + LLDS training step (SPEC §4), with explicit shardings.

A training step, after the rollout, is exactly the reference's:

1. ``logπ_old`` of every action token, once, with the *training* model's own forward
   (``policy_logprobs``: same code path and temperature as the loss) — before any update;
2. ``logπ_ref`` with the frozen reference params (``reference_logprobs``; bf16 allowed);
3. ``update``: the rollout batch split **in order, without shuffling** into
   ``mini_batch_size`` chunks, one AdamW update each (a ``lax.scan``, so π_θ moves between
   chunks while π_old stays fixed — which is the only reason LLDS is ever non-zero), every
   update accumulating exact gradients over ``micro_batch_size`` chunks (sums and
   denominators, ``llds_jax.rl.objective``), clipping the global norm, and skipping the
   update (counted) when the loss or the gradient norm is non-finite.

The pieces are top-level pure functions that take their static settings (``StepSettings``,
``train.step_settings``) as explicit arguments, bound with ``functools.partial`` where
``build_update_fns`` jits them (MaxText's ``train_step``):

* the forward and the padded π_old/π_ref pass — ``train.forward`` (``forward_logprobs``, ``logprobs``);
* a micro-batch's loss and the accumulation over a mini-batch — ``train.micro_loss``;
* the same over packed rows (``train.packing``) — ``train.packed_step``;
* a mini-batch's update (``mini_batch_update``) and the step's (``update``) — here.

All three are ``jax.jit`` with ``in_shardings``/``out_shardings`` computed before the first
call, and ``update`` donates the train state; on a GPU their FSDP collectives are pipelined across the
layer loop's trips (``parallel.overlap.TRAINING_COMPILER_OPTIONS``). Batch arrays are sharded over the batch axes
of the rules table (``("data", "fsdp")``); every micro-batch is re-constrained to that
layout so each device works on its slice. The rules stay the model's: params and Adam
moments use the same table the sampler reads, so no resharding happens between rollout and
update on the default rules.

Advantages are computed inside ``update`` from the batch's rewards, group ids and row weights
(``llds_jax.rl.advantages``, pure jnp) over the *global* batch, and returned with the new
state, so no host round trip precedes the update and several hosts need no gather. The
optimizer step (clip, non-finite skip, AdamW, counters) is ``train.state.apply_update``,
shared with the SFT warm-up. The config is validated when the settings are built, never in a trace.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from llds_jax.models import params_in_compute_dtype
from llds_jax.parallel.overlap import TRAINING_COMPILER_OPTIONS
from llds_jax.parallel.rules import ShardingRules, current_rules
from llds_jax.rl.advantages import (
    TOKEN_LEVEL_ESTIMATORS,
    compute_advantages,
    reinforce_pp_token_advantages,
    row_summary,
)
from llds_jax.rl.objective import ObjectiveTerms, batch_constants, finalize
from llds_jax.train.batch import TrainBatch, batch_sharding, next_token_targets
from llds_jax.train.forward import (
    advantage_view,
    constrain_rows,
    forward_logprobs,
    logprobs,
    objective_view,
    split_rows,
)
from llds_jax.train.micro_loss import accumulate_micro_batches
from llds_jax.train.packed_step import packed_accumulation, packed_logprobs
from llds_jax.train.packing import PackedRows, PackingSizes
from llds_jax.train.signatures import SignatureLog
from llds_jax.train.state import TrainState, apply_update, learning_rate
from llds_jax.train.step_settings import StepSettings, StepSizes, needs_reinforce_pp_reference

# StepSizes and forward_logprobs are re-exported: tests and tools read the step's sizes and forward from here.
__all__ = ["StepOutputs", "StepSizes", "UpdateFns", "build_update_fns", "forward_logprobs", "mini_batch_update",
           "update"]


class StepOutputs(NamedTuple):
    """What the update hands back besides the state and per-mini-batch metrics (for logging and diagnostics)."""

    advantages: jax.Array  # float32 [N], row-sharded: computed inside the update (REINFORCE++: row means)
    action_tokens: jax.Array  # float32 scalar: action tokens of the global batch
    tokens: jax.Array  # float32 scalar: real tokens of the global batch


# (params, input_ids, attention_mask, action_mask) padded, or (params, packed: PackedRows, action_mask) packed
# → token-aligned log-probs [N, T] of the action tokens, 0 elsewhere.
LogprobPass = Callable[..., jax.Array]
# (state, batch) → (state, metrics with a leading [num_mini_batches] axis, StepOutputs).
UpdateFn = Callable[[TrainState, TrainBatch], tuple[TrainState, dict[str, jax.Array], StepOutputs]]


class UpdateFns(NamedTuple):
    """The jitted functions of a step (``build_update_fns``)."""

    policy_logprobs: LogprobPass  # π_old (and the Δ pass) with the policy params
    reference_logprobs: LogprobPass | None  # π_ref with the frozen reference params; None without a reference
    update: UpdateFn  # donates the state
    signatures: SignatureLog  # signatures each jitted function above was traced for (compile counts)


def _finish_update(settings: StepSettings, state: TrainState, grads, loss, terms: ObjectiveTerms, gap, lr):
    """The mini-batch's metrics, and the optimizer step on its accumulated gradients."""
    _, metrics = finalize(terms, settings.rl)
    metrics["delta_logp/abs_max"] = gap  # mini-batch 1: the recompute gap
    state, optimizer_metrics = apply_update(state, grads, loss, lr, settings.tx, settings.optim.clip_norm)
    metrics.update({"loss/objective": loss, **optimizer_metrics})
    return state, metrics


def mini_batch_update(graphdef, settings: StepSettings, state: TrainState, mini: TrainBatch, advantages, lr,
                      on_policy, batch_mean_searches, packed: PackedRows | None = None, packed_mini=None):
    """One AdamW update on one mini-batch: its constants, its micro-batches' gradients, the optimizer step.

    ``packed`` / ``packed_mini`` (``train.packing``): the batch's packed rows, and this mini-batch's
    (trajectory places, first slot, slot count); its micro-batches are then packed rows.
    """
    positions, mini_masks, _, _ = objective_view(mini, settings.scored(mini.input_ids))
    constants = batch_constants(advantage_view(advantages, positions), mini_masks, settings.rl,
                                llds_coef=state.llds_coef, mean_searches=batch_mean_searches)
    zero_grads = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
    # θ is fixed across the micro-batches: cast it once, not in every micro-batch's forward,
    # remat and backward; the gradients are the same (see params_in_compute_dtype).
    params = params_in_compute_dtype(state.params, settings.compute_dtype, keep_lookup_tables=True)
    if packed is not None:
        where, first, count = packed_mini
        grads, loss, terms, gap = packed_accumulation(graphdef, settings, params, packed, mini, where, first, count,
                                                      advantages, constants, on_policy, zero_grads)
    else:
        grads, loss, terms, gap = accumulate_micro_batches(graphdef, settings, params, mini, advantages, constants,
                                                           on_policy, zero_grads)
    return _finish_update(settings, state, grads, loss, terms, gap, lr)


def _advantages(batch: TrainBatch, rl_cfg):
    """(advantages as the loss reads them, [N] per row) over the global batch: no host gathers the rewards."""
    advantages = compute_advantages(batch.rewards, batch.group_ids, batch.row_weight > 0,
                                    estimator=rl_cfg.advantage_estimator, eps=rl_cfg.advantage_eps,
                                    unbiased_std=rl_cfg.unbiased_std)
    if rl_cfg.advantage_estimator not in TOKEN_LEVEL_ESTIMATORS:
        return advantages, advantages
    # REINFORCE++: per target token, [N, T-1]
    if needs_reinforce_pp_reference(rl_cfg) and batch.ref_logp is None:
        raise ValueError("rl.advantage_estimator = 'reinforce_pp' with reinforce_pp_kl_coef > 0 needs π_ref")
    ref = None if batch.ref_logp is None else next_token_targets(batch.ref_logp)
    advantages = reinforce_pp_token_advantages(
        advantages, next_token_targets(batch.action_mask), next_token_targets(batch.old_logp), ref,
        rl_cfg.reinforce_pp_kl_coef, batch.row_weight)
    return advantages, row_summary(advantages, next_token_targets(batch.action_mask))


def update(graphdef, settings: StepSettings, state: TrainState, batch: TrainBatch):
    """The step's update: advantages, then one ``mini_batch_update`` per mini-batch, in row order (a ``lax.scan``)."""
    rl_cfg, sizes = settings.rl, settings.sizes
    lr = learning_rate(state.step, settings.optim, sizes.total_steps)
    advantages, row_advantages = _advantages(batch, rl_cfg)
    advantages = constrain_rows(advantages, settings.rules)
    packed = batch.packed
    minis = split_rows((batch.unpacked(), advantages), sizes.num_mini_batches)
    on_policy = jnp.arange(sizes.num_mini_batches) == 0  # θ = θ_old only before the first update
    packed_minis = None
    if packed is not None:  # each mini-batch's trajectories' places, and its micro-batch slots
        where = split_rows((packed.row, packed.score_start, packed.slot), sizes.num_mini_batches)
        packed_minis = (where, packed.mini_first, packed.mini_count)
    batch_mean_searches = None  # minibatch_executed: each mini-batch's own mean
    if rl_cfg.ma_search_count == "batch_written":  # the official valid_search_mean: whole rollout batch
        batch_mean_searches = (batch.num_searches * batch.row_weight).sum() / jnp.maximum(batch.row_weight.sum(), 1.0)
    one = functools.partial(mini_batch_update, graphdef, settings)
    state, metrics = jax.lax.scan(
        lambda s, xs: one(s, xs[0][0], xs[0][1], lr, xs[1], batch_mean_searches, packed, xs[2]),
        state, (minis, on_policy, packed_minis))
    metrics["optim/lr"] = jnp.broadcast_to(lr, (sizes.num_mini_batches,))
    metrics["llds/lambda"] = jnp.broadcast_to(state.llds_coef, (sizes.num_mini_batches,))
    state = state.replace(step=state.step + 1)
    outputs = StepOutputs(constrain_rows(row_advantages, settings.rules), batch.action_mask.sum(),
                          batch.attention_mask.sum(dtype=jnp.float32))
    return state, metrics, outputs


def _bind(fn, graphdef, settings: StepSettings):
    """``fn`` with its static arguments bound, under its own name (the jitted program's, as profiles show it)."""
    bound = functools.partial(fn, graphdef, settings)
    bound.__name__ = bound.__qualname__ = fn.__name__
    return bound


def build_update_fns(graphdef, state_shardings: TrainState, batch_shardings: TrainBatch, mesh, config,
                     rules: ShardingRules | None = None, packing: PackingSizes | None = None) -> UpdateFns:
    """Jit the three functions of a step with explicit shardings; call them under ``jax.set_mesh(mesh)``.

    ``packing`` (``train.packing``): the decoder passes read packed rows (several trajectories per row) and
    loop over the used micro-batches — the update ``batch.packed``, π_old / π_ref ``batch.packed_passes`` (the
    whole batch as one group); ``batch_shardings`` must carry both.
    """
    rules = rules or current_rules()
    settings = StepSettings.from_config(config, mesh, rules, packing)
    replicated = NamedSharding(mesh, PartitionSpec())
    logp_sharding = batch_sharding(mesh, rules, 2)
    token_sh = (batch_shardings.input_ids, batch_shardings.attention_mask, batch_shardings.action_mask)
    pass_fn = _bind(logprobs, graphdef, settings)
    if packing is not None:
        if batch_shardings.packed is None or batch_shardings.packed_passes is None:
            raise ValueError("build_update_fns(packing=...) needs batch_shardings with both packed groupings")
        token_sh = (batch_shardings.packed_passes, batch_shardings.action_mask)
        pass_fn = _bind(packed_logprobs, graphdef, settings)
    log = SignatureLog()
    policy_logprobs = jax.jit(log.counted("policy_logprobs", pass_fn),
                              in_shardings=(state_shardings.params, *token_sh), out_shardings=logp_sharding,
                              compiler_options=TRAINING_COMPILER_OPTIONS)
    reference_logprobs = None
    if state_shardings.ref_params is not None:
        own = jax.jit(log.counted("reference_logprobs", pass_fn),
                      in_shardings=(state_shardings.ref_params, *token_sh), out_shardings=logp_sharding,
                      compiler_options=TRAINING_COMPILER_OPTIONS)
        # π_ref laid out as π_θ (the usual case) runs π_old's program where its dtypes match: no second compile.
        reference_logprobs = (log.reusing("reference_logprobs", "policy_logprobs", policy_logprobs, own)
                              if state_shardings.ref_params == state_shardings.params else own)
    outputs_sharding = StepOutputs(batch_sharding(mesh, rules, 1), replicated, replicated)
    update_jit = jax.jit(log.counted("update", _bind(update, graphdef, settings)),
                         in_shardings=(state_shardings, batch_shardings),
                         out_shardings=(state_shardings, replicated, outputs_sharding), donate_argnums=(0,),
                         compiler_options=TRAINING_COMPILER_OPTIONS)
    return UpdateFns(policy_logprobs, reference_logprobs, update_jit, log)
