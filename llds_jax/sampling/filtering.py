"""Temperature, top-k and top-p (nucleus) filtering, and drawing one token per row.

The order is HF's and vLLM's: divide by the temperature, keep the ``top_k`` largest
logits, then keep the smallest set of the remaining tokens (largest first) whose
probability mass reaches ``top_p``. Tokens tied with the last kept one are kept too.

All knobs are traced scalars, so one compiled decode loop serves greedy evaluation and
sampled training. The sort that top-k/top-p need is skipped with ``lax.cond`` when
neither is active (``top_k == 0`` and ``top_p >= 1``): sorting a 152k vocabulary every
step is the most expensive thing here after the model itself.

``temperature <= 0`` means greedy. The log-prob returned for a token is under the
distribution it was drawn from (temperature-scaled and filtered); for greedy it is the
plain log-softmax of the logits, i.e. the model's own log-prob at temperature 1. Its
normaliser is summed so that a row's log-prob does not depend on the batch it was drawn
in (``models.reductions``): a rollout in waves of any size gets the same numbers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from llds_jax.models.reductions import log_softmax

_NEG_INF = -jnp.inf


def _truncate(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    vocab = scaled.shape[-1]
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth_largest = jax.lax.dynamic_index_in_dim(sorted_desc, k - 1, axis=-1, keepdims=True)
    in_top_k = jnp.arange(vocab)[None, :] < k
    sorted_kept = jnp.where(in_top_k, sorted_desc, _NEG_INF)
    probs = jax.nn.softmax(sorted_kept, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    in_nucleus = in_top_k & (mass_before < top_p)  # the top token always has mass_before == 0
    nucleus_floor = jnp.min(jnp.where(in_nucleus, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    threshold = jnp.maximum(kth_largest, nucleus_floor)
    return jnp.where(scaled < threshold, _NEG_INF, scaled)


def filter_logits(logits: jax.Array, temperature, top_k, top_p) -> jax.Array:
    """``[B, V]`` fp32 logits of the sampling distribution: scaled, with filtered tokens at -inf."""
    logits = logits.astype(jnp.float32)
    temperature = jnp.asarray(temperature, jnp.float32)
    top_k = jnp.asarray(top_k, jnp.int32)
    top_p = jnp.asarray(top_p, jnp.float32)
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)
    needs_sort = (top_k > 0) | (top_p < 1.0)
    return jax.lax.cond(needs_sort, lambda x: _truncate(x, top_k, top_p), lambda x: x, scaled)


def sample_tokens(logits: jax.Array, key: jax.Array, temperature, top_k, top_p
                  ) -> tuple[jax.Array, jax.Array]:
    """One token per row and its log-prob under the distribution it came from. ``[B]``, ``[B]``."""
    temperature = jnp.asarray(temperature, jnp.float32)
    greedy = temperature <= 0

    def draw(logits):
        filtered = filter_logits(logits, temperature, top_k, top_p)
        tokens = jax.random.categorical(key, filtered, axis=-1)
        return tokens, log_softmax(filtered)

    def argmax(logits):
        logits = logits.astype(jnp.float32)
        return jnp.argmax(logits, axis=-1), log_softmax(logits)

    tokens, logprobs = jax.lax.cond(greedy, argmax, draw, logits)
    tokens = tokens.astype(jnp.int32)
    return tokens, jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
