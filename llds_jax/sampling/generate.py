"""``generate``: one batched, single-turn call of the sampler, with bucketed shapes.

Shapes that reach the compiled programs are rounded up to buckets (powers of two, at
least 16 for lengths): the batch, the prompt width and the generation width. Padding rows
are frozen from the start and padding prompt slots are invalid cache slots, so results do
not depend on the bucket — only the number of compiled programs does: one per bucket,
whatever the prompts, knobs, stop strings or weights (asserted in the tests).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from llds_jax.sampling import decode_loop
from llds_jax.sampling.stop_strings import StopStringTable, build_stop_table
from llds_jax.sampling.token_bytes import vocab_bytes

MIN_LENGTH_BUCKET = 16


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two ≥ ``max(n, minimum)``."""
    n = max(int(n), minimum, 1)
    return 1 << (n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    """Host arrays for the caller's rows, ``max_new_tokens`` columns.

    ``tokens`` holds ``pad_id`` past ``lengths``; ``logprobs`` holds 0 there. ``finish``
    is a :class:`~llds_jax.sampling.decode_loop.FinishReason` per row.
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    lengths: np.ndarray
    finish: np.ndarray


@functools.lru_cache(maxsize=8)
def _never_stop_table(vocab_size: int) -> np.ndarray:
    return np.zeros((1, 16, vocab_size), np.int8)


def resolve_stop_table(stop_strings: Sequence[str] | StopStringTable, tokenizer, vocab_size: int) -> np.ndarray:
    """The ``[K, S, V]`` transition tables for ``stop_strings`` (needs the tokenizer for token bytes)."""
    if isinstance(stop_strings, StopStringTable):
        table = stop_strings.transitions
    elif not stop_strings:
        return _never_stop_table(vocab_size)
    else:
        if tokenizer is None:
            raise ValueError("stop_strings need tokenizer= (stop strings are matched on the bytes of tokens)")
        table = build_stop_table(vocab_bytes(tokenizer, vocab_size), tuple(stop_strings)).transitions
    if table.shape[-1] != vocab_size:
        raise ValueError(f"stop-string table covers {table.shape[-1]} ids but the model has {vocab_size} logits")
    return table


def generate(model, input_ids, attention_mask, *, max_new_tokens: int, temperature: float = 1.0,
             top_p: float = 1.0, top_k: int = 0, stop_strings: Sequence[str] | StopStringTable = (),
             stop_token_ids: Sequence[int] = (), key: jax.Array, tokenizer=None,
             pad_id: int = 0) -> GenerateOutput:
    """Sample up to ``max_new_tokens`` per row after a (left- or right-) padded prompt batch.

    ``model`` is a :class:`~llds_jax.models.Decoder` or a ``(graphdef, params)`` pair from
    ``nnx.split``. ``temperature=0`` is greedy. A row stops after a token in
    ``stop_token_ids``, after the token that completes one of ``stop_strings`` (that token
    is kept, see ``stop_strings.py``), or at ``max_new_tokens``.
    """
    graphdef, params = nnx.split(model) if isinstance(model, nnx.Module) else model
    config = _config(graphdef, params)
    input_ids = np.asarray(input_ids, np.int32)
    attention_mask = np.asarray(attention_mask, bool)
    if input_ids.shape != attention_mask.shape or input_ids.ndim != 2:
        raise ValueError(f"input_ids {input_ids.shape} and attention_mask {attention_mask.shape} must be equal [B, T]")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
    rows, prompt_len = input_ids.shape
    batch = bucket(rows)
    prompt_width = bucket(prompt_len, MIN_LENGTH_BUCKET)
    width = bucket(max_new_tokens, MIN_LENGTH_BUCKET)

    tokens = np.full((batch, prompt_width), pad_id, np.int32)
    mask = np.zeros((batch, prompt_width), bool)
    tokens[:rows, prompt_width - prompt_len:] = input_ids  # extra left padding: invalid slots
    mask[:rows, prompt_width - prompt_len:] = attention_mask
    done = np.arange(batch) >= rows
    budget = np.full((batch,), max_new_tokens, np.int32)

    sampling = decode_loop.SamplingParams.create(
        temperature=temperature, top_k=top_k, top_p=top_p, stop_token_ids=stop_token_ids,
        stop_table=resolve_stop_table(stop_strings, tokenizer, config.vocab_size))
    cache = decode_loop.new_cache(config, batch, prompt_width + width)
    logits, cache = decode_loop.extend(graphdef, params, jnp.asarray(tokens), jnp.asarray(mask), cache)
    keys = decode_loop.row_keys(key, np.arange(batch))  # row b's draws depend on (key, b) only
    state = decode_loop.decode(graphdef, params, logits, cache, jnp.asarray(done), jnp.asarray(budget), keys,
                               jnp.zeros((batch,), jnp.int32), sampling, width=width, pad_id=pad_id)
    out_tokens, out_logprobs, lengths, finish = jax.device_get(
        (state.tokens, state.logprobs, state.lengths, state.finish))
    return GenerateOutput(
        tokens=np.asarray(out_tokens[:rows, :max_new_tokens]),
        logprobs=np.asarray(out_logprobs[:rows, :max_new_tokens]),
        lengths=np.asarray(lengths[:rows]),
        finish=np.asarray(finish[:rows]),
    )


def _config(graphdef, params):
    """The model's ``DecoderConfig`` without materialising weights."""
    return nnx.merge(graphdef, params).config
