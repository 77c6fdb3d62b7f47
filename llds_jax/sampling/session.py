"""A multi-turn decoding session: one live KV cache for a batch of conversations.

The rollout alternates "every active row writes an action" and "some rows receive tool
feedback". Re-prefilling the whole history each turn costs O(context) per turn and, in
the measured PyTorch reference run (STACK.md), dominated generation time; a session keeps
the cache and only ever feeds it new tokens:

    start(prompts)      prefill the left-padded prompts                (extend)
    act(active, budget) sample one action per active row               (decode loop)
    observe(chunks)     append each row's feedback ids, right-padded   (extend)
    cut_last_actions(k) keep only the first k[row] ids of a row's last action

The token that ends an action is already in the cache (the decode loop writes every
sampled token), so feedback goes straight after it and positions continue exactly as in
a full forward over the concatenated ids.

Shapes are bucketed — batch, prompt/chunk widths and the cache's slot count to powers of
two, the action buffer to ``bucket(max_action_tokens)`` — so a training run compiles a
handful of programs once. The cache starts with room for the prompts and one action and
grows a bucket at a time (``decode_loop.grow_cache``) as rows lengthen: a decode step's
cost follows the cache's slot count, so a cache sized for ``max_context`` from the start
would make every early step as slow as the last possible one. The context cap itself is
the caller's (the rollout's) to enforce.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from llds_jax.models import KVCache
from llds_jax.sampling import decode_loop
from llds_jax.sampling.generate import MIN_LENGTH_BUCKET, bucket


@dataclasses.dataclass(frozen=True)
class SampledAction:
    """One row's action as sampled: ids, their log-probs and why it ended."""

    ids: np.ndarray
    logprobs: np.ndarray
    finish: decode_loop.FinishReason


