"""The free-form world's writing (issue 43): near-duplicate thoughts and queries that still find the passage."""

import ml_collections
import numpy as np
import pytest
from transformers import AutoTokenizer

from llds_jax.lab.freeform import CHAIN, QUERY_TEMPLATES, Writing, chain_weights, thought
from llds_jax.lab.policy import lab_trajectories
from llds_jax.lab.tokenizer import train_tokenizer
from llds_jax.lab.world import DEFAULT_WORLD, generate_world, question_files, read_questions, write_world
from llds_jax.retrieval.factory import build_retriever
from llds_jax.rollout.trajectory import token_layout

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """The default world (the one configs/lab_freeform.py trains on), its tokenizer and BM25 retriever."""
    tmp = tmp_path_factory.mktemp("freeform")
    world = generate_world(DEFAULT_WORLD)
    directory = write_world(world, tmp / "world")
    train_tokenizer(world, 2048, tmp / "tok")
    tokenizer = AutoTokenizer.from_pretrained(str(tmp / "tok"))
    retrieval = ml_collections.ConfigDict(dict(method="bm25", corpus_path=str(directory / "corpus.jsonl"), url="",
                                               index_path="", max_doc_tokens=0))
    rows = [row for f in question_files(directory, "train") for row in read_questions(f)]
    return world, tokenizer, build_retriever(retrieval, tokenizer), rows


def test_every_query_paraphrase_keeps_the_entitys_passage_at_bm25_top_1(lab):
    world, _, retriever, rows = lab
    entities = sorted({row["metadata"]["entity"] for row in rows} | {row["metadata"]["bridge"] for row in rows} - {""})
    for template in QUERY_TEMPLATES:
        queries = [template.format(e=entity) for entity in entities]
        hits = retriever.search(queries, 1)
        titles = [hit[0].contents.split("\n", 1)[0].strip('"') for hit in hits]
        wrong = [(q, t) for q, t, e in zip(queries, titles, entities) if t != e]
        assert not wrong, f"template {template!r}: {len(wrong)} of {len(entities)} miss, e.g. {wrong[:3]}"


def test_thoughts_are_near_duplicates_never_one_fixed_string():
    weights = chain_weights(0)
    rng = np.random.default_rng(0)
    thoughts = [thought(rng, weights, "Zen Deifom", 0.3) for _ in range(400)]
    assert all(t.startswith("<think> ") and t.endswith(". </think>\n") for t in thoughts)
    assert len(set(thoughts)) > 40, "the chain must give many distinct thoughts"
    share_with_entity = np.mean(["Zen Deifom" in t for t in thoughts])
    assert 0.2 < share_with_entity < 0.4
    # Every successor named in the chain is a state of the chain (or the end marker).
    assert {w for nexts in CHAIN.values() for w in nexts} - {"</>"} <= set(CHAIN)
    # Seeded: the same seed gives the same thoughts.
    again = np.random.default_rng(0)
    assert [thought(again, chain_weights(0), "Zen Deifom", 0.3) for _ in range(400)] == thoughts


def test_freeform_trajectories_search_a_paraphrase_and_still_read_the_answer(lab):
    _, tokenizer, retriever, rows = lab
    rollout = ml_collections.ConfigDict(dict(topk=1, max_obs_tokens=96, max_prompt_tokens=256))
    rows = rows[:60]
    trajectories = lab_trajectories(rows, tokenizer, retriever, rollout, Writing("freeform", np.random.default_rng(1)))
    layout = token_layout(trajectories, max(t.length for t in trajectories), pad_id=0)
    first_actions = set()
    for row, ids, action, feedback in zip(rows, layout["input_ids"], layout["action_mask"], layout["feedback_mask"]):
        actions = tokenizer.decode(ids[action.astype(bool)])
        assert row["metadata"]["entity"] in actions.split("</search>")[0]
        assert actions.endswith(f"<answer> {row['golden_answers'][0]} </answer>"), actions
        assert row["golden_answers"][0] in tokenizer.decode(ids[feedback.astype(bool)])
        first_actions.add(actions.split("</search>")[0].replace(row["metadata"]["entity"], "E"))
    assert len(first_actions) > 20, "first actions must vary beyond the entity name"
    # 48-token actions (configs/lab_freeform.py) hold every first action.
    assert max(len(action.ids) for t in trajectories for action in t.actions) <= 48
