"""A rollout step's schedule without a model: decode steps, prefill chunks and retrieval waits.

Given each trajectory's action and feedback token counts (``ReferenceTrajectory``, e.g.
Search-R1's own 3B policy in ``shared/data/searchr1/reference_rollout_lengths.jsonl``),
it counts what one rollout step costs in device steps under

* **waves + turn barrier** (``rollout/multi_turn.py`` today): rows in waves; every turn of a
  wave decodes until its longest action ends, then the whole wave waits for one batched
  retrieval and one feedback append;
* **the engine** (``rollout/engine.py``): driven by the engine's own :class:`Scheduler`,
  the same segment length and the same host-thread retrieval: slots decode ``segment``
  tokens per device call, finished actions leave their query with the retriever and keep
  decoding nothing until the feedback is back, free slots admit the next trajectory.

Time is counted in decode steps (one token for every active row); the retriever's
latency is given in the same unit (``retrieval_steps``). A slot that ends its action
mid-segment idles until the segment ends, as in the engine. The lower bound of a
schedule is ``max(longest trajectory's decode tokens, total decode tokens / slots)``;
``efficiency`` is that over the decode steps taken. Prefill chunks (device calls of at most
``prefill_chunk`` tokens per row) and the steps no row decodes because every slot waits
for the retriever (``retrieval_wait_steps``) are reported beside them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from llds_jax.data.lengths import TrajectoryLengths
from llds_jax.rollout.scheduler import Phase, Scheduler

# One trajectory's token counts (prompt, actions, feedback between actions): the project's one record of them.
ReferenceTrajectory = TrajectoryLengths


def load_reference(path: str | Path, count: int, *, max_action_tokens: int, max_obs_tokens: int,
                   max_prompt_tokens: int) -> list[ReferenceTrajectory]:
    """The first ``count`` trajectories of a reference-lengths file, cut to the rollout's caps.

    Each line has ``first_prompt_tokens``, ``actions`` and ``feedback`` (per search). The
    file's counts come from re-tokenised text, so a few actions read 501-502 tokens
    against the 500 cap: they are cut to the cap, as the sampler would have.
    """
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if len(rows) < count:
        raise ValueError(f"{path} has {len(rows)} trajectories, {count} requested")
    out = []
    for row in rows[:count]:
        actions = tuple(min(int(a), max_action_tokens) for a in row["actions"])
        feedback = tuple(min(int(f), max_obs_tokens) for f in row["feedback"])[: len(actions) - 1]
        out.append(ReferenceTrajectory(min(int(row["first_prompt_tokens"]), max_prompt_tokens), actions, feedback))
    return out


def lower_bound_steps(trajectories: Sequence[ReferenceTrajectory], slots: int) -> int:
    total = sum(t.decode_tokens for t in trajectories)
    return max(max(t.decode_tokens for t in trajectories), -(-total // slots))


def _chunks(tokens: int, prefill_chunk: int) -> int:
    return -(-tokens // prefill_chunk) if tokens > 0 else 0


def _summary(trajectories, slots: int, decode_steps: int, **extra) -> dict:
    bound = lower_bound_steps(trajectories, slots)
    return dict(slots=slots, decode_steps=decode_steps, lower_bound_steps=bound,
                efficiency=round(bound / decode_steps, 4), **extra)


def simulate_waves(trajectories: Sequence[ReferenceTrajectory], rows: int, *, prefill_chunk: int,
                   retrieval_steps: int) -> dict:
    """Waves of ``rows`` trajectories, each turn a barrier (``multi_turn._run_wave``)."""
    steps = chunks = waits = batches = 0
    waves = math.ceil(len(trajectories) / rows)
    for first in range(0, len(trajectories), rows):
        wave = list(trajectories[first:first + rows])
        chunks += _chunks(max(t.prompt for t in wave), prefill_chunk)
        active = wave
        for turn in range(max(len(t.actions) for t in wave)):
            acting = [t for t in active if turn < len(t.actions)]
            if not acting:
                break
            steps += max(t.actions[turn] for t in acting)
            searching = [t for t in acting if turn < len(t.feedback)]
            if searching:
                waits += retrieval_steps
                batches += 1
                chunks += _chunks(max(t.feedback[turn] for t in searching), prefill_chunk)
            active = searching
    return _summary(trajectories, rows, steps, waves=waves, prefill_chunks=chunks, retrieval_wait_steps=waits,
                    retrieval_batches=batches)


def simulate_engine(trajectories: Sequence[ReferenceTrajectory], slots: int, *, segment: int, prefill_chunk: int,
                    retrieval_steps: int, max_tokens: int, kv_blocks: int | None = None,
                    block_size: int = 128, devices: int = 1) -> dict:
    """The engine's schedule of ``trajectories`` over ``slots`` (its :class:`Scheduler`, its rules).

    ``kv_blocks``: each of the ``devices`` sampler devices' KV pool in blocks of ``block_size``
    tokens (``None``: dense rows, no preemption), as the engine's paged cache holds them. A
    preempted trajectory loses its unfinished action (the engine redraws it with the same
    keys) and re-prefills its history.
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
            in_flight, queued, ready_at, batches = queued, [], now + retrieval_steps, batches + 1
            if retrieval_steps == 0:
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
