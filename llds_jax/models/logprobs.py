"""Per-token log-probabilities and entropies without a [batch, length, vocab] array.

Training needs log π(y_t) for the sampled ids and the full-vocabulary entropy, but the
fp32 logits of a Qwen2.5 batch are 0.61 MB per token. ``token_logprobs`` walks the
sequence in chunks under ``lax.scan``; each chunk's body is rematerialised, so the
forward keeps only [B, chunk, V] alive at once and the backward recomputes a chunk's
logits instead of storing them. Peak temporary memory therefore scales with
``B * chunk_size * V``, independent of the sequence length. When one chunk covers the
sequence there is nothing to trade and it is not rematerialised.

Temperature divides the logits before the softmax, as the reference does when it
recomputes log-probs of tokens sampled at that temperature.

A loss reads log-probs of action tokens only (prompt, feedback and padding are masked
out), so ``sequence_logprobs(..., positions=)`` gathers the final hidden states of just
those positions (``scored_positions``: a static number per row, the action-token bound)
before the output projection. The projection and the softmax over V are a fifth of a
SmolLM2 token's FLOPs and most of its elementwise work; a Search-R1 trajectory's action
tokens are a quarter to a half of its length.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from llds_jax.models.layers import unembed
from llds_jax.parallel.rules import constrain


def _chunk_stats(hidden: jax.Array, table: jax.Array, targets: jax.Array, temperature: float,
                 with_entropy: bool, vocab_major: bool) -> tuple[jax.Array, jax.Array]:
    """log p(target) and entropy [B, C] for one chunk of hidden states [B, C, D]."""
    # One [B*C, D] x table matmul, not a bcd,dv einsum (see ``layers.project``).
    logits = unembed(hidden, table, vocab_major=vocab_major, preferred_element_type=jnp.float32)
    logits = constrain(logits, ("batch", "seq", "act_vocab"))
    if temperature != 1.0:
        logits = logits / temperature
    # One exp pass serves both the normaliser and the entropy; the shift is gradient-free
    # because log Z does not depend on it.
    shift = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    unnormalised = jnp.exp(logits - shift)
    total = jnp.sum(unnormalised, axis=-1)
    log_norm = shift[..., 0] + jnp.log(total)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    logp = target_logit - log_norm
    if not with_entropy:
        return logp, jnp.zeros_like(logp)
    entropy = log_norm - jnp.sum(unnormalised * logits, axis=-1) / total
    return logp, entropy


def balanced_chunk(length: int, chunk_size: int) -> int:
    """The chunk ≤ ``chunk_size`` that splits ``length`` into as few, equal pieces as it can.

    144 positions in chunks of ≤ 64 run as 3 × 48, not 64 + 64 + 16 padded to 192 (a third
    more projection work). Rounded up to a multiple of 8 (sublane-friendly rows on TPU).
    """
    chunk_size = max(1, min(int(chunk_size), length))
    pieces = -(-length // chunk_size)
    chunk = -(-length // pieces)
    return min(-(-chunk // 8) * 8, chunk_size) if chunk >= 8 else chunk


def scored_positions(target_mask: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
    """(positions [B, size] int32, valid [B, size] bool): each row's nonzero columns of ``target_mask``, in order.

    Rows with fewer than ``size`` get trailing entries pointing at column 0 with
    ``valid = False``; columns past ``size`` are dropped, so a caller that cannot prove the
    bound must check it on the host first (``train.batch.check_action_tokens``).
    """
    on = target_mask > 0
    positions = jax.vmap(lambda row: jnp.nonzero(row, size=size, fill_value=0)[0])(on).astype(jnp.int32)
    valid = jnp.arange(size, dtype=jnp.int32)[None, :] < on.sum(axis=1, keepdims=True)
    return positions, valid


def token_logprobs(hidden: jax.Array, table: jax.Array, targets: jax.Array, *, vocab_major: bool = False,
                   temperature: float = 1.0, chunk_size: int = 128, with_entropy: bool = True
                   ) -> tuple[jax.Array, jax.Array | None]:
    """log π(targets) and token entropy, both fp32 [B, T].

    hidden [B, T, D] are final-norm states (``Decoder.hidden_states``) whose position t
    predicts ``targets[:, t]``; table is the output projection, [D, V], or [V, D] with
    ``vocab_major`` (``Decoder.output_head()`` gives both). Differentiable with respect to
    hidden and table. ``with_entropy=False`` returns ``None`` for the entropy.
    """
    if hidden.ndim != 3 or targets.shape != hidden.shape[:2]:
        raise ValueError(f"hidden {hidden.shape} and targets {targets.shape} must be [B, T, D] and [B, T]")
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    batch, length, width = hidden.shape
    chunk = balanced_chunk(length, chunk_size)
    padded = -(-length // chunk) * chunk
    if padded != length:
        hidden = jnp.pad(hidden, ((0, 0), (0, padded - length), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, padded - length)))
    n_chunks = padded // chunk
    hidden_chunks = hidden.reshape(batch, n_chunks, chunk, width).swapaxes(0, 1)
    target_chunks = targets.astype(jnp.int32).reshape(batch, n_chunks, chunk).swapaxes(0, 1)

    body = functools.partial(_chunk_stats, temperature=temperature, with_entropy=with_entropy,
                             vocab_major=vocab_major)
    # Every chunk multiplies the whole table, which is sharded over fsdp along its width: gathered here,
    # before the chunks, not by each chunk. Left to XLA inside the scan, the table was gathered every chunk
    # (and, in the update, gathered again and its gradient reduce-scattered every chunk): qwen3b's 15 chunks
    # a row made 48 gathers and 16 reduce-scatters of the 0.6 GB table an update micro-batch on 8 H100s.
    # Gathered here, a no-grad pass gathers it once (XLA hoists it out of the micro-batch loop) and an
    # update micro-batch once, its gradient summed over the chunks in this layout and reduced once
    # (tests/scale/test_plan_collectives.py reads the compiled programs).
    table = constrain(table, ("vocab", None) if vocab_major else (None, "vocab"))
    if n_chunks == 1:
        # A lone chunk's logits die before the decoder's backward starts whether they are kept
        # or recomputed, so rematerialising them would only repeat the projection.
        logp, entropy = jax.tree.map(lambda x: x[None], body(hidden_chunks[0], table, target_chunks[0]))
    else:
        body = jax.checkpoint(body)
        _, (logp, entropy) = jax.lax.scan(lambda _, xs: (None, body(xs[0], table, xs[1])), None,
                                          (hidden_chunks, target_chunks))
    logp = logp.swapaxes(0, 1).reshape(batch, padded)[:, :length]
    entropy = entropy.swapaxes(0, 1).reshape(batch, padded)[:, :length]
    return logp, (entropy if with_entropy else None)


def sequence_logprobs(model, input_ids: jax.Array, attention_mask: jax.Array, *, temperature: float = 1.0,
                      chunk_size: int = 128, with_entropy: bool = True, positions: jax.Array | None = None,
                      segment_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
    """log π(input_ids[:, t+1] | prefix) for a Decoder, fp32 [B, T-1] (and entropy).

    Entry t scores token t+1, the usual shift for causal LMs; masks are the caller's job.
    With ``positions`` [B, K] (target columns, e.g. from ``scored_positions``) only those
    entries are computed: [B, K], entry k scoring token ``positions[:, k] + 1``.
    ``segment_ids`` [B, T]: packed rows (``Decoder.hidden_states``); ``attention_mask`` is then
    ignored, and a column whose next token starts another segment scores nothing meaningful
    (action targets never do: a trajectory starts with its prompt).
    """
    hidden = model.hidden_states(input_ids, attention_mask, segment_ids=segment_ids)[:, :-1]
    targets = input_ids[:, 1:]
    if positions is not None:
        hidden = constrain(jnp.take_along_axis(hidden, positions[..., None], axis=1), ("batch", "seq", "act_embed"))
        targets = jnp.take_along_axis(targets, positions, axis=1)
    table, vocab_major = model.output_head()
    return token_logprobs(hidden, table, targets, vocab_major=vocab_major,
                          temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy)
