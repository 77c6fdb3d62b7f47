"""The real service in a subprocess: Search-R1's wire format, validation, concurrency, restarts."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from llds_jax.retrieval import RetrievalError
from llds_jax.retrieval.client import HttpRetriever

from .service_process import ServiceProcess

pytestmark = pytest.mark.integration

QUERIES = ["who directed the 1962 Tamil film Padithal Mattum Podhuma?", "nobel prize in physics", "the of and"]


@pytest.fixture(scope="module")
def service(small_corpus_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("service")
    process = ServiceProcess({"corpus_path": small_corpus_path, "index_path": folder / "bm25", "port": 0, "topk": 3},
                             folder / "server.log")
    process.start()
    yield process
    process.stop()


def post(url: str, body, **kwargs) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return httpx.post(url + "/retrieve", content=body, headers={"content-type": "application/json"}, **kwargs)
    return httpx.post(url + "/retrieve", json=body, **kwargs)


def test_search_r1_trainer_payload_gets_the_reference_reply_shape_and_bm25_ranking(service, small_bm25):
    reply = post(service.url, {"queries": QUERIES, "topk": 3, "return_scores": True})
    assert reply.status_code == 200, reply.text
    result = reply.json()["result"]
    expected = small_bm25.search(QUERIES, 3)
    assert len(result) == len(QUERIES)
    for hits, oracle in zip(result, expected):
        assert [set(h) for h in hits] == [{"document", "score"}] * 3
        assert [set(h["document"]) for h in hits] == [{"id", "contents"}] * 3
        assert [h["document"]["id"] for h in hits] == [o.id for o in oracle]
        assert [h["score"] for h in hits] == pytest.approx([o.score for o in oracle])


def test_return_scores_false_returns_bare_documents(service):
    reply = post(service.url, {"queries": QUERIES[:1], "topk": 2, "return_scores": False})
    assert reply.status_code == 200, reply.text
    (hits,) = reply.json()["result"]
    assert [set(h) for h in hits] == [{"id", "contents"}] * 2


def test_missing_topk_uses_the_configured_default(service):
    (hits,) = post(service.url, {"queries": QUERIES[:1]}).json()["result"]
    assert len(hits) == 3


def test_health_answers_ok(service):
    reply = httpx.get(service.url + "/health")
    assert reply.status_code == 200 and reply.json()["status"] == "ok"


def malformed_bodies() -> list:
    """100 requests a confused or hostile client might send."""
    kinds = [
        b"", b"{", b"not json", b"[]", b"null", b"42", b'"queries"',
        {}, {"topk": 3}, {"queries": "one string"}, {"queries": None}, {"queries": [1, 2]},
        {"queries": [["nested"]]}, {"queries": [None]}, {"queries": [{"q": 1}]},
        {"queries": ["q"] * 65_537}, {"queries": ["x" * 70_000]}, {"queries": ["q"], "topk": 0},
        {"queries": ["q"], "topk": -3}, {"queries": ["q"], "topk": 10**9}, {"queries": ["q"], "topk": "3"},
        {"queries": ["q"], "topk": 2.5}, {"queries": ["q"], "topk": [3]}, {"queries": ["q"], "return_scores": "yes"},
    ]
    return [kinds[i % len(kinds)] for i in range(100)]


def test_hundred_malformed_requests_get_4xx_with_a_message_and_the_server_keeps_answering(service):
    statuses = []
    with httpx.Client() as client:
        for body in malformed_bodies():
            if isinstance(body, bytes):
                reply = client.post(service.url + "/retrieve", content=body, headers={"content-type": "application/json"})
            else:
                reply = client.post(service.url + "/retrieve", json=body)
            statuses.append((reply.status_code, json.dumps(body) if not isinstance(body, bytes) else body))
            assert reply.json().get("detail"), f"no error message for {body!r}"
    bad = [(s, b) for s, b in statuses if not 400 <= s < 500]
    assert not bad, f"non-4xx replies: {bad[:5]}"
    assert post(service.url, {"queries": QUERIES, "topk": 3, "return_scores": True}).status_code == 200


def test_validation_messages_name_the_offending_field(service):
    assert "topk" in post(service.url, {"queries": ["q"], "topk": 0}).text
    assert "queries[1]: 70000 characters exceed the limit of 65536" in post(service.url, {"queries": ["q", "x" * 70_000]}).text
    too_many = post(service.url, {"queries": ["q"] * 65_537})
    assert too_many.status_code == 413 and "queries: 65537 queries exceed the limit of 65536" in too_many.text


def test_a_body_past_the_byte_limit_gets_413_naming_its_size_and_the_limit(service):
    body = b'{"queries": ["' + b"a" * (32 * 2**20) + b'"]}'
    reply = post(service.url, body)
    assert reply.status_code == 413
    assert reply.json() == {"detail": f"body: {len(body)} bytes exceed the limit of {32 * 2**20}"}


def test_a_query_of_a_degenerate_500_token_turn_is_served(service, qwen_tokenizer):
    """The longest Qwen2.5 token (128 characters) 500 times: a collapsed policy's query is still searched."""
    longest = max(qwen_tokenizer.get_vocab().values(), key=lambda i: len(qwen_tokenizer.decode([i])))
    query = qwen_tokenizer.decode([longest] * 500) + " nobel prize"
    assert len(query) == 500 * 128 + len(" nobel prize")
    reply = post(service.url, {"queries": [query], "topk": 3, "return_scores": True})
    assert reply.status_code == 200, reply.text[:300]
    assert len(reply.json()["result"][0]) == 3


