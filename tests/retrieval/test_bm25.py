"""`BM25Retriever` over real wiki-18 passages: ranking, persistence, and awkward queries."""

from __future__ import annotations

import pytest

from llds_jax.retrieval import BM25Retriever, Corpus, Hit, RetrievalError

pytestmark = pytest.mark.unit


def test_a_passages_own_title_and_opening_retrieve_it_first(small_bm25, small_corpus):
    for index in (0, 123, 1999):
        _, contents = small_corpus.row(index)
        query = " ".join(contents.split()[:25])
        best = small_bm25.search([query], topk=3)[0][0]
        assert best.contents == contents, f"row {index}: got {best.id}"


def test_results_are_best_first_hits_with_corpus_ids(small_bm25, small_corpus):
    (hits,) = small_bm25.search(["Indian Tamil language film"], topk=5)
    assert len(hits) == 5 and all(isinstance(h, Hit) for h in hits)
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    ids = {small_corpus.row(i)[0] for i in range(len(small_corpus))}
    assert all(h.id in ids for h in hits)


def test_one_result_list_per_query_in_query_order(small_bm25):
    queries = ["Tamil film", "football club", "Tamil film"]
    results = small_bm25.search(queries, topk=2)
    assert len(results) == 3 and results[0] == results[2]


def test_saved_index_loads_and_answers_identically(small_bm25, small_corpus, tmp_path):
    small_bm25.save(tmp_path / "bm25")
    assert BM25Retriever.exists(tmp_path / "bm25")
    loaded = BM25Retriever.load(tmp_path / "bm25", small_corpus)
    queries = ["who directed the 1962 Tamil film", "river in europe"]
    assert loaded.search(queries, 4) == small_bm25.search(queries, 4)


def test_loading_an_index_over_a_different_corpus_is_refused(small_bm25, tmp_path):
    small_bm25.save(tmp_path / "bm25")
    other = tmp_path / "other.jsonl"
    other.write_text('{"id": "a", "contents": "A\\nx"}\n')
    with pytest.raises(RetrievalError, match="rebuild the index"):
        BM25Retriever.load(tmp_path / "bm25", Corpus(other))


def test_loading_a_missing_index_says_to_run_index_mode(small_corpus, tmp_path):
    with pytest.raises(FileNotFoundError, match="--mode=index"):
        BM25Retriever.load(tmp_path / "absent", small_corpus)


@pytest.mark.parametrize("query", ["", "the of and a", "zzqxv unknownword"])
def test_queries_without_known_tokens_still_get_topk_zero_score_hits(small_bm25, query):
    (hits,) = small_bm25.search([query], topk=3)
    assert len(hits) == 3 and all(h.score == 0.0 for h in hits)


def test_topk_larger_than_the_corpus_returns_every_row(tmp_path):
    path = tmp_path / "tiny.jsonl"
    path.write_text('{"id": "a", "contents": "\\"Apple\\"\\nfruit"}\n{"id": "b", "contents": "\\"Pear\\"\\nfruit"}\n')
    (hits,) = BM25Retriever.build(Corpus(path)).search(["apple"], topk=10)
    assert [h.id for h in hits][0] == "a" and len(hits) == 2


def test_empty_query_list_returns_empty_result(small_bm25):
    assert small_bm25.search([], topk=3) == []
