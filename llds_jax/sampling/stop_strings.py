"""Stop strings detected *while decoding*, on the bytes the sampled ids decode to.

Why not cut text afterwards: Search-R1 decodes a turn, cuts the text after a closing tag
and re-tokenises, so the ids it trains on can differ from the ids it sampled. Here each
row carries, per stop string, a KMP matcher state — the length of the longest prefix of
the stop string that is a suffix of the text generated so far — and every sampled token
advances it with one table lookup::

    state' = table[stop, state, token]      # MATCHED (-1) when the string completes

The table is built once per (vocabulary, stop strings) on the host by running the
matcher over each token's bytes, and is passed to the jitted decode loop as an *argument*
(never a trace-time constant), so changing the stop strings changes data, not the program.
A string that spans several tokens (``</`` ``search`` ``>``), that starts in the middle of
a token (``.</`` ``search`` ``>``) or that ends in the middle of one (``</`` ``search``
``>\\n\\n``) is found, because matching is on bytes, not on token boundaries.

A stop string that ends inside a token: the row stops after that token and keeps it, so
the action's text runs a few characters past the stop string (``>\\n\\n`` above). The
reference would drop those characters and re-tokenise; we keep exactly what was sampled.
The action parser applies the reference's cut to the text first, so the extra characters
never change the parsed action; the following feedback is appended after the whole token.

"Stop at the first of these strings" is one kind of byte automaton; a stop rule that needs
history (the Search-R1 action rule, ``llds_jax/rollout/action_stop.py``) is another. Any
byte-level DFA whose stop state is absorbing becomes a token table with
:func:`table_from_byte_dfa` and runs in the same slot of the same decode loop, since the
loop only ever looks up ``table[slot, state, token]`` and stops on ``MATCHED``.

Matching starts from the empty state for every call: a stop string is looked for in the
newly generated text only, never across the prompt or previous turns.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

MATCHED = -1
_STATE_BUCKET = 16


def _longest_prefix_suffix(text: bytes, stop: bytes) -> int:
    """Largest k < len(stop) with ``text.endswith(stop[:k])``."""
    for k in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:k]):
            return k
    return 0


def _transitions(stop: bytes, vocab: Sequence[bytes], num_states: int) -> np.ndarray:
    """``[num_states, V]`` int8: next matcher state per (state, token), MATCHED on completion.

    Most tokens cannot interact with the carried partial match; for them the next state
    is independent of the current one (``tail``), so only "relevant" tokens — those that
    are a piece of the stop string or start with one of its suffixes — are simulated per
    state. This keeps building a 152k-token table at well under a second.
    """
    n = len(stop)
    table = np.zeros((num_states, len(vocab)), dtype=np.int8)
    suffixes = [stop[j:] for j in range(1, n)]
    prefixes = [stop[:s] for s in range(n)]
    for token_id, piece in enumerate(vocab):
        relevant = piece in stop or any(piece.startswith(suffix) for suffix in suffixes)
        if not relevant:
            table[:n, token_id] = MATCHED if stop in piece else _longest_prefix_suffix(piece, stop)
            continue
        for s in range(n):
            text = prefixes[s] + piece
            table[s, token_id] = MATCHED if stop in text else _longest_prefix_suffix(text, stop)
    return table


@dataclasses.dataclass(frozen=True)
class StopStringTable:
    """Device-ready transition tables for a set of stop strings over one vocabulary.

    ``transitions`` is ``[num_stops, num_states, vocab]`` int8. Both leading sizes are
    bucketed (stop count to a power of two, states to a multiple of 16) so that calls with
    different stop strings reuse one compiled decode loop. Unused stop slots never match.
    """

    stop_strings: tuple[str, ...]
    transitions: np.ndarray

    @property
    def num_stops(self) -> int:
        return self.transitions.shape[0]

    def initial_state(self, batch: int) -> np.ndarray:
        return np.zeros((batch, self.num_stops), dtype=np.int8)

    def advance(self, state: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Host (numpy) step: ``(new_state [B, K], matched [B])``; same maths as :func:`advance`."""
        new = self.transitions[np.arange(self.num_stops)[None, :], state.astype(np.int64), tokens[:, None]]
        return new, (new == MATCHED).any(axis=-1)