class DecodeSession:
    """Turn-synchronous decoding for ``rows`` conversations sharing one cache.

    ``model``: a ``Decoder`` or ``(graphdef, params)``; ``sampling``: a
    :class:`~llds_jax.sampling.decode_loop.SamplingParams`; ``max_action_tokens``: the
    per-action cap (the decode buffer width).
    """

    def __init__(self, model, sampling: decode_loop.SamplingParams, *, max_action_tokens: int, key: jax.Array,
                 pad_id: int = 0):
        self.graphdef, self.params = nnx.split(model) if isinstance(model, nnx.Module) else model
        self.config = nnx.merge(self.graphdef, self.params).config
        self.sampling = sampling
        self.width = bucket(max_action_tokens, MIN_LENGTH_BUCKET)
        self.pad_id = pad_id
        self.key = key
        self.rows = 0
        self.cache = None
        self.logits = None
        self.last_actions: list[SampledAction | None] = []

    @property
    def batch(self) -> int:
        return bucket(self.rows)

    def _reserve(self, new_tokens: int) -> None:
        """Grow the cache so every row has ``new_tokens`` free slots after its end."""
        needed = int(jax.device_get(self.cache.end).max()) + new_tokens
        if needed > self.cache.max_len:
            self.cache = decode_loop.grow_cache(self.cache, bucket(needed, MIN_LENGTH_BUCKET))

    def _extend(self, ids: np.ndarray, mask: np.ndarray) -> None:
        logits, self.cache = decode_loop.extend(self.graphdef, self.params, jnp.asarray(ids), jnp.asarray(mask),
                                                self.cache)
        has_tokens = jnp.asarray(mask.any(axis=1))[:, None]
        self.logits = logits if self.logits is None else jnp.where(has_tokens, logits, self.logits)

    def start(self, prompts: Sequence[Sequence[int]]) -> None:
        """Prefill a fresh cache with the prompts (left-padded to a bucketed width)."""
        self.rows = len(prompts)
        width = bucket(max(len(p) for p in prompts), MIN_LENGTH_BUCKET)
        ids = np.full((self.batch, width), self.pad_id, np.int32)
        mask = np.zeros((self.batch, width), bool)
        for row, prompt in enumerate(prompts):
            if prompt:
                ids[row, width - len(prompt):] = prompt
                mask[row, width - len(prompt):] = True
        self.cache = decode_loop.new_cache(self.config, self.batch, bucket(width + self.width, MIN_LENGTH_BUCKET))
        self.logits = None
        self._extend(ids, mask)

    def act(self, active: np.ndarray, budgets: np.ndarray) -> list[SampledAction | None]:
        """Sample one action for every active row (up to its budget); ``None`` for the others."""
        done = np.ones((self.batch,), bool)
        done[: self.rows] = ~np.asarray(active, bool)
        budget = np.zeros((self.batch,), np.int32)
        budget[: self.rows] = budgets
        self._reserve(self.width)
        self.key, key = jax.random.split(self.key)
        state = decode_loop.decode(self.graphdef, self.params, self.logits, self.cache, jnp.asarray(done),
                                   jnp.asarray(budget), key, self.sampling, width=self.width, pad_id=self.pad_id)
        self.cache, self.logits = state.cache, state.logits
        tokens, logprobs, lengths, finish = jax.device_get((state.tokens, state.logprobs, state.lengths, state.finish))
        self.last_actions = [
            SampledAction(tokens[row, : lengths[row]], logprobs[row, : lengths[row]],
                          decode_loop.FinishReason(int(finish[row])))
            if not done[row] else None
            for row in range(self.rows)
        ]
        return list(self.last_actions)

    def cut_last_actions(self, kept_tokens: Sequence[int | None]) -> None:
        """Forget all but the first ``kept_tokens[row]`` ids of each row's last action (``None``: keep all).

        Used when the action's text is cut after it was sampled (the Search-R1 cut at an
        ``</answer>`` that did not decide the action). The dropped slots become invalid,
        so positions continue from the kept ids exactly as if decoding had stopped there;
        the last kept id is written again to get the next-token logits after it.
        """
        if len(kept_tokens) != self.rows:
            raise ValueError(f"{len(kept_tokens)} kept-token counts for {self.rows} rows")
        drop = np.zeros((self.batch,), np.int32)
        ids = np.full((self.batch, MIN_LENGTH_BUCKET), self.pad_id, np.int32)
        mask = np.zeros((self.batch, MIN_LENGTH_BUCKET), bool)
        for row, kept in enumerate(kept_tokens):
            if kept is None:
                continue
            action = self.last_actions[row] if row < len(self.last_actions) else None
            sampled = 0 if action is None else len(action.ids)
            if not 1 <= kept <= sampled:
                raise ValueError(f"row {row}: cannot keep {kept} of the {sampled} ids its last action sampled")
            if kept < sampled:
                drop[row] = sampled - kept + 1
                ids[row, 0], mask[row, 0] = action.ids[kept - 1], True
        if not mask.any():
            return
        self.cache = _forget_last_slots(self.cache, jnp.asarray(drop))
        self._extend(ids, mask)

    def observe(self, chunks: Sequence[Sequence[int]]) -> None:
        """Append each row's feedback ids (empty for rows that get none)."""
        longest = max((len(c) for c in chunks), default=0)
        if longest == 0:
            return
        width = bucket(longest, MIN_LENGTH_BUCKET)
        ids = np.full((self.batch, width), self.pad_id, np.int32)
        mask = np.zeros((self.batch, width), bool)
        for row, chunk in enumerate(chunks):
            ids[row, : len(chunk)] = chunk
            mask[row, : len(chunk)] = True
        self._reserve(width)
        self._extend(ids, mask)


@functools.partial(jax.jit, donate_argnames=("cache",))
def _forget_last_slots(cache: KVCache, drop: jax.Array) -> KVCache:
    """Move each row's ``end`` back by ``drop[row]`` and mark the slots from there on invalid."""
    end = cache.end - drop
    slots = jnp.arange(cache.max_len, dtype=end.dtype)
    return KVCache(k=cache.k, v=cache.v, valid=cache.valid & (slots[None, :] < end[:, None]), end=end)
