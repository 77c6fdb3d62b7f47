"""A micro-batch's share of the loss, and its exact accumulation over a mini-batch (padded rows).

Why a module of its own: this is the gradient's inner loop — one forward, one ``micro_batch_loss``
(``llds_jax.rl.objective``: sums and denominators, so the micro-batches add up exactly), fp32 gradient
sums — shared in its tail (``policy_objective``) by the packed path (``train.packed_step``), and run
once per mini-batch by the update (``train.step.mini_batch_update``).

Mini-batch 1 of a step runs at θ = θ_old exactly, so its loss uses its own forward,
gradient-stopped, as log π_old (``on_policy``; verl does the same for on-policy updates). The
separately computed π_old equals that forward only up to rounding — the two are different XLA programs
and on a tensor-parallel mesh they partition differently (measured: 4.6e-9 LLDS, 1e-6 log-prob
gaps) — and the LLDS hinge max(0, log π_old − log π_θ) turns noise-sized gaps into
λ·∇log π gradients on about half the tokens (8e-4 relative grad-norm drift on a (2, 2, 2)
mesh). The precomputed π_old still serves every later mini-batch. Each micro-batch reports
max |log π_θ − precomputed log π_old| on action tokens (the gap, ``delta_logp/abs_max``); in mini-batch 1
that is the recompute gap, so a code-path mismatch (dtype, temperature) stays visible.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from llds_jax.rl.objective import BatchConstants, ObjectiveTerms, PolicyBatch, micro_batch_loss
from llds_jax.rl.objective import accumulate as accumulate_terms
from llds_jax.train.batch import TrainBatch
from llds_jax.train.forward import (
    advantage_view,
    constrain_rows,
    forward_logprobs,
    objective_view,
    split_rows,
)
from llds_jax.train.step_settings import StepSettings


def entropy_term(entropy, rl_cfg):
    """The update's entropy: a gradient term when ``rl.entropy_coef`` > 0, a logged metric (no gradient) at 0."""
    return entropy if entropy is None or rl_cfg.entropy_coef > 0 else jax.lax.stop_gradient(entropy)


def policy_objective(logp, entropy, view, scored, advantages, constants: BatchConstants, on_policy, rl_cfg,
                     num_micro_batches):
    """(loss, (terms, gap)) of a micro-batch whose log π_θ (and entropy) the caller's forward gave.

    ``view`` = (positions, masks, precomputed π_old, π_ref) from ``objective_view``; ``scored`` [N, K]
    marks the entries the gap reads; ``on_policy`` swaps in the forward's own gradient-stopped log-probs
    as π_old (mini-batch 1, see the module docstring).
    """
    positions, masks, precomputed_old, ref_logp = view
    own = jax.lax.stop_gradient(logp)
    gap = jnp.max(jnp.where(scored, jnp.abs(own - precomputed_old), 0.0))
    old_logp = jnp.where(on_policy, own, precomputed_old)
    policy_batch = PolicyBatch(logp=logp, old_logp=old_logp, ref_logp=ref_logp, entropy=entropy,
                               advantages=advantage_view(advantages, positions), masks=masks)
    loss, terms = micro_batch_loss(policy_batch, rl_cfg, constants, num_micro_batches)
    return loss, (terms, gap)


def micro_loss(graphdef, settings: StepSettings, params, mb: TrainBatch, advantages, constants: BatchConstants,
               on_policy):
    """One padded micro-batch's share of the mini-batch loss: differentiated with respect to ``params``."""
    positions, masks, precomputed_old, ref_logp = objective_view(mb, settings.scored(mb.input_ids))
    logp, entropy = forward_logprobs(graphdef, params, mb.input_ids, mb.attention_mask,
                                     temperature=settings.temperature, chunk_size=settings.chunk_size,
                                     with_entropy=settings.with_entropy, positions=positions)
    entropy = entropy_term(entropy, settings.rl)
    return policy_objective(logp, entropy, (positions, masks, precomputed_old, ref_logp), masks.action_mask > 0,
                            advantages, constants, on_policy, settings.rl, settings.sizes.num_micro_batches)


def empty_terms(shapes: ObjectiveTerms) -> ObjectiveTerms:
    """The identity of ``accumulate_terms``: zero sums/denominators, ∓inf extrema."""
    full = lambda tree, value: jax.tree.map(lambda s: jnp.full(s.shape, value, s.dtype), tree)
    return ObjectiveTerms(full(shapes.sums, 0.0), full(shapes.denoms, 0.0),
                          full(shapes.maxima, -jnp.inf), full(shapes.minima, jnp.inf))


def add_micro_batch(carry, micro):
    """(grads, loss, terms, gap) plus one micro-batch's ((loss, (terms, gap)), grads): fp32 gradient sums."""
    grads, loss, terms, gap = carry
    (mb_loss, (mb_terms, mb_gap)), mb_grads = micro
    grads = jax.tree.map(lambda g, d: g + d.astype(jnp.float32), grads, mb_grads)
    return grads, loss + mb_loss, accumulate_terms(terms, mb_terms), jnp.maximum(gap, mb_gap)


def accumulate_micro_batches(graphdef, settings: StepSettings, params, mini: TrainBatch, advantages,
                             constants: BatchConstants, on_policy, zero_grads):
    """(grads, loss, terms, gap) of one padded mini-batch: a ``lax.scan`` over its micro-batches, in row order."""
    grad_fn = jax.value_and_grad(functools.partial(micro_loss, graphdef, settings), has_aux=True)
    micros = split_rows((mini, advantages), settings.sizes.num_micro_batches)

    def accumulate(carry, micro):
        mb, mb_advantages = constrain_rows(micro, settings.rules)
        return add_micro_batch(carry, grad_fn(params, mb, mb_advantages, constants, on_policy)), None

    first_mb, first_advantages = jax.tree.map(lambda x: x[0], micros)
    terms_shape = jax.eval_shape(grad_fn, params, first_mb, first_advantages, constants, on_policy)[0][1][0]
    zero = jnp.zeros((), jnp.float32)
    (grads, loss, terms, gap), _ = jax.lax.scan(
        accumulate, (zero_grads, zero, empty_terms(terms_shape), zero), micros)
    return grads, loss, terms, gap
