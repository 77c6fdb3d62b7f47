"""Decode slots: a fixed batch of rows, each advancing its own conversation (continuous batching).

:class:`~llds_jax.sampling.session.DecodeSession` moves all its rows through one turn at a
time. A :class:`SlotSession` keeps ``slots`` rows alive and lets each one be at a different
point of its own conversation, as JetStream's decode slots do:

    reset(slot, trajectory, drawn)  the slot now holds another trajectory (empty cache row)
    append({slot: ids})             feed ids to slots' caches: a prompt, a history (recompute), feedback
    start_action(slot, budget)      the slot decodes an action of at most ``budget`` tokens
    decode(steps)                   up to ``steps`` tokens for every decoding slot, in one device call;
                                    returns the actions that ended: {slot: ids, log-probs, finish reason}
    stop_action(slot)               abandon an unfinished action (preemption: redrawn later, same keys)
    cut({slot: kept})               keep the first ``kept`` ids of each slot's last action

A decode call ends after ``steps`` tokens or when no slot decodes: the host then sees which
actions ended, appends feedback, admits new trajectories, and calls again. The per-action
state (ids so far, stop-string state, length) lives on the device between calls, so an
action spans as many calls as it needs.

The same invariants as the session, so a trajectory's tokens do not depend on its slot, its
neighbours or the order of events: row ``b`` samples token ``n`` of its trajectory with
``fold_in(fold_in(key, trajectory id), n)``, its tokens sit from cache slot 0 on, the cache
has at least one key block, and appends go through the same padded ``extend``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from llds_jax.models import KVCache
from llds_jax.sampling import decode_loop, placement, stop_strings
from llds_jax.sampling.decode_loop import DecodeState, FinishReason, SamplingParams
from llds_jax.sampling.generate import MIN_LENGTH_BUCKET, bucket
from llds_jax.sampling.session import (
    MIN_CACHE_SLOTS,
    MIN_EXTEND_TOKENS,
    NO_TRAJECTORY,
    SampledAction,
    cache_slot_limit,
)

# The fewest rows a session decodes: XLA:CPU multiplies a single row by a matrix with another
# kernel (a vector product), whose rounding differs by an ulp (measured: 27 of a one-slot
# rollout's sampler log-probs were 1 ulp off the 16-slot run, the same tokens). With two
# rows or more the rows are bit-identical (the waves' 2-row test), so one slot runs on two rows.
MIN_ROWS = 2


class SlotSession:
    """``slots`` decode rows over one cache (see the module docstring); at least :data:`MIN_ROWS`
    rows are allocated, the extra ones idle.

    ``model``: a ``Decoder`` or ``(graphdef, params)``; ``max_tokens``: a row's context cap
    (the cache never grows past :func:`~llds_jax.sampling.session.cache_slot_limit` of it);
    ``prefill_chunk``: appends run at most this many columns per call (0: whole); ``mesh``: a
    process-local ``sampling.placement.sampler_mesh`` to spread the rows over (each device
    holds ``slots / devices`` rows and a replica of the weights; None: the default device).
    ``usable_slots`` is ``slots`` rounded up to a multiple of the devices; ``slots`` the rows
    allocated (at least :data:`MIN_ROWS` per device).
    """

    def __init__(self, model, sampling: SamplingParams, *, slots: int, max_action_tokens: int, key: jax.Array,
                 max_tokens: int, pad_id: int = 0, prefill_chunk: int = 0, mesh: jax.sharding.Mesh | None = None):
        self.graphdef, self.params = nnx.split(model) if isinstance(model, nnx.Module) else model
        self.mesh = mesh
        devices = 1 if mesh is None else mesh.devices.size
        if mesh is not None:
            self.params = placement.replicate_params(self.params, mesh)
        self.config = nnx.merge(self.graphdef, self.params).config
        self.sampling, self.key, self.pad_id = sampling, key, int(pad_id)
        self.usable_slots = -(-int(slots) // devices) * devices
        self.slots = max(self.usable_slots, MIN_ROWS * devices)
        self.rows_per_device = self.slots // devices
        self.width = bucket(max_action_tokens, MIN_LENGTH_BUCKET)
        self.max_tokens = int(max_tokens)
        self.slot_limit = cache_slot_limit(max_tokens)
        self.prefill_chunk = int(prefill_chunk)
        self.trajectory = np.full((self.slots,), NO_TRAJECTORY, np.uint32)
        self.drawn = np.zeros((self.slots,), np.int32)        # tokens the slot's trajectory drew before its action
        self.budget = np.zeros((self.slots,), np.int32)       # the current action's cap (0: not decoding)
        self.decoding = np.zeros((self.slots,), bool)
        self.partial = np.zeros((self.slots,), np.int32)      # tokens the current action has so far
        self.rows_end = np.zeros((self.slots,), np.int64)     # tokens in each slot's cache (host mirror of end)
        with placement.on_mesh(mesh):
            # sliced out of the stacked layers once per session: a decode call would copy them every
            # call (Decoder.layer_weights), and the engine makes several short calls per action
            # (SmolLM2 on XLA:CPU, 48-token actions, segment 8: 6 calls where the waves make 1;
            # before this the engine took 38 s of CPU per rollout against the waves' 27 s)
            self.layer_weights = _layer_weights(self.graphdef, self.params)
            self.cache = self._rows(decode_loop.new_cache(self.config, self.slots, MIN_CACHE_SLOTS))
            self.logits = self._rows(jnp.zeros((self.slots, self.config.vocab_size), jnp.float32))
            self.keys = self._rows(decode_loop.row_keys(self.key, self.trajectory))
            self.state = self._rows(self._fresh_action_state())
        self._keys_stale = False
        self._started: set[int] = set()  # slots whose action begins with the next decode call
        self._last: dict[int, SampledAction] = {}

    def _rows(self, tree):
        """``tree``'s arrays (leading axis: rows) split over the mesh's devices; as they are without a mesh."""
        if self.mesh is None:
            return jax.tree.map(jnp.asarray, tree)
        return jax.device_put(tree, placement.row_sharding(self.mesh))

    def _fresh_action_state(self) -> dict[str, jax.Array]:
        return dict(tokens=jnp.full((self.slots, self.width), self.pad_id, jnp.int32),
                    logprobs=jnp.zeros((self.slots, self.width), jnp.float32),
                    lengths=jnp.zeros((self.slots,), jnp.int32), done=jnp.ones((self.slots,), bool),
                    finish=jnp.zeros((self.slots,), jnp.int32),
                    stop_state=jnp.zeros((self.slots, self.sampling.stop_table.shape[0]), jnp.int8))

    # -- slot bookkeeping ------------------------------------------------------------------
    def reset(self, slot: int, trajectory: int, drawn: int) -> None:
        """``slot`` now holds ``trajectory``, which has drawn ``drawn`` tokens so far; its cache row empties."""
        if not 0 <= trajectory < NO_TRAJECTORY:
            raise ValueError(f"trajectory id {trajectory} out of range")
        self.trajectory[slot], self.drawn[slot] = trajectory, drawn
        self.decoding[slot], self.budget[slot], self.rows_end[slot] = False, 0, 0
        self._keys_stale = True
        with placement.on_mesh(self.mesh):
            self.cache = _empty_rows(self.cache, self._rows(np.arange(self.slots) == slot))

    def _reserve(self, new_tokens: np.ndarray) -> None:
        needed = int((self.rows_end + new_tokens).max())
        if needed > self.slot_limit:
            raise ValueError(f"a slot needs {needed} cache slots; rows hold at most max_tokens={self.max_tokens}")
        if needed > self.cache.max_len:
            slots = min(max(bucket(needed, MIN_LENGTH_BUCKET), MIN_CACHE_SLOTS), self.slot_limit)
            with placement.on_mesh(self.mesh):
                self.cache = self._rows(decode_loop.grow_cache(self.cache, slots))

    # -- appends -----------------------------------------------------------------------------
    def append(self, chunks: dict[int, list[int]]) -> None:
        """Feed ``chunks[slot]`` to each slot's cache (right-padded, in ``prefill_chunk`` columns)."""
        chunks = {slot: ids for slot, ids in chunks.items() if len(ids)}
        if not chunks:
            return
        width = bucket(max(len(c) for c in chunks.values()), MIN_LENGTH_BUCKET)
        ids = np.full((self.slots, width), self.pad_id, np.int32)
        mask = np.zeros((self.slots, width), bool)
        for slot, chunk in chunks.items():
            ids[slot, : len(chunk)] = chunk
            mask[slot, : len(chunk)] = True
        self._reserve(mask.sum(axis=1))
        step = width if self.prefill_chunk == 0 else min(self.prefill_chunk, width)
        columns = -(-width // step) * step
        if columns > width:
            ids = np.pad(ids, ((0, 0), (0, columns - width)), constant_values=self.pad_id)
            mask = np.pad(mask, ((0, 0), (0, columns - width)))
        for first in range(0, columns, step):
            if mask[:, first:first + step].any():
                self._extend(ids[:, first:first + step], mask[:, first:first + step])
        self.rows_end += mask.sum(axis=1)

    def _extend(self, ids: np.ndarray, mask: np.ndarray) -> None:
        short = bucket(MIN_EXTEND_TOKENS // self.rows_per_device) - ids.shape[1]
        if short > 0:  # the session's floor on a call's positions per device (session.MIN_EXTEND_TOKENS)
            ids = np.pad(ids, ((0, 0), (0, short)), constant_values=self.pad_id)
            mask = np.pad(mask, ((0, 0), (0, short)))
        with placement.on_mesh(self.mesh):
            logits, self.cache = _extend(self.graphdef, self.params, self.layer_weights, self._rows(ids),
                                         self._rows(mask), self.cache)
            self.logits = _take_rows(self._rows(mask.any(axis=1)), logits, self.logits)

    # -- actions -----------------------------------------------------------------------------
    def start_action(self, slot: int, budget: int) -> None:
        """``slot`` decodes its next action, at most ``budget`` (≤ the buffer width) tokens."""
        if budget < 1:
            raise ValueError(f"slot {slot}: an action needs a budget >= 1, got {budget}")
        self.decoding[slot], self.budget[slot], self.partial[slot] = True, min(int(budget), self.width), 0
        self._started.add(slot)

    def stop_action(self, slot: int) -> None:
        """Abandon ``slot``'s unfinished action (preemption): its ids leave the cache, nothing is drawn."""
        self.decoding[slot], self.budget[slot] = False, 0
        self._started.discard(slot)

    @property
    def any_decoding(self) -> bool:
        return bool(self.decoding.any())

    def decode(self, steps: int) -> dict[int, SampledAction]:
        """Up to ``steps`` tokens for every decoding slot; returns the actions that ended, by slot."""
        started = np.zeros((self.slots,), bool)
        started[sorted(self._started)] = True
        self._started.clear()
        self._reserve(np.where(self.decoding, self.budget, 0))
        with placement.on_mesh(self.mesh):
            if self._keys_stale:
                self.keys = self._rows(decode_loop.row_keys(self.key, self.trajectory))
                self._keys_stale = False
            state = DecodeState(cache=self.cache, logits=self.logits, keys=self.keys, drawn=self._rows(self.drawn),
                                step=jnp.zeros((), jnp.int32), **self.state)
            state = decode_segment(self.graphdef, self.params, self.layer_weights, state, self._rows(started),
                                   self._rows(~self.decoding),
                                   self._rows(self.budget), self.sampling, steps=int(steps), pad_id=self.pad_id)
        self.cache, self.logits, self.keys = state.cache, state.logits, state.keys  # the inputs were donated
        self.state = dict(tokens=state.tokens, logprobs=state.logprobs, lengths=state.lengths, done=state.done,
                          finish=state.finish, stop_state=state.stop_state)
        done, lengths = jax.device_get((state.done, state.lengths))
        self.partial = np.where(self.decoding, np.asarray(lengths, np.int32), 0)
        ended = np.flatnonzero(self.decoding & np.asarray(done))
        if not len(ended):
            return {}
        tokens, logprobs, finish = jax.device_get((state.tokens, state.logprobs, state.finish))
        out = {}
        for slot in ended:
            n = int(lengths[slot])
            out[int(slot)] = SampledAction(tokens[slot, :n], logprobs[slot, :n], FinishReason(int(finish[slot])))
            self.drawn[slot] += n
            self.rows_end[slot] += n
            self.decoding[slot], self.budget[slot] = False, 0
        self._last.update(out)
        return out

    def cut(self, cuts: dict[int, int]) -> None:
        """Keep only the first ``cuts[slot]`` ids of each slot's last action (the Search-R1 cut).

        As ``DecodeSession.cut_last_actions``: the dropped slots become invalid and the last
        kept id is written again, so the next-token logits follow it.
        """
        drop = np.zeros((self.slots,), np.int32)
        rewrite: dict[int, list[int]] = {}
        for slot, kept in cuts.items():
            action = self._last[slot]
            if not 1 <= kept <= len(action.ids):
                raise ValueError(f"slot {slot}: cannot keep {kept} of {len(action.ids)} sampled ids")
            if kept < len(action.ids):
                drop[slot] = len(action.ids) - kept + 1
                rewrite[slot] = [int(action.ids[kept - 1])]
        if not rewrite:
            return
        with placement.on_mesh(self.mesh):
            self.cache = _forget_last_slots(self.cache, self._rows(drop))
        self.rows_end -= drop
        ids = np.full((self.slots, MIN_LENGTH_BUCKET), self.pad_id, np.int32)
        mask = np.zeros((self.slots, MIN_LENGTH_BUCKET), bool)
        for slot, (token,) in rewrite.items():
            ids[slot, 0], mask[slot, 0] = token, True
        self._extend(ids, mask)
        self.rows_end += mask.sum(axis=1)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _layer_weights(graphdef: nnx.GraphDef, params: nnx.State):
    return nnx.merge(graphdef, params).layer_weights()


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def _extend(graphdef: nnx.GraphDef, params: nnx.State, layer_weights, tokens: jax.Array, token_mask: jax.Array,
            cache: KVCache) -> tuple[jax.Array, KVCache]:
    """``decode_loop.extend`` with the session's layer weights (sliced once, not per call)."""
    return nnx.merge(graphdef, params).forward_cached(tokens, cache, token_mask=token_mask,
                                                      layer_weights=layer_weights)


@jax.jit
def _take_rows(rows: jax.Array, new: jax.Array, old: jax.Array) -> jax.Array:
    return jnp.where(rows[:, None], new, old)


@functools.partial(jax.jit, donate_argnames=("cache",))
def _empty_rows(cache: KVCache, rows: jax.Array) -> KVCache:
    """Rows ``rows`` hold nothing: ``end`` 0 and every slot invalid (their old keys are never read)."""
    return KVCache(k=cache.k, v=cache.v, valid=cache.valid & ~rows[:, None], end=jnp.where(rows, 0, cache.end))


@functools.partial(jax.jit, donate_argnames=("cache",))
def _forget_last_slots(cache: KVCache, drop: jax.Array) -> KVCache:
    end = cache.end - drop
    slots = jnp.arange(cache.max_len, dtype=end.dtype)
    return KVCache(k=cache.k, v=cache.v, valid=cache.valid & (slots[None, :] < end[:, None]), end=end)


@functools.partial(jax.jit, static_argnames=("graphdef", "steps"), donate_argnames=("state",))
def decode_segment(graphdef: nnx.GraphDef, params: nnx.State, layer_weights, state: DecodeState, started: jax.Array,
                   idle: jax.Array, budget: jax.Array, sampling: SamplingParams, *, steps: int,
                   pad_id: jax.Array | int = 0) -> DecodeState:
    """At most ``steps`` tokens for every slot that decodes, continuing each slot's own action.

    ``started [B]``: slots whose action begins now (ids, length and stop-string state reset);
    ``idle [B]``: slots that take no part (frozen, as ``decode_loop.decode`` freezes done
    rows). Each slot writes its tokens at its own column (its action's length), so an action
    runs over several calls. The per-token work is ``decode_loop.decode_program``'s: the same
    sampler with row ``b``'s key at count ``drawn[b] + length[b]``, the same stop rules, the
    same cached forward.
    """
    model = nnx.merge(graphdef, params)
    width = state.tokens.shape[1]
    pad_id = jnp.asarray(pad_id, jnp.int32)
    budget = jnp.minimum(budget.astype(jnp.int32), width)
    columns = jnp.arange(width, dtype=jnp.int32)
    lengths = jnp.where(started, 0, state.lengths)
    state = DecodeState(
        tokens=jnp.where(started[:, None], pad_id, state.tokens),
        logprobs=jnp.where(started[:, None], 0.0, state.logprobs),
        lengths=lengths,
        done=idle | (budget <= 0),
        finish=jnp.where(started, FinishReason.CAP, state.finish),
        stop_state=jnp.where(started[:, None], 0, state.stop_state).astype(jnp.int8),
        logits=state.logits, cache=state.cache, step=jnp.zeros((), jnp.int32), keys=state.keys,
        drawn=state.drawn.astype(jnp.int32))

    def one_token(s: DecodeState) -> DecodeState:
        sampled, logprob = decode_loop.sample_rows(s.logits, s.keys, s.drawn + s.lengths, sampling)
        active = ~s.done
        token = jnp.where(active, sampled, pad_id)
        logprob = jnp.where(active, logprob, 0.0)
        stop_state, string_hit = stop_strings.advance(sampling.stop_table, s.stop_state, token)
        stop_state = jnp.where(active[:, None], stop_state, s.stop_state)
        id_hit = jnp.any(token[:, None] == sampling.stop_ids[None, :], axis=-1)
        write = active[:, None] & (columns[None, :] == s.lengths[:, None])
        lengths = s.lengths + active.astype(jnp.int32)
        finish = jnp.where(id_hit, FinishReason.STOP_TOKEN,
                           jnp.where(string_hit, FinishReason.STOP_STRING, FinishReason.CAP))
        now_done = active & (id_hit | string_hit | (lengths >= budget))
        next_logits, cache = model.forward_cached(token[:, None], s.cache, token_mask=active[:, None],
                                                  layer_weights=layer_weights)
        return DecodeState(
            tokens=jnp.where(write, token[:, None], s.tokens),
            logprobs=jnp.where(write, logprob[:, None], s.logprobs),
            lengths=lengths, done=s.done | now_done, finish=jnp.where(now_done, finish, s.finish),
            stop_state=stop_state, logits=jnp.where(active[:, None], next_logits, s.logits), cache=cache,
            step=s.step + 1, keys=s.keys, drawn=s.drawn)

    def keep_going(s: DecodeState):
        return (s.step < steps) & ~jnp.all(s.done)

    return jax.lax.while_loop(keep_going, one_token, state)
