"""The action stop rule against the reference's semantics (Search-R1 ``_postprocess_responses`` +
``postprocess_predictions``), on whole texts the reference would have decoded to EOS / the cap.

``reference(text)`` below is a transcription of the reference code, kept independent of
``protocol.parse_action`` on purpose. For every text we check, with our pipeline (stop
where the table says, cut the kept ids with ``kept_action_tokens``, parse):

* the parsed action equals the reference's on the full text;
* the kept text, cut, equals the reference's cut text — or, when we stopped at a deciding
  ``</answer>``, is a prefix of it that ends with that ``</answer>``;
* the stop is decided: appending any witness continuation to the kept text leaves the
  reference's parse unchanged;
* the stop is earliest: at every earlier token the witnesses still give different parses.
"""

from __future__ import annotations

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llds_jax.rollout import protocol
from llds_jax.rollout.action_stop import action_byte_dfa, action_stop_table, kept_action_tokens
from llds_jax.rollout.config import terminator_ids
from llds_jax.sampling import stop_strings
from llds_jax.sampling.token_bytes import decode_text, vocab_bytes

pytestmark = pytest.mark.unit

WITNESSES = ("", "</search>", "</answer>", "<search>w</search>", "<answer>w</answer>")


def reference(text: str) -> tuple[str | None, str, str]:
    """(action, content, cut text) exactly as search_r1/llm_agent/generation.py computes them."""
    cut = (text.split("</search>")[0] + "</search>" if "</search>" in text
           else text.split("</answer>")[0] + "</answer>" if "</answer>" in text
           else text)
    match = re.search(r"<(search|answer)>(.*?)</\1>", cut, re.DOTALL)
    return (match.group(1), match.group(2).strip(), cut) if match else (None, "", cut)


def reference_action(text: str) -> tuple[str | None, str]:
    return reference(text)[:2]


def rule_stop(table: list[list[int]], ids: list[int]) -> int | None:
    """Tokens sampled when the rule stops decoding, ``None`` if it never does."""
    state = 0
    for i, token in enumerate(ids):
        state = table[state][token]
        if state == stop_strings.MATCHED:
            return i + 1
    return None


def ours(table: list[list[int]], ids: list[int], vocab, stop_ids=frozenset()):
    """(stop: tokens sampled, kept: tokens recorded, action) — the rollout's pipeline on the host;
    the stream ends with EOS (a ``stop_ids`` token) or, like a cap, where it ends."""
    ends = [i + 1 for i, token in enumerate(ids) if token in stop_ids][:1] + [rule_stop(table, ids) or len(ids)]
    stop = min(ends)
    kept = kept_action_tokens(ids[:stop], vocab)
    parsed = protocol.parse_action(decode_text(ids[:kept], vocab))
    return stop, kept, (None if parsed.kind == "invalid" else parsed.kind, parsed.content)


def check_against_reference(table, ids, vocab, stop_ids=frozenset()):
    full = decode_text(ids, vocab)
    stop, kept, action = ours(table, ids, vocab, stop_ids)
    if stop < len(ids) and ids[stop - 1] in stop_ids:  # the reference's vLLM stops on EOS too
        full = decode_text(ids[:stop], vocab)
    ref_action, ref_content, ref_cut = reference(full)
    assert action == (ref_action, ref_content), (full, action, ref_cut)

    kept_text = decode_text(ids[:kept], vocab)
    our_cut = kept_text[: protocol.reference_cut_end(kept_text)]
    early_answer = our_cut.endswith("</answer>") and ref_cut.endswith("</search>")
    assert our_cut == ref_cut or (early_answer and ref_cut.startswith(our_cut)), (full, our_cut, ref_cut)

    if rule_stop(table, ids) == stop:  # stopped by the rule, not by EOS or the end (cap)
        sampled_text = decode_text(ids[:stop], vocab)
        for witness in WITNESSES:  # decided: nothing that follows changes the reference's parse
            assert reference_action(sampled_text + witness) == action, (full, sampled_text, witness)
    return stop


