"""The composed GRPO + KL + entropy + LLDS objective, as sums and denominators.

    loss = agg(pg) + kl_coef * agg(kl_ref) - entropy_coef * agg(entropy) + sum(c * llds) / N

`agg` is `cfg.aggregation` (see aggregation.py); the LLDS term always sums tokens and divides
by its own N (`cfg.llds_denominator`, see llds.py). Gradients flow through `logp` and
`entropy` only: old/ref log-probs, advantages and every gate are stop-gradient.

How a trainer uses it (exact over micro-batches and data-parallel shards):

    constants = batch_constants(advantages, masks, cfg)        # whole mini-batch, masks only
    for k in micro_batches:                                     # inside grad / jit
        loss_k, terms_k = micro_batch_loss(batch_k, cfg, constants, num_micro_batches)
        grads += grad(loss_k); terms = accumulate(terms, terms_k)
    _, metrics = finalize(terms, cfg)

`loss_scope = "mini_batch"` divides every micro-batch's sums by the mini-batch denominators,
so sum_k loss_k is exactly the loss of the whole mini-batch in one piece (and independent of
the micro-batch size). `"micro_batch"` reproduces the reference (verl): each micro-batch is
normalised by its own denominators (LLDS: its own action tokens) and the mini-batch loss is
the mean of the micro-batch losses. Under jit with batch-sharded global arrays the sums are
already global (a "micro-batch" is then the global one across shards); inside `shard_map`,
call `batch_constants(..., axis_name=...)` and pass terms through `all_reduce`. Metrics are
always pooled sums / pooled denominators.

`cfg` is a validated `config.rl`: `rl.validate` runs where the config is built (`config.validate`,
the trainer's `StepSettings.from_config`), never here — these functions run inside traces.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from llds_jax.rl.action_runs import action_run_ids, action_run_starts
from llds_jax.rl.aggregation import aggregate
from llds_jax.rl.kl import KL_ESTIMATORS
from llds_jax.rl.llds import answer_coefficient, llds_terms, preserved_rows
from llds_jax.rl.metrics import TermSink, add_diagnostics
from llds_jax.rl.policy_losses import POLICY_LOSSES
from llds_jax.rl.rollout_correction import rollout_correction

LOSS_KEYS = ("pg", "kl_ref", "entropy", "llds")
# The loss terms under their metrics.jsonl names (llds_jax/diagnostics/keys.py).
_METRIC_NAMES = {"pg": "loss/pg", "kl_ref": "kl/mean", "entropy": "policy/entropy", "llds": "llds/loss"}


class LossMasks(NamedTuple):
    """Rollout-side masks, all token-aligned with the (shifted) targets."""

    action_mask: jax.Array  # [B, T] 1 on trained model-written tokens; 0 prompt/feedback/padding
    answer_mask: jax.Array | None = None  # [B, T] 1 on the last <answer>...</answer> span
    action_index: jax.Array | None = None  # [B, T] int: 0 first action, 1 second, ...; -1 elsewhere
    row_weight: jax.Array | None = None  # [B] 1 real row, 0 padding row
    num_searches: jax.Array | None = None  # [B] searches per trajectory (adaptive MA)
    # [B, T] log π_old − log π_sampler (rl.rollout_correction; None when it is "none"). Fixed for
    # the rollout step: the step computes it from the precomputed π_old, never from mini-batch 1's own.
    rollout_log_ratio: jax.Array | None = None


class PolicyBatch(NamedTuple):
    logp: jax.Array  # [B, T] fp32, current policy (differentiable)
    old_logp: jax.Array  # [B, T] fp32, pi_old, computed once per rollout step
    ref_logp: jax.Array | None  # [B, T] fp32, frozen reference (None if kl_coef == 0)
    entropy: jax.Array | None  # [B, T] fp32 full-vocabulary entropy (None if entropy_coef == 0)
    advantages: jax.Array  # [B] per response, or [B, T]
    masks: LossMasks


class BatchConstants(NamedTuple):
    """What every micro-batch must share: loss denominators, mean searches, and lambda."""

    denominators: dict[str, jax.Array]
    mean_searches: jax.Array
    llds_coef: jax.Array  # lambda for this step: cfg.llds_coef unless overridden (may be traced)


class ObjectiveTerms(NamedTuple):
    sums: dict[str, jax.Array]
    denoms: dict[str, jax.Array]
    maxima: dict[str, jax.Array]
    minima: dict[str, jax.Array]


def _row_weight(masks: LossMasks) -> jax.Array:
    if masks.row_weight is None:
        return jnp.ones(masks.action_mask.shape[0], jnp.float32)
    return masks.row_weight.astype(jnp.float32)


def _token_advantages(advantages: jax.Array, shape) -> jax.Array:
    advantages = jax.lax.stop_gradient(advantages.astype(jnp.float32))
    return jnp.broadcast_to(advantages[:, None] if advantages.ndim == 1 else advantages, shape)


def _searches_sum_and_rows(masks: LossMasks, row_weight: jax.Array, cfg) -> tuple[jax.Array, jax.Array]:
    if masks.num_searches is None:
        if cfg.mask_answer and cfg.adaptive_ma:
            raise ValueError("rl.adaptive_ma needs masks.num_searches")
        return jnp.zeros((), jnp.float32), row_weight.sum()
    return (masks.num_searches * row_weight).sum(), row_weight.sum()


def _llds_denominator(token_mask: jax.Array, advantages: jax.Array, cfg) -> jax.Array:
    if cfg.llds_denominator == "preserved_tokens":
        return (token_mask * preserved_rows(advantages, cfg)).sum()
    return token_mask.sum()


def _corrected(masks: LossMasks, cfg):
    """(masks with masked-IS rejections removed from the action mask, the correction or None)."""
    if cfg.rollout_correction == "none":
        return masks, None
    if masks.rollout_log_ratio is None:
        raise ValueError(f"rl.rollout_correction = {cfg.rollout_correction!r} needs the sampler's log-probs "
                         "(LossMasks.rollout_log_ratio)")
    correction = rollout_correction(masks.rollout_log_ratio, masks.action_mask, cfg)
    return masks._replace(action_mask=masks.action_mask * correction.keep.astype(masks.action_mask.dtype)), correction


def batch_constants(
    advantages: jax.Array, masks: LossMasks, cfg, *, axis_name=None, llds_coef=None, mean_searches=None
) -> BatchConstants:
    """Denominators of the loss terms + mean searches for a whole mini-batch (masks only).

    Inside `shard_map`, `axis_name` sums the pieces over the data-parallel axis first.
    `llds_coef` overrides `cfg.llds_coef` with a (possibly traced) scalar, so lambda can
    change between steps (e.g. a death-spiral monitor raising it) without recompiling.
    `mean_searches` overrides this mini-batch's mean (``rl.ma_search_count = batch_written``
    averages over the whole rollout batch, as the official code does). Masked-IS rejections
    (``rl.rollout_correction``, from ``masks.rollout_log_ratio``) leave the denominators.
    """
    return _constants(advantages, _corrected(masks, cfg)[0], cfg, axis_name=axis_name,
                      llds_coef=llds_coef, mean_searches=mean_searches)


def _constants(advantages, masks: LossMasks, cfg, *, axis_name=None, llds_coef=None, mean_searches=None):
    """`batch_constants` of masks that already went through the rollout correction."""
    row_weight = _row_weight(masks)
    mask = masks.action_mask.astype(jnp.float32)
    advantages = _token_advantages(advantages, mask.shape)
    zeros = jnp.zeros_like(mask)
    denom = aggregate(zeros, mask, row_weight, cfg.aggregation, cfg.token_sum_norm_length)[1]
    denominators = {"pg": denom, "kl_ref": denom, "entropy": denom}
    denominators["llds"] = _llds_denominator(mask * row_weight[:, None], advantages, cfg)
    searches, rows = _searches_sum_and_rows(masks, row_weight, cfg)
    if axis_name is not None:
        denominators, searches, rows = jax.lax.psum((denominators, searches, rows), axis_name)
    lam = jnp.asarray(cfg.llds_coef if llds_coef is None else llds_coef, jnp.float32)
    if mean_searches is None:
        mean_searches = searches / jnp.maximum(rows, 1.0)
    return BatchConstants(denominators, jnp.asarray(mean_searches, jnp.float32), lam)


def objective_terms(batch: PolicyBatch, cfg, constants: BatchConstants | None = None) -> ObjectiveTerms:
    """Unreduced sums, their denominators and extrema for one (micro-)batch.

    `constants` (from `batch_constants` over the whole mini-batch) supplies lambda and the
    mean number of searches for adaptive MA here; the denominators stored in the result are
    always this batch's own, so that pooling terms over micro-batches adds them up correctly.
    """
    masks, correction = _corrected(batch.masks, cfg)
    mask = masks.action_mask.astype(jnp.float32)
    row_weight = _row_weight(masks)
    token_mask = mask * row_weight[:, None]
    logp = batch.logp.astype(jnp.float32)
    old_logp = jax.lax.stop_gradient(batch.old_logp.astype(jnp.float32))
    advantages = _token_advantages(batch.advantages, mask.shape)
    own = _constants(batch.advantages, masks, cfg)
    shared = constants or own
    sink = TermSink({}, {}, {}, {})

    def add_aggregated(key: str, values: jax.Array) -> None:
        sink.add_ratio(key, *aggregate(values, mask, row_weight, cfg.aggregation, cfg.token_sum_norm_length))

    policy = POLICY_LOSSES.get(cfg.policy_loss)(logp, old_logp, advantages, mask, cfg)
    if correction is not None:  # verl: pg_losses * rollout_is_weights (stop-gradient)
        policy = policy._replace(loss=policy.loss * correction.weight)
    add_aggregated("pg", policy.loss)
    for key, values, coef in (
        ("kl_ref", batch.ref_logp, cfg.kl_coef),
        ("entropy", batch.entropy, cfg.entropy_coef),
    ):
        if values is None and coef > 0:
            raise ValueError(f"rl: {key} input is None but its coefficient is {coef}")
        if values is None:
            values = jnp.zeros_like(logp)
        elif key == "kl_ref":
            values = KL_ESTIMATORS.get(cfg.kl_estimator)(
                logp, jax.lax.stop_gradient(values.astype(jnp.float32))
            )
        add_aggregated(key, values.astype(jnp.float32))

    run_ids = action_run_ids(mask, masks.action_index)
    answer_mask = jnp.zeros_like(mask) if masks.answer_mask is None else masks.answer_mask
    llds = llds_terms(
        logp,
        old_logp,
        advantages,
        token_mask,
        answer_mask,
        run_ids,
        cfg,
        shared.mean_searches,
        shared.llds_coef,
    )
    sink.add_ratio("llds", llds.weighted.sum(), own.denominators["llds"])
    sink.add_ratio("llds/value", llds.penalty.sum(), own.denominators["llds"])
    sink.maxima["llds/answer_coef"] = answer_coefficient(cfg, shared.mean_searches, shared.llds_coef)

    add_diagnostics(
        sink,
        policy=policy,
        llds=llds,
        logp=logp,
        old_logp=old_logp,
        advantages=advantages,
        token_mask=token_mask,
        row_weight=row_weight,
        run_ids=run_ids,
        run_starts=action_run_starts(mask, masks.action_index),
        num_searches=masks.num_searches,
    )
    return ObjectiveTerms(sink.sums, sink.denoms, sink.maxima, sink.minima)


def accumulate(a: ObjectiveTerms, b: ObjectiveTerms) -> ObjectiveTerms:
    """Pool two micro-batches' terms: sums and denominators add, extrema combine."""
    return ObjectiveTerms(
        jax.tree.map(jnp.add, a.sums, b.sums),
        jax.tree.map(jnp.add, a.denoms, b.denoms),
        jax.tree.map(jnp.maximum, a.maxima, b.maxima),
        jax.tree.map(jnp.minimum, a.minima, b.minima),
    )


