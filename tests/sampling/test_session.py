"""DecodeSession: actions and appended feedback continue one cache, which grows as rows lengthen."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from llds_jax.models.testing import tiny_model
from llds_jax.sampling import SamplingParams
from llds_jax.sampling.generate import resolve_stop_table
from llds_jax.sampling.session import DecodeSession

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


@pytest.mark.codegen_sensitive
def test_session_continuation_equals_one_forward_over_the_whole_conversation():
    model = tiny_model("llama", seed=1)
    sampling = SamplingParams.create(temperature=1.0, top_k=0, top_p=1.0, stop_token_ids=[],
                                     stop_table=resolve_stop_table((), None, model.config.vocab_size))
    session = DecodeSession(model, sampling, max_action_tokens=10, key=jax.random.key(0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 256, n).tolist() for n in (9, 3, 14)]
    conversation = [list(p) for p in prompts]
    sampled = [[] for _ in prompts]  # (position, token, logprob) of every sampled token

    session.start(prompts)
    initial_slots = session.cache.max_len
    plan = [  # (active rows, budgets, feedback chunk lengths)
        ([True, True, True], [10, 4, 7], [40, 0, 500]),
        ([True, False, True], [6, 0, 10], [5, 0, 0]),
        ([True, True, False], [10, 10, 0], None),
    ]
    for active, budgets, chunk_lengths in plan:
        actions = session.act(np.array(active), np.array(budgets))
        for row, action in enumerate(actions):
            assert (action is None) == (not active[row])
            if action is None:
                continue
            assert len(action.ids) == budgets[row]
            for token, logprob in zip(action.ids, action.logprobs):
                sampled[row].append((len(conversation[row]), int(token), float(logprob)))
                conversation[row].append(int(token))
        if chunk_lengths is not None:
            chunks = [rng.integers(1, 256, n).tolist() for n in chunk_lengths]
            session.observe(chunks)
            for row, chunk in enumerate(chunks):
                conversation[row].extend(chunk)
    assert session.cache.max_len > initial_slots, "the 500-token chunk should have grown the cache past one key block"

    for row, logp in enumerate(_forward_logprobs(model, conversation)):
        for position, token, logprob in sampled[row]:
            expected = float(logp[position - 1, token])
            assert abs(expected - logprob) < 1e-4, (row, position, expected, logprob)


@pytest.mark.codegen_sensitive
def test_cutting_an_action_continues_as_if_decoding_had_stopped_at_the_cut():
    """After cut_last_actions the dropped ids are gone from the cache: feedback and the next action
    get the positions and attention a single forward over the kept conversation gives them."""
    model = tiny_model("llama", seed=2)
    sampling = SamplingParams.create(temperature=1.0, top_k=0, top_p=1.0, stop_token_ids=[],
                                     stop_table=resolve_stop_table((), None, model.config.vocab_size))
    session = DecodeSession(model, sampling, max_action_tokens=10, key=jax.random.key(3))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 256, n).tolist() for n in (5, 11, 7, 3)]
    session.start(prompts)
    first = session.act(np.array([True, True, True, True]), np.array([9, 9, 9, 6]))
    # row 0 cut then feedback; row 1 untouched; row 2 cut and no feedback (the next action starts
    # from the logits after its last kept id); row 3 "cut" to everything it sampled.
    kept = [3, None, 4, 6]
    session.cut_last_actions(kept)
    chunks = [rng.integers(1, 256, n).tolist() for n in (4, 2, 0, 0)]
    session.observe(chunks)
    second = session.act(np.array([True, True, True, True]), np.array([5, 5, 5, 5]))

    conversations, starts = [], []
    for row in range(4):
        keep = len(first[row].ids) if kept[row] is None else kept[row]
        conversation = prompts[row] + first[row].ids[:keep].tolist() + chunks[row]
        starts.append(len(conversation))
        conversation += second[row].ids.tolist()
        assert int(session.cache.next_positions()[row]) == len(conversation), row
        conversations.append(conversation)
    for row, (logp, start) in enumerate(zip(_forward_logprobs(model, conversations), starts, strict=True)):
        expected = [float(logp[start + i - 1, t]) for i, t in enumerate(second[row].ids)]
        np.testing.assert_allclose(second[row].logprobs, expected, atol=1e-4, err_msg=f"row {row}")


def test_cut_last_actions_rejects_counts_outside_the_sampled_action():
    model = tiny_model("llama", seed=2)
    sampling = SamplingParams.create(temperature=1.0, top_k=0, top_p=1.0, stop_token_ids=[],
                                     stop_table=resolve_stop_table((), None, model.config.vocab_size))
    session = DecodeSession(model, sampling, max_action_tokens=4, key=jax.random.key(0))
    session.start([[1, 2, 3], [4, 5]])
    session.act(np.array([True, False]), np.array([4, 4]))
    for bad in ([5, None], [0, None], [None, 1]):
        with pytest.raises(ValueError, match="cannot keep"):
            session.cut_last_actions(bad)


def _actions_of_a_conversation(model, sampling) -> list:
    """Every action a 3-row session samples over three turns of different budgets (rows stop at their
    budgets, and at the stop string wherever a row completes it), and a slot engine's actions over
    calls of 5 and 11 tokens: (ids, log-probs, finish) each."""
    from llds_jax.sampling.slots import SlotSession  # noqa: PLC0415

    session = DecodeSession(model, sampling, max_action_tokens=24, key=jax.random.key(3))
    rng = np.random.default_rng(4)
    session.start([rng.integers(1, 256, n).tolist() for n in (9, 3, 14)])
    out = []
    for active, budgets in (([True, True, True], [24, 5, 17]), ([True, False, True], [9, 0, 24])):
        out += [(a.ids.tolist(), a.logprobs.tolist(), int(a.finish)) for a in session.act(np.array(active),
                                                                                         np.array(budgets)) if a]
    slots = SlotSession(model, sampling, slots=3, max_action_tokens=24, key=jax.random.key(3), max_tokens=128)
    for slot in range(3):
        slots.reset(slot, slot, 0)
        slots.set_blocks(slot, [slot])
    slots.append({slot: rng.integers(1, 256, n).tolist() for slot, n in enumerate((9, 3, 14))})
    for slot, budget in enumerate((24, 7, 19)):
        slots.start_action(slot, budget)
    for steps in (5, 11, 11):
        out += [(a.ids.tolist(), a.logprobs.tolist(), int(a.finish)) for _, a in sorted(slots.decode(steps).items())]
    return out


def test_checking_for_finished_rows_every_8_tokens_samples_what_checking_every_token_does(monkeypatch):
    """The accelerators' decode loops check "every row done?" once per chunk of 8 tokens (a host round
    trip on XLA:GPU); XLA:CPU checks every token. Both paths, run here on CPU, give the same actions:
    rows that finish inside a chunk stay frozen for its rest. Greedy, so the check is of the loops and
    the frozen rows, not of two programs' rounding (a code generator may round the chunked program's
    logits an ulp apart, which a sampled draw can turn into another token; a greedy argmax of a random
    model's logits, whose top two are far more than an ulp apart, cannot)."""
    from llds_jax.sampling import decode_loop  # noqa: PLC0415

    model = tiny_model("qwen2", seed=2)
    from llds_jax.sampling.stop_strings import build_stop_table  # noqa: PLC0415

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
