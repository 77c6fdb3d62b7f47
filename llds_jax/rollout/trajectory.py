"""The trajectory record: ids as they were produced, and the masks the losses need.

A trajectory is ``prompt, y_0, o_0, y_1, o_1, …, y_T``: actions ``y_t`` sampled by the
policy (trained) and feedback ``o_t`` written by the environment (masked). Each piece is
recorded with its kind at the moment its ids exist — sampled ids straight from the
sampler, feedback ids from the tokenizer call that produced them — so every mask is a
statement about where ids came from. Nothing is ever re-derived by tokenising text.

Layout of :class:`RolloutBatch` arrays ``[N, L]``: each row is its prompt starting at
column 0, then its response, then padding (``attention_mask`` False). Position ``t`` of
``sampler_logprobs`` is the log-prob of the token *at* ``t`` given ``input_ids[:t]`` —
compare it with a forward pass's prediction made at ``t - 1``.

``answer_mask`` covers the last complete ``<answer>…</answer>`` the model wrote (tags
included; every token that holds a character of it), located in the decoded text of the
action that contains it and mapped back to that action's token positions through the
per-token character offsets of the sampled ids.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from llds_jax.rollout.reward import ANSWER_PATTERN, extract_answer
from llds_jax.sampling.decode_loop import FinishReason
from llds_jax.sampling.token_bytes import char_offsets, decode_text


@dataclasses.dataclass(frozen=True)
class ActionRecord:
    """One sampled action: its ids and log-probs as sampled, its decoded text and why it ended."""

    ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str
    offsets: tuple[int, ...]      # char_offsets(ids): chars decoded from ids[:i]
    finish: FinishReason

    def answer_token_span(self) -> tuple[int, int] | None:
        """Token range ``[a, b)`` of this action's last complete answer block, or ``None``."""
        spans = [m.span() for m in ANSWER_PATTERN.finditer(self.text)]
        if not spans:
            return None
        start_char, end_char = spans[-1]
        # token i holds chars [offsets[i], offsets[i+1]); keep tokens overlapping the span.
        tokens = [i for i in range(len(self.ids))
                  if self.offsets[i] < end_char and self.offsets[i + 1] > start_char]
        return tokens[0], tokens[-1] + 1


@dataclasses.dataclass(frozen=True)
class FeedbackRecord:
    """Environment text appended after an action: search results or the invalid-action message."""

    ids: tuple[int, ...]
    kind: str  # "search" | "invalid"


@dataclasses.dataclass
class Trajectory:
    """A growing trajectory for one row of the rollout, plus its protocol statistics."""

    prompt_ids: list[int]
    group_id: int
    pieces: list[ActionRecord | FeedbackRecord] = dataclasses.field(default_factory=list)
    searches: int = 0               # searches executed (results appended as feedback)
    search_actions_written: int = 0  # actions that parsed as a search, executed or not (see RolloutBatch)
    valid_actions: int = 0
    finished: bool = False          # ended by a valid <answer> action
    truncated: bool = False         # an action or the context hit a token cap
    done: bool = False

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + sum(len(p.ids) for p in self.pieces)

    @property
    def actions(self) -> list[ActionRecord]:
        return [p for p in self.pieces if isinstance(p, ActionRecord)]

    @property
    def turns(self) -> int:
        return len(self.actions)

    def add_action(self, ids: Sequence[int], logprobs: Sequence[float], finish: FinishReason,
                   vocab: Sequence[bytes]) -> ActionRecord:
        ids = tuple(int(i) for i in ids)
        if len(logprobs) != len(ids):
            raise ValueError(f"action has {len(ids)} ids but {len(logprobs)} log-probs")
        record = ActionRecord(ids=ids, logprobs=tuple(float(x) for x in logprobs), text=decode_text(ids, vocab),
                              offsets=tuple(char_offsets(ids, vocab)), finish=FinishReason(int(finish)))
        self.pieces.append(record)
        return record

    def add_feedback(self, ids: Sequence[int], kind: str) -> None:
        if ids:
            self.pieces.append(FeedbackRecord(ids=tuple(int(i) for i in ids), kind=kind))

    def last_answer(self) -> tuple[int, tuple[int, int]] | None:
        """(action number, token span) of the last complete answer block the model wrote."""
        actions = self.actions
        for number in range(len(actions) - 1, -1, -1):
            span = actions[number].answer_token_span()
            if span is not None:
                return number, span
        return None


