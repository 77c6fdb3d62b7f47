"""`Corpus`: lazy row access through a byte-offset index, and loud failures on bad rows."""

from __future__ import annotations

import gzip
import json
import os

import numpy as np
import pytest

from llds_jax.retrieval import Corpus, CorpusFormatError
from llds_jax.retrieval.corpus import OFFSETS_SUFFIX

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLDS_JAX_CACHE", str(tmp_path / "cache"))


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_random_access_returns_the_same_rows_as_parsing_every_line(small_corpus_path, small_corpus):
    expected = [json.loads(line) for line in small_corpus_path.read_text().splitlines()]
    assert len(small_corpus) == len(expected)
    for index in [0, 1, 999, len(expected) - 1]:
        assert small_corpus.row(index) == (expected[index]["id"], expected[index]["contents"])
    assert small_corpus.rows([5, 2]) == [small_corpus.row(5), small_corpus.row(2)]
    assert list(small_corpus.iter_contents(10, 13)) == [expected[i]["contents"] for i in (10, 11, 12)]


def test_offsets_are_saved_beside_the_corpus_as_a_memmapped_npy_and_reused(tmp_path):
    path = write_rows(tmp_path / "c.jsonl", [{"id": "a", "contents": "A\nx"}, {"id": "b", "contents": "B\ny"}])
    Corpus(path)
    offsets_path = tmp_path / ("c.jsonl" + OFFSETS_SUFFIX)
    stamp = offsets_path.stat().st_mtime_ns
    reopened = Corpus(path)
    assert offsets_path.stat().st_mtime_ns == stamp
    assert isinstance(reopened._offsets, np.memmap)
    assert reopened.row(1) == ("b", "B\ny")


def test_offsets_are_rebuilt_when_the_corpus_changes(tmp_path):
    path = write_rows(tmp_path / "c.jsonl", [{"id": "a", "contents": "A\nx"}])
    assert len(Corpus(path)) == 1
    write_rows(path, [{"id": "a", "contents": "A\nx"}, {"id": "b", "contents": "B\nyy"}])
    corpus = Corpus(path)
    assert len(corpus) == 2 and corpus.row(1) == ("b", "B\nyy")


def test_read_only_corpus_directory_puts_offsets_in_the_cache(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    path = write_rows(folder / "c.jsonl", [{"id": "a", "contents": "A\nx"}])
    os.chmod(folder, 0o555)
    try:
        corpus = Corpus(path)
        assert corpus.row(0) == ("a", "A\nx")
        assert not (folder / ("c.jsonl" + OFFSETS_SUFFIX)).exists()
        assert list((tmp_path / "cache" / "corpus_offsets").glob("c.jsonl.*" + OFFSETS_SUFFIX))
    finally:
        os.chmod(folder, 0o755)


def test_gzipped_corpus_reads_like_the_plain_one(tmp_path):
    rows = [{"id": str(i), "contents": f'"T{i}"\ntext {i}'} for i in range(5)]
    with gzip.open(tmp_path / "c.jsonl.gz", "wt") as handle:
        handle.writelines(json.dumps(r) + "\n" for r in rows)
    corpus = Corpus(tmp_path / "c.jsonl.gz")
    assert len(corpus) == 5 and corpus.row(3) == ("3", '"T3"\ntext 3')


def test_blank_lines_are_skipped_and_integer_ids_become_strings(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"id": 7, "contents": "A\\nx"}\n\n{"id": "b", "contents": "B"}\n\n')
    corpus = Corpus(path)
    assert len(corpus) == 2
    assert corpus.rows([0, 1]) == [("7", "A\nx"), ("b", "B")]


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ("{not json", "c.jsonl:2: not valid JSON"),
        ('["a list"]', "c.jsonl:2: expected a JSON object"),
        ('{"id": "x"}', "c.jsonl:2: missing field 'contents'"),
        ('{"contents": "x"}', "c.jsonl:2: missing field 'id'"),
        ('{"id": "x", "contents": 3}', "c.jsonl:2: field 'contents' must be a string, got int"),
        ('{"id": null, "contents": "x"}', "c.jsonl:2: field 'id' must be a string, got NoneType"),
    ],
)
def test_bad_row_fails_naming_file_line_and_field(tmp_path, bad_line, message):
    path = tmp_path / "c.jsonl"
    path.write_text('{"id": "ok", "contents": "A"}\n' + bad_line + "\n")
    with pytest.raises(CorpusFormatError, match=message.replace("[", r"\[")):
        Corpus(path)


def test_missing_or_empty_corpus_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        Corpus(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(CorpusFormatError, match="no rows"):
        Corpus(tmp_path / "empty.jsonl")


def test_row_out_of_range_names_the_corpus(small_corpus):
    with pytest.raises(IndexError, match="wiki18_first2000.jsonl"):
        small_corpus.row(len(small_corpus))
