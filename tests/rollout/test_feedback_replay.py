"""``--mode=replay``'s comparison (``rollout/feedback_replay.py``): a recorded response's ``<information>``
blocks are matched to their queries as the rollout parsed them, and each is compared with the feedback a
retriever gives now, built as the rollout builds it (Qwen2.5 tokens, the ``max_obs_tokens`` cut).
The process (exit codes) is ``tests/test_cli_modes.py``'s; whole runs over two retrievers are
``tests/retrieval/test_mesh_training.py``'s."""

from __future__ import annotations

import itertools

import pytest

from llds_jax.errors import InputError
from llds_jax.retrieval import BM25Retriever, Corpus
from llds_jax.retrieval.config import BUNDLED_CORPUS
from llds_jax.rollout import protocol
from llds_jax.rollout.feedback_replay import read_responses, replay_feedback
from llds_jax.sampling.token_bytes import decode_text, vocab_bytes

pytestmark = pytest.mark.unit

TOPK, MAX_OBS = 3, 500


@pytest.fixture(scope="module")
def retriever(tmp_path_factory):
    path = tmp_path_factory.mktemp("replay") / "corpus.jsonl"
    with open(BUNDLED_CORPUS, "rb") as src, open(path, "wb") as dst:
        dst.writelines(itertools.islice(src, 60))
    return BM25Retriever.build(Corpus(path))


def feedback_text(retriever, tokenizer, query: str, max_obs: int = MAX_OBS) -> str:
    """What the rollout appends after a search for ``query``, as the response's decoded text holds it."""
    (feedback,) = protocol.batch_search_feedback(retriever, [query], TOPK)
    return decode_text(protocol.encode_feedback(tokenizer, feedback, max_obs), vocab_bytes(tokenizer))


def test_blocks_are_matched_to_the_search_before_them_past_an_invalid_actions_message(retriever, qwen_tokenizer):
    """A block the ``max_obs_tokens`` cut left without its closing tag is followed by the next action: the
    walk finds that action right after the replayed feedback, not at a tag."""
    first = feedback_text(retriever, qwen_tokenizer, "album", max_obs=20)
    second = feedback_text(retriever, qwen_tokenizer, "football club", max_obs=20)
    assert "</information>" not in first + second
    response = ("<think> a </think> oops" + protocol.INVALID_ACTION_FEEDBACK + "<search> album </search>" + first
                + "<search> football club </search>" + second + "<answer> x </answer>")
    report = replay_feedback([response, "<answer> x </answer>"], retriever, qwen_tokenizer, TOPK, 20)
    assert (report.samples, report.searches, report.mismatches) == (2, 2, [])
    swapped = response.replace("<search> football club </search>", "<search> album </search>")
    ((mismatch,),) = [replay_feedback([swapped], retriever, qwen_tokenizer, TOPK, 20).mismatches]
    assert (mismatch.sample, mismatch.turn, mismatch.query, mismatch.replayed) == (0, 1, "album", first)


def test_feedback_the_retriever_still_gives_is_equal_and_a_changed_document_is_not(retriever, qwen_tokenizer):
    fed = feedback_text(retriever, qwen_tokenizer, "album")
    other = feedback_text(retriever, qwen_tokenizer, "football club")
    responses = [f"<search> album </search>{fed}<search> football club </search>{other}<answer> a </answer>",
                 f"<search> football club </search>{other}<answer> b </answer>"]
    report = replay_feedback(responses, retriever, qwen_tokenizer, TOPK, MAX_OBS)
    assert (report.samples, report.searches, report.mismatches) == (2, 3, [])

    changed = fed.replace("Doc 2(Title:", "Doc 2(Title: x", 1)
    assert changed != fed
    report = replay_feedback([f"<search> album </search>{changed}<answer> a </answer>"], retriever, qwen_tokenizer,
                             TOPK, MAX_OBS)
    (mismatch,) = report.mismatches
    assert (mismatch.query, mismatch.recorded, mismatch.replayed) == ("album", changed, fed)


def test_a_block_the_context_cut_is_equal_when_it_begins_the_replayed_feedback(retriever, qwen_tokenizer):
    fed = feedback_text(retriever, qwen_tokenizer, "album")
    cut = "<search> album </search>" + fed[: len(fed) // 2]
    assert replay_feedback([cut], retriever, qwen_tokenizer, TOPK, MAX_OBS).mismatches == []
    wrong = "<search> album </search>" + fed[: len(fed) // 2 - 1] + "#"
    assert len(replay_feedback([wrong], retriever, qwen_tokenizer, TOPK, MAX_OBS).mismatches) == 1


def test_the_max_obs_cut_is_applied_as_the_rollout_applies_it(retriever, qwen_tokenizer):
    short = feedback_text(retriever, qwen_tokenizer, "album", max_obs=20)
    assert "</information>" not in short, "20 tokens end inside the documents"
    response = f"<search> album </search>{short}<answer> a </answer>"
    assert replay_feedback([response], retriever, qwen_tokenizer, TOPK, 20).mismatches == []
    assert len(replay_feedback([response], retriever, qwen_tokenizer, TOPK, 40).mismatches) == 1


def test_a_block_after_an_action_that_is_no_search_is_a_mismatch(retriever, qwen_tokenizer):
    fed = feedback_text(retriever, qwen_tokenizer, "album")
    (mismatch,) = replay_feedback([f"<answer> album </answer>{fed}"], retriever, qwen_tokenizer, TOPK,
                                  MAX_OBS).mismatches
    assert (mismatch.query, mismatch.recorded, mismatch.replayed) == (None, fed, "")


def test_a_bad_samples_line_names_the_file_the_line_and_the_field(tmp_path):
    path = tmp_path / "samples.jsonl"
    path.write_text('{"response": "ok"}\n{"response": 3}\n')
    with pytest.raises(InputError, match=r"samples.jsonl:2: field 'response' must be a string"):
        read_responses(path)
    path.write_text('{"response": "ok"}\nnot json\n')
    with pytest.raises(InputError, match=r"samples.jsonl:2: not a JSON object"):
        read_responses(path)