def check_earliest(table, ids, vocab, stop):
    """Before the stop token, some continuation still changes the reference's parse."""
    for j in range(stop - 1):
        prefix = decode_text(ids[:j + 1], vocab)
        outcomes = {reference_action(prefix + w) for w in WITNESSES}
        assert len(outcomes) > 1, (decode_text(ids, vocab), prefix, "stopped too late: already decided")


# --- one token per byte: the rule itself ------------------------------------------------------

BYTE_VOCAB = tuple(bytes([b]) for b in range(256))


@pytest.fixture(scope="module")
def byte_table():
    return action_stop_table(BYTE_VOCAB).transitions[0].tolist()


def byte_ids(text: str) -> list[int]:
    return list(text.encode())


ISSUE_CASES = {
    # text the model would write: (reference action, reference content, text our action keeps)
    "answer_inside_search": ("<search><answer>x</answer></search> tail", "search", "<answer>x</answer>",
                             "<search><answer>x</answer></search>"),
    "answer_close_inside_search": ("<search> x </answer> then <search>y</search>", "search",
                                   "x </answer> then <search>y", "<search> x </answer> then <search>y</search>"),
    "answer_close_inside_think": ("<think>end with </answer> later</think><search> q </search>", "search", "q",
                                  "<think>end with </answer> later</think><search> q </search>"),
    "answer_then_search": ("<answer> A </answer> <search> q </search>", "answer", "A", "<answer> A </answer>"),
    "answer_opened_after_search_then_eos": ("<search> a <answer> b </answer> more", "answer", "b",
                                            "<search> a <answer> b </answer>"),
    "answer_opened_after_search_then_close": ("<search> a <answer> b </answer> more </search>", "search",
                                              "a <answer> b </answer> more",
                                              "<search> a <answer> b </answer> more </search>"),
    "search_closed_by_answer_tag_only": ("<search> q </answer> and more", None, "", "<search> q </answer>"),
    "search_open_answer_close_search_close": ("<search> q </answer> r </search>", "search", "q </answer> r",
                                              "<search> q </answer> r </search>"),
    "answer_then_answer_then_search": ("<answer> a </answer><answer> b </answer></search>", "answer", "a",
                                       "<answer> a </answer>"),
    "plain_search": ("<think>t</think>\n<search> nobel </search>\n\nmore", "search", "nobel",
                     "<think>t</think>\n<search> nobel </search>"),
    "plain_answer": ("<think>t</think>\n<answer> Paris </answer> bye", "answer", "Paris",
                     "<think>t</think>\n<answer> Paris </answer>"),
}


@pytest.mark.parametrize("name", sorted(ISSUE_CASES))
def test_issue_cases_parse_as_the_reference_parses_them(byte_table, name):
    text, kind, content, kept_text = ISSUE_CASES[name]
    assert reference_action(text) == (kind, content), "the case itself is wrong"
    ids = byte_ids(text)
    stop, kept, action = ours(byte_table, ids, BYTE_VOCAB)
    assert action == (kind, content)
    assert decode_text(ids[:kept], BYTE_VOCAB) == kept_text
    check_against_reference(byte_table, ids, BYTE_VOCAB)
    check_earliest(byte_table, ids, BYTE_VOCAB, stop)


def test_a_deciding_answer_stops_decoding_at_its_close_tag(byte_table):
    ids = byte_ids("<answer> A </answer> <search> q </search>")
    stop, kept, _ = ours(byte_table, ids, BYTE_VOCAB)
    assert decode_text(ids[:stop], BYTE_VOCAB) == "<answer> A </answer>" and kept == stop


def test_an_undeciding_answer_close_decodes_on_and_is_cut_afterwards(byte_table):
    ids = byte_ids("<search> q </answer> and more")
    stop, kept, action = ours(byte_table, ids, BYTE_VOCAB)
    assert stop == len(ids), "decoding must not stop at an </answer> that decides nothing"
    assert decode_text(ids[:kept], BYTE_VOCAB) == "<search> q </answer>" and action == (None, "")


PIECES = ("<search>", "</search>", "<answer>", "</answer>", "x", "<")


