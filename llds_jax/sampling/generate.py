"""``generate``: one batched, single-turn call of the sampler, with bucketed shapes.

It runs on the rollout engine's decode slots (``slots.SlotSession``, the paged KV cache),
so there is one cache layout and one decode program: row ``b`` is slot ``b`` holding
trajectory ``b``, its mask-true prompt ids are appended from cache slot 0 on (no padding
in the cache, positions as transformers counts them), and one decode call samples every
row's action.

Shapes that reach the compiled programs are rounded up to buckets (powers of two, at
least 16 for lengths): the batch, the longest prompt and the generation width. Padding rows
idle and a row's padding never enters the cache, so results do not depend on the bucket —
only the number of compiled programs does: one per bucket, whatever the prompts, knobs,
stop strings or weights (asserted in the tests).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from llds_jax.sampling import decode_loop
from llds_jax.sampling.slots import MIN_LENGTH_BUCKET, SlotSession, bucket
from llds_jax.sampling.stop_strings import StopStringTable, build_stop_table
from llds_jax.sampling.token_bytes import vocab_bytes


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
    is kept, see ``stop_strings.py``), or at ``max_new_tokens``. Every row needs at least
    one prompt token (its first draw follows its last one).
    """
    graphdef, params = nnx.split(model) if isinstance(model, nnx.Module) else model
    config = _config(graphdef, params)
    input_ids = np.asarray(input_ids, np.int32)
    attention_mask = np.asarray(attention_mask, bool)
    if input_ids.shape != attention_mask.shape or input_ids.ndim != 2:
        raise ValueError(f"input_ids {input_ids.shape} and attention_mask {attention_mask.shape} must be equal [B, T]")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
    prompts = [ids[row_mask].tolist() for ids, row_mask in zip(input_ids, attention_mask)]
    empty = [row for row, ids in enumerate(prompts) if not ids]
    if empty:
        raise ValueError(f"rows {empty} have no prompt token (attention_mask all false)")
    rows = len(prompts)
    # The context a row may hold, bucketed (the longest real prompt, then the generation
    # buffer) so that the pool and block tables — shapes of both programs — follow the buckets.
    width = bucket(max_new_tokens, MIN_LENGTH_BUCKET)
    max_tokens = bucket(max(map(len, prompts)), MIN_LENGTH_BUCKET) + width

    sampling = decode_loop.SamplingParams.create(
        temperature=temperature, top_k=top_k, top_p=top_p, stop_token_ids=stop_token_ids,
        stop_table=resolve_stop_table(stop_strings, tokenizer, config.vocab_size))
    session = SlotSession((graphdef, params), sampling, slots=bucket(rows), max_action_tokens=max_new_tokens,
                          key=key, max_tokens=max_tokens, pad_id=pad_id)
    for row in range(rows):
        # slot ``row`` holds trajectory ``row``: its draws use fold_in(fold_in(key, row), n), the
        # keys ``decode_loop.row_keys(key, arange(B))`` gave the dense path; its own ``columns``
        # blocks of the pool (sized for every allocated slot to hold ``max_tokens``)
        session.reset(row, row, 0)
        session.set_blocks(row, np.arange(row * session.columns, (row + 1) * session.columns))
    # mask-true ids only: a row's tokens sit from cache slot 0 on, at positions 0, 1, ... —
    # transformers' cumsum(mask) - 1 position ids for left or right padding alike
    session.append(dict(enumerate(prompts)))
    for row in range(rows):
        session.start_action(row, max_new_tokens)
    actions = session.decode(width)  # every budget is ≤ the buffer width: one call ends every action
    if session.any_decoding or len(actions) != rows:
        raise RuntimeError(f"a decode call of {width} tokens ended {len(actions)} of {rows} rows")

    tokens = np.full((rows, max_new_tokens), pad_id, np.int32)
    logprobs = np.zeros((rows, max_new_tokens), np.float32)
    lengths = np.zeros((rows,), np.int32)
    finish = np.zeros((rows,), np.int32)
    for row, action in actions.items():
        n = len(action.ids)
        tokens[row, :n], logprobs[row, :n], lengths[row], finish[row] = action.ids, action.logprobs, n, action.finish
    return GenerateOutput(tokens=tokens, logprobs=logprobs, lengths=lengths, finish=finish)


def _config(graphdef, params):
    """The model's ``DecoderConfig`` without materialising weights."""
    return nnx.merge(graphdef, params).config
