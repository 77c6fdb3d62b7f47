"""Where an action stops while it is decoded, so that it parses exactly as in Search-R1.

What the reference does (``search_r1/llm_agent/generation.py``): vLLM gets *no* stop strings
(``max_tokens`` and EOS only), so each turn is decoded to EOS or the cap. The decoded text
``T`` is then cut — after the first ``</search>`` if ``T`` contains one anywhere, else after
the first ``</answer>`` if it contains one, else not at all — re-tokenised, and parsed with
the first ``<(search|answer)>(.*?)</\\1>`` match (DOTALL) of the cut text
(:func:`llds_jax.rollout.protocol.parse_action` does exactly this).

Stopping at the first ``</search>`` or ``</answer>`` (what we did before) is not the same:
``<search><answer>x</answer></search>`` is a search for ``<answer>x</answer>`` there, and
``<search> x </answer> then <search>y</search>`` is a search for ``x </answer> then
<search>y``. So we stop at the earliest point where the reference's parse no longer
depends on what would follow:

* at the first ``</search>``: the cut is fixed there whatever follows;
* at the first ``</answer>``, only if an ``<answer>`` was opened before it and no
  ``<search>`` was opened before that ``<answer>``. The only thing that can still change
  the reference's cut is a later ``</search>``; it would make every ``<search>`` opened
  before it start a match, so the parse stays the answer exactly when no ``<search>``
  precedes the answer's opening tag (``<search>`` opened *after* ``<answer>`` cannot win:
  the regex takes the leftmost match);
* otherwise the first ``</answer>`` does not decide anything (both "``</search>`` follows"
  and "nothing follows" stay possible, with different parses), later ``</answer>`` never
  move the reference's cut, so the action runs on to ``</search>``, a stop token or the cap.

In that last case with no ``</search>`` coming, the reference keeps the text up to the first
``</answer>``; :func:`kept_action_tokens` gives the matching number of *sampled* tokens
(those up to the one that completes the cut), and the rollout drops the rest from the
record and the KV cache — ids are cut, never re-tokenised.

One difference is left by design: after a deciding ``</answer>``, the reference would
keep decoding and, if a ``</search>`` came later, keep (and train on) the text up to it —
for the same parsed answer. Matching that would mean decoding every answer to EOS or the cap.

The rule is a byte automaton (phase × partial tag match, 66 states); it becomes one int8
token table (:func:`llds_jax.sampling.stop_strings.table_from_byte_dfa`) that the decode
loop runs in the slot a stop string would use.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from llds_jax.rollout.protocol import reference_cut_end
from llds_jax.sampling.stop_strings import MATCHED, StopStringTable, table_from_byte_dfa
from llds_jax.sampling.token_bytes import decode_bytes

STOP = "stop"

# phase -> the tags that matter in it; (phase, tag) -> the phase (or STOP) once the tag completes.
_WATCHED: dict[str, tuple[bytes, ...]] = {
    "nothing_opened": (b"<search>", b"<answer>", b"</search>", b"</answer>"),
    "search_opened_first": (b"</search>", b"</answer>"),
    "answer_opened_first": (b"</search>", b"</answer>"),
    "waiting_for_search_close": (b"</search>",),
}
_ON_TAG: dict[tuple[str, bytes], str] = {
    ("nothing_opened", b"<search>"): "search_opened_first",
    ("nothing_opened", b"<answer>"): "answer_opened_first",
    ("nothing_opened", b"</answer>"): "waiting_for_search_close",
    ("search_opened_first", b"</answer>"): "waiting_for_search_close",
    ("answer_opened_first", b"</answer>"): STOP,
}


def _on_tag(phase: str, tag: bytes) -> str:
    return STOP if tag == b"</search>" else _ON_TAG[(phase, tag)]


def action_byte_dfa() -> tuple[np.ndarray, list[tuple[str, bytes]]]:
    """``(byte_next [S, 256], states)``: the stop rule over bytes; ``states[i] = (phase, partial tag)``.

    State 0 is ``("nothing_opened", b"")``; ``byte_next`` holds ``MATCHED`` where the action
    stops. Partial matches follow the usual string-matching fallback (the longest suffix
    of the text that is still a prefix of a watched tag).
    """
    states: list[tuple[str, bytes]] = []
    for phase, tags in _WATCHED.items():
        prefixes = sorted({tag[:k] for tag in tags for k in range(len(tag))}, key=lambda p: (len(p), p))
        states.extend((phase, prefix) for prefix in prefixes)
    index = {state: i for i, state in enumerate(states)}
    byte_next = np.zeros((len(states), 256), np.int16)
    for i, (phase, partial) in enumerate(states):
        tags = _WATCHED[phase]
        for byte in range(256):
            text = partial + bytes([byte])
            completed = [tag for tag in tags if text.endswith(tag)]
            if completed:
                target = _on_tag(phase, completed[0])
                byte_next[i, byte] = MATCHED if target == STOP else index[(target, b"")]
                continue
            suffix = next(text[k:] for k in range(len(text) + 1) if (phase, text[k:]) in index)
            byte_next[i, byte] = index[(phase, suffix)]
    return byte_next, states


@functools.lru_cache(maxsize=4)
def action_stop_table(vocab: tuple[bytes, ...]) -> StopStringTable:
    """The decode loop's stop table for Search-R1 actions over per-id ``vocab`` bytes (cached)."""
    byte_next, _ = action_byte_dfa()
    return StopStringTable(("</search>", "</answer>"), table_from_byte_dfa(byte_next, vocab)[None])


def kept_action_tokens(ids: Sequence[int], vocab: Sequence[bytes]) -> int:
    """How many of an action's sampled ``ids`` the reference's cut keeps: up to the token
    that completes the cut text (all of them when the text is not cut).

    Tags are ASCII, so finding them in the bytes finds them in the decoded text.
    """
    data = decode_bytes(ids, vocab)
    cut = reference_cut_end(data)
    if cut == len(data):
        return len(ids)
    reached = 0
    for count, token_id in enumerate(ids, start=1):
        reached += len(vocab[int(token_id)])
        if reached >= cut:
            return count
    return len(ids)
