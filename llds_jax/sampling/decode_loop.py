"""The decode program's parts: its state, its one-token step, its loop, the sampler's knobs.

The one decode program is ``slots.decode_segment`` (the rollout engine's, both policies, and
``generate``'s), over the paged KV cache (``models.PagedKVCache``); this module holds what it is
built from. Everything a decode step needs is in one pytree, :class:`DecodeState`; the loop
(:func:`run_steps`) ends when every row is done, checked every :data:`STOP_CHECK_EVERY` tokens, or
after its static number of steps. Parameters enter the program as arguments (``nnx.split``
state), never as closed-over constants, so a new policy after an optimizer step reuses the
compiled program. So do the sampling knobs, the stop token ids and the stop-string tables: they
are arrays, not trace-time constants.

Per step (:func:`token_step`), for every row at once::

    token  ~ filtered(logits)              # greedy / temperature / top-k / top-p, row b's own key
    done  |= token ∈ stop_ids  or  a stop string completed  or  length == budget
    logits, cache = model.forward_cached(token, cache, token_mask=row was active)

A row that is done is frozen: its token is ``pad_id``, its length and its cache stop moving
(``token_mask`` False); its next-token logits are overwritten (nothing reads them: a slot's next
action starts after an append). The token that finishes a row *is* written to the cache, so a
multi-turn caller can append tool feedback right after it without a re-prefill.

Each row has its own ``budget`` (≤ the buffer width): the per-action cap, or less when the
context cap is close.

Randomness is per row: row ``b`` draws its ``n``-th token of a trajectory with
``fold_in(keys[b], drawn[b] + n)``. So what a row samples depends on its own key and its own
token count only — not on which other rows share the batch, where in the batch it sits, or how
many decode calls came before — which is what lets the engine decode a trajectory in any slot,
beside any others, in segments of any length, and get the same trajectory.
"""

from __future__ import annotations

import dataclasses
import enum
import functools

import jax
import jax.numpy as jnp

from llds_jax.models import PagedKVCache
from llds_jax.models.reductions import target_platform
from llds_jax.sampling import stop_strings
from llds_jax.sampling.filtering import SamplingMode, sample_tokens

MAX_STOP_IDS = 8

STOP_CHECK_EVERY = {"gpu": 8, "tpu": 8, "cpu": 1}
"""Tokens between the decode loops' checks for "every row is done", per platform the program compiles for.

Why not every token on an accelerator: the check is a ``while_loop`` predicate that depends on the
data, and XLA:GPU copies such a predicate to the host and waits for it before the next trip, a
host round trip per token on the critical path. The tokens between checks run in a ``fori_loop``
of static length, which XLA:GPU runs without reading anything back. The price: up to 7 steps
after the last row finishes, in which every row is frozen. XLA:CPU runs the loop on the host
anyway, so there a check costs nothing and every token is checked (no frozen steps); the
chunked path is the same code, tested on CPU by setting the entry to 8
(``tests/sampling/test_slots.py``).
"""


def stop_check_every() -> int:
    """:data:`STOP_CHECK_EVERY` for the platform being compiled for (read at trace time)."""
    return STOP_CHECK_EVERY.get(target_platform(), STOP_CHECK_EVERY["gpu"])


