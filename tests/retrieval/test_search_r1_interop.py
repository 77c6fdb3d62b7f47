"""Interoperability with Search-R1's own code, following what it really sends and returns.

* Its trainer's client (``search_r1/llm_agent/generation.py``, ``_batch_search``):
  ``requests.post(url, json={"queries": qs, "topk": k, "return_scores": True}).json()["result"]``,
  called on *every* search-enabled turn, with ``queries == []`` when no row searched, and with up
  to 512 prompts × 5 samples = 2,560 queries at once; ``_passages2string`` then reads only
  ``hit["document"]["contents"]``.
* Its server (``search_r1/search/retrieval_server.py``, ``retrieve_endpoint``) answers
  ``{"result": [[{"document": doc, "score": s}, …], …]}`` with ``return_scores``; ``doc`` is the
  corpus row (wiki-18: ``{"id", "contents"}``) from the dense retriever and
  ``{"title", "text", "contents"}`` (no ``id``) from the BM25 one. An empty list gets
  ``{"result": []}``. With ``return_scores`` false it unpacks ``results, scores`` from a bare
  list, so it fails for every batch but one of exactly two queries: there is nothing to mirror,
  and ours returns the bare documents.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from llds_jax.retrieval.client import HttpRetriever

from .test_server import service  # noqa: F401  (the real service fixture, module-scoped)

pytestmark = pytest.mark.integration

PAPER_BATCH = 512 * 5


def search_r1_batch_search(url: str, queries: list[str], topk: int = 3, return_scores: bool = True) -> list:
    """Search-R1's ``_batch_search`` call and its ``['result']``, as its trainer makes them."""
    payload = {"queries": queries, "topk": topk, "return_scores": return_scores}
    return requests.post(url, json=payload).json()["result"]


def passages_to_string(hits: list) -> str:
    """Search-R1's ``_passages2string``: the only use its trainer makes of a reply."""
    out = ""
    for idx, doc_item in enumerate(hits):
        content = doc_item["document"]["contents"]
        title = content.split("\n")[0]
        text = "\n".join(content.split("\n")[1:])
        out += f"Doc {idx + 1}(Title: {title}) {text}\n"
    return out


@pytest.mark.parametrize("return_scores", [True, False])
def test_a_turn_in_which_no_row_searches_gets_an_empty_result(service, return_scores):  # noqa: F811
    assert search_r1_batch_search(service.url + "/retrieve", [], return_scores=return_scores) == []


@pytest.mark.parametrize("topk", [3, 5])
def test_the_papers_batch_of_2560_queries_is_served_in_one_request(service, small_bm25, topk):  # noqa: F811
    queries = [f"who won the nobel prize in physics in {1900 + i % 120} {i}" for i in range(PAPER_BATCH)]
    result = search_r1_batch_search(service.url + "/retrieve", queries, topk=topk)
    assert len(result) == PAPER_BATCH
    assert [len(hits) for hits in result] == [topk] * PAPER_BATCH
    assert all([set(hit) for hit in hits] == [{"document", "score"}] * topk for hits in result)
    assert all([set(hit["document"]) for hit in hits] == [{"id", "contents"}] * topk for hits in result)  # wiki-18 rows
    sample = list(range(0, PAPER_BATCH, 97))
    expected = small_bm25.search([queries[i] for i in sample], topk)
    for i, oracle in zip(sample, expected):
        assert [hit["document"]["id"] for hit in result[i]] == [h.id for h in oracle], f"query {i}"
        assert passages_to_string(result[i]) == "".join(
            f"Doc {n}(Title: {h.title}) {h.text}\n" for n, h in enumerate(oracle, start=1))


def test_return_scores_false_gets_bare_corpus_rows_for_any_batch_size(service):  # noqa: F811
    for size in (1, 2, 3):
        result = search_r1_batch_search(service.url + "/retrieve", ["nobel prize"] * size, topk=2, return_scores=False)
        assert [[set(doc) for doc in hits] for hits in result] == [[{"id", "contents"}] * 2] * size


def official_bm25_row(contents: str) -> dict:
    """``BM25Retriever._search`` of retrieval_server.py, for an index that stores the documents."""
    return {"title": contents.split("\n")[0].strip('"'), "text": "\n".join(contents.split("\n")[1:]),
            "contents": contents}


@pytest.fixture
def official_bm25_server(small_bm25):
    """Answers ``/retrieve`` with our BM25's hits in exactly the rows and envelope of the official BM25 server."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            request = json.loads(self.rfile.read(int(self.headers["content-length"])))
            assert request["return_scores"] is True  # what Search-R1's trainer and our client send
            hits = small_bm25.search(request["queries"], request["topk"])
            result = [[{"document": official_bm25_row(h.contents), "score": h.score} for h in row] for row in hits]
            body = json.dumps({"result": result}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.unit
def test_our_client_reads_the_official_bm25_servers_rows_without_id(official_bm25_server, small_bm25):
    queries = ["first nobel prize in physics", "tamil film director", "river in europe"]
    with HttpRetriever(official_bm25_server, retries=0) as retriever:
        got = retriever.search(queries, 3)
    expected = small_bm25.search(queries, 3)
    assert [[h.contents for h in row] for row in got] == [[h.contents for h in row] for row in expected]
    assert [[h.score for h in row] for row in got] == [[h.score for h in row] for row in expected]
    assert {h.id for row in got for h in row} == {""}, "no id on the wire: unknown, not invented"
