"""The QA loader reads every shared slice and names file, line and field for bad rows."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llds_jax.data.benchmarks import (
    BENCHMARKS,
    DataRowError,
    QARecord,
    load_flashrag_jsonl,
    load_qa_file,
    load_qa_files,
    load_searchr1_parquet,
)

pytestmark = pytest.mark.unit

SLICE_SIZES = {
    "nq": 200, "triviaqa": 200, "popqa": 200, "hotpotqa": 200,
    "2wikimultihopqa": 200, "musique": 200, "bamboogle": 50,
}


def test_all_seven_shared_eval_slices_load_in_paper_order(shared_dir):
    grouped = load_qa_files(sorted((shared_dir / "data" / "eval").glob("*.jsonl")))
    assert tuple(grouped) == BENCHMARKS
    assert {source: len(rows) for source, rows in grouped.items()} == SLICE_SIZES
    for source, rows in grouped.items():
        assert all(r.data_source == source and r.question and r.golden_answers for r in rows)
    popqa_first = grouped["popqa"][0]
    assert popqa_first.golden_answers == ("Ralph Rainger", "Ralph Reichenthal")


def test_searchr1_parquet_and_flashrag_jsonl_give_the_same_nq_records(shared_dir):
    from_parquet = load_searchr1_parquet(shared_dir / "data" / "searchr1" / "nq_test_first200.parquet")
    from_jsonl = load_flashrag_jsonl(shared_dir / "data" / "eval" / "nq.dev200.jsonl")
    assert from_parquet == from_jsonl


def test_training_files_are_read_by_the_same_loader(shared_dir):
    rows = load_qa_file(shared_dir / "data" / "train" / "hotpotqa_train_800.jsonl", limit=10)
    assert len(rows) == 10 and {r.data_source for r in rows} == {"hotpotqa"}


def _write_searchr1_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)


def _searchr1_row(question_text="Question: who wrote hamlet?\n", target=("Shakespeare",), index=7):
    return {
        "data_source": "nq",
        "prompt": [{"role": "user", "content": "Answer the given question. ... " + question_text}],
        "ability": "fact-reasoning",
        "reward_model": {"ground_truth": {"target": list(target)}, "style": "rule"},
        "extra_info": {"split": "train", "index": index},
    }


def test_original_searchr1_columns_take_question_from_prompt_and_answers_from_target(tmp_path):
    path = tmp_path / "train.parquet"
    _write_searchr1_parquet(path, [_searchr1_row()])
    assert load_qa_file(path) == [
        QARecord(id="train_7", question="who wrote hamlet?", golden_answers=("Shakespeare",), data_source="nq")
    ]


def _jsonl(tmp_path, rows, name="nq.bad.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


GOOD = {"id": "a", "question": "q?", "golden_answers": ["x"]}


@pytest.mark.parametrize(
    ("bad_row", "field"),
    [
        ("{not json", "<json>"),
        ({"id": "b", "question": "q?"}, "golden_answers"),
        ({"id": "b", "question": "  ", "golden_answers": ["x"]}, "question"),
        ({"id": "b", "question": "q?", "golden_answers": []}, "golden_answers"),
        ({"id": "b", "question": "q?", "golden_answers": ["x", {"text": "y"}]}, "golden_answers[1]"),
        ({"id": ["b"], "question": "q?", "golden_answers": ["x"]}, "id"),
        ({"id": "b", "question": "q?", "golden_answers": ["x"], "data_source": "squad"}, "data_source"),
        ({"id": "a", "question": "q?", "golden_answers": ["x"]}, "id"),
    ],
)
def test_bad_jsonl_row_fails_with_file_line_and_field(tmp_path, bad_row, field):
    path = _jsonl(tmp_path, [GOOD, "", bad_row])
    with pytest.raises(DataRowError) as caught:
        load_flashrag_jsonl(path)
    assert (caught.value.path, caught.value.line, caught.value.field) == (str(path), 3, field)
    assert f"{path}:line 3: field {field!r}" in str(caught.value)


def test_bad_parquet_row_fails_with_file_row_and_field(tmp_path):
    path = tmp_path / "nq.parquet"
    _write_searchr1_parquet(path, [_searchr1_row(index=1), _searchr1_row("no question marker here", index=2)])
    with pytest.raises(DataRowError, match=r"nq\.parquet:row 2: field 'prompt'"):
        load_searchr1_parquet(path)


def test_file_that_does_not_name_a_benchmark_needs_an_explicit_data_source(tmp_path):
    path = _jsonl(tmp_path, [GOOD], name="mystery.jsonl")
    with pytest.raises(ValueError, match="pass data_source="):
        load_qa_file(path)
    assert load_qa_file(path, data_source="2wiki")[0].data_source == "2wikimultihopqa"
