"""The lab policy's SFT data: trajectories (rollout records) query the question's entity; drills pack episodes
and train only actions."""

import ml_collections
import pytest
from transformers import AutoTokenizer

from llds_jax.lab.policy import lab_trajectories, reading_drills
from llds_jax.lab.tokenizer import train_tokenizer
from llds_jax.lab.world import generate_world, question_files, read_questions, write_world
from llds_jax.retrieval.factory import build_retriever
from llds_jax.rollout.trajectory import token_layout

pytestmark = pytest.mark.unit

SMALL = dict(seed=2, countries=3, cities=6, companies=5, people=30, train_questions=40, dev_questions=4)


def _setup(tmp_path):
    world = generate_world(SMALL)
    directory = write_world(world, tmp_path / "world")
    train_tokenizer(world, 1000, tmp_path / "tok")
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    retrieval = ml_collections.ConfigDict(dict(method="bm25", corpus_path=str(directory / "corpus.jsonl"), url="",
                                               index_path="", max_doc_tokens=0))
    rows = [row for f in question_files(directory, "train") for row in read_questions(f)]
    rollout = ml_collections.ConfigDict(dict(topk=1, max_obs_tokens=96, max_prompt_tokens=256))
    return tokenizer, build_retriever(retrieval, tokenizer), rows, rollout


def test_trajectory_searches_the_entity_and_its_passage_holds_the_answer_or_bridge(tmp_path):
    tokenizer, retriever, rows, rollout = _setup(tmp_path)
    trajectories = lab_trajectories(rows, tokenizer, retriever, rollout)
    layout = token_layout(trajectories, max(t.length for t in trajectories), pad_id=0)
    for row, ids, action, feedback in zip(rows, layout["input_ids"], layout["action_mask"], layout["feedback_mask"]):
        actions = tokenizer.decode(ids[action.astype(bool)])
        feedback = tokenizer.decode(ids[feedback.astype(bool)])
        assert f"<search> {row['metadata']['entity']} </search>" in actions, actions
        assert actions.endswith(f"<answer> {row['golden_answers'][0]} </answer>"), actions
        assert row["golden_answers"][0] in feedback, (row, feedback)


def test_drills_pack_several_episodes_within_the_length_and_train_only_searches_and_answers(tmp_path):
    tokenizer, retriever, rows, rollout = _setup(tmp_path)
    drills = reading_drills(rows, tokenizer, retriever, rollout, 288)
    assert len(drills) < len(rows) / 1.5, f"{len(drills)} drills for {len(rows)} episodes: not packed"
    answers = 0
    for drill in drills:
        assert len(drill.input_ids) <= 288
        assert not (drill.action_mask & drill.feedback_mask).any()
        actions = tokenizer.decode(drill.input_ids[drill.action_mask])
        assert "Question:" not in actions and "<information>" not in actions, actions
        answers += actions.count("<answer>")
    assert answers == len(rows), f"{answers} answers trained for {len(rows)} episodes"
