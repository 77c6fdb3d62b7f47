"""SlotSession: actions and appended feedback continue one paged cache row, exactly as one forward
over the whole conversation; a cut action continues as if decoding had stopped at the cut."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from llds_jax.models.testing import tiny_model
from llds_jax.sampling import SamplingParams
from llds_jax.sampling.generate import resolve_stop_table
from llds_jax.sampling.slots import SlotSession

pytestmark = pytest.mark.unit


def _forward_logprobs(model, rows: list[list[int]]) -> list[np.ndarray]:
    """log-softmax of one uncached forward over each whole row, [len(row), V] per row. The rows are
    right-padded to one width and masked, so one compiled program serves every row (not one per
    length); a causal model's logits at a real token read no later position, pads included."""
    width = max(map(len, rows))
    ids, mask = np.zeros((len(rows), width), np.int32), np.zeros((len(rows), width), bool)
    for i, row in enumerate(rows):
        ids[i, :len(row)], mask[i, :len(row)] = row, True
    logp = np.asarray(jax.jit(lambda i, m: jax.nn.log_softmax(model(i, m), axis=-1))(ids, mask))
    return [logp[i, :len(row)] for i, row in enumerate(rows)]


def _plain_sampling(model) -> SamplingParams:
    return SamplingParams.create(temperature=1.0, top_k=0, top_p=1.0, stop_token_ids=[],
                                 stop_table=resolve_stop_table((), None, model.config.vocab_size))


def _session(model, sampling, rows: int, *, max_action_tokens: int, key: int, max_tokens: int = 1024) -> SlotSession:
    """``rows`` slots, slot ``s`` holding trajectory ``s`` and its own whole range of the pool's blocks."""
    session = SlotSession(model, sampling, slots=rows, max_action_tokens=max_action_tokens, key=jax.random.key(key),
                          max_tokens=max_tokens)
    for slot in range(rows):
        session.reset(slot, slot, 0)
        session.set_blocks(slot, range(slot * session.columns, (slot + 1) * session.columns))
    return session


def _act(session: SlotSession, budgets: dict[int, int]) -> dict:
    """One action for each slot of ``budgets``, in one decode call of the whole action buffer."""
    for slot, budget in budgets.items():
        session.start_action(slot, budget)
    ended = session.decode(session.width)
    assert sorted(ended) == sorted(budgets), "every started action ends within the buffer"
    return ended


@pytest.mark.codegen_sensitive
def test_slot_continuation_equals_one_forward_over_the_whole_conversation():
    model = tiny_model("llama", seed=1)
    session = _session(model, _plain_sampling(model), 3, max_action_tokens=10, key=0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 256, n).tolist() for n in (9, 3, 14)]
    conversation = [list(p) for p in prompts]
    sampled = [[] for _ in prompts]  # (position, token, logprob) of every sampled token
    session.append(dict(enumerate(prompts)))
    # (budgets of the slots that act, feedback chunk lengths after the turn); slot 1 sits out a turn
    # and is fed after it (a decode call leaves an idle slot's logits stale: an action follows an append)
    plan = [
        ({0: 10, 1: 4, 2: 7}, {0: 40, 2: 500}),
        ({0: 6, 2: 10}, {0: 5, 1: 3, 2: 1}),
        ({0: 10, 1: 10}, None),
    ]
    for budgets, chunk_lengths in plan:
        for slot, action in _act(session, budgets).items():
            assert len(action.ids) == budgets[slot]
            for token, logprob in zip(action.ids, action.logprobs):
                sampled[slot].append((len(conversation[slot]), int(token), float(logprob)))
                conversation[slot].append(int(token))
        if chunk_lengths is not None:
            chunks = {slot: rng.integers(1, 256, n).tolist() for slot, n in chunk_lengths.items()}
            session.append(chunks)
            for slot, chunk in chunks.items():
                conversation[slot].extend(chunk)
    assert list(session.rows_end[:3]) == [len(c) for c in conversation]
    assert len(conversation[2]) > 4 * session.block_tokens, "the 500-token chunk spans several blocks"

    for row, logp in enumerate(_forward_logprobs(model, conversation)):
        for position, token, logprob in sampled[row]:
            expected = float(logp[position - 1, token])
            assert abs(expected - logprob) < 1e-4, (row, position, expected, logprob)