def _bucket_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.lru_cache(maxsize=16)
def build_stop_table(vocab: tuple[bytes, ...], stop_strings: tuple[str, ...]) -> StopStringTable:
    """The transition tables for ``stop_strings`` over per-id ``vocab`` bytes (cached)."""
    encoded = [s.encode("utf-8") for s in stop_strings]
    if any(len(s) == 0 for s in encoded):
        raise ValueError(f"empty stop string in {stop_strings!r}")
    longest = max((len(s) for s in encoded), default=1)
    if longest > 127:
        raise ValueError(f"stop strings longer than 127 bytes are not supported: {stop_strings!r}")
    num_states = -(-longest // _STATE_BUCKET) * _STATE_BUCKET
    num_stops = _bucket_pow2(max(1, len(encoded)))
    tables = np.zeros((num_stops, num_states, len(vocab)), dtype=np.int8)
    for k, stop in enumerate(encoded):
        tables[k] = _transitions(stop, vocab, num_states)
    return StopStringTable(tuple(stop_strings), tables)


def advance(transitions, state, tokens):
    """Jittable step: ``(new_state [B, K], matched [B])`` for sampled ``tokens [B]``.

    ``transitions`` ``[K, S, V]``, ``state`` ``[B, K]`` (int8). A row that matched has
    finished; its state is not used again.
    """
    import jax.numpy as jnp

    k = jnp.arange(transitions.shape[0])[None, :]
    new = transitions[k, state.astype(jnp.int32), tokens[:, None]]
    return new, jnp.any(new == MATCHED, axis=-1)


def table_from_byte_dfa(byte_next: np.ndarray, vocab: Sequence[bytes]) -> np.ndarray:
    """``[S_bucket, V]`` int8 token transitions of a byte-level DFA, MATCHED where it stops.

    ``byte_next`` is ``[S, 256]``: the next state per (state, byte), ``MATCHED`` (-1) for
    "stop"; state 0 is the start state and stopping is absorbing (once a token's bytes
    reach the stop state, the rest of the token does not matter). All tokens are walked at
    once, byte column by byte column (tokens sorted longest first, so the tokens still
    walking are a prefix), which costs ``S x total vocabulary bytes`` numpy gathers.
    """
    byte_next = np.asarray(byte_next)
    num_states = byte_next.shape[0]
    if byte_next.shape != (num_states, 256):
        raise ValueError(f"byte_next must be [states, 256], got {byte_next.shape}")
    if num_states > 127:
        raise ValueError(f"a byte DFA with {num_states} states does not fit the int8 tables (at most 127)")
    if byte_next.min() < MATCHED or byte_next.max() >= num_states:
        raise ValueError(f"byte_next holds states outside [-1, {num_states}): "
                         f"[{byte_next.min()}, {byte_next.max()}]")
    stop = num_states  # an extra absorbing row, so the walk never indexes with -1
    extended = np.concatenate([np.where(byte_next == MATCHED, stop, byte_next),
                               np.full((1, 256), stop)]).astype(np.int16)
    lengths = np.fromiter((len(piece) for piece in vocab), np.int64, len(vocab))
    order = np.argsort(-lengths, kind="stable")
    longest = int(lengths.max(initial=0))
    byte_columns = np.zeros((len(vocab), longest), np.uint8)
    for row, token_id in enumerate(order):
        piece = vocab[token_id]
        byte_columns[row, : len(piece)] = np.frombuffer(piece, np.uint8)
    walking = len(vocab) - np.cumsum(np.bincount(lengths, minlength=longest + 1))  # [j]: tokens longer than j
    states = np.broadcast_to(np.arange(num_states, dtype=np.int16)[:, None], (num_states, len(vocab))).copy()
    for column in range(longest):
        count = walking[column]
        states[:, :count] = extended[states[:, :count], byte_columns[None, :count, column]]
    table = np.zeros((-(-num_states // _STATE_BUCKET) * _STATE_BUCKET, len(vocab)), np.int8)
    table[:num_states, order] = np.where(states == stop, MATCHED, states)
    return table


def first_stop_end(ids: Sequence[int], vocab: Sequence[bytes], stop_strings: Sequence[str]) -> int | None:
    """Reference (slow, obviously correct): tokens kept when stopping, i.e. 1 + index of the
    token whose bytes complete the earliest stop string; ``None`` if none completes."""
    encoded = [s.encode("utf-8") for s in stop_strings]
    text = b""
    for i, token_id in enumerate(ids):
        text += vocab[int(token_id)]
        if any(s in text for s in encoded):
            return i + 1
    return None
