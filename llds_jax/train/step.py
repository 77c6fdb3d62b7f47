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

Mini-batch 1 of a step runs at θ = θ_old exactly, so its loss uses its own forward,
gradient-stopped, as log π_old (verl does the same for on-policy updates). The separately
computed π_old equals that forward only up to rounding — the two are different XLA programs
and on a tensor-parallel mesh they partition differently (measured: 4.6e-9 LLDS, 1e-6 log-prob
gaps) — and the LLDS hinge max(0, log π_old − log π_θ) turns noise-sized gaps into
λ·∇log π gradients on about half the tokens (8e-4 relative grad-norm drift on a (2, 2, 2)
mesh). The precomputed π_old still serves every later mini-batch. Each mini-batch reports
max |log π_θ − precomputed log π_old| on action tokens (``delta_logp/abs_max``); in mini-batch 1
that is the recompute gap, so a code-path mismatch (dtype, temperature) stays visible.

All three are ``jax.jit`` with ``in_shardings``/``out_shardings`` computed before the first
call, and ``update`` donates the train state. Batch arrays are sharded over the batch axes
of the rules table (``("data", "fsdp")``); every micro-batch is re-constrained to that
layout so each device works on its slice. The rules stay the model's: params and Adam
moments use the same table the sampler reads, so no resharding happens between rollout and
update on the default rules.

Advantages are computed inside ``update`` from the batch's rewards, group ids and row weights
(``llds_jax.rl.advantages``, pure jnp) over the *global* batch, and returned with the new
state, so no host round trip precedes the update and several hosts need no gather. The
optimizer step (clip, non-finite skip, AdamW, counters) is ``train.state.apply_update``,
shared with the SFT warm-up.

Scored positions: the loss reads log-probs of action tokens only, so every pass computes the
output projection and softmax for at most ``StepSizes.scored_positions`` positions per row (the
rollout's bound on a row's action tokens, ``batch.scored_positions_per_row``): the final hidden
states of a row's action targets are gathered, in order, before the projection
(``compact_view``); π_old / π_ref come back token-aligned with 0 off the action tokens.
The loss's sums visit the same terms, so this changes rounding only (tests/train).

Packed rows (``train.packing``, ``llds_jax.train.packing``): π_old, π_ref and the update's forward
read ``batch.packed`` — several trajectories per row, segment ids, positions restarting per
trajectory — one micro-batch of rows per iteration of a loop whose trip count is the number of
micro-batches the batch (π_old / π_ref) or the mini-batch (update) uses, so lengths vary without a
recompile. Each row's LM head computes its listed action targets; ``trajectory_view`` reads them
back into every trajectory's own ``[M, K]`` compact view (trajectories of other micro-batches:
row weight 0, log π = π_old), so ``micro_batch_loss`` and ``batch_constants`` see exactly the
padded layout's arrays: advantages, the A-gate's per-action sums, sequence aggregations, GSPO's
sequence ratio, KL, entropy and every denominator are per trajectory as before, and the
accumulated sums equal the padded step's up to summation order (``tests/train/test_packing.py``).

Token alignment: the batch is token-aligned (``llds_jax.train.batch``); ``policy_logprobs``
returns token-aligned log-probs and the loss reads the objective's next-token view
(``_objective_view``). Nothing here materialises [B, T, V] logits (``token_logprobs`` chunks).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from llds_jax.models import params_in_compute_dtype
from llds_jax.models.logprobs import scored_positions, sequence_logprobs
from llds_jax.parallel.rules import ShardingRules, current_rules
from llds_jax.rl.advantages import (
    TOKEN_LEVEL_ESTIMATORS,
    compute_advantages,
    reinforce_pp_token_advantages,
    row_summary,
)
from llds_jax.rl.objective import (
    LossMasks,
    ObjectiveTerms,
    PolicyBatch,
    batch_constants,
    finalize,
    micro_batch_loss,
)
from llds_jax.rl.objective import accumulate as accumulate_terms
from llds_jax.train.batch import (
    TrainBatch,
    batch_sharding,
    next_token_targets,
    padded_length,
    scored_positions_per_row,
    token_aligned,
)
from llds_jax.train.packing import PackedRows, PackingSizes, data_parallel_size, packing_sizes
from llds_jax.train.signatures import SignatureLog
from llds_jax.train.state import TrainState, apply_update, learning_rate, make_optimizer


