"""A rollout step's schedule without a model: decode steps, prefill chunks and retrieval waits.

Given each trajectory's action and feedback token counts (``ReferenceTrajectory``, loaded by
``data.lengths`` — the project's one loader — e.g. Search-R1's own 3B policy), it counts what
one rollout step costs in device steps under

* **waves + turn barrier** (``rollout/multi_turn.py`` today): rows in waves; every turn of a
  wave decodes until its longest action ends, then the whole wave waits for one batched
  retrieval and one feedback append;
* **the engine** (``rollout/engine.py``): driven by the engine's own :class:`Scheduler`,
  the same segment length and the same host-thread retrieval: slots decode ``segment``
  tokens per device call, finished actions leave their query with the retriever and keep
  decoding nothing until the feedback is back, free slots admit the next trajectory.

Time is counted in decode steps (one token for every active row); the retriever's
latency is given in the same unit (``retrieval_steps``: a count, or a function of a batch's
queries, since a batch of exact searches costs its queries). A slot that ends its action
mid-segment idles until the segment ends, as in the engine. The lower bound of a
schedule is ``max(longest trajectory's decode tokens, total decode tokens / slots)``;
``efficiency`` is that over the decode steps taken. Prefill chunks (device calls of at most
``prefill_chunk`` tokens per row) and the steps no row decodes because every slot waits
for the retriever (``retrieval_wait_steps``) are reported beside them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from llds_jax.data.lengths import TrajectoryLengths
from llds_jax.rollout.scheduler import Phase, Scheduler
from llds_jax.utils.flops import causal_pairs

# One trajectory's token counts (prompt, actions, feedback between actions): the project's one record of them.
ReferenceTrajectory = TrajectoryLengths


def lower_bound_steps(trajectories: Sequence[ReferenceTrajectory], slots: int) -> int:
    total = sum(t.decode_tokens for t in trajectories)
    return max(max(t.decode_tokens for t in trajectories), -(-total // slots))


def _chunks(tokens: int, prefill_chunk: int) -> int:
    return -(-tokens // prefill_chunk) if tokens > 0 else 0


def _summary(trajectories, slots: int, decode_steps: int, **extra) -> dict:
    bound = lower_bound_steps(trajectories, slots)
    return dict(slots=slots, decode_steps=decode_steps, lower_bound_steps=bound,
                efficiency=round(bound / decode_steps, 4), **extra)


def simulate_waves(trajectories: Sequence[ReferenceTrajectory], rows: int, *, prefill_chunk: int = 512,
                   retrieval_steps: int = 0) -> dict:
    """Waves of ``rows`` trajectories, each turn a barrier (``multi_turn._run_wave``): the project's one
    waves simulation (``plan.step_time`` turns it into seconds).

    Besides the steps: ``key_reads`` (Σ over sampled tokens of the live KV entries each attends to: a
    row at context c sampling n tokens reads c, …, c+n−1), ``prefill_tokens`` and ``prefill_pairs``
    (prompts and appended feedback, causal within each piece, after the context before it), and
    ``retrieval_batches`` — one per turn in which some row's feedback came from the retriever.
    """
    steps = chunks = waits = batches = 0
    key_reads = prefill_pairs = 0.0
    waves = math.ceil(len(trajectories) / rows)
    for first in range(0, len(trajectories), rows):
        wave = list(trajectories[first:first + rows])
        chunks += _chunks(max(t.prompt for t in wave), prefill_chunk)
        context = [t.prompt for t in wave]
        for turn in range(max(len(t.actions) for t in wave)):
            acting = [i for i, t in enumerate(wave) if turn < len(t.actions)]
            if not acting:
                break
            steps += max(wave[i].actions[turn] for i in acting)
            for i in acting:
                n = wave[i].actions[turn]
                key_reads += n * context[i] + n * (n - 1) / 2
                context[i] += n
            appending = [i for i in acting if turn < len(wave[i].feedback)]
            if any(wave[i].is_search(turn) for i in appending):
                waits += retrieval_steps
                batches += 1
            if appending:
                chunks += _chunks(max(wave[i].feedback[turn] for i in appending), prefill_chunk)
            for i in appending:
                f = wave[i].feedback[turn]
                prefill_pairs += f * context[i] + f * (f + 1) / 2
                context[i] += f
    prefill_pairs += sum(causal_pairs(t.prompt) for t in trajectories)
    return _summary(trajectories, rows, steps, waves=waves, prefill_chunks=chunks, retrieval_wait_steps=waits,
                    retrieval_batches=batches, key_reads=key_reads, prefill_pairs=prefill_pairs,
                    decode_tokens=sum(t.decode_tokens for t in trajectories),
                    prefill_tokens=sum(t.prompt + sum(t.feedback) for t in trajectories))


def simulate_engine(trajectories: Sequence[ReferenceTrajectory], slots: int, *, segment: int, prefill_chunk: int,
                    retrieval_steps: int | Callable[[int], int], max_tokens: int, kv_blocks: int | None = None,
                    block_size: int = 128, devices: int = 1) -> dict:
    """The engine's schedule of ``trajectories`` over ``slots`` (its :class:`Scheduler`, its rules).

    ``kv_blocks``: each of the ``devices`` sampler devices' KV pool in blocks of ``block_size``
    tokens (``None``: dense rows, no preemption), as the engine's paged cache holds them. A
    preempted trajectory loses its unfinished action (the engine redraws it with the same
    keys) and re-prefills its history. ``retrieval_steps``: a batch's latency in decode steps, or
    a function of its query count.
    """
    scheduler = Scheduler([t.prompt for t in trajectories], slots=slots, block_size=block_size, kv_blocks=kv_blocks,
                          max_tokens=max_tokens, devices=devices)
    progress = [0] * len(trajectories)   # tokens of the current action decoded so far
    turn = [0] * len(trajectories)       # actions ended so far
    now = steps = chunks = waits = batches = 0
    in_flight: list[int] = []
    queued: list[int] = []
    ready_at = 0
    while not scheduler.finished:
        if in_flight and now >= ready_at:
            for i in in_flight:
                scheduler.feedback_arrived(i, trajectories[i].feedback[turn[i] - 1])
            in_flight = []
        if queued and not in_flight:  # the retrieval thread takes everything queued as one batch
            latency = retrieval_steps(len(queued)) if callable(retrieval_steps) else int(retrieval_steps)
            in_flight, queued, ready_at, batches = queued, [], now + latency, batches + 1
            if latency == 0:
                continue
        scheduler.admit()
        widest = 0
        for i in scheduler.in_phase(Phase.APPEND):
            if scheduler.entries[i].phase is not Phase.APPEND:
                continue  # preempted by an earlier reservation in this loop
            for victim in scheduler.reserve(i, 0):
                progress[victim] = 0
            if scheduler.entries[i].phase is Phase.APPEND:
                widest = max(widest, scheduler.entries[i].to_append)
                scheduler.appended(i)
        chunks += _chunks(widest, prefill_chunk)
        for i in scheduler.in_phase(Phase.DECODE):
            if scheduler.entries[i].phase is Phase.DECODE:
                left = trajectories[i].actions[turn[i]] - progress[i]
                for victim in scheduler.reserve(i, progress[i] + min(segment, left)):
                    progress[victim] = 0
        decoding = scheduler.in_phase(Phase.DECODE)
        if decoding:
            run = min(segment, max(trajectories[i].actions[turn[i]] - progress[i] for i in decoding))
            steps, now = steps + run, now + run
            for i in decoding:
                length = trajectories[i].actions[turn[i]]
                progress[i] = min(length, progress[i] + run)
                if progress[i] < length:
                    continue
                progress[i] = 0
                turn[i] += 1
                searched = turn[i] <= len(trajectories[i].feedback)
                scheduler.action_ended(i, length, "search" if searched else "done")
                if searched:
                    queued.append(i)
        elif in_flight:
            waits, now = waits + max(0, ready_at - now), max(now, ready_at)
        elif not queued and not scheduler.in_phase(Phase.APPEND) and not scheduler.finished:
            raise RuntimeError(f"schedule stalled: {len(scheduler.pending)} pending, {scheduler.used_blocks} "
                               f"of {scheduler.kv_blocks} blocks in use")
    return _summary(trajectories, slots, steps, prefill_chunks=chunks, retrieval_wait_steps=waits,
                    retrieval_batches=batches, preemptions=scheduler.preemptions,
                    kv_blocks=scheduler.kv_blocks * scheduler.devices,
                    peak_kv_blocks=scheduler.peak_blocks, segment=segment)


def simulate_engine_groups(trajectories: Sequence[ReferenceTrajectory], groups: int, slots_per_group: int,
                           **kwargs) -> dict:
    """One engine per group of contiguous rows (a host: hosts sample independently); the step
    lasts as long as the slowest group. Counts are summed, the lower bound is the whole step's."""
    per = -(-len(trajectories) // groups)
    runs = [simulate_engine(trajectories[g * per:(g + 1) * per], slots_per_group, **kwargs)
            for g in range(groups) if trajectories[g * per:(g + 1) * per]]
    steps = max(r["decode_steps"] for r in runs)
    summed = {k: sum(r[k] for r in runs) for k in ("prefill_chunks", "retrieval_batches", "preemptions")}
    return _summary(trajectories, slots_per_group * groups, steps, groups=groups,
                    retrieval_wait_steps=max(r["retrieval_wait_steps"] for r in runs),
                    kv_blocks=sum(r["kv_blocks"] for r in runs), peak_kv_blocks=max(r["peak_kv_blocks"] for r in runs),
                    segment=runs[0]["segment"], **summed)
