"""The continuous rollout engine: every slot advances its own trajectory, no turn barrier.

``multi_turn``'s waves decode a turn until the wave's longest action ends, then the whole
wave waits for one retrieval and one append. Here (JetStream's orchestrator, vLLM's
scheduler, verl's agent loop, in one host loop):

* a fixed number of slots decode ``rollout.segment_tokens`` tokens per device call
  (:class:`~llds_jax.sampling.slots.SlotSession`); an action spans as many calls as it needs;
* when a slot's action ends it is recorded and parsed exactly as in the turn loop
  (:func:`~llds_jax.rollout.turns.apply_action`: stop rule, cut, parse, counts, last turn);
  a search query goes to the retrieval thread, which serves whatever is queued as one
  batch while the device keeps decoding the other slots; the feedback is appended when it
  returns; an invalid action's message is appended at once;
* a finished slot takes the next pending trajectory, prefilled in ``prefill_chunk`` chunks;
* :class:`~llds_jax.rollout.scheduler.Scheduler` owns slots, turns and KV blocks; the
  session's paged cache reads and writes exactly the blocks it hands out (each slot's block
  table is the scheduler's, before every device call). When a device's pool runs dry the
  newest trajectory there is preempted and resumes from its ids (recompute); its unfinished
  action is redrawn with the same keys.

The turn-synchronous waves (``rollout.engine="waves"``, Search-R1's own ``run_llm_loop``
schedule) are a policy of this same loop, ``waves=True``: the scheduler admits a new wave only
into an empty engine; each turn decodes until the wave's longest action ends (one decode call of
the whole action buffer); the turn's queries go to the retriever as one batch once no slot
decodes; every row's feedback is appended in one call once they are back. Same session, same
paged cache, same decode program: only when the host lets things happen differs.

What a trajectory samples does not depend on this schedule: trajectory ``i`` draws token
``n`` with ``fold_in(fold_in(key, i), n)`` whatever slot, order or latency it meets, and its
cache row is its own (``tests/rollout/test_engine.py`` compares slot counts, retrieval
delays and the two policies).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import time

import jax
import numpy as np
from flax import nnx

from llds_jax.rollout import protocol
from llds_jax.rollout.scheduler import Phase, Scheduler, blocks_for
from llds_jax.rollout.trajectory import Trajectory
from llds_jax.rollout.turns import apply_action, cut_feedback
from llds_jax.sampling import placement
from llds_jax.sampling.decode_loop import SamplingParams
from llds_jax.sampling.slots import SlotSession, cache_slot_limit


@dataclasses.dataclass(frozen=True)
class ModelPolicy:
    """What the engine samples with: the model (``nnx.split`` halves), the sampling knobs, the
    rollout's key (trajectory ``i`` samples with ``fold_in(key, i)``), the pad id and the append
    chunk. ``multi_turn.make_policy`` builds one from a config."""

    graphdef: nnx.GraphDef
    params: nnx.State
    sampling: SamplingParams
    key: jax.Array
    pad_id: int = 0
    prefill_chunk: int = 0

    @functools.cached_property
    def config(self):
        """The model's ``DecoderConfig`` (the memory plans size slots from it), merged once."""
        return nnx.merge(self.graphdef, self.params).config


