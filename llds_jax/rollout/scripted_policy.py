"""A policy that replays fixed token streams, for testing the rollout without a model.

Each row has one stream per turn: the ids a model "would" sample if nothing stopped it.
``act`` emits them through the *same* stop logic as the JAX decode loop — stop ids, a
byte-level stop table (the rollout's is ``llds_jax.rollout.action_stop.action_stop_table``),
the per-row budget — so a test can script ``</search>`` split over tokens or followed by
more text and watch where the action really ends. Log-probs are a fixed function of the token id
(:func:`scripted_logprob`), which lets tests check that each log-prob stayed next to
its token through the whole rollout.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from llds_jax.sampling.decode_loop import FinishReason
from llds_jax.sampling.slots import SampledAction
from llds_jax.sampling.stop_strings import StopStringTable


def scripted_logprob(token_id: int) -> float:
    """The log-prob the scripted policy reports for ``token_id`` (distinct per id, always < 0)."""
    return -1.0 - (int(token_id) % 997) / 1000.0


class ScriptedPolicy:
    """Replays ``streams[row][turn]``; when a row's scripted turn runs out it emits ``filler_id``."""

    def __init__(self, streams: Sequence[Sequence[Sequence[int]]], stop_table: StopStringTable,
                 stop_token_ids: Sequence[int] = (), filler_id: int = 0):
        self.streams = [[list(turn) for turn in row] for row in streams]
        self.stop_table = stop_table
        self.stop_token_ids = frozenset(int(i) for i in stop_token_ids)
        self.filler_id = filler_id
        self.turn = [0] * len(self.streams)
        self.prompts: list[list[int]] = []  # per scripted row, filled as waves start
        self.rows: list[int] = []  # the scripted rows of the current wave
        self.observed: list[list[list[int]]] = [[] for _ in self.streams]
        self.last_actions: list[SampledAction | None] = []
        self.cuts: list[list[int | None]] = []  # every cut_last_actions call, as given

    def start(self, prompts: Sequence[Sequence[int]], *, trajectory_ids: Sequence[int] | None = None,
              batch: int | None = None) -> None:
        """Begin a wave: ``trajectory_ids`` are the scripted rows it holds (default: all, in order)."""
        ids = list(range(len(prompts))) if trajectory_ids is None else [int(i) for i in trajectory_ids]
        if len(ids) != len(prompts) or not all(0 <= i < len(self.streams) for i in ids):
            raise ValueError(f"{len(prompts)} prompts for rows {ids} of {len(self.streams)} scripted rows")
        if trajectory_ids is None and len(prompts) != len(self.streams):
            raise ValueError(f"{len(prompts)} prompts for {len(self.streams)} scripted rows")
        self.rows = ids
        self.prompts = self.prompts if self.prompts else [[] for _ in self.streams]
        for row, prompt in zip(ids, prompts):
            self.prompts[row] = list(prompt)

    def _one_action(self, row: int, budget: int) -> SampledAction:
        turns = self.streams[row]
        stream = turns[self.turn[row]] if self.turn[row] < len(turns) else []
        self.turn[row] += 1
        state = self.stop_table.initial_state(1)
        ids: list[int] = []
        finish = FinishReason.CAP
        position = 0
        while len(ids) < budget:
            token = stream[position] if position < len(stream) else self.filler_id
            position += 1
            ids.append(token)
            state, matched = self.stop_table.advance(state, np.array([token]))
            if token in self.stop_token_ids:
                finish = FinishReason.STOP_TOKEN
                break
            if matched[0]:
                finish = FinishReason.STOP_STRING
                break
        logprobs = np.array([scripted_logprob(t) for t in ids], np.float32)
        return SampledAction(np.array(ids, np.int32), logprobs, finish)

    def act(self, active: np.ndarray, budgets: np.ndarray) -> list[SampledAction | None]:
        self.last_actions = [self._one_action(row, int(budgets[i])) if active[i] else None
                             for i, row in enumerate(self.rows)]
        return list(self.last_actions)

    def cut_last_actions(self, kept_tokens: Sequence[int | None]) -> None:
        """Nothing to forget (no cache); checks the counts as the JAX session does and records them."""
        for row, kept in enumerate(kept_tokens):
            action = self.last_actions[row] if row < len(self.last_actions) else None
            sampled = 0 if action is None else len(action.ids)
            if kept is not None and not 1 <= kept <= sampled:
                raise ValueError(f"row {row}: cannot keep {kept} of the {sampled} ids its last action sampled")
        self.cuts.append(list(kept_tokens))

    def observe(self, chunks: Sequence[Sequence[int]]) -> None:
        for row, chunk in zip(self.rows, chunks):
            if chunk:
                self.observed[row].append(list(chunk))