def test_eight_concurrent_clients_times_fifty_requests_all_succeed_with_correct_hits(service, small_bm25):
    questions = [f"{word} history" for word in ("film", "river", "football", "nobel", "war", "song", "city", "album")]
    expected = {q: [h.id for h in hits] for q, hits in zip(questions, small_bm25.search(questions, 3))}
    failures: list[str] = []

    def client_loop(client_index: int) -> None:
        with HttpRetriever(service.url, timeout=60, retries=2, backoff=0.1) as retriever:
            for request_index in range(50):
                query = questions[(client_index + request_index) % len(questions)]
                try:
                    (hits,) = retriever.search([query], 3)
                except RetrievalError as exc:
                    failures.append(str(exc))
                    continue
                if [h.id for h in hits] != expected[query]:
                    failures.append(f"client {client_index} request {request_index}: wrong hits for {query!r}")

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures[:5]


def test_killed_server_fails_the_client_naming_the_url_and_a_restart_recovers(small_corpus_path, tmp_path):
    overrides = {"corpus_path": small_corpus_path, "index_path": tmp_path / "bm25", "port": 0}
    first = ServiceProcess(overrides, tmp_path / "first.log").start()
    port = first.url.rsplit(":", 1)[1]
    restarted = ServiceProcess({**overrides, "port": port}, tmp_path / "second.log")
    try:
        with HttpRetriever(first.url, timeout=5, retries=2, backoff=0.05) as retriever:
            assert len(retriever.search(["film"], 2)[0]) == 2
            first.kill()
            with pytest.raises(RetrievalError, match=f"{first.url}/retrieve failed after 3 attempts"):
                retriever.search(["film"], 2)
            restarted.start()
            assert len(retriever.search(["film"], 2)[0]) == 2
    finally:
        first.stop()
        restarted.stop()


def test_client_splits_long_query_lists_into_requests_the_service_accepts(service, small_bm25):
    queries = [f"{word} film" for word in ("tamil", "french", "silent", "war", "comedy")]
    with HttpRetriever(service.url, max_queries_per_request=2) as retriever:
        got = retriever.search(queries, 2)
    assert [[h.id for h in hits] for hits in got] == [[h.id for h in hits] for hits in small_bm25.search(queries, 2)]


def test_client_cuts_requests_by_encoded_bytes_and_each_fits_the_limit(service, small_bm25):
    queries = [f"{word} film" + " é" * n for n, word in enumerate(("tamil", "french", "silent", "war", "comedy", "jazz"))]
    limit = 120
    with HttpRetriever(service.url, max_request_bytes=limit) as retriever:
        chunks = retriever._chunks(queries, 2)
        sizes = [len(json.dumps({"queries": c, "topk": 2, "return_scores": True}, ensure_ascii=False,
                                separators=(",", ":")).encode()) for c in chunks]
        got = retriever.search(queries, 2)
    assert [q for c in chunks for q in c] == queries and len(chunks) > 1
    assert all(size <= limit for size in sizes), sizes
    for chunk, next_chunk in zip(chunks, chunks[1:]):  # greedy: the next query would not have fitted
        grown = {"queries": chunk + next_chunk[:1], "topk": 2, "return_scores": True}
        assert len(json.dumps(grown, ensure_ascii=False, separators=(",", ":")).encode()) > limit
    assert [[h.id for h in hits] for hits in got] == [[h.id for h in hits] for hits in small_bm25.search(queries, 2)]


def test_client_reports_a_413_at_once_with_the_servers_reason(service):
    with HttpRetriever(service.url, retries=3, backoff=30.0) as retriever:
        with pytest.raises(RetrievalError, match=r"rejected the request: HTTP 413.*exceed the limit of 33554432"):
            retriever.search(["a" * (32 * 2**20)], 3)


def test_client_reports_a_rejected_request_at_once_with_the_servers_reason(service):
    with HttpRetriever(service.url + "/retrieve", retries=3, backoff=30.0) as retriever:
        with pytest.raises(RetrievalError, match=r"rejected the request: HTTP 422.*topk"):
            retriever.search(["q"], 1000)


@pytest.mark.unit
def test_client_refuses_a_lone_surrogate_query_naming_it_before_sending():
    with HttpRetriever("http://127.0.0.1:9", retries=0) as retriever:  # nothing listens: nothing may be sent
        with pytest.raises(ValueError, match=r"queries\[1\] is not valid Unicode"):
            retriever.search(["ok", "\ud800"], 3)
