"""The rollout engine's scheduler: slots, per-trajectory turns, KV blocks, admission, preemption.

Host-side and pure (no JAX): the real engine (``rollout/engine.py``) and the scheduling
simulation of a paper step (``rollout/schedule_sim.py``) drive this one class, so the
simulated schedule is the schedule the engine runs.

The shape follows JetStream's orchestrator and vLLM's scheduler, kept to what a Search-R1
rollout needs:

* a fixed number of **slots** (decode rows; slot ``s`` lives on device ``s % devices``, so
  admission in slot order spreads trajectories over the devices);
* each trajectory moves through its own turns, with no barrier between trajectories::

      PENDING --admit--> APPEND --appended--> DECODE --action_ended--+--> RETRIEVAL --feedback--> APPEND
         ^                                                           +--> APPEND (invalid-action message)
         +------------------------- preempt --------------------------+--> DONE (answer, last turn, cap)

  ``APPEND`` means "ids to feed the cache before the next action": a new prompt, the
  whole history of a preempted trajectory (recompute), or feedback;
* **KV blocks** of ``block_size`` tokens (128: the blockwise kernel's key block) are taken
  from its device's pool as a trajectory grows, never reserved for the worst case; its block
  table lists them in order (the engine's paged cache reads exactly these blocks);
* **admission** fills free slots from the pending queue in order (preempted trajectories
  go back to its front, so they resume first);
* **preemption by recompute** when a device's pool runs dry: the most recently admitted
  trajectory on that device gives back its slot and blocks and resumes later from its ids (vLLM's
  recompute mode); it is never dropped. Whatever it had sampled of an unfinished action is
  the engine's to discard: the scheduler only counts committed tokens.

A trajectory keeps its slot (and blocks) while its search is out: the retrieval runs on a
host thread and the other slots keep decoding.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from collections.abc import Sequence


class Phase(enum.Enum):
    PENDING = "pending"      # waiting for a slot (new, or preempted and resuming from its ids)
    APPEND = "append"        # holds a slot; ids to feed its cache before it can decode
    DECODE = "decode"        # decoding an action
    RETRIEVAL = "retrieval"  # its search is with the retriever; keeps slot and blocks
    DONE = "done"


class SchedulerError(RuntimeError):
    """The engine asked for something its state machine forbids (a bug, never user input)."""


@dataclasses.dataclass
class Entry:
    """One trajectory as the scheduler sees it: token counts, slot and block table."""

    index: int
    tokens: int                 # committed tokens: prompt, kept action ids, feedback
    phase: Phase = Phase.PENDING
    cached: int = 0             # of those, how many its slot's cache holds
    slot: int | None = None
    blocks: list[int] = dataclasses.field(default_factory=list)  # its block table, in order
    admitted: int = -1          # admission counter at its last admission (preemption takes the newest)
    preemptions: int = 0

    @property
    def to_append(self) -> int:
        return self.tokens - self.cached


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-int(tokens) // block_size)


class Scheduler:
    """Slots and KV blocks for ``len(prompt_tokens)`` trajectories.

    ``slots``: decode rows, over ``devices`` devices (slot ``s`` on ``s % devices``, each device
    its own pool); ``block_size``: tokens per KV block; ``kv_blocks``: each device's pool
    (``None``: every slot can hold ``max_tokens``, i.e. a dense cache, and nothing is ever
    preempted); ``max_tokens``: a trajectory's context cap (one slot's worst case must fit
    a pool, else the schedule could deadlock). Block ids are local to their device's pool.
    """

    def __init__(self, prompt_tokens: Sequence[int], *, slots: int, block_size: int = 128,
                 kv_blocks: int | None = None, max_tokens: int, devices: int = 1, waves: bool = False):
        if slots < 1 or block_size < 1 or devices < 1 or slots % devices:
            raise ValueError(f"slots={slots}, block_size={block_size}, devices={devices}: all must be >= 1 "
                             f"and slots a multiple of devices")
        per_row = blocks_for(max_tokens, block_size)
        kv_blocks = slots // devices * per_row if kv_blocks is None else int(kv_blocks)
        if kv_blocks < per_row:
            raise ValueError(f"{kv_blocks} KV blocks of {block_size} tokens cannot hold one trajectory of "
                             f"max_tokens={max_tokens} ({per_row} blocks)")
        self.slots, self.block_size, self.kv_blocks, self.max_tokens = slots, block_size, kv_blocks, max_tokens
        self.devices = devices
        self.waves = waves  # admit only into an empty engine: the turn-synchronous policy's waves
        self.entries = [Entry(i, int(n)) for i, n in enumerate(prompt_tokens)]
        self.pending: collections.deque[int] = collections.deque(range(len(self.entries)))
        self.slot_owner: list[int | None] = [None] * slots
        self.pools: list[collections.deque[int]] = [collections.deque(range(kv_blocks)) for _ in range(devices)]
        self._admissions = 0
        self._admission_paused = False  # after a preemption, until a trajectory finishes (no thrashing)
        self.preemptions = 0
        self.peak_blocks = 0

    # -- queries -------------------------------------------------------------------------
    def in_phase(self, phase: Phase) -> list[int]:
        """Trajectories holding a slot in ``phase``, in slot order (PENDING: queue order)."""
        if phase is Phase.PENDING:
            return list(self.pending)
        return [i for i in self.slot_owner if i is not None and self.entries[i].phase is phase]

    @property
    def finished(self) -> bool:
        return all(e.phase is Phase.DONE for e in self.entries)

    @property
    def used_blocks(self) -> int:
        """Blocks in use over every device's pool."""
        return self.kv_blocks * self.devices - sum(map(len, self.pools))

    def device_of(self, slot: int) -> int:
        return slot % self.devices

    def _pool(self, entry: Entry) -> collections.deque[int]:
        return self.pools[self.device_of(entry.slot)]

    def block_table(self, index: int) -> list[int]:
        return list(self.entries[index].blocks)

    # -- transitions ---------------------------------------------------------------------
    def admit(self) -> list[tuple[int, int]]:
        """Fill free slots from the queue: ``[(slot, trajectory)]`` now in ``APPEND``.

        A trajectory is admitted only when the free pool covers its history plus one block
        (its first decode step); otherwise admission waits for blocks to come back. After a
        preemption nothing is admitted until a trajectory finishes: the pool proved short, and
        re-admitting at once would only preempt again (40 toy trajectories over 40 slots and a
        pool of 30 16-token blocks, ``tests/rollout/test_scheduler.py``: 557 preemptions with the
        pause, 823 without; a pool that small for that many slots thrashes either way).
        With ``waves`` only an empty engine admits: the next wave starts when the last one ended.
        """
        admitted = []
        if (self._admission_paused or self.waves) and any(owner is not None for owner in self.slot_owner):
            return admitted
        self._admission_paused = False
        for slot, owner in enumerate(self.slot_owner):
            if owner is not None or not self.pending:
                continue
            entry = self.entries[self.pending[0]]
            if blocks_for(min(entry.tokens + 1, self.max_tokens), self.block_size) > len(
                    self.pools[self.device_of(slot)]):
                continue  # this device's pool is short; a free slot on another device may take it
            self.pending.popleft()
            entry.phase, entry.slot, entry.cached = Phase.APPEND, slot, 0
            entry.admitted, self._admissions = self._admissions, self._admissions + 1
            self.slot_owner[slot] = entry.index
            admitted.append((slot, entry.index))
        return admitted

    def reserve(self, index: int, new_tokens: int) -> list[int]:
        """Blocks for ``new_tokens`` more tokens in ``index``'s cache; returns the trajectories
        preempted to find them (possibly ``index`` itself, when it is the newest)."""
        entry = self._holding(index)
        needed = blocks_for(entry.tokens + new_tokens, self.block_size) - len(entry.blocks)
        device, pool = self.device_of(entry.slot), self._pool(entry)
        preempted = []
        while needed > len(pool):
            victim = max((self.entries[i] for s, i in enumerate(self.slot_owner)
                          if i is not None and self.device_of(s) == device), key=lambda e: e.admitted)
            self._preempt(victim)
            preempted.append(victim.index)
            if victim.index == index:
                return preempted
        for _ in range(max(0, needed)):
            entry.blocks.append(pool.popleft())
        self.peak_blocks = max(self.peak_blocks, self.used_blocks)
        return preempted

    def appended(self, index: int) -> None:
        """The engine fed ``index``'s pending ids to its cache; it decodes next."""
        entry = self._holding(index, Phase.APPEND)
        if blocks_for(entry.tokens, self.block_size) > len(entry.blocks):
            raise SchedulerError(f"trajectory {index} appended {entry.tokens} tokens into {len(entry.blocks)} blocks")
        entry.cached, entry.phase = entry.tokens, Phase.DECODE

    def action_ended(self, index: int, kept_tokens: int, then: str, feedback_tokens: int = 0) -> None:
        """``index``'s action ended with ``kept_tokens`` ids in its cache; ``then`` is ``"search"``
        (its query goes to the retriever), ``"feedback"`` (``feedback_tokens`` ids to append
        now: the invalid-action message) or ``"done"`` (slot and blocks are freed)."""
        entry = self._holding(index, Phase.DECODE)
        entry.tokens += int(kept_tokens)
        entry.cached = entry.tokens
        self._shrink(entry)
        if then == "search":
            entry.phase = Phase.RETRIEVAL
        elif then == "feedback":
            entry.tokens += int(feedback_tokens)
            entry.phase = Phase.APPEND
        elif then == "done":
            self._release(entry)
            entry.phase = Phase.DONE
            self._admission_paused = False
        else:
            raise SchedulerError(f"action_ended(then={then!r})")

    def feedback_arrived(self, index: int, feedback_tokens: int) -> None:
        """``index``'s search results came back as ``feedback_tokens`` ids (0: none fit)."""
        entry = self.entries[index]
        if entry.phase is not Phase.RETRIEVAL:
            raise SchedulerError(f"feedback for trajectory {index} in phase {entry.phase}")
        entry.tokens += int(feedback_tokens)
        if entry.slot is None:  # preempted while its search was out: resumes first, from its ids
            entry.phase = Phase.PENDING
            self.pending.appendleft(index)
        else:
            entry.phase = Phase.APPEND

    def end(self, index: int) -> None:
        """``index`` ends without another action (no room left in its context)."""
        entry = self._holding(index)
        self._release(entry)
        entry.phase = Phase.DONE
        self._admission_paused = False

    # -- internals -----------------------------------------------------------------------
    def _holding(self, index: int, phase: Phase | None = None) -> Entry:
        entry = self.entries[index]
        if entry.slot is None or (phase is not None and entry.phase is not phase):
            raise SchedulerError(f"trajectory {index} is {entry.phase} in slot {entry.slot}, expected "
                                 f"{phase or 'any phase'} in a slot")
        return entry

    def _shrink(self, entry: Entry) -> None:
        """Give back blocks reserved past the committed tokens (an action that ended early or was cut)."""
        keep = blocks_for(entry.cached, self.block_size)
        while len(entry.blocks) > keep:
            self._pool(entry).appendleft(entry.blocks.pop())

    def _release(self, entry: Entry) -> None:
        self._pool(entry).extend(entry.blocks)
        entry.blocks = []
        self.slot_owner[entry.slot] = None
        entry.slot = None

    def _preempt(self, entry: Entry) -> None:
        """Recompute mode: free the slot and blocks, queue the trajectory first to resume from its ids.

        A trajectory preempted while its search is out stays in RETRIEVAL without a slot; it
        joins the queue when its feedback arrives (:meth:`feedback_arrived`).
        """
        self._release(entry)
        entry.cached = 0
        entry.preemptions += 1
        self.preemptions += 1
        self._admission_paused = True
        if entry.phase is Phase.RETRIEVAL:
            return
        entry.phase = Phase.PENDING
        self.pending.appendleft(entry.index)
