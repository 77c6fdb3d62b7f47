"""Interoperability with Search-R1's own code, following what it really sends and returns.

* Its trainer's client (``search_r1/llm_agent/generation.py``, ``_batch_search``):
  ``requests.post(url, json={"queries": qs, "topk": k, "return_scores": True}).json()["result"]``,
  called on *every* search-enabled turn, with ``queries == []`` when no row searched, and with up
  to 512 prompts × 5 samples = 2,560 queries at once.
* Its BM25 server (``search_r1/search/retrieval_server.py``) returns documents
  ``{"title", "text", "contents"}`` with no ``id``; our client must read them.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from llds_jax.retrieval.client import HttpRetriever

from .test_server import service  # noqa: F401  (the real service fixture, module-scoped)


def search_r1_batch_search(url: str, queries: list[str], topk: int = 3) -> list:
    """Search-R1's ``_batch_search`` call, as its trainer makes it."""
    payload = {"queries": queries, "topk": topk, "return_scores": True}
    return requests.post(url, json=payload).json()["result"]


def test_a_turn_in_which_no_row_searches_gets_an_empty_result(service):  # noqa: F811
    assert search_r1_batch_search(service.url + "/retrieve", []) == []


def test_the_papers_batch_of_2560_queries_is_served_in_one_request(service):  # noqa: F811
    queries = [f"who won the nobel prize in physics in {1900 + i % 120} {i}" for i in range(2560)]
    result = search_r1_batch_search(service.url + "/retrieve", queries, topk=3)
    assert len(result) == 2560
    assert all(len(hits) == 3 and {"document", "score"} == set(hits[0]) for hits in result)
    # Search-R1's _passages2string reads hit["document"]["contents"]
    assert all(isinstance(hit["document"]["contents"], str) for hits in result[:50] for hit in hits)


def _passage(title: str, text: str) -> dict:
    contents = f'"{title}"\n{text}'
    return {"title": title, "text": text, "contents": contents}  # the official BM25 server's row


class _OfficialBM25Reply(BaseHTTPRequestHandler):
    """Answers as Search-R1's retrieval_server.py does with a BM25 retriever and return_scores."""

    def do_POST(self):  # noqa: N802
        request = json.loads(self.rfile.read(int(self.headers["content-length"])))
        docs = [_passage("Röntgen", "Wilhelm Röntgen won the first Nobel Prize in Physics."),
                _passage("Nobel Prize", "The prizes were first awarded in 1901.")][: request["topk"]]
        result = [[{"document": doc, "score": 10.0 - rank} for rank, doc in enumerate(docs)]
                  for _ in request["queries"]]
        body = json.dumps({"result": result}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def official_bm25_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _OfficialBM25Reply)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_our_client_reads_the_official_bm25_servers_rows_without_id(official_bm25_server):
    with HttpRetriever(official_bm25_server, retries=0) as retriever:
        (hits, again) = retriever.search(["first nobel prize in physics", "nobel"], 2)
    assert [h.contents.split("\n", 1)[0] for h in hits] == ['"Röntgen"', '"Nobel Prize"']
    assert [h.score for h in hits] == [10.0, 9.0] and again == hits
    assert hits[0].text == "Wilhelm Röntgen won the first Nobel Prize in Physics."