class RetrievalThread:
    """One host thread serving batched searches: whatever is queued when it is free goes as one batch."""

    def __init__(self, retriever, topk: int):
        self.retriever, self.topk = retriever, topk
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-retrieval")
        self._queued: list[tuple[int, str]] = []
        self._running: concurrent.futures.Future | None = None
        self._running_rows: list[int] = []
        self.batches = 0

    @property
    def busy(self) -> bool:
        return self._running is not None or bool(self._queued)

    def submit(self, row: int, query: str, *, launch: bool = True) -> None:
        """Queue ``row``'s query; ``launch=False`` holds it for :meth:`launch` (the waves' turn batch)."""
        self._queued.append((row, query))
        if launch:
            self._launch()

    def launch(self) -> None:
        """Send whatever is queued as one batch, if no batch is out."""
        self._launch()

    def _launch(self) -> None:
        if self._running is None and self._queued:
            rows, queries = zip(*self._queued)
            self._queued = []
            self._running_rows = list(rows)
            self._running = self._pool.submit(protocol.batch_search_feedback, self.retriever, list(queries), self.topk)
            self.batches += 1

    def poll(self, wait: bool = False) -> list[tuple[int, str]]:
        """Results of the running batch if it is done (``wait``: block until it is), then launch the next."""
        if self._running is None or (not wait and not self._running.done()):
            return []
        texts = self._running.result()
        rows, self._running, self._running_rows = self._running_rows, None, []
        self._launch()
        return list(zip(rows, texts))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def count_decode_work(lengths, context, timings: dict) -> None:
    """Add one decode call's work to ``timings``: its steps (the longest row's tokens: rows decode
    together), tokens, and live KV reads (a row at context c sampling n tokens reads c, c+1, …,
    c+n−1 cached entries). ``train.utilisation`` turns them into the decode's bytes (MBU); both
    schedules count here, so the counters mean the same whatever ``rollout.engine`` is."""
    lengths = [int(n) for n in lengths]
    timings["decode_steps"] = timings.get("decode_steps", 0) + max(lengths, default=0)
    timings["decode_tokens"] = timings.get("decode_tokens", 0) + sum(lengths)
    timings["decode_key_reads"] = timings.get("decode_key_reads", 0) + sum(
        n * int(c) + n * (n - 1) // 2 for n, c in zip(lengths, context))


def _history(traj: Trajectory) -> list[int]:
    return list(traj.prompt_ids) + [i for piece in traj.pieces for i in piece.ids]


def run_engine(policy: ModelPolicy, trajectories: list[Trajectory], vocab, tokenizer, retriever, config,
               timings: dict, *, slots: int, kv_blocks: int = 0, waves: bool = False) -> dict:
    """Roll out ``trajectories`` (row ``i`` samples as trajectory ``i``) over ``slots`` slots, in place.

    ``policy`` supplies the model, sampling knobs, key and pad id; ``kv_blocks``: blocks per
    device's pool (0: every slot can hold ``max_context``); ``waves``: the turn-synchronous
    policy (module docstring). Returns the schedule's counts (decode calls, appends, retrieval
    batches, waves, preemptions, peak KV blocks).
    """
    devices = placement.sampler_devices(int(config.sampler_devices))
    block = int(config.kv_block_tokens)
    slots = -(-int(slots) // len(devices)) * len(devices)
    kv_blocks = int(kv_blocks) or slots // len(devices) * blocks_for(cache_slot_limit(config.max_context), block)
    session = SlotSession((policy.graphdef, policy.params), policy.sampling, slots=slots,
                          max_action_tokens=int(config.max_action_tokens), key=policy.key,
                          max_tokens=int(config.max_context), pad_id=policy.pad_id,
                          prefill_chunk=policy.prefill_chunk, append_rows=int(config.prefill_rows),
                          mesh=placement.sampler_mesh(devices) if len(devices) > 1 else None,
                          kv_blocks=kv_blocks, block_tokens=block)
    # scheduler slot s -> session row: round-robin over the devices (each holds a contiguous block
    # of rows), so every device gets rows even when the session allocated spare ones (MIN_ROWS)
    per_device = session.rows_per_device
    row_of = [(s % len(devices)) * per_device + s // len(devices) for s in range(slots)]
    scheduler = Scheduler([len(t.prompt_ids) for t in trajectories], slots=slots, block_size=block,
                          kv_blocks=kv_blocks, max_tokens=int(config.max_context), devices=len(devices), waves=waves)
    segment = session.width if waves else int(config.segment_tokens)  # waves: a turn's action in one call
    retrieval = RetrievalThread(retriever, int(config.topk))
    drawn = [0] * len(trajectories)   # tokens trajectory i has drawn (its keys' counter), cut ids included
    slot_of: dict[int, int] = {}      # trajectory -> the session row (slot) it holds
    counts = dict(decode_calls=0, appends=0, waves=0, busy_rows_per_device=[0] * len(devices))

    def preempted(victims: list[int]) -> None:
        for victim in victims:
            slot = slot_of.pop(victim)
            session.stop_action(slot)
            session.set_blocks(slot, [])
            tables[slot] = []

    tables: dict[int, list[int]] = {}  # session row -> the blocks its table was last set to (None: unknown)

    def sync_tables() -> None:  # each slot's block table is its trajectory's, as the scheduler holds it
        for slot, owner in enumerate(scheduler.slot_owner):
            blocks = [] if owner is None else scheduler.entries[owner].blocks
            if tables.get(row_of[slot]) != blocks:
                session.set_blocks(row_of[slot], blocks)
                tables[row_of[slot]] = list(blocks)

    def feedback(row: int, text: str) -> None:
        traj = trajectories[row]
        chunk = cut_feedback(tokenizer, text, traj, config)
        traj.add_feedback(chunk, "search")
        traj.searches += 1
        scheduler.feedback_arrived(row, len(chunk))

    try:
        while not scheduler.finished:
            for row, text in retrieval.poll():
                feedback(row, text)
            admitted = scheduler.admit()
            counts["waves"] += bool(waves and admitted)
            for slot, row in admitted:
                slot_of[row] = row_of[slot]
                session.reset(slot_of[row], row, drawn[row])
                tables[slot_of[row]] = []
            if waves and not scheduler.in_phase(Phase.DECODE):
                retrieval.launch()  # the turn's queries, one batch, once no slot decodes
            # waves: nothing is appended until every action of the turn has ended and its searches are back
            barrier = waves and (bool(scheduler.in_phase(Phase.DECODE)) or retrieval.busy)
            for row in ([] if barrier else scheduler.in_phase(Phase.APPEND)):  # blocks first: a later reservation may preempt
                if scheduler.entries[row].phase is Phase.APPEND:
                    preempted(scheduler.reserve(row, 0))
            chunks = {}
            for row in ([] if barrier else scheduler.in_phase(Phase.APPEND)):
                entry = scheduler.entries[row]
                if entry.tokens != trajectories[row].length:
                    raise AssertionError(f"scheduler counts {entry.tokens} tokens for trajectory {row}, "
                                         f"its record {trajectories[row].length}")
                chunks[slot_of[row]] = _history(trajectories[row])[entry.cached:]
                scheduler.appended(row)
            if chunks:
                clock = time.perf_counter()
                sync_tables()
                session.append(chunks)
                timings["append_s"] += time.perf_counter() - clock
                counts["appends"] += 1
            for row in scheduler.in_phase(Phase.DECODE):
                slot, traj = slot_of[row], trajectories[row]
                if session.decoding[slot]:
                    continue
                budget = min(int(config.max_action_tokens), int(config.max_context) - traj.length)
                if budget <= 0:
                    traj.done = traj.truncated = True
                    scheduler.end(row)
                    slot_of.pop(row)
                    continue
                session.start_action(slot, budget)
            for row in scheduler.in_phase(Phase.DECODE):
                if scheduler.entries[row].phase is Phase.DECODE:
                    slot = slot_of[row]
                    partial = int(session.partial[slot])
                    preempted(scheduler.reserve(row, partial + min(segment, int(session.budget[slot]) - partial)))
            if session.any_decoding:
                clock = time.perf_counter()
                busy = session.decoding.reshape(len(devices), -1).sum(axis=1)
                sync_tables()
                end_before = session.rows_end + session.partial  # a started action's partial is 0
                decoding = session.decoding.copy()
                ended = session.decode(segment)
                decoded = np.where(decoding, session.rows_end + session.partial - end_before, 0)
                count_decode_work(decoded, end_before, timings)
                counts["busy_rows_per_device"] = [max(a, int(b)) for a, b in zip(counts["busy_rows_per_device"], busy)]
                timings["decode_s"] += time.perf_counter() - clock
                counts["decode_calls"] += 1
                _end_actions(ended, session, scheduler, trajectories, slot_of, drawn, retrieval, tables, vocab, tokenizer,
                             config, hold_queries=waves)
            elif retrieval.busy:
                clock = time.perf_counter()
                results = retrieval.poll(wait=True)
                timings["retrieval_s"] += time.perf_counter() - clock
                for row, text in results:
                    feedback(row, text)
            elif not (scheduler.in_phase(Phase.APPEND) or scheduler.finished):
                raise RuntimeError(f"rollout engine stalled: {len(scheduler.pending)} pending, "
                                   f"{scheduler.used_blocks}/{scheduler.kv_blocks} KV blocks in use")
    finally:
        retrieval.close()
    return dict(counts, retrieval_batches=retrieval.batches, preemptions=scheduler.preemptions,
                peak_kv_blocks=scheduler.peak_blocks, kv_blocks_per_device=kv_blocks, kv_block_tokens=block,
                slots=slots, sampler_devices=len(devices), rows_per_device=_rows_per_device(session),
                kv_pool_bytes=session.pool_bytes)


def _rows_per_device(session: SlotSession) -> list[int]:
    """Slots each sampler device holds (from the arrays' own shards: what the device really has)."""
    return [int(shard.data.shape[0]) for shard in session.logits.addressable_shards]


def _end_actions(ended, session: SlotSession, scheduler: Scheduler, trajectories, slot_of, drawn, retrieval, tables,
                 vocab, tokenizer, config, *, hold_queries: bool) -> None:
    """Record the actions that ended this call (slot order), cut them, and move each trajectory on
    (``hold_queries``: queue searches for the turn's one batch instead of sending them now)."""
    owner = {slot: row for row, slot in slot_of.items()}
    cuts = {}
    for slot, action in sorted(ended.items()):
        row = owner[slot]
        traj = trajectories[row]
        drawn[row] += len(action.ids)
        outcome = apply_action(traj, action, vocab, tokenizer, config,
                               search_allowed=traj.turns < int(config.max_turns))
        if outcome.cut is not None and not traj.done:  # a finished slot's row is emptied on its next admission
            cuts[slot] = outcome.cut
        if traj.done:
            scheduler.action_ended(row, outcome.kept_tokens, "done")
            slot_of.pop(row)
        elif outcome.query is not None:
            scheduler.action_ended(row, outcome.kept_tokens, "search")
            retrieval.submit(row, outcome.query, launch=not hold_queries)
        else:
            scheduler.action_ended(row, outcome.kept_tokens, "feedback", len(outcome.feedback))
    if cuts:
        for slot in cuts:  # the cut rewrites a kept id: through the table the scheduler now holds
            session.set_blocks(slot, scheduler.entries[owner[slot]].blocks)
            tables[slot] = list(scheduler.entries[owner[slot]].blocks)
        session.cut(cuts)
