"""SPEC §2 text protocol: the prompt, action parsing, feedback strings, with the real Qwen2.5 tokenizer."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

from llds_jax.retrieval import Hit
from llds_jax.rollout import protocol

pytestmark = pytest.mark.unit


def test_user_prompt_is_byte_identical_to_searchr1_parquet_prompts(shared_dir):
    rows = pq.read_table(shared_dir / "data" / "searchr1" / "nq_test_first200.parquet").to_pylist()
    for row in rows:
        (message,) = row["prompt"]
        assert protocol.user_prompt(row["question"]) == message["content"], row["id"]


def test_question_is_stripped_and_gets_a_question_mark():
    assert protocol.format_question("  who is he ") == "who is he?"
    assert protocol.format_question("who is he?") == "who is he?"


def test_prompt_goes_through_the_chat_template_with_generation_prompt(qwen_tokenizer):
    text = protocol.prompt_text(qwen_tokenizer, "who got the first nobel prize in physics")
    assert text.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\nAnswer the given question." in text
    assert text.endswith("Question: who got the first nobel prize in physics?\n<|im_end|>\n<|im_start|>assistant\n")


def test_prompt_keeps_its_last_max_prompt_tokens(qwen_tokenizer):
    full = protocol.encode_prompt(qwen_tokenizer, "q", max_prompt_tokens=100_000)
    cut = protocol.encode_prompt(qwen_tokenizer, "q", max_prompt_tokens=20)
    assert len(full) > 20
    assert cut == full[-20:]


def test_tags_are_plain_text_tokens(qwen_tokenizer):
    for tag in ("<search>", "</search>", "<answer>", "</answer>", "<information>", "<think>"):
        ids = qwen_tokenizer.encode(tag, add_special_tokens=False)
        assert len(ids) > 1, (tag, ids)
        assert not set(ids) & set(qwen_tokenizer.all_special_ids)


def test_parse_action_takes_the_first_complete_block():
    assert protocol.parse_action("<think>a</think><search> x y </search>") == protocol.Action("search", "x y")
    assert protocol.parse_action("<answer> B </answer><search> q </search>") == protocol.Action("answer", "B")
    assert protocol.parse_action("<search>\nmulti\nline\n</search>") == protocol.Action("search", "multi\nline")
    assert protocol.parse_action("<search> q </answer>").kind == "invalid"          # mismatched tags
    assert protocol.parse_action("<search> q").kind == "invalid"                      # unclosed
    assert protocol.parse_action("no tags at all").kind == "invalid"
    assert protocol.parse_action("<search> q </answer> r </search>") == protocol.Action("search", "q </answer> r")


def test_parse_action_cuts_the_text_as_the_reference_does_before_matching():
    """_postprocess_responses: cut after the first </search> if there is one anywhere, else after
    the first </answer>; only then the first-block regex."""
    assert protocol.parse_action("<answer> a </search> b </answer>") == protocol.Action("invalid")
    assert protocol.parse_action("<search><answer>x</answer></search>") == protocol.Action("search", "<answer>x</answer>")
    assert protocol.parse_action("<search> a <answer> b </answer> c </answer>") == protocol.Action("answer", "b")
    assert protocol.parse_action("<answer> a </answer> b </search>") == protocol.Action("answer", "a")
    text = "<search> a </answer> b </search> c </answer>"
    assert protocol.reference_cut_end(text) == text.index("</search>") + len("</search>")
    assert protocol.reference_cut_end(text.encode()) == protocol.reference_cut_end(text)
    assert protocol.reference_cut_end("no tags") == len("no tags")


_free_text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=30).filter(
    lambda s: "<" not in s and ">" not in s)


@given(_free_text, st.sampled_from(["search", "answer"]), _free_text, _free_text)
def test_parse_action_recovers_kind_and_stripped_content(before, kind, content, after):
    parsed = protocol.parse_action(f"{before}<{kind}>{content}</{kind}>{after}")
    assert parsed == protocol.Action(kind, content.strip())
    assert parsed.is_valid


@given(_free_text)
def test_text_without_tags_is_an_invalid_action(text):
    assert protocol.parse_action(text) == protocol.Action("invalid")


def test_search_feedback_wraps_formatted_docs_like_the_reference():
    hits = [Hit("1", '"Title A"\nline one\nline two', 1.0), Hit("2", '"B"\ntext b', 0.5)]
    from llds_jax.retrieval import format_docs

    feedback = protocol.search_feedback(format_docs(hits))
    assert feedback == (
        '\n\n<information>Doc 1(Title: "Title A") line one\nline two\nDoc 2(Title: "B") text b'
        "</information>\n\n"
    )


def test_invalid_action_feedback_is_the_reference_message():
    assert protocol.INVALID_ACTION_FEEDBACK == (
        "\nMy previous action is invalid. If I want to search, I should put the query between <search> and "
        "</search>. If I want to give the final answer, I should put the answer between <answer> and </answer>. "
        "Let me try again.\n")


def test_feedback_is_cut_to_max_obs_tokens(qwen_tokenizer):
    text = protocol.search_feedback("word " * 400)
    full = protocol.encode_feedback(qwen_tokenizer, text, max_obs_tokens=10_000)
    cut = protocol.encode_feedback(qwen_tokenizer, text, max_obs_tokens=50)
    assert len(full) > 50 and cut == full[:50]


class _CountingRetriever:
    def __init__(self):
        self.calls = []

    def search(self, queries, topk):
        self.calls.append((list(queries), topk))
        return [[Hit(f"{q}-{i}", f'"T{i}"\n{q} text {i}', 1.0 / (i + 1)) for i in range(topk)] for q in queries]


def test_all_queries_of_a_turn_go_to_the_retriever_in_one_call():
    retriever = _CountingRetriever()
    feedback = protocol.batch_search_feedback(retriever, ["a", "b", "c"], topk=2)
    assert retriever.calls == [(["a", "b", "c"], 2)]
    assert [f.count("Doc ") for f in feedback] == [2, 2, 2]
    assert "a text 0" in feedback[0] and "c text 1" in feedback[2]
    assert protocol.batch_search_feedback(retriever, [], topk=2) == [] and len(retriever.calls) == 1
