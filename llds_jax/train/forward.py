"""The one forward of π_old, π_ref and the loss, the row views around it, and the padded π_old/π_ref pass.

Why a module of its own: the update (``train.step``), the packed path (``train.packed_step``) and the SFT
step (``train.sft``) all run ``forward_logprobs``; the views here say which positions it scores and how
its outputs line up with the arrays the objective (``llds_jax.rl.objective``) reads.

Scored positions: the loss reads log-probs of action tokens only, so every pass computes the
output projection and softmax for at most ``StepSizes.scored_positions`` positions per row (the
rollout's bound on a row's action tokens, ``batch.scored_positions_per_row``): the final hidden
states of a row's action targets are gathered, in order, before the projection
(``compact_view``); π_old / π_ref come back token-aligned with 0 off the action tokens.
The loss's sums visit the same terms, so this changes rounding only (tests/train).

Token alignment: the batch is token-aligned (``llds_jax.train.batch``); ``logprobs`` returns
token-aligned log-probs and the loss reads the objective's next-token view (``objective_view``).
Nothing here materialises [B, T, V] logits (``token_logprobs`` chunks).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from llds_jax.models import params_in_compute_dtype
from llds_jax.models.logprobs import scored_positions, sequence_logprobs
from llds_jax.parallel.rules import ShardingRules
from llds_jax.rl.objective import LossMasks
from llds_jax.train.batch import TrainBatch, next_token_targets, token_aligned
from llds_jax.train.step_settings import StepSettings


def constrain_rows(tree, rules: ShardingRules):
    """Every leaf's rows over the batch axes of ``rules`` (no-op outside a mesh): each device works on its slice."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return tree
    return jax.tree.map(
        lambda x: jax.lax.with_sharding_constraint(x, rules.spec(("batch",) + (None,) * (x.ndim - 1), x.shape, mesh)),
        tree)


def split_rows(tree, parts: int):
    """[N, ...] → [parts, N/parts, ...], keeping row order (chunk k = rows k·n … (k+1)·n − 1)."""
    return jax.tree.map(lambda x: x.reshape((parts, x.shape[0] // parts) + x.shape[1:]), tree)


def forward_logprobs(graphdef, params, input_ids, attention_mask, *, temperature: float, chunk_size: int,
                     with_entropy: bool, positions=None, segment_ids=None):
    """log π(token t+1 | ≤ t) [N, T-1] *target-aligned* (and entropy) — the one forward of π_old, π_ref and the loss.

    With ``positions`` [N, K] only those target columns: [N, K] (``sequence_logprobs``);
    ``segment_ids``: packed rows (``train.packing``).
    """
    return sequence_logprobs(nnx.merge(graphdef, params), input_ids, attention_mask, temperature=temperature,
                             chunk_size=chunk_size, with_entropy=with_entropy, positions=positions,
                             segment_ids=segment_ids)


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


def objective_view(mb: TrainBatch, size: int | None):
    """(positions or None, masks, π_old, π_ref) as the loss reads them: next-token targets, cut to ``size``.

    ``size`` None keeps every target (no compaction). ``masks.rollout_log_ratio``
    (rl.rollout_correction) uses the precomputed π_old: fixed for the step.
    """
    masks = LossMasks(
        action_mask=next_token_targets(mb.action_mask),
        answer_mask=next_token_targets(mb.answer_mask),
        action_index=next_token_targets(mb.action_index),
        row_weight=mb.row_weight,
        num_searches=mb.num_searches,
    )
    ref_logp = None if mb.ref_logp is None else next_token_targets(mb.ref_logp)
    old_logp = next_token_targets(mb.old_logp)
    if mb.sampler_logp is not None:
        masks = masks._replace(rollout_log_ratio=next_token_targets(mb.old_logp - mb.sampler_logp))
    if size is None:
        return None, masks, old_logp, ref_logp
    positions, _, masks, old_logp, ref_logp = compact_view(masks, old_logp, ref_logp, size)
    return positions, masks, old_logp, ref_logp


def advantage_view(advantages, positions):
    """Token-level (REINFORCE++) advantages [N, T-1] cut to the compacted positions; [N] ones as they are."""
    if advantages.ndim == 1 or positions is None:
        return advantages
    return jnp.take_along_axis(advantages, positions, axis=1)


def logprobs(graphdef, settings: StepSettings, params, input_ids, attention_mask, action_mask):
    """No-grad token-aligned log-probs of the action tokens in ``logprob_batch_size`` chunks (lax.map): π_old, π_ref.

    Other positions hold 0 when the rows are compacted (``settings.scored``): every reader masks
    them out (the loss, the diagnostics, the sampler-gap metric).
    """
    sizes, rules = settings.sizes, settings.rules
    params = params_in_compute_dtype(params, settings.compute_dtype)  # once, not per chunk
    parts = sizes.trajectories // sizes.logprob_batch_size
    ids, mask, actions = split_rows((input_ids, attention_mask, action_mask), parts)

    def one(chunk_arrays):
        chunk_ids, chunk_mask, chunk_actions = constrain_rows(chunk_arrays, rules)
        positions = valid = None
        if size := settings.scored(chunk_ids):
            positions, valid = scored_positions(next_token_targets(chunk_actions), size)
        logp, _ = forward_logprobs(graphdef, params, chunk_ids, chunk_mask, temperature=settings.temperature,
                                   chunk_size=settings.chunk_size, with_entropy=False, positions=positions)
        if positions is not None:
            logp = scatter_targets(logp, positions, valid, chunk_ids.shape[1] - 1)
        return constrain_rows(token_aligned(logp), rules)

    out = jax.lax.map(one, (ids, mask, actions))
    return jax.lax.stop_gradient(out.reshape((sizes.trajectories,) + out.shape[2:]))
