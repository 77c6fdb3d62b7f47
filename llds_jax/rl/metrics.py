"""Diagnostics of one update that the objective can compute for free (SPEC §8).

Every metric is a (sum, denominator) pair or an extremum, like the loss terms, so metrics
pooled over micro-batches and shards are exact too. Names: pos / neg = advantage > 0 / < 0
(strict on both sides, so the A = 0 responses of an all-equal group are in neither: they carry
no "correct vs incorrect" signal). The official LLDS code's ``pos_avg_old_log_prob`` uses
A ≥ 0 (its preserved set) and so mixes those zero-advantage groups into the "correct" curve;
``llds/*`` metrics below use A ≥ 0, as the penalty does;
"first_action" / "later_actions" = action run 0 / runs >= 1 (the paper tracks the first
action's likelihood separately, since it decays first).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from llds_jax.rl.kl import k3_kl
from llds_jax.rl.llds import LLDSTerms
from llds_jax.rl.policy_losses import PolicyTerms


class TermSink(NamedTuple):
    """Mutable dicts the objective fills: `sums[k] / denoms[k]` is metric k after pooling."""

    sums: dict
    denoms: dict
    maxima: dict
    minima: dict

    def add_ratio(self, key: str, total: jax.Array, denom: jax.Array) -> None:
        self.sums[key], self.denoms[key] = total, denom

    def add_mean(self, key: str, values: jax.Array, weights: jax.Array) -> None:
        self.add_ratio(key, (values * weights).sum(), weights.sum())


def add_diagnostics(
    sink: TermSink,
    *,
    policy: PolicyTerms,
    llds: LLDSTerms,
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    token_mask: jax.Array,
    row_weight: jax.Array,
    run_ids: jax.Array,
    run_starts: jax.Array,
    num_searches: jax.Array | None,
) -> None:
    on = token_mask > 0
    logp, old_logp = jax.lax.stop_gradient(logp), jax.lax.stop_gradient(old_logp)

    # Ratio statistics and KL to pi_old: how far this update has moved from the sampler.
    ratio = jax.lax.stop_gradient(policy.ratio)
    sink.add_mean("ratio/mean", ratio, token_mask)
    sink.add_mean("ratio/clip_frac", (policy.clipped_high | policy.clipped_low).astype(jnp.float32), token_mask)
    sink.add_mean("ratio/clip_frac_high", policy.clipped_high.astype(jnp.float32), token_mask)
    sink.add_mean("ratio/clip_frac_low", policy.clipped_low.astype(jnp.float32), token_mask)
    sink.add_mean("kl/old_k1", old_logp - logp, token_mask)
    sink.add_mean("kl/old_k3", k3_kl(logp, old_logp), token_mask)
    sink.maxima["ratio/max"] = jnp.where(on, ratio, -jnp.inf).max()
    sink.minima["ratio/min"] = jnp.where(on, ratio, jnp.inf).min()

    # LLDS activity: how much of the preserved set (A >= 0) the gate switches on.
    gate, preserved = llds.gate, llds.preserved
    starts = (run_starts & on).astype(jnp.float32)
    preserved_actions = (starts * preserved).sum()
    gated_actions = (starts * gate).sum()
    preserved_rows = (preserved.max(axis=-1) * row_weight).sum()
    sink.add_mean("llds/gate_frac_tokens", gate, preserved * token_mask)
    sink.add_ratio("llds/gate_frac_actions", gated_actions, preserved_actions)
    sink.add_ratio("llds/gate_frac_responses", (gate.max(axis=-1) * row_weight).sum(), preserved_rows)
    sink.add_ratio("llds/gated_actions_per_preserved_response", gated_actions, preserved_rows)
    sink.add_ratio(
        "llds/preserved_response_frac", preserved_rows, ((token_mask.max(axis=-1) > 0) * row_weight).sum()
    )

    # Likelihood of correct / incorrect responses under pi_old, and its drift so far.
    for sign, selected in (("pos", advantages > 0), ("neg", advantages < 0)):
        weights = token_mask * selected
        sink.add_mean(f"logp_old/{sign}_mean", old_logp, weights)
        # The reference's variant: summed over the group's tokens, divided by ALL action tokens.
        sink.add_ratio(f"logp_old/{sign}_mean_all_token_scaled", (old_logp * weights).sum(), token_mask.sum())
        sink.add_mean(f"logp_old/{sign}_first_action", old_logp, weights * (run_ids == 0))
        sink.add_mean(f"logp_old/{sign}_later_actions", old_logp, weights * (run_ids >= 1))
        sink.add_mean(f"delta_logp/{sign}_mean", logp - old_logp, weights)

    sink.add_ratio("response/action_tokens", token_mask.sum(), row_weight.sum())
    sink.add_ratio("response/actions", starts.sum(), row_weight.sum())
    if num_searches is not None:
        sink.add_mean("response/searches", num_searches.astype(jnp.float32), row_weight)
