"""One action's turn under the Search-R1 protocol: record it, cut it, parse it, say what comes next.

Shared by the turn-synchronous loop (``multi_turn.py``) and the continuous engine
(``engine.py``), so both apply one protocol, exactly the reference's (see ``multi_turn``'s
docstring for the rules and ``action_stop.py`` for the stop rule and the cut).
"""

from __future__ import annotations

import dataclasses

from llds_jax.rollout import protocol
from llds_jax.rollout.action_stop import kept_action_tokens
from llds_jax.rollout.trajectory import Trajectory
from llds_jax.sampling.decode_loop import FinishReason
from llds_jax.sampling.slots import SampledAction


@dataclasses.dataclass(frozen=True)
class ActionOutcome:
    """What one recorded action asks of the loop: ``query`` (a search to run), ``feedback``
    (the invalid-action message's ids, already recorded), ``cut`` (sampled ids kept, None: all)."""

    query: str | None
    feedback: tuple[int, ...]
    cut: int | None
    kept_tokens: int


def apply_action(traj: Trajectory, action: SampledAction, vocab, tokenizer, config,
                 search_allowed: bool) -> ActionOutcome:
    """Record one sampled action on ``traj`` and apply the reference's protocol to it.

    The reference's cut at an undeciding ``</answer>`` (the caller drops the cut ids from
    its cache), the parse, the counts; an answer ends the trajectory, so does any action of
    the last, search-disabled turn; an invalid action gets the invalid-action message,
    recorded here. The turn loop and the engine share this, so they apply one protocol.
    """
    ids, logprobs, finish, cut = action.ids, action.logprobs, action.finish, None
    kept = kept_action_tokens(ids, vocab)
    if kept < len(ids):  # the reference's cut at an undeciding </answer>
        ids, logprobs, finish, cut = ids[:kept], logprobs[:kept], FinishReason.STOP_STRING, kept
    record = traj.add_action(ids, logprobs, finish, vocab)
    traj.truncated |= record.finish == FinishReason.CAP
    parsed = protocol.parse_action(record.text)
    traj.valid_actions += int(parsed.is_valid)
    traj.search_actions_written += int(parsed.kind == "search")
    query, feedback = None, []
    if parsed.kind == "answer":
        traj.done = traj.finished = True
    elif not search_allowed:
        traj.done = True  # the last turn: a search is not executed, the trajectory ends
    elif parsed.kind == "search":
        query = parsed.content
    else:
        feedback = cut_feedback(tokenizer, protocol.INVALID_ACTION_FEEDBACK, traj, config)
        traj.add_feedback(feedback, "invalid")
    return ActionOutcome(query, tuple(feedback), cut, len(ids))


def cut_feedback(tokenizer, text: str, traj: Trajectory, config) -> list[int]:
    """Feedback ids cut to ``max_obs_tokens`` and to the room left in the context."""
    ids = protocol.encode_feedback(tokenizer, text, config.max_obs_tokens)
    room = max(0, config.max_context - traj.length)
    return ids[:room]
