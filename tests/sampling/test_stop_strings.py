"""Stop strings found while decoding, on token bytes, with the real Qwen2.5 tokenizer and scripted streams."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llds_jax.rollout.protocol import ACTION_STOP_STRINGS, parse_action
from llds_jax.sampling import stop_strings
from llds_jax.sampling.token_bytes import char_offsets, decode_text, vocab_bytes

pytestmark = pytest.mark.unit

STOPS = ACTION_STOP_STRINGS


@pytest.fixture(scope="module")
def vocab(qwen_tokenizer):
    return vocab_bytes(qwen_tokenizer)


@pytest.fixture(scope="module")
def table(vocab):
    return stop_strings.build_stop_table(vocab, STOPS)


def host_stop(table, ids):
    """Tokens kept by the host matcher (same tables as the decode loop), or None."""
    state = table.initial_state(1)
    for i, token in enumerate(ids):
        state, matched = table.advance(state, np.array([token]))
        if matched[0]:
            return i + 1
    return None


@jax.jit
def _jitted_hits(transitions, ids):
    def step(state, token):
        state, matched = stop_strings.advance(transitions, state, token[None])
        return state, matched[0]

    init = jnp.zeros((1, transitions.shape[0]), jnp.int8)
    return jax.lax.scan(step, init, ids)[1]


def jitted_stop(table, ids):
    hits = np.asarray(_jitted_hits(jnp.asarray(table.transitions), jnp.asarray(ids, jnp.int32)))
    return int(np.argmax(hits)) + 1 if hits.any() else None


def spec_cut(text: str) -> int | None:
    """SPEC §2: the action ends at the end of the first stop string to complete."""
    ends = [text.find(s) + len(s) for s in STOPS if s in text]
    return min(ends) if ends else None


def ids_of(tokenizer, *pieces: str) -> list[int]:
    """Concatenate separately encoded pieces, so the test controls where token boundaries fall."""
    return [i for piece in pieces for i in tokenizer.encode(piece, add_special_tokens=False)]


CASES = {
    # name: (pieces, expected token pieces of the last kept token)
    "split_across_three_tokens": (["<search> nobel physics ", "</search>", " trailing words"], ">"),
    "merged_with_preceding_text": (["<search> foo.</search>", " more"], ">"),
    "ends_inside_a_token": (["<search> q </search>\n\n", "<information>"], ">\n\n"),
    "answer_merged_into_following_tag": (["<answer> A </answer></search>", " x"], "></"),
    "preceded_by_answer": (["<answer> A </answer> <search> q </search>"], ">"),
    "after_multibyte_text": (["<search> 中文 Röntgen </search>", "中"], ">"),
    "answer_stop": (["<think>t</think><answer> Paris </answer>", "<|im_end|>"], ">"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_action_ends_where_spec_cuts_the_text(qwen_tokenizer, vocab, table, name):
    pieces, last_piece = CASES[name]
    ids = ids_of(qwen_tokenizer, *pieces)
    text = decode_text(ids, vocab)
    assert text == qwen_tokenizer.decode(ids, skip_special_tokens=True)
    cut = spec_cut(text)
    kept = host_stop(table, ids)
    assert kept is not None, (name, qwen_tokenizer.convert_ids_to_tokens(ids))
    offsets = char_offsets(ids, vocab)
    # The kept tokens are the shortest prefix whose text reaches the SPEC cut.
    assert offsets[kept - 1] < cut <= offsets[kept], (name, kept, cut, offsets)
    assert decode_text(ids[kept - 1:kept], vocab) == last_piece, qwen_tokenizer.convert_ids_to_tokens(ids)
    assert jitted_stop(table, ids) == kept == stop_strings.first_stop_end(ids, vocab, STOPS)


def test_stop_string_ending_inside_a_token_keeps_the_whole_sampled_token(qwen_tokenizer, vocab, table):
    ids = ids_of(qwen_tokenizer, "<search> q </search>\n\n")
    kept = host_stop(table, ids)
    assert kept == len(ids)
    assert decode_text(ids[:kept], vocab) == "<search> q </search>\n\n"  # 2 chars past the stop string
    assert parse_action(decode_text(ids[:kept], vocab)).content == "q"


def test_answer_before_search_ends_the_action_as_an_answer(qwen_tokenizer, vocab, table):
    """The reference cuts at </search> when both occur; its parser then still picks the answer."""
    ids = ids_of(qwen_tokenizer, "<answer> A </answer> <search> q </search>")
    ours = decode_text(ids[: host_stop(table, ids)], vocab)
    full = decode_text(ids, vocab)
    reference = full.split("</search>")[0] + "</search>"
    assert ours == "<answer> A </answer>"
    assert parse_action(ours) == parse_action(reference) == parse_action(full)


def test_no_stop_string_means_no_stop(qwen_tokenizer, vocab, table):
    ids = ids_of(qwen_tokenizer, "<search> q </sear", "ch", " </ answer>", "</search")
    assert host_stop(table, ids) is None and jitted_stop(table, ids) is None


def test_vocab_bytes_reproduce_hf_decoding(qwen_tokenizer, vocab):
    rng = np.random.default_rng(0)
    for _ in range(20):
        ids = rng.integers(0, 151643, size=40).tolist()
        assert decode_text(ids, vocab) == qwen_tokenizer.decode(ids), ids
    special = [151643, 151644, 151645]
    assert all(vocab[i] == b"" for i in special)


def test_unused_stop_slots_never_match(vocab):
    table = stop_strings.build_stop_table(vocab, ("</search>", "</answer>", "<|x|>"))
    assert table.transitions.shape[:2] == (4, 16)  # 3 stops bucketed to 4, states to 16
    assert not (table.transitions[3] == stop_strings.MATCHED).any()


def test_byte_automaton_builder_reproduces_the_stop_string_tables(vocab):
    """table_from_byte_dfa on the plain string matcher for one stop string equals build_stop_table."""
    stop = b"</search>"
    byte_next = np.zeros((len(stop), 256), np.int16)
    for state in range(len(stop)):
        for byte in range(256):
            text = stop[:state] + bytes([byte])
            byte_next[state, byte] = (stop_strings.MATCHED if text.endswith(stop)
                                      else stop_strings._longest_prefix_suffix(text, stop))
    built = stop_strings.table_from_byte_dfa(byte_next, vocab)
    expected = stop_strings.build_stop_table(vocab, ("</search>",)).transitions[0]
    assert built.shape == expected.shape == (16, len(vocab))
    differ = np.argwhere(built[: len(stop)] != expected[: len(stop)])
    assert differ.size == 0, [(s, vocab[t], built[s, t], expected[s, t]) for s, t in differ[:5]]


def test_byte_automaton_builder_rejects_tables_it_cannot_hold():
    with pytest.raises(ValueError, match="int8"):
        stop_strings.table_from_byte_dfa(np.zeros((128, 256), np.int16), (b"a",))
    with pytest.raises(ValueError, match="outside"):
        stop_strings.table_from_byte_dfa(np.full((2, 256), 5, np.int16), (b"a",))


@pytest.fixture(scope="module")
def relevant_ids(qwen_tokenizer):
    """Token ids that interact with the stop strings, plus some that do not."""
    pieces = ["</", "search", ">", "answer", "></", ".</", ">\n\n", "<", "/", "s", "se", "arch", "h", "h>",
              " </", "ans", "wer", "er>", ">\n", "x", " the", "中"]
    ids = set()
    for piece in pieces:
        ids.update(qwen_tokenizer.encode(piece, add_special_tokens=False))
    return sorted(ids)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_table_matcher_equals_substring_search_on_random_streams(vocab, table, relevant_ids, data):
    ids = data.draw(st.lists(st.sampled_from(relevant_ids), min_size=1, max_size=24))
    assert host_stop(table, ids) == stop_strings.first_stop_end(ids, vocab, STOPS), ids