@dataclasses.dataclass(frozen=True)
class RolloutBatch:
    """Padded arrays for the trainer (``[N, L]``), per-row statistics (``[N]``) and texts.

    Masks: ``prompt_mask | action_mask | feedback_mask == attention_mask`` and they are
    disjoint. ``action_index`` is 0 on the first action's tokens, 1 on the second's, …,
    -1 elsewhere. ``answer`` is the content of the last answer block the model wrote (not
    the prompt's example, not feedback), ``None`` when there is none. ``action_feedback[row][k]``
    is the kind of the feedback appended after action ``k`` (``"search"``: its results,
    ``"invalid"``: the invalid-action message, None: nothing followed), as recorded when the
    feedback was appended.

    ``searches`` counts searches executed; ``search_actions_written`` counts actions that
    parsed as a search, including one written in the last, search-disabled turn, which is
    not executed. The latter is the reference's ``is_search`` / ``valid_search_stats``
    (``execute_predictions`` sets it for every parsed search, ``do_search`` or not), whose
    batch mean the official adaptive LLDS-MA uses as ``valid_search_mean``.
    """

    input_ids: np.ndarray
    attention_mask: np.ndarray
    prompt_mask: np.ndarray
    action_mask: np.ndarray
    feedback_mask: np.ndarray
    action_index: np.ndarray
    answer_mask: np.ndarray
    sampler_logprobs: np.ndarray
    prompt_lengths: np.ndarray
    lengths: np.ndarray
    group_ids: np.ndarray
    turns: np.ndarray
    searches: np.ndarray
    search_actions_written: np.ndarray
    valid_actions: np.ndarray
    finished: np.ndarray
    truncated: np.ndarray
    response_texts: list[str]
    action_texts: list[list[str]]
    answers: list[str | None]
    action_feedback: list[list[str | None]]
    timings: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def with_timings(self, timings: dict[str, float]) -> RolloutBatch:
        """A copy carrying wall-clock seconds per rollout phase (prefill, decode, append, retrieval, host)."""
        return dataclasses.replace(self, timings=dict(timings))

    def stats(self) -> dict[str, float]:
        """Batch means of the per-trajectory statistics (for logging)."""
        return {
            "rollout/turns": float(self.turns.mean()),
            "rollout/searches": float(self.searches.mean()),
            "rollout/search_actions_written": float(self.search_actions_written.mean()),
            "rollout/valid_action_rate": float(self.valid_actions.sum() / max(1, self.turns.sum())),
            "rollout/finished": float(self.finished.mean()),
            "rollout/truncated": float(self.truncated.mean()),
            "rollout/response_tokens": float((self.lengths - self.prompt_lengths).mean()),
            "rollout/action_tokens": float(self.action_mask.sum(axis=1).mean()),
        }


def _padded_length(longest: int, multiple: int) -> int:
    multiple = max(1, multiple)
    return max(multiple, -(-longest // multiple) * multiple)


def token_layout(trajectories: Sequence[Trajectory], width: int, *, pad_id: int) -> dict[str, np.ndarray]:
    """The ``[N, width]`` token arrays of ``trajectories`` (right-padded): ids, masks by provenance, log-probs.

    The one place masks are made — rollouts (:func:`collate`) and the SFT warm-up
    (``train.sft.collate_sft``) both lay their trajectories out with it. Also returns, per row,
    ``answers`` (the last answer block's content or None) and ``action_feedback``: the kind of
    the feedback that followed each action (``"search"``, ``"invalid"``, or None: none followed).
    """
    n = len(trajectories)
    longest = max((t.length for t in trajectories), default=0)
    if longest > width:
        raise ValueError(f"a trajectory has {longest} tokens, more than the layout width {width}")
    input_ids = np.full((n, width), pad_id, np.int32)
    prompt_mask = np.zeros((n, width), bool)
    action_mask = np.zeros((n, width), bool)
    feedback_mask = np.zeros((n, width), bool)
    answer_mask = np.zeros((n, width), bool)
    action_index = np.full((n, width), -1, np.int32)
    logprobs = np.zeros((n, width), np.float32)
    answers: list[str | None] = []
    action_feedback: list[list[str | None]] = []
    for row, traj in enumerate(trajectories):
        cursor = len(traj.prompt_ids)
        input_ids[row, :cursor] = traj.prompt_ids
        prompt_mask[row, :cursor] = True
        action_starts = []
        feedback_kinds: list[str | None] = []
        number = 0
        for piece in traj.pieces:
            ids = piece.ids
            stop = cursor + len(ids)
            input_ids[row, cursor:stop] = ids
            if isinstance(piece, ActionRecord):
                action_mask[row, cursor:stop] = True
                action_index[row, cursor:stop] = number
                logprobs[row, cursor:stop] = piece.logprobs
                action_starts.append(cursor)
                feedback_kinds.append(None)
                number += 1
            else:
                feedback_mask[row, cursor:stop] = True
                if feedback_kinds:
                    feedback_kinds[-1] = piece.kind
            cursor = stop
        last = traj.last_answer()
        if last is not None:
            number, (a, b) = last
            answer_mask[row, action_starts[number] + a:action_starts[number] + b] = True
            answers.append(extract_answer(traj.actions[number].text))
        else:
            answers.append(None)
        action_feedback.append(feedback_kinds)
    return dict(input_ids=input_ids, attention_mask=prompt_mask | action_mask | feedback_mask,
                prompt_mask=prompt_mask, action_mask=action_mask, feedback_mask=feedback_mask,
                action_index=action_index, answer_mask=answer_mask, sampler_logprobs=logprobs,
                answers=answers, action_feedback=action_feedback)


def collate(trajectories: Sequence[Trajectory], vocab: Sequence[bytes], *, pad_id: int,
            pad_to_multiple: int = 128) -> RolloutBatch:
    """Lay finished trajectories out as right-padded ``[N, L]`` arrays (L a multiple of ``pad_to_multiple``)."""
    width = _padded_length(max(t.length for t in trajectories), pad_to_multiple)
    layout = token_layout(trajectories, width, pad_id=pad_id)
    return RolloutBatch(
        **layout,
        prompt_lengths=np.array([len(t.prompt_ids) for t in trajectories], np.int32),
        lengths=np.array([t.length for t in trajectories], np.int32),
        group_ids=np.array([t.group_id for t in trajectories], np.int64),
        turns=np.array([t.turns for t in trajectories], np.int32),
        searches=np.array([t.searches for t in trajectories], np.int32),
        search_actions_written=np.array([t.search_actions_written for t in trajectories], np.int32),
        valid_actions=np.array([t.valid_actions for t in trajectories], np.int32),
        finished=np.array([t.finished for t in trajectories], bool),
        truncated=np.array([t.truncated for t in trajectories], bool),
        response_texts=[decode_text([i for p in t.pieces for i in p.ids], vocab) for t in trajectories],
        action_texts=[[a.text for a in t.actions] for t in trajectories],
    )
