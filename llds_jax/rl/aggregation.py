"""Token losses [B, T] -> (unreduced sum, denominator), one pair per aggregation mode.

Returning the pair instead of the mean is what makes accumulation exact: over micro-batches
and data-parallel shards the sums and the denominators are added separately, and the loss is
`total_sum / total_denominator`. Denominators depend on masks only (never on log-probs), so a
trainer can compute the whole mini-batch's denominators before the first micro-batch and
give every micro-batch the same ones (`objective.batch_constants`).

`action_mask` [B, T] is 0/1; `row_weight` [B] is 1 for real rows, 0 for padding rows (any
non-negative weight works). In the seq-mean modes a row counts when it has weight and at
least one action token; token-sum-norm counts every weighted row (a fixed budget per prompt).

  token-mean           sum_bt w m x / sum_bt w m          (reference default)
  seq-mean-token-mean  sum_b w mean_t(x) / sum_b w         (each response counts once)
  seq-mean-token-sum   sum_b w sum_t(x) / sum_b w          (longer responses weigh more)
  token-sum-norm       sum_bt w m x / (sum_b w * L)        (Dr. GRPO: a constant L, default T)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from llds_jax.rl.registry import Registry

AGGREGATIONS: Registry = Registry("loss aggregation")


def _row_terms(values, action_mask, row_weight):
    mask = (action_mask > 0).astype(values.dtype)
    token_count = mask.sum(axis=-1)
    row_sum = (values * mask).sum(axis=-1)
    has_tokens = row_weight * (token_count > 0)
    return mask, token_count, row_sum, has_tokens


@AGGREGATIONS.register("token-mean")
def token_mean(values, action_mask, row_weight, norm_length):
    mask = (action_mask > 0).astype(values.dtype) * row_weight[:, None]
    return (values * mask).sum(), mask.sum()


@AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(values, action_mask, row_weight, norm_length):
    _, token_count, row_sum, has_tokens = _row_terms(values, action_mask, row_weight)
    return (has_tokens * row_sum / jnp.maximum(token_count, 1.0)).sum(), has_tokens.sum()


@AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(values, action_mask, row_weight, norm_length):
    _, _, row_sum, has_tokens = _row_terms(values, action_mask, row_weight)
    return (has_tokens * row_sum).sum(), has_tokens.sum()


@AGGREGATIONS.register("token-sum-norm")
def token_sum_norm(values, action_mask, row_weight, norm_length):
    mask = (action_mask > 0).astype(values.dtype) * row_weight[:, None]
    length = norm_length if norm_length > 0 else values.shape[-1]
    return (values * mask).sum(), row_weight.sum() * length


def aggregate(
    values: jax.Array, action_mask: jax.Array, row_weight: jax.Array, mode: str, norm_length: int = 0
):
    """(sum, denominator) of per-token `values` under aggregation `mode`."""
    return AGGREGATIONS.get(mode)(values, action_mask, row_weight, norm_length)