class FinishReason(enum.IntEnum):
    """Why a row stopped: its budget ran out, it sampled a stop id, or it completed a stop string."""

    CAP = 0
    STOP_TOKEN = 1
    STOP_STRING = 2


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """The whole sampler state; the decode loops' carry (:func:`run_steps`).

    tokens, logprobs: ``[B, N]`` generated ids and their log-probs (pad / 0 past ``lengths``).
    lengths: ``[B]`` tokens generated per row (also the next write column).
    done: ``[B]`` frozen rows.  finish: ``[B]`` :class:`FinishReason` of done rows.
    stop_state: ``[B, K]`` int8 stop-string matcher state per row and stop string.
    logits: ``[B, V]`` next-token logits (the compute dtype).  cache: the paged KV cache.
    step: scalar, columns written so far.
    keys: ``[B]`` per-row PRNG keys; drawn: ``[B]`` tokens each row drew before this call.
    """

    tokens: jax.Array
    logprobs: jax.Array
    lengths: jax.Array
    done: jax.Array
    finish: jax.Array
    stop_state: jax.Array
    logits: jax.Array
    cache: PagedKVCache
    step: jax.Array
    keys: jax.Array
    drawn: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Traced sampling knobs plus the stop ids / stop-string tables, all as arrays; and the
    static :class:`~llds_jax.sampling.filtering.SamplingMode`, which filters the program runs.

    The mode is a trace-time constant (part of the pytree's structure, so each mode compiles
    its own program) because a run-time choice is a ``lax.cond`` whose predicate XLA:GPU
    reads back to the host every token. :meth:`create` derives it from the knobs; built by
    hand, the params default to ``ANY`` (every filter, each switched by its knob's value).
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    stop_ids: jax.Array       # [MAX_STOP_IDS] int32, -1 = unused
    stop_table: jax.Array     # [K, S, V] int8 (see stop_strings.py)
    mode: SamplingMode = dataclasses.field(default=SamplingMode.ANY, metadata=dict(static=True))

    @classmethod
    def create(cls, *, temperature: float, top_k: int, top_p: float, stop_token_ids, stop_table):
        ids = [int(i) for i in stop_token_ids]
        if len(ids) > MAX_STOP_IDS:
            raise ValueError(f"at most {MAX_STOP_IDS} stop token ids, got {len(ids)}: {ids}")
        return cls(
            temperature=jnp.asarray(temperature, jnp.float32),
            top_k=jnp.asarray(top_k, jnp.int32),
            top_p=jnp.asarray(top_p, jnp.float32),
            stop_ids=jnp.asarray(ids + [-1] * (MAX_STOP_IDS - len(ids)), jnp.int32),
            stop_table=jnp.asarray(stop_table, jnp.int8),
            mode=SamplingMode.of(temperature, top_k, top_p),
        )


def run_steps(step, state: DecodeState, steps: int, every: int | None = None) -> DecodeState:
    """At most ``steps`` (static) one-token ``step``s from ``state`` (whose ``step`` counts from 0),
    ending early once every row is done, which is checked only every ``every`` tokens (default:
    :func:`stop_check_every` of the platform compiled for).

    The ``steps % k`` odd tokens (``k = min(every, steps)``) first, in a ``fori_loop`` of static
    length (at the start rows are rarely all done: this is work, not waste), then an outer
    ``while_loop`` over chunks of ``k`` tokens, each such a ``fori_loop``; so never more than
    ``steps`` tokens, and the only data-dependent predicate is the outer loop's, once a chunk.
    Tokens run after every row is done change nothing: done rows are frozen (pad token, no
    cache write, no length), so the trajectories are those of a per-token check.
    """
    every = max(1, min(stop_check_every() if every is None else every, steps))

    def run(count: int, s: DecodeState) -> DecodeState:
        return jax.lax.fori_loop(0, count, lambda _, s: step(s), s)

    if steps % every:
        state = run(steps % every, state)

    def keep_going(s: DecodeState):
        return (s.step <= steps - every) & ~jnp.all(s.done)

    return jax.lax.while_loop(keep_going, functools.partial(run, every), state)


def token_step(model, layer_weights, sampling: SamplingParams, budget: jax.Array, pad_id: jax.Array):
    """The one-token step ``DecodeState -> DecodeState`` of the decode program (``slots.decode_segment``;
    ``tools/roofline`` compiles the same step to cost it).

    Every row that is not done samples with its own key at count ``drawn + lengths``, writes its
    token and log-prob at its own column (its action's length, so an action can span several
    calls), advances its stop-string matcher and its length, and finishes on a stop id, a stop
    string or its ``budget``; the token goes through ``forward_cached`` with the done rows masked
    (no cache write). Every row's next-token logits are written, a done row's included: keeping a
    frozen row's would be a select over the ``[B, V]`` logits each token, and the engine never
    reads them (a slot's next action always starts right after an append, which sets its logits).
    """
    def one_token(s: DecodeState) -> DecodeState:
        sampled, logprob = sample_rows(s.logits, s.keys, s.drawn + s.lengths, sampling)
        active = ~s.done
        token = jnp.where(active, sampled, pad_id)
        logprob = jnp.where(active, logprob, 0.0)
        stop_state, string_hit = stop_strings.advance(sampling.stop_table, s.stop_state, token)
        stop_state = jnp.where(active[:, None], stop_state, s.stop_state)
        id_hit = jnp.any(token[:, None] == sampling.stop_ids[None, :], axis=-1)
        columns = jnp.arange(s.tokens.shape[1], dtype=jnp.int32)
        write = active[:, None] & (columns[None, :] == s.lengths[:, None])
        lengths = s.lengths + active.astype(jnp.int32)
        finish = jnp.where(id_hit, FinishReason.STOP_TOKEN,
                           jnp.where(string_hit, FinishReason.STOP_STRING, FinishReason.CAP))
        now_done = active & (id_hit | string_hit | (lengths >= budget))
        next_logits, cache = model.forward_cached(token[:, None], s.cache, token_mask=active[:, None],
                                                  layer_weights=layer_weights)
        return DecodeState(
            tokens=jnp.where(write, token[:, None], s.tokens),
            logprobs=jnp.where(write, logprob[:, None], s.logprobs),
            lengths=lengths, done=s.done | now_done, finish=jnp.where(now_done, finish, s.finish),
            stop_state=stop_state,
            logits=next_logits,
            cache=cache, step=s.step + 1, keys=s.keys, drawn=s.drawn)

    return one_token


def sample_rows(logits: jax.Array, keys: jax.Array, counts: jax.Array, sampling: SamplingParams
                ) -> tuple[jax.Array, jax.Array]:
    """Row ``b``'s token from ``logits[b]`` with key ``fold_in(keys[b], counts[b])``: ``[B]``, ``[B]``.

    One draw per row with its own key (a vmap over rows) instead of one key for the batch:
    a batch-wide draw makes row ``b``'s noise depend on the batch width and on ``b``.
    """
    def one_row(row_logits, key, count):
        token, logprob = sample_tokens(row_logits[None], jax.random.fold_in(key, count), sampling.temperature,
                                       sampling.top_k, sampling.top_p, mode=sampling.mode)
        return token[0], logprob[0]

    return jax.vmap(one_row)(logits, keys, counts)


@jax.jit
def row_keys(key: jax.Array, trajectory_ids) -> jax.Array:
    """``[B]`` per-row keys ``fold_in(key, id)``: a row's randomness follows its trajectory id."""
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, jnp.asarray(trajectory_ids, jnp.uint32))