@dataclasses.dataclass(frozen=True)
class StepSizes:
    """Static sizes of the update (one compiled shape per run)."""

    trajectories: int
    mini_batch_size: int
    micro_batch_size: int
    logprob_batch_size: int
    total_steps: int
    # Next-token positions per row that π_old, π_ref, the loss and the Δ pass compute: the bound
    # on a row's action tokens (``batch.scored_positions_per_row``), or length - 1 (all of them).
    scored_positions: int

    @property
    def num_mini_batches(self) -> int:
        return self.trajectories // self.mini_batch_size

    @property
    def num_micro_batches(self) -> int:
        return self.mini_batch_size // self.micro_batch_size

    @classmethod
    def from_config(cls, config) -> StepSizes:
        t = config.train
        return cls(t.prompts_per_step * config.rollout.n_samples, t.mini_batch_size, t.micro_batch_size,
                   t.logprob_batch_size, t.total_steps, scored_positions_per_row(config, padded_length(config)))


def packing_for_run(config, mesh, rules: ShardingRules | None = None) -> PackingSizes | None:
    """The packed shapes of a run on ``mesh``, or None for padded rows (``train.packing`` off).

    One host or several: several pack the same rows (``Learner.pack_across_hosts``).
    """
    if not config.train.packing:
        return None
    sizes = StepSizes.from_config(config)
    return packing_sizes(config, padded_length(config), sizes.scored_positions, data_parallel_size(mesh, rules))


def _constrain_rows(tree, rules: ShardingRules):
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return tree
    return jax.tree.map(
        lambda x: jax.lax.with_sharding_constraint(x, rules.spec(("batch",) + (None,) * (x.ndim - 1), x.shape, mesh)),
        tree)


