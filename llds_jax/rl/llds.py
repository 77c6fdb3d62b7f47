"""LLD / LLDS / LLDS-MA: the paper's likelihood-preserving regulariser (SPEC §5).

Per action token t of response i, with d = log pi_old - log pi_theta (pi_old and every gate
carry no gradient) and m the action mask (feedback and padding are 0):

    L = (1/N) sum_i P(A_i) sum_t c_t * g_{i,t} * m_{i,t} * max(0, d_{i,t})

* P (`llds_preserve`): "non_negative" = [A_i >= 0] (official code, the default), "positive" =
  [A_i > 0] (only correct responses of mixed groups; zero-advantage rows are left alone).
* c_t = lambda on ordinary tokens; on answer tokens (last <answer>...</answer>, tags included)
  min(w_ans, lambda) under MA, w_ans scaled by max(mean_searches - 1, 0) under adaptive MA.
* g (0/1, stop-gradient) is chosen by `llds_gate`:
    "token"    LLD: g = 1, every likelihood-reducing token of a preserved response.
    "response" R-gate (paper v1, eq. 5): g = [sum_t m d > 0] per response.
    "action"   A-gate (official code default): g = [sum over the action's run of d > 0], an
               action being a maximal run of action tokens between feedback spans.
* N (`llds_denominator`): "action_tokens" = every action token of the (micro-/mini-)batch, as
  the official code and SPEC §5 say; "preserved_tokens" = only those of responses with A >= 0,
  the paper's eq. 5 normaliser (the preserved set follows `llds_preserve`) (larger per-token weight when few responses are preserved).
* `answer_in_gate` (default True): answer tokens still count in the gate's signed sum under
  MA (MA only changes their coefficient); False drops them from the gate as well.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from llds_jax.rl.action_runs import sum_over_runs
from llds_jax.rl.registry import Registry

LLDS_GATES: Registry = Registry("LLDS gate")


@LLDS_GATES.register("token")
def no_gate(gate_displacement: jax.Array, run_ids: jax.Array) -> jax.Array:
    return jnp.ones_like(gate_displacement)


@LLDS_GATES.register("response")
def response_gate(gate_displacement: jax.Array, run_ids: jax.Array) -> jax.Array:
    total = gate_displacement.sum(axis=-1, keepdims=True)
    return jnp.broadcast_to(total > 0, gate_displacement.shape).astype(gate_displacement.dtype)


@LLDS_GATES.register("action")
def action_gate(gate_displacement: jax.Array, run_ids: jax.Array) -> jax.Array:
    return (sum_over_runs(gate_displacement, run_ids) > 0).astype(gate_displacement.dtype)


def answer_coefficient(cfg, mean_searches, llds_coef) -> jax.Array:
    """Coefficient of answer tokens: lambda, or min(w_ans [* max(mean_searches - 1, 0)], lambda)."""
    llds_coef = jnp.asarray(llds_coef, jnp.float32)
    if not cfg.mask_answer:
        return llds_coef
    weight = jnp.asarray(cfg.answer_weight, jnp.float32)
    if cfg.adaptive_ma:
        weight = weight * jnp.maximum(jnp.asarray(mean_searches, jnp.float32) - 1.0, 0.0)
    return jnp.minimum(weight, llds_coef)


def preserved_rows(advantages: jax.Array, cfg) -> jax.Array:
    """Bool mask of the responses LLDS protects (``rl.llds_preserve``), broadcast like ``advantages``."""
    return advantages > 0 if cfg.llds_preserve == "positive" else advantages >= 0


class LLDSTerms(NamedTuple):
    weighted: jax.Array  # [B, T] c * g * pres * m * max(0, d): the loss numerator (differentiable)
    penalty: jax.Array  # [B, T] same without c: the paper's L_LLDS numerator (a metric)
    gate: jax.Array  # [B, T] 0/1 gate on action tokens of preserved responses
    preserved: jax.Array  # [B, T] 0/1: action token of a response with A >= 0


def llds_terms(
    logp, old_logp, advantages, token_mask, answer_mask, run_ids, cfg, mean_searches, llds_coef
) -> LLDSTerms:
    """Per-token LLDS pieces; `token_mask` is the action mask times the row weight.

    `llds_coef` (lambda) is passed in rather than read from `cfg` so it may be a traced
    scalar: a monitor can change it between steps without recompiling.
    """
    displacement = jax.lax.stop_gradient(old_logp) - logp
    d_const = jax.lax.stop_gradient(displacement)
    on = token_mask > 0
    answer = on & (answer_mask > 0)
    in_gate = on if (cfg.answer_in_gate or not cfg.mask_answer) else on & ~answer
    gate = jax.lax.stop_gradient(LLDS_GATES.get(cfg.llds_gate)(jnp.where(in_gate, d_const, 0.0), run_ids))
    preserved = (on & preserved_rows(advantages, cfg)).astype(logp.dtype)
    # `where`, not `maximum(0, d)`: the gradient must be exactly 0 at d = 0 (pi_theta = pi_old).
    reducing = jnp.where(d_const > 0, displacement, 0.0)
    penalty = token_mask * preserved * gate * reducing
    coefficient = jnp.where(answer, answer_coefficient(cfg, mean_searches, llds_coef), llds_coef)
    return LLDSTerms(
        weighted=coefficient * penalty, penalty=penalty, gate=gate * preserved, preserved=preserved
    )