@pytest.mark.codegen_sensitive
def test_cutting_an_action_continues_as_if_decoding_had_stopped_at_the_cut():
    """After ``cut`` the dropped ids are gone from the row: feedback and the next action get the
    positions and attention a single forward over the kept conversation gives them."""
    model = tiny_model("llama", seed=2)
    session = _session(model, _plain_sampling(model), 4, max_action_tokens=10, key=3)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 256, n).tolist() for n in (5, 11, 7, 3)]
    session.append(dict(enumerate(prompts)))
    first = _act(session, {0: 9, 1: 9, 2: 9, 3: 6})
    # slot 0 cut then feedback; slot 1 untouched, feedback; slot 2 cut and no feedback (the next
    # action starts from the logits after its last kept id, which the cut rewrote); slot 3 "cut" to
    # everything it sampled, then feedback.
    kept = {0: 3, 2: 4, 3: 6}
    session.cut(kept)
    chunks = {0: rng.integers(1, 256, 4).tolist(), 1: rng.integers(1, 256, 2).tolist(), 3: [17]}
    session.append(chunks)
    second = _act(session, {slot: 5 for slot in range(4)})

    conversations, starts = [], []
    for slot in range(4):
        keep = kept.get(slot, len(first[slot].ids))
        conversation = prompts[slot] + first[slot].ids[:keep].tolist() + chunks.get(slot, [])
        starts.append(len(conversation))
        conversation += second[slot].ids.tolist()
        assert int(session.rows_end[slot]) == len(conversation), slot
        conversations.append(conversation)
    for slot, (logp, start) in enumerate(zip(_forward_logprobs(model, conversations), starts, strict=True)):
        expected = [float(logp[start + i - 1, t]) for i, t in enumerate(second[slot].ids)]
        np.testing.assert_allclose(second[slot].logprobs, expected, atol=1e-4, err_msg=f"slot {slot}")


def test_cut_rejects_counts_outside_the_sampled_action():
    model = tiny_model("llama", seed=2)
    session = _session(model, _plain_sampling(model), 2, max_action_tokens=4, key=0, max_tokens=128)
    session.append({0: [1, 2, 3], 1: [4, 5]})
    _act(session, {0: 4})
    for bad in ({0: 5}, {0: 0}, {1: 1}):
        with pytest.raises(ValueError, match="cannot keep"):
            session.cut(bad)


def _actions_of_a_conversation(model, sampling) -> list:
    """Every action a 3-slot session samples over calls of 5 and 11 tokens after one whole-buffer
    turn (slots stop at their budgets, and at the stop string wherever one completes it):
    (ids, log-probs, finish) each."""
    session = _session(model, sampling, 3, max_action_tokens=24, key=3, max_tokens=128)
    rng = np.random.default_rng(4)
    session.append({slot: rng.integers(1, 256, n).tolist() for slot, n in enumerate((9, 3, 14))})
    out = [(a.ids.tolist(), a.logprobs.tolist(), int(a.finish))
           for _, a in sorted(_act(session, {0: 24, 1: 5, 2: 17}).items())]
    session.append({slot: rng.integers(1, 256, n).tolist() for slot, n in enumerate((2, 4, 1))})
    for slot, budget in enumerate((24, 7, 19)):
        session.start_action(slot, budget)
    for steps in (5, 11, 11):
        out += [(a.ids.tolist(), a.logprobs.tolist(), int(a.finish)) for _, a in sorted(session.decode(steps).items())]
    return out


def test_checking_for_finished_rows_every_8_tokens_samples_what_checking_every_token_does(monkeypatch):
    """The accelerators' decode loops check "every row done?" once per chunk of 8 tokens (a host round
    trip on XLA:GPU); XLA:CPU checks every token. Both paths, run here on CPU, give the same actions:
    rows that finish inside a chunk stay frozen for its rest. Greedy, so the check is of the loops and
    the frozen rows, not of two programs' rounding (a code generator may round the chunked program's
    logits an ulp apart, which a sampled draw can turn into another token; a greedy argmax of a random
    model's logits, whose top two are far more than an ulp apart, cannot)."""
    from llds_jax.sampling import decode_loop  # noqa: PLC0415
    from llds_jax.sampling.stop_strings import build_stop_table  # noqa: PLC0415

    model = tiny_model("qwen2", seed=2)
    stop_table = build_stop_table(tuple(bytes([i % 256]) for i in range(model.config.vocab_size)), ("ab",)).transitions
    sampling = SamplingParams.create(temperature=0.0, top_k=0, top_p=1.0, stop_token_ids=[7], stop_table=stop_table)
    every_token = _actions_of_a_conversation(model, sampling)
    monkeypatch.setitem(decode_loop.STOP_CHECK_EVERY, "cpu", 8)
    jax.clear_caches()  # the programs above were traced with the other interval
    try:
        chunked = _actions_of_a_conversation(model, sampling)
    finally:
        jax.clear_caches()
    assert [(ids, finish) for ids, _, finish in chunked] == [(ids, finish) for ids, _, finish in every_token]
    for (_, chunked_logprobs, _), (_, logprobs, _) in zip(chunked, every_token, strict=True):
        np.testing.assert_allclose(chunked_logprobs, logprobs, rtol=0, atol=1e-5)  # log-softmaxes of ~5.5: ≈ 20 ulp
    lengths = [len(ids) for ids, _, _ in every_token]
    assert len(set(lengths)) > 2 and any(n % 8 for n in lengths)  # rows ended inside chunks, at several points
