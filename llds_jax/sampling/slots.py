"""Decode slots: a fixed batch of rows, each advancing its own conversation (continuous batching).

The rollout's one decoding session (both of the engine's policies, ``rollout/engine.py``, and
the single-turn ``generate``). A :class:`SlotSession` keeps ``slots`` rows alive and lets each
one be at a different point of its own conversation, as JetStream's decode slots do:

    reset(slot, trajectory, drawn)  the slot now holds another trajectory (empty cache row)
    append({slot: ids})             feed ids to slots' caches: a prompt, a history (recompute), feedback
    start_action(slot, budget)      the slot decodes an action of at most ``budget`` tokens
    decode(steps)                   up to ``steps`` tokens for every decoding slot, in one device call;
                                    returns the actions that ended: {slot: ids, log-probs, finish reason}
    stop_action(slot)               abandon an unfinished action (preemption: redrawn later, same keys)
    cut({slot: kept})               keep the first ``kept`` ids of each slot's last action

A decode call ends after ``steps`` tokens or when no slot decodes (checked every
``decode_loop.STOP_CHECK_EVERY`` tokens, never past ``steps``): the host then sees which
actions ended, appends feedback, admits new trajectories, and calls again. The per-action
state (ids so far, stop-string state, length) lives on the device between calls, so an
action spans as many calls as it needs.

The cache is paged (``models/paged_cache.py``): one pool of ``block_tokens``-token KV blocks
per device and layer, allocated once, and a block table per slot that the caller fills
(``set_blocks``: the rollout scheduler's blocks), so a slot holds only the blocks its
trajectory has used. Appends run over the rows that have ids only (gathered into a batch of
their own, a power of two per device), writing through their tables into the shared pool.

A trajectory's tokens do not depend on its slot, its neighbours or the order of events:

* randomness: row ``b`` samples token ``n`` of its trajectory with
  ``fold_in(fold_in(key, trajectory id), n)`` (``decode_loop.sample_rows``);
* layout: its tokens sit from cache slot 0 on, read in key blocks of ``CACHED_BLOCK`` (the
  paged read equals a dense one bit for bit, ``tests/models/test_paged_cache.py``);
* batch width: matrix products are row-invariant on XLA:CPU and the row reductions (RMSNorm,
  softmax sums, the sampler's log-softmax) use ``models.reductions.row_sum``, whose rounding
  ignores the row count; appends keep floors on rows (:data:`MIN_ROWS`) and positions
  (:data:`MIN_EXTEND_TOKENS`) per call, below which XLA:CPU switches kernels.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from llds_jax.models import PagedKVCache, init_paged_pools
from llds_jax.models.attention import CACHED_BLOCK
from llds_jax.sampling import decode_loop, placement
from llds_jax.sampling.decode_loop import DecodeState, FinishReason, SamplingParams

MIN_LENGTH_BUCKET = 16  # lengths (prompt, chunk, action buffer) round up to powers of two, at least this


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two ≥ ``max(n, minimum)``."""
    n = max(int(n), minimum, 1)
    return 1 << (n - 1).bit_length()


# An append is padded to at least this many batch x token positions. The row reductions
# are batch-invariant (``models.reductions``), but XLA:CPU still switches matmul kernels
# for very small row counts (measured on the dense cache before the paged one replaced it:
# without this floor a 2-row wave rounded 5 of its sampler log-probs 1 ulp away from the
# all-rows run). Keeping every call at 64 positions or more keeps rows bit-identical.
MIN_EXTEND_TOKENS = 64
NO_TRAJECTORY = np.uint32(2**32 - 1)  # the id of an empty slot's key (its draws are discarded)


