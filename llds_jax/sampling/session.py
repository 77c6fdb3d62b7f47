"""A multi-turn decoding session: one live KV cache for a batch of conversations.

The rollout alternates "every active row writes an action" and "some rows receive tool
feedback". Re-prefilling the whole history each turn costs O(context) per turn, which
dominates a multi-turn rollout's generation time (docs/decisions.md); a session keeps
the cache and only ever feeds it new tokens:

    start(prompts, ids) prefill the right-padded prompts, in chunks    (extend)
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
would make every early step as slow as the last possible one. It never grows past
:func:`cache_slot_limit` of ``max_tokens`` (the context cap, which the caller — the
rollout — enforces), so a row's memory is known before the session starts.

A row's results depend on nothing but the row (its trajectory id, prompt and what it is
fed), so a caller may run its rows in waves of any size:

* randomness: row ``b`` samples with ``fold_in(key, trajectory_ids[b])``, counted per
  token it drew (``decode_loop.sample_rows``);
* layout: every row's tokens sit from slot 0 on (prompts right-padded, also when they
  are prefilled in chunks of ``prefill_chunk`` tokens), and the cache has at least
  :data:`MIN_CACHE_SLOTS` slots — the cached attention reads keys in blocks of
  ``CACHED_BLOCK`` and takes the whole cache as one block when it is smaller, so a
  smaller cache would sum a row's attention over a length that depends on the longest
  row beside it (measured with 512-slot blocks: logits differ by ~1e-7 between a 256- and a
  512-slot cache);
* batch width: per-row results do not depend on it — matrix products are row-invariant
  on XLA:CPU and the row reductions (RMSNorm, softmax sums, the sampler's log-softmax)
  use ``models.reductions.row_sum``, whose rounding ignores the row count (asserted by
  the rollout's wave test); each wave uses one batch width, padded with inert rows.
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
from llds_jax.models.attention import CACHED_BLOCK
from llds_jax.sampling import decode_loop
from llds_jax.sampling.generate import MIN_LENGTH_BUCKET, bucket

# The smallest cache a session allocates: one attention key block (see the module docstring).
MIN_CACHE_SLOTS = CACHED_BLOCK
# An append is padded to at least this many batch x token positions. The row reductions
# are batch-invariant (``models.reductions``), but XLA:CPU still switches matmul kernels
# for very small row counts (measured: without this floor a 2-row wave rounded 5 of its
# sampler log-probs 1 ulp away from the all-rows run). Keeping every call at 64 positions
# or more keeps rows bit-identical across wave sizes (the rollout's wave test).
MIN_EXTEND_TOKENS = 64
NO_TRAJECTORY = np.uint32(2**32 - 1)  # the id of a padding row's key (its draws are discarded)


def cache_slot_limit(max_tokens: int) -> int:
    """The most slots a session's cache ever has when no row holds more than ``max_tokens`` tokens."""
    return max(-(-int(max_tokens) // MIN_LENGTH_BUCKET) * MIN_LENGTH_BUCKET, MIN_CACHE_SLOTS)


def cache_slots_at_peak(max_tokens: int) -> int:
    """Slots alive at once in the worst case: the last growth copies the cache into the full one.

    ``grow_cache`` cannot write in place (the output is larger), so while it runs the old
    cache (the bucket below the limit) and the new one both exist.
    """
    limit = cache_slot_limit(max_tokens)
    below = bucket(limit) // 2
    return limit + below if below >= MIN_CACHE_SLOTS else limit


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
    per-action cap (the decode buffer width); ``key``: row ``b`` samples with
    ``fold_in(key, trajectory_ids[b])``; ``max_tokens``: the most tokens a row will hold
    (``None``: unbounded), which caps the cache at :func:`cache_slot_limit`;
    ``prefill_chunk``: prompts are prefilled at most this many columns at a time (0: whole).
    """

    def __init__(self, model, sampling: decode_loop.SamplingParams, *, max_action_tokens: int, key: jax.Array,
                 pad_id: int = 0, max_tokens: int | None = None, prefill_chunk: int = 0):
        self.graphdef, self.params = nnx.split(model) if isinstance(model, nnx.Module) else model
        self.config = nnx.merge(self.graphdef, self.params).config
        self.sampling = sampling
        self.width = bucket(max_action_tokens, MIN_LENGTH_BUCKET)
        self.pad_id = pad_id
        self.key = key
        if prefill_chunk < 0:
            raise ValueError(f"prefill_chunk={prefill_chunk}: expected 0 (whole prompt) or a positive token count")
        self.prefill_chunk = int(prefill_chunk)
        self.slot_limit = None if max_tokens is None else cache_slot_limit(max_tokens)
        self.max_tokens = max_tokens
        self.rows = 0
        self.batch = 0
        self.cache = None
        self.logits = None
        self.keys = None
        self.drawn = np.zeros((0,), np.int32)  # tokens each row has drawn so far (its next key offset)
        self.last_actions: list[SampledAction | None] = []

    def _capacity(self, needed: int) -> int:
        """Slots for a cache that should hold ``needed``: the bucket above, at least one key block, at most the limit."""
        slots = max(bucket(needed, MIN_LENGTH_BUCKET), MIN_CACHE_SLOTS)
        return slots if self.slot_limit is None else min(slots, self.slot_limit)

    def _reserve(self, new_tokens: np.ndarray) -> None:
        """Grow the cache so row ``b`` has ``new_tokens[b]`` free slots after its end."""
        end = np.asarray(jax.device_get(self.cache.end))
        needed = int((end + np.asarray(new_tokens, np.int64)).max())
        if self.slot_limit is not None and needed > self.slot_limit:
            raise ValueError(f"a row needs {needed} cache slots but the session holds at most "
                             f"max_tokens={self.max_tokens} tokens per row ({self.slot_limit} slots)")
        if needed > self.cache.max_len:
            self.cache = decode_loop.grow_cache(self.cache, self._capacity(needed))

    def _extend(self, ids: np.ndarray, mask: np.ndarray) -> None:
        short = bucket(MIN_EXTEND_TOKENS // self.batch) - ids.shape[1]
        if short > 0:  # see MIN_EXTEND_TOKENS
            ids = np.pad(ids, ((0, 0), (0, short)), constant_values=self.pad_id)
            mask = np.pad(mask, ((0, 0), (0, short)))
        logits, self.cache = decode_loop.extend(self.graphdef, self.params, jnp.asarray(ids), jnp.asarray(mask),
                                                self.cache)
        has_tokens = jnp.asarray(mask.any(axis=1))[:, None]
        self.logits = logits if self.logits is None else jnp.where(has_tokens, logits, self.logits)

    def start(self, prompts: Sequence[Sequence[int]], *, trajectory_ids: Sequence[int] | None = None,
              batch: int | None = None) -> None:
        """Prefill a fresh cache with the prompts (right-padded to a bucketed width, in chunks).

        ``trajectory_ids[row]`` (default: the row index) picks the row's random stream;
        ``batch`` (default: the bucket above ``len(prompts)``) is the compiled batch width —
        a caller running waves passes one width for all of them, padded with inert rows.
        """
        self.rows = len(prompts)
        self.batch = bucket(self.rows) if batch is None else int(batch)
        if not 0 < self.rows <= self.batch:
            raise ValueError(f"{self.rows} prompts for a batch of {self.batch} rows")
        ids_of_rows = np.arange(self.rows) if trajectory_ids is None else np.asarray(trajectory_ids, np.int64)
        if ids_of_rows.shape != (self.rows,) or (ids_of_rows < 0).any() or (ids_of_rows >= NO_TRAJECTORY).any():
            raise ValueError(f"trajectory_ids must be {self.rows} ids in [0, 2**32 - 1), got {trajectory_ids}")
        longest = max(len(p) for p in prompts)
        if self.max_tokens is not None and longest > self.max_tokens:
            raise ValueError(f"a prompt of {longest} tokens is longer than the session's max_tokens={self.max_tokens}")
        self.cache = self.logits = None  # the previous wave's cache is freed before the next is allocated
        trajectory = np.full((self.batch,), NO_TRAJECTORY, np.uint32)
        trajectory[: self.rows] = ids_of_rows
        self.keys = decode_loop.row_keys(self.key, trajectory)
        self.drawn = np.zeros((self.batch,), np.int32)
        self.last_actions = []

        width = bucket(longest, MIN_LENGTH_BUCKET)
        ids = np.full((self.batch, width), self.pad_id, np.int32)
        mask = np.zeros((self.batch, width), bool)
        for row, prompt in enumerate(prompts):
            ids[row, : len(prompt)] = prompt
            mask[row, : len(prompt)] = True
        self.cache = decode_loop.new_cache(self.config, self.batch, self._capacity(longest + self.width))
        self._extend_in_chunks(ids, mask)

    def act(self, active: np.ndarray, budgets: np.ndarray) -> list[SampledAction | None]:
        """Sample one action for every active row (up to its budget); ``None`` for the others."""
        done = np.ones((self.batch,), bool)
        done[: self.rows] = ~np.asarray(active, bool)
        budget = np.zeros((self.batch,), np.int32)
        budget[: self.rows] = budgets
        budget = np.where(done, 0, np.minimum(budget, self.width))
        self._reserve(budget)
        state = decode_loop.decode(self.graphdef, self.params, self.logits, self.cache, jnp.asarray(done),
                                   jnp.asarray(budget), self.keys, jnp.asarray(self.drawn), self.sampling,
                                   width=self.width, pad_id=self.pad_id)
        self.cache, self.logits = state.cache, state.logits
        tokens, logprobs, lengths, finish = jax.device_get((state.tokens, state.logprobs, state.lengths, state.finish))
        self.drawn = self.drawn + np.asarray(lengths, np.int32)
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
        self._reserve(mask.sum(axis=1))
        self._extend_in_chunks(ids, mask)

    def _extend_in_chunks(self, ids: np.ndarray, mask: np.ndarray) -> None:
        """Append right-padded ``ids`` at most ``prefill_chunk`` columns per call (all chunks one width)."""
        width = ids.shape[1]
        step = width if self.prefill_chunk == 0 else min(self.prefill_chunk, width)
        columns = -(-width // step) * step
        if columns > width:
            ids = np.pad(ids, ((0, 0), (0, columns - width)), constant_values=self.pad_id)
            mask = np.pad(mask, ((0, 0), (0, columns - width)))
        for first in range(0, columns, step):
            if mask[:, first:first + step].any():  # right padding: nothing real after an empty chunk
                self._extend(ids[:, first:first + step], mask[:, first:first + step])


@functools.partial(jax.jit, donate_argnames=("cache",))
def _forget_last_slots(cache: KVCache, drop: jax.Array) -> KVCache:
    """Move each row's ``end`` back by ``drop[row]`` and mark the slots from there on invalid."""
    end = cache.end - drop
    slots = jnp.arange(cache.max_len, dtype=end.dtype)
    return KVCache(k=cache.k, v=cache.v, valid=cache.valid & (slots[None, :] < end[:, None]), end=end)