def all_reduce(terms: ObjectiveTerms, axis_name) -> ObjectiveTerms:
    """Pool terms across a data-parallel mesh axis inside `shard_map`."""
    return ObjectiveTerms(
        jax.lax.psum(terms.sums, axis_name),
        jax.lax.psum(terms.denoms, axis_name),
        jax.lax.pmax(terms.maxima, axis_name),
        jax.lax.pmin(terms.minima, axis_name),
    )


def _ratio(total: jax.Array, denom: jax.Array) -> jax.Array:
    return jnp.where(denom > 0, total / jnp.where(denom > 0, denom, 1.0), 0.0)


def _combine(sums: dict, denoms: dict, cfg) -> jax.Array:
    pg, kl_ref, entropy, llds = (_ratio(sums[k], denoms[k]) for k in LOSS_KEYS)
    return pg + cfg.kl_coef * kl_ref - cfg.entropy_coef * entropy + llds


def finalize(terms: ObjectiveTerms, cfg) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(loss, metrics) from pooled terms. `metrics['llds/loss']` already includes lambda."""
    means = {key: _ratio(terms.sums[key], terms.denoms[key]) for key in terms.sums}
    loss = _combine(terms.sums, terms.denoms, cfg)
    metrics = {_METRIC_NAMES.get(k, k): v for k, v in means.items()}
    metrics["loss/total"] = loss
    for key, value in {**terms.maxima, **terms.minima}.items():
        metrics[key] = jnp.where(jnp.isfinite(value), value, 0.0)
    return loss, metrics


def micro_batch_loss(
    batch: PolicyBatch, cfg, constants: BatchConstants, num_micro_batches: int
) -> tuple[jax.Array, ObjectiveTerms]:
    """This micro-batch's share of the mini-batch loss (sum over micro-batches = the loss)."""
    terms = objective_terms(batch, cfg, constants)
    if cfg.loss_scope == "mini_batch":
        return _combine(terms.sums, constants.denominators, cfg), terms
    return _combine(terms.sums, terms.denoms, cfg) / num_micro_batches, terms


def objective(logp, old_logp, ref_logp, entropy, advantages, masks: LossMasks, cfg):
    """(loss, metrics) of one batch in one piece: `finalize(objective_terms(...))`."""
    return finalize(
        objective_terms(PolicyBatch(logp, old_logp, ref_logp, entropy, advantages, masks), cfg), cfg
    )