def _split_rows(tree, parts: int):
    """[N, ...] → [parts, N/parts, ...], keeping row order (chunk k = rows k·n … (k+1)·n − 1)."""
    return jax.tree.map(lambda x: x.reshape((parts, x.shape[0] // parts) + x.shape[1:]), tree)


def _entropy_term(entropy, rl_cfg):
    """The update's entropy: a gradient term when ``rl.entropy_coef`` > 0, a logged metric (no gradient) at 0."""
    return entropy if entropy is None or rl_cfg.entropy_coef > 0 else jax.lax.stop_gradient(entropy)


def forward_logprobs(graphdef, params, input_ids, attention_mask, *, temperature: float, chunk_size: int,
                     with_entropy: bool, positions=None, segment_ids=None):
    """log π(token t+1 | ≤ t) [N, T-1] *target-aligned* (and entropy) — the one forward of π_old, π_ref and the loss.

    With ``positions`` [N, K] only those target columns: [N, K] (``sequence_logprobs``);
    ``segment_ids``: packed rows (``train.packing``).
    """
    return sequence_logprobs(nnx.merge(graphdef, params), input_ids, attention_mask, temperature=temperature,
                             chunk_size=chunk_size, with_entropy=with_entropy, positions=positions,
                             segment_ids=segment_ids)


def packed_micro_batch(packed: PackedRows, slot, rules: ShardingRules):
    """(input_ids, segment_ids, score_positions) [P, ...] of micro-batch ``slot`` (axis 0 is unsharded: a local index)."""
    take = lambda x: jax.lax.dynamic_index_in_dim(x, slot, 0, keepdims=False)
    return _constrain_rows((take(packed.input_ids), take(packed.segment_ids), take(packed.score_positions)), rules)


def trajectory_view(row_values, row, score_start, valid):
    """Packed LM-head outputs → each trajectory's own compact view [N, K]: entry k is its k-th action target.

    ``row_values`` [R, Kp] (one micro-batch's rows, or [S, P, Kp] with ``row`` already the global
    row slot·P + row); ``row`` / ``score_start`` [N] from ``PackedRows``; ``valid`` [N, K] marks the
    entries that exist (others read entry 0 and must be masked by the caller).
    """
    width = row_values.shape[-1]
    index = (row * width + score_start)[:, None] + jnp.arange(valid.shape[1], dtype=jnp.int32)[None, :]
    return jnp.take(row_values.reshape(-1), jnp.where(valid, index, 0), axis=0)


def compact_view(masks: LossMasks, old_logp, ref_logp, size: int):
    """The objective's target-aligned view cut to each row's first ``size`` action targets, in order.

    Returns (positions [N, K], valid [N, K], masks, π_old, π_ref), every [N, T-1] array gathered to [N, K];
    the unused tail of a row is masked out (action mask 0, action index -1). Every loss term is
    a masked sum over action tokens, and an action run is told apart by its index, so the
    objective sums the full view's terms (in a different reduction order: rounding only).
    """
    positions, valid = scored_positions(masks.action_mask, size)
    take = lambda x: None if x is None else jnp.take_along_axis(x, positions, axis=1)
    compact = masks._replace(
        action_mask=jnp.where(valid, take(masks.action_mask), 0).astype(masks.action_mask.dtype),
        answer_mask=None if masks.answer_mask is None else jnp.where(valid, take(masks.answer_mask), 0),
        action_index=None if masks.action_index is None else jnp.where(valid, take(masks.action_index), -1),
        rollout_log_ratio=take(masks.rollout_log_ratio))
    return positions, valid, compact, take(old_logp), take(ref_logp)


def scatter_targets(values, positions, valid, length: int):
    """[N, K] values at target columns ``positions`` → [N, length] target-aligned, 0 elsewhere.

    Adds rather than sets, so a padding entry (``valid`` False, column 0, added as 0) cannot
    overwrite a real one.
    """
    rows = jnp.arange(values.shape[0])[:, None]
    return jnp.zeros((values.shape[0], length), values.dtype).at[rows, positions].add(jnp.where(valid, values, 0))


def _objective_view(mb: TrainBatch) -> tuple[LossMasks, jax.Array, jax.Array | None]:
    """The token-aligned batch as the objective reads it: masks and π_old/π_ref on next-token targets."""
    masks = LossMasks(
        action_mask=next_token_targets(mb.action_mask),
        answer_mask=next_token_targets(mb.answer_mask),
        action_index=next_token_targets(mb.action_index),
        row_weight=mb.row_weight,
        num_searches=mb.num_searches,
    )
    ref = None if mb.ref_logp is None else next_token_targets(mb.ref_logp)
    return masks, next_token_targets(mb.old_logp), ref


def needs_reinforce_pp_reference(rl_cfg) -> bool:
    """REINFORCE++ with β > 0 reads π_ref in its advantages even when the loss has no KL term."""
    return rl_cfg.advantage_estimator == "reinforce_pp" and rl_cfg.reinforce_pp_kl_coef > 0


def _advantage_view(advantages, positions):
    """Token-level (REINFORCE++) advantages [N, T-1] cut to the compacted positions; [N] ones as they are."""
    if advantages.ndim == 1 or positions is None:
        return advantages
    return jnp.take_along_axis(advantages, positions, axis=1)


def _empty_terms(shapes: ObjectiveTerms) -> ObjectiveTerms:
    """The identity of ``accumulate_terms``: zero sums/denominators, ∓inf extrema."""
    full = lambda tree, value: jax.tree.map(lambda s: jnp.full(s.shape, value, s.dtype), tree)
    return ObjectiveTerms(full(shapes.sums, 0.0), full(shapes.denoms, 0.0),
                                       full(shapes.maxima, -jnp.inf), full(shapes.minima, jnp.inf))


class StepOutputs(NamedTuple):
    """What the update hands back besides the state and per-mini-batch metrics (for logging and diagnostics)."""

    advantages: jax.Array  # float32 [N], row-sharded: computed inside the update (REINFORCE++: row means)
    action_tokens: jax.Array  # float32 scalar: action tokens of the global batch
    tokens: jax.Array  # float32 scalar: real tokens of the global batch


class UpdateFns(NamedTuple):
    policy_logprobs: Any  # (params, input_ids, attention_mask, action_mask) -> token-aligned logp [N, T]
    reference_logprobs: Any  # (ref_params, input_ids, attention_mask, action_mask) -> token-aligned logp [N, T]
    update: Any  # (state, batch) -> (state, metrics with a leading [num_mini_batches] axis, StepOutputs)
    signatures: SignatureLog  # signatures each jitted function above was traced for (compile counts)


def build_update_fns(graphdef, state_shardings: TrainState, batch_shardings: TrainBatch, mesh, config,
                     rules: ShardingRules | None = None, packing: PackingSizes | None = None) -> UpdateFns:
    """Jit the three functions of a step with explicit shardings; call them under ``jax.set_mesh(mesh)``.

    ``packing`` (``train.packing``): the decoder passes read ``batch.packed`` (several trajectories per
    row, ``train.packing``) and loop over the used micro-batches; ``batch_shardings.packed`` must be set.
    """
    rules = rules or current_rules()
    sizes = StepSizes.from_config(config)
    rl_cfg, optim_cfg = config.rl, config.optim
    if rl_cfg.aggregation == "token-sum-norm" and not rl_cfg.token_sum_norm_length:
        # Dr. GRPO's constant L defaults to the width of the arrays it sums, which compaction
        # narrows: pin it to the trainer's target count (what the full view would use).
        rl_cfg = rl_cfg.copy_and_resolve_references()
        rl_cfg.token_sum_norm_length = padded_length(config) - 1

    def scored(input_ids) -> int | None:
        """Positions per row the pass computes, or None for all of them (the bound is no smaller)."""
        targets = input_ids.shape[1] - 1
        return sizes.scored_positions if sizes.scored_positions < targets else None
    temperature = float(config.rollout.temperature)
    chunk = int(config.model.logprob_chunk_size)
    compute_dtype = jnp.dtype(config.model.dtype).name
    tx = make_optimizer(optim_cfg)
    # The entropy is a diagnostic the death-spiral monitor reads whatever its coefficient: computed in
    # every update forward, and held out of the gradient when the coefficient is 0 (`_entropy_term`).
    with_entropy = True
    # A packed pass reads each trajectory's first ``packed_scored`` action targets (all of a row's
    # targets when the bound is no smaller): the same positions the padded pass scores.
    packed_scored = sizes.scored_positions
    replicated = NamedSharding(mesh, PartitionSpec())
    logp_sharding = batch_sharding(mesh, rules, 2)

    def logprobs(params, input_ids, attention_mask, action_mask):
        """No-grad token-aligned log-probs of the action tokens in ``logprob_batch_size`` chunks (lax.map).

        Other positions hold 0 when the rows are compacted (``scored``): every reader masks them
        out (the loss, the diagnostics, the sampler-gap metric).
        """
        params = params_in_compute_dtype(params, compute_dtype)  # once, not per chunk
        parts = sizes.trajectories // sizes.logprob_batch_size
        ids, mask, actions = _split_rows((input_ids, attention_mask, action_mask), parts)

        def one(chunk_arrays):
            chunk_ids, chunk_mask, chunk_actions = _constrain_rows(chunk_arrays, rules)
            positions = valid = None
            if size := scored(chunk_ids):
                positions, valid = scored_positions(next_token_targets(chunk_actions), size)
            logp, _ = forward_logprobs(graphdef, params, chunk_ids, chunk_mask, temperature=temperature,
                                       chunk_size=chunk, with_entropy=False, positions=positions)
            if positions is not None:
                logp = scatter_targets(logp, positions, valid, chunk_ids.shape[1] - 1)
            return _constrain_rows(token_aligned(logp), rules)

        out = jax.lax.map(one, (ids, mask, actions))
        return jax.lax.stop_gradient(out.reshape((sizes.trajectories,) + out.shape[2:]))

    def packed_logprobs(params, packed: PackedRows, action_mask):
        """``logprobs`` over packed rows: one micro-batch of rows per iteration, as many as the batch uses.

        Each row's LM head computes its ``packing.scored`` listed targets; the results come back as
        every trajectory's token-aligned log-probs, 0 off its action tokens, as the padded pass gives.
        """
        params = params_in_compute_dtype(params, compute_dtype)
        buffer_sharding = NamedSharding(mesh, rules.spec((None, "batch", None), packed.score_positions.shape, mesh))

        def one(slot, out):
            ids, segments, positions = packed_micro_batch(packed, slot, rules)
            logp, _ = forward_logprobs(graphdef, params, ids, None, temperature=temperature, chunk_size=chunk,
                                       with_entropy=False, positions=positions, segment_ids=segments)
            return jax.lax.dynamic_update_index_in_dim(out, logp, slot, 0)

        out = jax.lax.with_sharding_constraint(jnp.zeros(packed.score_positions.shape, jnp.float32), buffer_sharding)
        out = jax.lax.fori_loop(0, packed.mini_count.sum(), one, out)
        positions, valid = scored_positions(next_token_targets(action_mask), packed_scored)
        rows = packed.slot * packing.rows + packed.row
        logp = jnp.where(valid, trajectory_view(out, rows, packed.score_start, valid), 0.0)
        logp = scatter_targets(logp, positions, valid, action_mask.shape[1] - 1)
        return jax.lax.stop_gradient(_constrain_rows(token_aligned(logp), rules))

    def objective_view(mb: TrainBatch):
        """(positions or None, masks, π_old, π_ref) as the loss reads them, compacted to ``scored`` positions.

        ``masks.rollout_log_ratio`` (rl.rollout_correction) uses the precomputed π_old: fixed for the step."""
        masks, old_logp, ref_logp = _objective_view(mb)
        if mb.sampler_logp is not None:
            masks = masks._replace(rollout_log_ratio=next_token_targets(mb.old_logp - mb.sampler_logp))
        if not (size := scored(mb.input_ids)):
            return None, masks, old_logp, ref_logp
        positions, _, masks, old_logp, ref_logp = compact_view(masks, old_logp, ref_logp, size)
        return positions, masks, old_logp, ref_logp

    def micro_loss(params, mb: TrainBatch, advantages, constants, on_policy):
        positions, masks, precomputed_old, ref_logp = objective_view(mb)
        logp, entropy = forward_logprobs(graphdef, params, mb.input_ids, mb.attention_mask, temperature=temperature,
                                         chunk_size=chunk, with_entropy=with_entropy, positions=positions)
        entropy = _entropy_term(entropy, rl_cfg)
        own = jax.lax.stop_gradient(logp)
        gap = jnp.max(jnp.where(masks.action_mask > 0, jnp.abs(own - precomputed_old), 0.0))
        old_logp = jnp.where(on_policy, own, precomputed_old)
        policy_batch = PolicyBatch(logp=logp, old_logp=old_logp, ref_logp=ref_logp, entropy=entropy,
                                   advantages=_advantage_view(advantages, positions), masks=masks)
        loss, terms = micro_batch_loss(policy_batch, rl_cfg, constants, sizes.num_micro_batches)
        return loss, (terms, gap)

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def packed_view(mb: TrainBatch):
        """(positions, masks, π_old, π_ref) of a mini-batch's trajectories, compacted to ``packed_scored``
        positions (always compacted: entry k of a row must be its k-th action target, the packed rows' order)."""
        masks, old_logp, ref_logp = _objective_view(mb)
        if mb.sampler_logp is not None:  # rl.rollout_correction: fixed for the step, as objective_view
            masks = masks._replace(rollout_log_ratio=next_token_targets(mb.old_logp - mb.sampler_logp))
        positions, _, masks, old_logp, ref_logp = compact_view(masks, old_logp, ref_logp, packed_scored)
        return positions, masks, old_logp, ref_logp

    def packed_micro_loss(params, rows, slot, where, view, advantages, constants, on_policy, num_micro):
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
        logp_rows, entropy_rows = forward_logprobs(graphdef, params, ids, None, temperature=temperature,
                                                   chunk_size=chunk, with_entropy=with_entropy, positions=positions,
                                                   segment_ids=segments)
        here = traj_slot == slot
        present = here[:, None] & (masks.action_mask > 0)
        logp = jnp.where(present, trajectory_view(logp_rows, row, score_start, present), precomputed_old)
        entropy = None
        if entropy_rows is not None:
            entropy = _entropy_term(jnp.where(present, trajectory_view(entropy_rows, row, score_start, present), 0.0),
                                    rl_cfg)
        masks = masks._replace(row_weight=masks.row_weight * here)
        own = jax.lax.stop_gradient(logp)
        gap = jnp.max(jnp.where(present, jnp.abs(own - precomputed_old), 0.0))
        old_logp = jnp.where(on_policy, own, precomputed_old)
        policy_batch = PolicyBatch(logp=logp, old_logp=old_logp, ref_logp=ref_logp, entropy=entropy,
                                   advantages=_advantage_view(advantages, target_positions), masks=masks)
        loss, terms = micro_batch_loss(policy_batch, rl_cfg, constants, num_micro)
        return loss, (terms, gap)

    packed_grad_fn = jax.value_and_grad(packed_micro_loss, has_aux=True)

    def packed_accumulation(params, packed: PackedRows, mini: TrainBatch, where, first, count, advantages,
                            constants, on_policy, zero_grads):
        """Gradients and terms of one mini-batch over its ``count`` packed micro-batches (a dynamic trip count)."""
        view = packed_view(mini)
        num_micro = count.astype(jnp.float32)  # rl.loss_scope = micro_batch: the mean over the micro-batches used

        def step(slot, carry):
            grads, loss, terms, gap = carry
            rows = packed_micro_batch(packed, slot, rules)
            (mb_loss, (mb_terms, mb_gap)), mb_grads = packed_grad_fn(
                params, rows, slot, where, view, advantages, constants, on_policy, num_micro)
            grads = jax.tree.map(lambda g, d: g + d.astype(jnp.float32), grads, mb_grads)
            return grads, loss + mb_loss, accumulate_terms(terms, mb_terms), jnp.maximum(gap, mb_gap)

        shapes = jax.eval_shape(packed_grad_fn, params, packed_micro_batch(packed, first, rules), first, where, view,
                                advantages, constants, on_policy, num_micro)[0][1][0]
        zero = jnp.zeros((), jnp.float32)
        return jax.lax.fori_loop(first, first + count, step, (zero_grads, zero, _empty_terms(shapes), zero))

    def one_update(state: TrainState, mini: TrainBatch, advantages, lr, on_policy, batch_mean_searches,
                   packed=None, packed_mini=None):
        positions, mini_masks, _, _ = objective_view(mini)
        constants = batch_constants(_advantage_view(advantages, positions), mini_masks, rl_cfg,
                                    llds_coef=state.llds_coef, mean_searches=batch_mean_searches)
        zero_grads = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
        # θ is fixed across the micro-batches: cast it once, not in every micro-batch's forward,
        # remat and backward; the gradients are the same (see params_in_compute_dtype).
        params = params_in_compute_dtype(state.params, compute_dtype, keep_lookup_tables=True)
        if packed is not None:
            where, first, count = packed_mini
            grads, loss, terms, gap = packed_accumulation(params, packed, mini, where, first, count, advantages,
                                                          constants, on_policy, zero_grads)
            return _finish_update(state, grads, loss, terms, gap, lr)
        micros = _split_rows((mini, advantages), sizes.num_micro_batches)

        def accumulate(carry, micro):
            grads, loss, terms, gap = carry
            mb, mb_advantages = _constrain_rows(micro, rules)
            (mb_loss, (mb_terms, mb_gap)), mb_grads = grad_fn(params, mb, mb_advantages, constants, on_policy)
            grads = jax.tree.map(lambda g, d: g + d.astype(jnp.float32), grads, mb_grads)
            terms = accumulate_terms(terms, mb_terms)
            return (grads, loss + mb_loss, terms, jnp.maximum(gap, mb_gap)), None

        first_mb, first_advantages = jax.tree.map(lambda x: x[0], micros)
        terms_shape = jax.eval_shape(grad_fn, params, first_mb, first_advantages, constants, on_policy)[0][1][0]
        zero = jnp.zeros((), jnp.float32)
        (grads, loss, terms, gap), _ = jax.lax.scan(
            accumulate, (zero_grads, zero, _empty_terms(terms_shape), zero), micros)
        return _finish_update(state, grads, loss, terms, gap, lr)

    def _finish_update(state, grads, loss, terms, gap, lr):
        _, metrics = finalize(terms, rl_cfg)
        metrics["delta_logp/abs_max"] = gap  # mini-batch 1: the recompute gap
        state, optimizer_metrics = apply_update(state, grads, loss, lr, tx, optim_cfg.clip_norm)
        metrics.update({"loss/objective": loss, **optimizer_metrics})
        return state, metrics

    def update(state: TrainState, batch: TrainBatch):
        lr = learning_rate(state.step, optim_cfg, sizes.total_steps)
        # Over the global batch (rows of every host): the group statistics need no host gather.
        advantages = compute_advantages(batch.rewards, batch.group_ids, batch.row_weight > 0,
                                        estimator=rl_cfg.advantage_estimator, eps=rl_cfg.advantage_eps,
                                        unbiased_std=rl_cfg.unbiased_std)
        row_advantages = advantages
        if rl_cfg.advantage_estimator in TOKEN_LEVEL_ESTIMATORS:  # REINFORCE++: per target token, [N, T-1]
            if needs_reinforce_pp_reference(rl_cfg) and batch.ref_logp is None:
                raise ValueError("rl.advantage_estimator = 'reinforce_pp' with reinforce_pp_kl_coef > 0 needs π_ref")
            ref = None if batch.ref_logp is None else next_token_targets(batch.ref_logp)
            advantages = reinforce_pp_token_advantages(
                advantages, next_token_targets(batch.action_mask), next_token_targets(batch.old_logp), ref,
                rl_cfg.reinforce_pp_kl_coef, batch.row_weight)
            row_advantages = row_summary(advantages, next_token_targets(batch.action_mask))
        advantages = _constrain_rows(advantages, rules)
        packed = batch.packed
        minis = _split_rows((batch._replace(packed=None), advantages), sizes.num_mini_batches)
        on_policy = jnp.arange(sizes.num_mini_batches) == 0  # θ = θ_old only before the first update
        packed_minis = None
        if packed is not None:  # each mini-batch's trajectories' places, and its micro-batch slots
            where = _split_rows((packed.row, packed.score_start, packed.slot), sizes.num_mini_batches)
            packed_minis = (where, packed.mini_first, packed.mini_count)
        batch_mean_searches = None  # minibatch_executed: each mini-batch's own mean
        if rl_cfg.ma_search_count == "batch_written":  # the official valid_search_mean: whole rollout batch
            batch_mean_searches = (batch.num_searches * batch.row_weight).sum() / jnp.maximum(batch.row_weight.sum(), 1.0)
        state, metrics = jax.lax.scan(
            lambda s, xs: one_update(s, xs[0][0], xs[0][1], lr, xs[1], batch_mean_searches, packed, xs[2]),
            state, (minis, on_policy, packed_minis))
        metrics["optim/lr"] = jnp.broadcast_to(lr, (sizes.num_mini_batches,))
        metrics["llds/lambda"] = jnp.broadcast_to(state.llds_coef, (sizes.num_mini_batches,))
        state = state.replace(step=state.step + 1)
        outputs = StepOutputs(_constrain_rows(row_advantages, rules), batch.action_mask.sum(), batch.attention_mask.sum(dtype=jnp.float32))
        return state, metrics, outputs

    token_sh = (batch_shardings.input_ids, batch_shardings.attention_mask, batch_shardings.action_mask)
    pass_fn = logprobs
    if packing is not None:
        if batch_shardings.packed is None:
            raise ValueError("build_update_fns(packing=...) needs batch_shardings with packed rows")
        token_sh, pass_fn = (batch_shardings.packed, batch_shardings.action_mask), packed_logprobs
    log = SignatureLog()
    policy_logprobs = jax.jit(log.counted("policy_logprobs", pass_fn),
                              in_shardings=(state_shardings.params, *token_sh), out_shardings=logp_sharding)
    reference_logprobs = None
    if state_shardings.ref_params is not None:
        own = jax.jit(log.counted("reference_logprobs", pass_fn),
                      in_shardings=(state_shardings.ref_params, *token_sh), out_shardings=logp_sharding)
        # π_ref laid out as π_θ (the usual case) runs π_old's program where its dtypes match: no second compile.
        reference_logprobs = (log.reusing("reference_logprobs", "policy_logprobs", policy_logprobs, own)
                              if state_shardings.ref_params == state_shardings.params else own)
    outputs_sharding = StepOutputs(batch_sharding(mesh, rules, 1), replicated, replicated)
    update_jit = jax.jit(log.counted("update", update), in_shardings=(state_shardings, batch_shardings),
                         out_shardings=(state_shardings, replicated, outputs_sharding), donate_argnums=(0,))
    return UpdateFns(policy_logprobs, reference_logprobs, update_jit, log)