def cache_slot_limit(max_tokens: int) -> int:
    """Cache positions a row of at most ``max_tokens`` tokens may use: rounded up to a length
    bucket, at least one attention key block (``CACHED_BLOCK``)."""
    return max(-(-int(max_tokens) // MIN_LENGTH_BUCKET) * MIN_LENGTH_BUCKET, CACHED_BLOCK)


@dataclasses.dataclass(frozen=True)
class SampledAction:
    """One row's action as sampled: ids, their log-probs and why it ended."""

    ids: np.ndarray
    logprobs: np.ndarray
    finish: FinishReason

# The fewest rows a session decodes: XLA:CPU multiplies a single row by a matrix with another
# kernel (a vector product), whose rounding differs by an ulp (measured: 27 of a one-slot
# rollout's sampler log-probs were 1 ulp off the 16-slot run, the same tokens). With two
# rows or more the rows are bit-identical (the waves' 2-row test), so one slot runs on two rows.
MIN_ROWS = 2


class SlotSession:
    """``slots`` decode rows over a paged cache (see the module docstring); at least
    :data:`MIN_ROWS` rows per device are allocated, the extra ones idle.

    ``model``: a ``Decoder`` or ``(graphdef, params)``; ``max_tokens``: a row's context cap;
    ``prefill_chunk``: appends run at most this many columns per call (0: whole); ``mesh``: a
    process-local ``sampling.placement.sampler_mesh`` to spread the rows over (each device
    holds ``slots / devices`` rows, a replica of the weights and its own pool; None: the
    default device). ``kv_blocks``: blocks per device's pool (0: every row can hold
    ``max_tokens``); ``block_tokens``: tokens per block; ``append_rows``: the most rows of one device
    an append call runs (0: all that have ids; the engine passes ``rollout.prefill_rows``, what the
    memory plan holds append workspace for: a wave's, or the first admission's, prompts are every
    slot's). ``usable_slots`` is ``slots`` rounded
    up to a multiple of the devices; ``slots`` the rows allocated. Row ``r`` is on device
    ``r // rows_per_device`` and names blocks of that device's pool.
    """

    def __init__(self, model, sampling: SamplingParams, *, slots: int, max_action_tokens: int, key: jax.Array,
                 max_tokens: int, pad_id: int = 0, prefill_chunk: int = 0, mesh: jax.sharding.Mesh | None = None,
                 kv_blocks: int = 0, block_tokens: int = CACHED_BLOCK, append_rows: int = 0):
        self.graphdef, self.params = nnx.split(model) if isinstance(model, nnx.Module) else model
        self.mesh = mesh
        self.devices = devices = 1 if mesh is None else mesh.devices.size
        if mesh is not None:
            self.params = placement.replicate_params(self.params, mesh)
        self.config = nnx.merge(self.graphdef, self.params).config
        self.sampling, self.key, self.pad_id = sampling, key, int(pad_id)
        self.usable_slots = -(-int(slots) // devices) * devices
        self.slots = max(self.usable_slots, MIN_ROWS * devices)
        self.rows_per_device = self.slots // devices
        self.width = bucket(max_action_tokens, MIN_LENGTH_BUCKET)
        self.max_tokens = int(max_tokens)
        self.block_tokens = int(block_tokens)
        self.columns = -(-cache_slot_limit(max_tokens) // self.block_tokens)  # block-table width
        self.kv_blocks = int(kv_blocks) or self.rows_per_device * self.columns
        self.prefill_chunk = int(prefill_chunk)
        self.append_rows = int(append_rows)
        self.trajectory = np.full((self.slots,), NO_TRAJECTORY, np.uint32)
        self.drawn = np.zeros((self.slots,), np.int32)        # tokens the slot's trajectory drew before its action
        self.budget = np.zeros((self.slots,), np.int32)       # the current action's cap (0: not decoding)
        self.decoding = np.zeros((self.slots,), bool)
        self.partial = np.zeros((self.slots,), np.int32)      # tokens the current action has in the cache so far
        self.fed = np.zeros((self.slots,), bool)              # the slot's logits follow its last id (see decode)
        self.rows_end = np.zeros((self.slots,), np.int64)     # committed tokens in each slot's cache
        self.table = np.full((self.slots, self.columns), self.kv_blocks, np.int32)  # kv_blocks: unallocated
        self._table_on_device = None
        with placement.on_mesh(mesh):
            # sliced out of the stacked layers once per session: a decode call would copy them every
            # call (Decoder.layer_weights), and the engine makes several short calls per action
            # (SmolLM2 on XLA:CPU, 48-token actions, segment 8: 6 calls where the waves make 1;
            # before this the engine took 38 s of CPU per rollout against the waves' 27 s)
            self.layer_weights = _layer_weights(self.graphdef, self.params)
            self.k, self.v = self._rows(_new_pools(self.config, devices, self.kv_blocks, self.block_tokens))
            # in the compute dtype, as forward_cached writes them (the sampler upcasts as it reads)
            self.logits = self._rows(jnp.zeros((self.slots, self.config.vocab_size), self.config.compute_dtype))
            self.keys = self._rows(decode_loop.row_keys(self.key, self.trajectory))
            self.state = self._rows(self._fresh_action_state())
        self._keys_stale = False
        self._started: set[int] = set()  # slots whose action begins with the next decode call
        self._last: dict[int, SampledAction] = {}

    def _rows(self, tree):
        """``tree``'s arrays (leading axis: rows, or devices) split over the mesh's devices; as they are without a mesh."""
        if self.mesh is None:
            return jax.tree.map(jnp.asarray, tree)
        return jax.device_put(tree, placement.row_sharding(self.mesh))

    def _fresh_action_state(self) -> dict[str, jax.Array]:
        return dict(tokens=jnp.full((self.slots, self.width), self.pad_id, jnp.int32),
                    logprobs=jnp.zeros((self.slots, self.width), jnp.float32),
                    lengths=jnp.zeros((self.slots,), jnp.int32), done=jnp.ones((self.slots,), bool),
                    finish=jnp.zeros((self.slots,), jnp.int32),
                    stop_state=jnp.zeros((self.slots, self.sampling.stop_table.shape[0]), jnp.int8))

    @property
    def pool_bytes(self) -> int:
        """Bytes of every device's k and v pools together (what the cache holds, whatever the rows use)."""
        return sum(x.nbytes for x in (*self.k, *self.v))

    # -- slot bookkeeping ------------------------------------------------------------------
    def reset(self, slot: int, trajectory: int, drawn: int) -> None:
        """``slot`` now holds ``trajectory``, which has drawn ``drawn`` tokens so far; it holds no blocks."""
        if not 0 <= trajectory < NO_TRAJECTORY:
            raise ValueError(f"trajectory id {trajectory} out of range")
        self.trajectory[slot], self.drawn[slot] = trajectory, drawn
        self.decoding[slot], self.budget[slot], self.rows_end[slot], self.partial[slot] = False, 0, 0, 0
        self.fed[slot] = False
        self.table[slot] = self.kv_blocks
        self._keys_stale = True

    def set_blocks(self, slot: int, blocks) -> None:
        """``slot``'s block table: its cache's blocks in slot order (ids in its device's pool)."""
        blocks = np.asarray(blocks, np.int32)
        if len(blocks) > self.columns or (len(blocks) and not (0 <= blocks.min() and blocks.max() < self.kv_blocks)):
            raise ValueError(f"slot {slot}: blocks {blocks.tolist()} do not fit a table of {self.columns} columns "
                             f"over a pool of {self.kv_blocks} blocks")
        self.table[slot] = self.kv_blocks
        self.table[slot, :len(blocks)] = blocks

    def _check_room(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """Rows ``rows`` will hold ``tokens`` tokens: their tables must cover them (writes past a
        table are dropped, so a short table would lose keys silently)."""
        held = (self.table[rows] < self.kv_blocks).sum(axis=1) * self.block_tokens
        short = np.flatnonzero(tokens > held)
        if len(short):
            r = int(rows[short[0]])
            raise ValueError(f"slot {r} needs {int(tokens[short[0]])} cache slots but its blocks hold {int(held[short[0]])}"
                             f" (max_tokens={self.max_tokens})")

    def _device_table(self) -> jax.Array:
        if self._table_on_device is None or not np.array_equal(self._table_on_device[0], self.table):
            self._table_on_device = (self.table.copy(), self._rows(self.table))
        return self._table_on_device[1]

    # -- appends -----------------------------------------------------------------------------
    def append(self, chunks: dict[int, list[int]]) -> None:
        """Feed ``chunks[slot]`` to each slot's cache (right-padded, in ``prefill_chunk`` columns, at
        most ``append_rows`` rows of a device a call), running only the slots that have ids (see
        :meth:`_compact`)."""
        chunks = {slot: list(ids) for slot, ids in chunks.items() if len(ids)}
        if not chunks:
            return
        rows = np.asarray(sorted(chunks), np.int64)
        lengths = np.asarray([len(chunks[int(r)]) for r in rows], np.int64)
        self._check_room(rows, self.rows_end[rows] + lengths)
        for group in self._row_groups(rows):
            width = bucket(max(len(chunks[r]) for r in group), MIN_LENGTH_BUCKET)
            step = width if self.prefill_chunk == 0 else min(self.prefill_chunk, width)
            for first in range(0, width, step):
                part = {r: chunks[r][first:first + step] for r in group}
                self._extend({r: ids for r, ids in part.items() if ids}, step)

    def _row_groups(self, rows: np.ndarray) -> list[list[int]]:
        """``rows`` in calls of at most ``append_rows`` rows per device (each call takes the next
        rows of every device, so the devices stay busy together); one call when ``append_rows`` is 0."""
        by_device = [[int(r) for r in rows if r // self.rows_per_device == d] for d in range(self.devices)]
        most = max(map(len, by_device))
        size = self.append_rows or most
        return [[r for group in by_device for r in group[i:i + size]] for i in range(0, most, size)]

    def _compact(self, slots) -> tuple[np.ndarray, int]:
        """Rows to run, grouped by device: ``[devices, per_device]`` session rows (``-1``: padding),
        ``per_device`` a power of two >= :data:`MIN_ROWS` (few compiled shapes)."""
        by_device = [[] for _ in range(self.devices)]
        for slot in sorted(slots):
            by_device[slot // self.rows_per_device].append(slot)
        per_device = min(bucket(max(map(len, by_device)), MIN_ROWS), self.rows_per_device)
        out = np.full((self.devices, per_device), -1, np.int64)
        for d, group in enumerate(by_device):
            out[d, :len(group)] = group
        return out, per_device

    def _extend(self, chunks: dict[int, list[int]], width: int) -> None:
        """One append call over the rows of ``chunks`` only; their logits replace the session's."""
        if not chunks:
            return
        order, per_device = self._compact(chunks)
        width = max(width, bucket(MIN_EXTEND_TOKENS // per_device))  # the session's floor (MIN_EXTEND_TOKENS)
        flat = order.reshape(-1)
        ids = np.full((len(flat), width), self.pad_id, np.int32)
        mask = np.zeros((len(flat), width), bool)
        table = np.full((len(flat), self.columns), self.kv_blocks, np.int32)
        end = np.zeros((len(flat),), np.int32)
        local = np.full((len(flat),), self.rows_per_device, np.int32)  # where each row's logits go (padding: dropped)
        for i, row in enumerate(flat):
            if row < 0:
                continue
            chunk = chunks[int(row)]
            ids[i, :len(chunk)], mask[i, :len(chunk)] = chunk, True
            table[i], end[i], local[i] = self.table[row], self.rows_end[row], row % self.rows_per_device
        with placement.on_mesh(self.mesh):
            logits, self.k, self.v = _extend(self.graphdef, self.params, self.layer_weights, self._rows(ids),
                                             self._rows(mask), self.k, self.v, self._rows(table), self._rows(end))
            self.logits = _put_rows(self.logits, self._rows(local.reshape(self.devices, per_device)), logits)
        for row, chunk in chunks.items():
            self.rows_end[row] += len(chunk)
            self.fed[row] = True

    # -- actions -----------------------------------------------------------------------------
    def start_action(self, slot: int, budget: int) -> None:
        """``slot`` decodes its next action, at most ``budget`` (≤ the buffer width) tokens.

        Only right after an append to the slot (a prompt, a history, feedback): a decode call
        leaves every slot that is not mid-action with logits that follow nothing (see
        :meth:`decode`), and the protocol always feeds a trajectory before its next action.
        """
        if budget < 1:
            raise ValueError(f"slot {slot}: an action needs a budget >= 1, got {budget}")
        if not self.fed[slot]:
            raise RuntimeError(f"slot {slot}: no ids were appended since its last action or decode call, so its "
                               "next-token logits are stale; append (feedback, a prompt) before starting an action")
        self.decoding[slot], self.budget[slot], self.partial[slot] = True, min(int(budget), self.width), 0
        self._started.add(slot)

    def stop_action(self, slot: int) -> None:
        """Abandon ``slot``'s unfinished action (preemption): its ids leave the cache, nothing is drawn."""
        self.decoding[slot], self.budget[slot], self.partial[slot] = False, 0, 0
        self._started.discard(slot)

    @property
    def any_decoding(self) -> bool:
        return bool(self.decoding.any())

    def decode(self, steps: int) -> dict[int, SampledAction]:
        """Up to ``steps`` tokens for every decoding slot; returns the actions that ended, by slot.

        Afterwards only a slot still mid-action has next-token logits that mean anything: the
        step writes every row's logits unconditionally (``decode_segment``), so a slot must be
        appended to before its next :meth:`start_action` (checked there).
        """
        started = np.zeros((self.slots,), bool)
        started[sorted(self._started)] = True
        self._started.clear()
        decoding = np.flatnonzero(self.decoding)
        partial = np.where(started, 0, self.partial)
        self._check_room(decoding, self.rows_end[decoding] + np.minimum(partial[decoding] + int(steps),
                                                                         self.budget[decoding]))
        with placement.on_mesh(self.mesh):
            if self._keys_stale:
                self.keys = self._rows(decode_loop.row_keys(self.key, self.trajectory))
                self._keys_stale = False
            end = (self.rows_end + np.where(self.decoding, partial, 0)).astype(np.int32)
            cache = PagedKVCache(k=self.k, v=self.v, table=self._device_table(), end=self._rows(end))
            state = DecodeState(cache=cache, logits=self.logits, keys=self.keys, drawn=self._rows(self.drawn),
                                step=jnp.zeros((), jnp.int32), **self.state)
            state = decode_segment(self.graphdef, self.params, self.layer_weights, state, self._rows(started),
                                   self._rows(~self.decoding),
                                   self._rows(self.budget), self.sampling, steps=int(steps), pad_id=self.pad_id)
        self.k, self.v, self.logits, self.keys = state.cache.k, state.cache.v, state.logits, state.keys  # donated
        self.fed[:] = False
        self._table_on_device = (self._table_on_device[0], state.cache.table)  # the input table was donated too
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
            self.decoding[slot], self.budget[slot], self.partial[slot] = False, 0, 0
        self._last.update(out)
        return out

    def cut(self, cuts: dict[int, int]) -> None:
        """Keep only the first ``cuts[slot]`` ids of each slot's last action (the Search-R1 cut).

        The dropped ids leave the row (its end moves back; the next write overwrites them) and
        the last kept id is written again, so the next-token logits follow it: positions
        continue from the kept ids exactly as if decoding had stopped there.
        """
        rewrite: dict[int, list[int]] = {}
        for slot, kept in cuts.items():
            action = self._last.get(slot)
            sampled = 0 if action is None else len(action.ids)
            if not 1 <= kept <= sampled:
                raise ValueError(f"slot {slot}: cannot keep {kept} of the {sampled} ids its last action sampled")
            if kept < len(action.ids):
                self.rows_end[slot] -= len(action.ids) - kept + 1
                rewrite[slot] = [int(action.ids[kept - 1])]
        if rewrite:
            self._extend(rewrite, MIN_LENGTH_BUCKET)


@functools.partial(jax.jit, static_argnames=("config", "devices", "blocks", "block"))
def _new_pools(config, devices: int, blocks: int, block: int):
    """Every layer's k and v pools, created on device (no host zeros)."""
    return init_paged_pools(config, devices, blocks, block)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _layer_weights(graphdef: nnx.GraphDef, params: nnx.State):
    return nnx.merge(graphdef, params).layer_weights()


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("k", "v"))
def _extend(graphdef: nnx.GraphDef, params: nnx.State, layer_weights, tokens: jax.Array, token_mask: jax.Array,
            k: tuple, v: tuple, table: jax.Array, end: jax.Array) -> tuple[jax.Array, tuple, tuple]:
    """``forward_cached`` of the gathered rows with the session's layer weights: (logits, k pools, v pools)."""
    cache = PagedKVCache(k=k, v=v, table=table, end=end)
    logits, cache = nnx.merge(graphdef, params).forward_cached(tokens, cache, token_mask=token_mask,
                                                               layer_weights=layer_weights)
    return logits, cache.k, cache.v


@functools.partial(jax.jit, donate_argnames=("logits",))
def _put_rows(logits: jax.Array, local: jax.Array, new: jax.Array) -> jax.Array:
    """``new`` [D x R, V] into rows ``local`` [D, R] of each device's part of ``logits`` [B, V]
    (an index past the device's rows is dropped); batched over devices, so it stays local."""
    devices, per_device = local.shape
    batch, vocab = logits.shape

    def one_device(rows, index, values):
        return rows.at[index].set(values, mode="drop")

    return jax.vmap(one_device)(logits.reshape(devices, batch // devices, vocab), local,
                                new.reshape(devices, per_device, vocab)).reshape(batch, vocab)


# XLA:GPU without autotuning (the planner's compile-only programs; a device autotunes among configs
# that respect it) splits the K of the step's skinny GEMMs (320 rows) two to four ways and writes fp32
# partials that a reduction fusion reads back: 1.86 GB of qwen3b's 15.13 a token on an H100 once the
# fusions they split apart are counted (bench_rollout.py --decode-program, with and without). A decode
# GEMM streams its weights once either way; the partials are traffic the bandwidth bound never needed.
# The one XLA option that keeps K whole; CPU and XLA:TPU accept it and change nothing.
DECODE_COMPILER_OPTIONS = {"xla_gpu_experimental_force_split_k": 1}


@functools.partial(jax.jit, static_argnames=("graphdef", "steps"), donate_argnames=("state",),
                   compiler_options=DECODE_COMPILER_OPTIONS)
def decode_segment(graphdef: nnx.GraphDef, params: nnx.State, layer_weights, state: DecodeState, started: jax.Array,
                   idle: jax.Array, budget: jax.Array, sampling: SamplingParams, *, steps: int,
                   pad_id: jax.Array | int = 0) -> DecodeState:
    """At most ``steps`` tokens for every slot that decodes, continuing each slot's own action.

    ``started [B]``: slots whose action begins now (ids, length and stop-string state reset);
    ``idle [B]``: slots that take no part (frozen, as the step freezes done rows: no token, no
    cache write, no length). Each slot writes its tokens at its own column
    (its action's length), so an action runs over several calls. The per-token work is
    ``decode_loop.token_step``: the sampler with row ``b``'s key at count ``drawn[b] + length[b]``,
    the stop rules, the cached forward over the paged cache.

    The next-token logits are written for every row, frozen ones included. Keeping a frozen
    row's would be a select over the ``[B, V]`` logits each token (three passes of
    it: 0.29 GB a token at 320 rows of Qwen's 151,936-word vocabulary in bf16, a sixth of the
    0.5B step's ideal bytes; ``bench_rollout.py --decode-program``), and the engine never reads
    them: a slot's next action always starts right after an append, which sets its logits
    (``SlotSession.start_action`` checks it).
    """
    model = nnx.merge(graphdef, params)
    width = state.tokens.shape[1]
    pad_id = jnp.asarray(pad_id, jnp.int32)
    budget = jnp.minimum(budget.astype(jnp.int32), width)
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

    step = decode_loop.token_step(model, layer_weights, sampling, budget, pad_id)
    return decode_loop.run_steps(step, state, steps)  # at most ``steps`` tokens, done checked every few