def test_exhaustively_over_short_tag_sequences(byte_table):
    checked = 0
    for length in range(1, 6):
        for pieces in itertools.product(PIECES, repeat=length):
            ids = byte_ids("".join(pieces))
            stop = check_against_reference(byte_table, ids, BYTE_VOCAB)
            if length <= 4:
                check_earliest(byte_table, ids, BYTE_VOCAB, stop)
            checked += 1
    assert checked == sum(len(PIECES) ** n for n in range(1, 6))


def test_token_table_of_single_bytes_is_the_byte_automaton(byte_table):
    byte_next, states = action_byte_dfa()
    assert len(states) == 66 and states[0] == ("nothing_opened", b"")
    np.testing.assert_array_equal(np.asarray(byte_table)[: len(states)], byte_next)


# --- the real Qwen2.5 vocabulary: multi-byte tokens, tags split anywhere -----------------------

@pytest.fixture(scope="module")
def vocab(qwen_tokenizer):
    return vocab_bytes(qwen_tokenizer)


@pytest.fixture(scope="module")
def qwen_table(vocab):
    return action_stop_table(vocab)


@pytest.fixture(scope="module")
def qwen_rows(qwen_table):
    """The table as nested lists, for fast host stepping."""
    return qwen_table.transitions[0].tolist()


@pytest.fixture(scope="module")
def qwen_stop_ids(qwen_tokenizer):
    return frozenset(terminator_ids(qwen_tokenizer))


QWEN_PIECES = ["<search>", "</search>", "<answer>", "</answer>", " q", "x", "<think>", "</think>", "<", "</",
               "search", "answer", ">", "></", ">\n\n", ".</", " </", "中", "<|im_end|>"]


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.sampled_from(QWEN_PIECES), min_size=1, max_size=12))
def test_qwen_token_streams_parse_as_the_reference_parses_them(qwen_tokenizer, vocab, qwen_rows, qwen_stop_ids,
                                                               pieces):
    ids = [i for piece in pieces for i in qwen_tokenizer.encode(piece, add_special_tokens=False)]
    stop = check_against_reference(qwen_rows, ids, vocab, qwen_stop_ids)
    check_earliest(qwen_rows, ids, vocab, stop)


def test_qwen_table_entries_equal_walking_the_byte_automaton(vocab, qwen_table):
    byte_next, states = action_byte_dfa()
    rng = np.random.default_rng(0)
    tag_tokens = [i for i, piece in enumerate(vocab) if any(c in piece for c in (b"<", b">", b"/"))]
    tokens = np.concatenate([rng.integers(0, len(vocab), 2000), rng.choice(tag_tokens, 2000)])
    for state in range(len(states)):
        for token in tokens[rng.integers(0, len(tokens), 300)]:
            walked = state
            for byte in vocab[token]:
                walked = byte_next[walked, byte]
                if walked == stop_strings.MATCHED:
                    break
            assert qwen_table.transitions[0, state, token] == walked, (states[state], vocab[token])


@jax.jit
def _jitted_states(transitions, ids):
    def step(state, token):
        state, matched = stop_strings.advance(transitions, state, token[None])
        return state, (state[0, 0], matched[0])

    return jax.lax.scan(step, jnp.zeros((1, transitions.shape[0]), jnp.int8), ids)[1]


def test_decode_loop_step_follows_the_host_automaton(qwen_tokenizer, qwen_table):
    text = "<search> a <answer> b </answer> more </search> after"
    ids = qwen_tokenizer.encode(text, add_special_tokens=False)
    states, matched = map(np.asarray, _jitted_states(jnp.asarray(qwen_table.transitions), jnp.asarray(ids)))
    host, host_matched = qwen_table.initial_state(1), []
    for token in ids:
        host, hit = qwen_table.advance(host, np.array([token]))
        host_matched.append(bool(hit[0]))
    first = host_matched.index(True)
    assert matched.tolist()[: first + 1] == host_matched[: first + 1]
    assert decode_text(ids[: first + 1], vocab_bytes(qwen_tokenizer)).endswith("</search>")
