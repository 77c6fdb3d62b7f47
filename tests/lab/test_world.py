"""The lab world: deterministic, in the formats the retrieval and data packages read, answers reachable."""

import json

import pytest

from llds_jax.data.benchmarks import load_qa_file
from llds_jax.lab.world import WorldConfigError, generate_world, question_files, write_world
from llds_jax.retrieval.corpus import parse_row

pytestmark = pytest.mark.unit

SMALL = dict(seed=3, countries=3, cities=6, companies=5, people=30, train_questions=60, dev_questions=10)


def test_same_settings_give_identical_files_and_another_seed_differs(tmp_path):
    a = write_world(generate_world(SMALL), tmp_path / "a")
    b = write_world(generate_world(SMALL), tmp_path / "b")
    c = write_world(generate_world({**SMALL, "seed": 4}), tmp_path / "c")
    for name in ("corpus.jsonl", "nq_lab_train.jsonl", "hotpotqa_lab_train.jsonl", "nq_lab_dev.jsonl"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "corpus.jsonl").read_bytes() != (c / "corpus.jsonl").read_bytes()


def test_corpus_rows_are_wiki18_rows_and_questions_load_as_nq_and_hotpotqa(tmp_path):
    world = generate_world(SMALL)
    directory = write_world(world, tmp_path)
    lines = (directory / "corpus.jsonl").read_bytes().splitlines()
    assert len(lines) == 3 + 6 + 5 + 30
    titles = set()
    for number, line in enumerate(lines, 1):
        _, contents = parse_row(line, "corpus.jsonl", number)
        title = contents.split("\n", 1)[0]
        assert title.startswith('"') and title.endswith('"'), contents
        titles.add(title.strip('"'))
    assert len(titles) == len(lines), "every entity has exactly one passage and a unique name"
    one, two = (load_qa_file(path) for path in question_files(directory, "train"))
    assert {r.data_source for r in one} == {"nq"} and {r.data_source for r in two} == {"hotpotqa"}
    assert len(one) + len(two) == 60


def test_two_hop_answers_are_in_the_bridge_passage_and_the_bridge_in_the_first(tmp_path):
    world = generate_world(SMALL)
    text_of = dict(world.passages)
    two_hop = [q for q in world.train if q.hops == 2]
    assert two_hop
    for q in two_hop:
        named = [title for title in text_of if title in q.question]
        assert any(q.bridge in text_of[title] for title in named), q
        assert q.answer in text_of[q.bridge], q
    for q in world.train:
        if q.hops == 1:
            assert any(q.answer in text_of[t] for t in text_of if t in q.question), q


def test_bad_settings_name_the_field():
    with pytest.raises(WorldConfigError, match=r"lab.world.people=0"):
        generate_world({**SMALL, "people": 0})
    with pytest.raises(WorldConfigError, match=r"unknown fields \['peeple'\]"):
        generate_world({**SMALL, "peeple": 3})
    with pytest.raises(WorldConfigError, match=r"two_hop_fraction=1.5"):
        generate_world({**SMALL, "two_hop_fraction": 1.5})


def test_rows_carry_the_bridge_for_trajectory_building(tmp_path):
    directory = write_world(generate_world(SMALL), tmp_path)
    rows = [json.loads(x) for x in (directory / "hotpotqa_lab_train.jsonl").read_text().splitlines()]
    assert all(r["metadata"]["hops"] == 2 and r["metadata"]["bridge"] for r in rows)


def test_articles_agree_and_rows_name_the_questions_entity(tmp_path):
    world = generate_world({**SMALL, "people": 60})
    texts = " ".join(text for _, text in world.passages)
    for wrong in (" a astronomer", " a engineer", " a artist"):
        assert wrong not in texts
    assert " an astronomer" in texts or " an engineer" in texts, "no vowel-initial occupation drawn in this world"
    text_of = dict(world.passages)
    for q in world.train:
        assert q.entity in q.question and q.entity in text_of, q
        assert (q.bridge or q.answer) in text_of[q.entity], q
