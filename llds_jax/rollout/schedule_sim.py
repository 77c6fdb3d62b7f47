"""A rollout step's schedule without a model: decode steps, prefill chunks and retrieval waits.

Given each trajectory's action and feedback token counts (``ReferenceTrajectory``, loaded by
``data.lengths`` — the project's one loader — e.g. Search-R1's own 3B policy), it counts what
one rollout step costs in device steps, driven by the engine's own :class:`Scheduler` with
the engine's rules (``rollout/engine.py``), under either of its policies:

* **continuous** (``rollout.engine="continuous"``): slots decode ``segment`` tokens per device
  call, finished actions leave their query with the retrieval thread (whatever is queued when
  it is free goes as one batch) and decode nothing until the feedback is back, free slots
  admit the next trajectory;
* **waves** (``rollout.engine="waves"``): only an empty engine admits (a wave), a turn is one
  decode call that lasts as long as the turn's longest action, the turn's queries go as one
  batch once no slot decodes, and the turn's appends wait until all of them are back.

Time is counted in decode steps (one token for every active row); the retriever's
latency is given in the same unit (``retrieval_steps``: a count, or a function of a batch's
queries, since a batch of exact searches costs its queries). A slot that ends its action
mid-segment idles until the segment ends, as in the engine. The lower bound of a
schedule is ``max(longest trajectory's decode tokens, total decode tokens / slots)``;
``efficiency`` is that over the decode steps taken. Prefill chunks (device calls of at most
``prefill_chunk`` tokens per row) and the steps no row decodes because every slot waits
for the retriever (``retrieval_wait_steps``) are reported beside them, and the step's work,
which no order changes: ``key_reads``, ``prefill_pairs``, ``decode_tokens``, ``prefill_tokens``.
"""

from __future__ import annotations

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


def step_work(trajectories: Sequence[ReferenceTrajectory]) -> dict:
    """What the step's trajectories cost whatever the schedule (a preempted one's recompute aside):
    ``key_reads`` (Σ over sampled tokens of the live KV entries each attends to: a row at context c
    sampling n tokens reads c, …, c+n−1), ``prefill_pairs`` (prompts and appended feedback, causal
    within each piece, after the context before it), ``decode_tokens`` and ``prefill_tokens``."""
    key_reads = pairs = 0.0
    for t in trajectories:
        context = t.prompt
        pairs += causal_pairs(t.prompt)
        for k, n in enumerate(t.actions):
            key_reads += n * context + n * (n - 1) / 2
            context += n
            if k < len(t.feedback):
                f = t.feedback[k]
                pairs += f * context + f * (f + 1) / 2
                context += f
    return dict(key_reads=key_reads, prefill_pairs=pairs, decode_tokens=sum(t.decode_tokens for t in trajectories),
                prefill_tokens=sum(t.prompt + sum(t.feedback) for t in trajectories))


def simulate_engine(trajectories: Sequence[ReferenceTrajectory], slots: int, *, segment: int, prefill_chunk: int,
                    retrieval_steps: int | Callable[[int], int], max_tokens: int, kv_blocks: int | None = None,
                    block_size: int = 128, devices: int = 1, waves: bool = False) -> dict:
    """The engine's schedule of ``trajectories`` over ``slots`` (its :class:`Scheduler`, its rules):
    the project's one rollout schedule simulation (``plan.step_time`` turns it into seconds).

    ``waves``: the waves policy (module docstring; ``segment`` is then the whole action buffer).
    ``kv_blocks``: each of the ``devices`` sampler devices' KV pool in blocks of ``block_size``
    tokens (``None``: whole-context rows, no preemption), as the engine's paged cache holds them. A
    preempted trajectory loses its unfinished action (the engine redraws it with the same
    keys) and re-prefills its history. ``retrieval_steps``: a batch's latency in decode steps, or
    a function of its query count. A feedback that is not a search (an invalid action's message)
    is appended without the retriever, as the engine does.
    """
    scheduler = Scheduler([t.prompt for t in trajectories], slots=slots, block_size=block_size, kv_blocks=kv_blocks,
                          max_tokens=max_tokens, devices=devices, waves=waves)
    progress = [0] * len(trajectories)   # tokens of the current action decoded so far
    turn = [0] * len(trajectories)       # actions ended so far
    now = steps = chunks = waits = batches = admissions = 0  # admissions: under the waves, the waves
    in_flight: list[int] = []
    queued: list[int] = []
    ready_at = 0
    while not scheduler.finished:
        if in_flight and now >= ready_at:
            for i in in_flight:
                scheduler.feedback_arrived(i, trajectories[i].feedback[turn[i] - 1])
            in_flight = []
        # the retrieval thread takes everything queued as one batch; the waves hold a turn's queries until no
        # slot decodes
        if queued and not in_flight and not (waves and scheduler.in_phase(Phase.DECODE)):
            latency = retrieval_steps(len(queued)) if callable(retrieval_steps) else int(retrieval_steps)
            in_flight, queued, ready_at, batches = queued, [], now + latency, batches + 1
            if latency == 0:
                continue
        admissions += bool(scheduler.admit())
        widest = 0
        # the waves append a turn's feedback once all of it is back
        if not (waves and (in_flight or queued or scheduler.in_phase(Phase.DECODE))):
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
                for victim in scheduler.reserve(i, progress[i] + (left if waves else min(segment, left))):
                    progress[victim] = 0
        decoding = scheduler.in_phase(Phase.DECODE)
        if decoding:
            run = max(trajectories[i].actions[turn[i]] - progress[i] for i in decoding)
            run = run if waves else min(segment, run)
            steps, now = steps + run, now + run
            for i in decoding:
                t, length = trajectories[i], trajectories[i].actions[turn[i]]
                progress[i] = min(length, progress[i] + run)
                if progress[i] < length:
                    continue
                progress[i] = 0
                turn[i] += 1
                k = turn[i] - 1  # the action that ended; its feedback (if any) has the same index
                if k >= len(t.feedback):
                    scheduler.action_ended(i, length, "done")
                elif t.is_search(k):
                    scheduler.action_ended(i, length, "search")
                    queued.append(i)
                else:
                    scheduler.action_ended(i, length, "feedback", t.feedback[k])
        elif in_flight:
            waits, now = waits + max(0, ready_at - now), max(now, ready_at)
        elif not queued and not scheduler.in_phase(Phase.APPEND) and not scheduler.finished:
            raise RuntimeError(f"schedule stalled: {len(scheduler.pending)} pending, {scheduler.used_blocks} "
                               f"of {scheduler.kv_blocks} blocks in use")
    return _summary(trajectories, slots, steps, prefill_chunks=chunks, retrieval_wait_steps=waits,
                    retrieval_batches=batches, preemptions=scheduler.preemptions,
                    kv_blocks=scheduler.kv_blocks * scheduler.devices, peak_kv_blocks=scheduler.peak_blocks,
                    segment=segment, **({"waves": admissions} if waves else {}), **step_work(trajectories))


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
