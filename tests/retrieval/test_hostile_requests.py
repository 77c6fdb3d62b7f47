"""200 hostile requests on one keep-alive connection: 4xx naming the field, short replies, server up.

FastAPI's own validation handler echoed the offending value: NaN, ±Infinity, 1e309 and lone
surrogates cannot be rendered (a 500 that also closed the connection) and a 10 MB wrong-typed
body came back whole in the 422. A 5,000-digit integer tripped Python's int-conversion limit
(another 500), and an out-of-range topk was echoed digit for digit.
"""

from __future__ import annotations

import http.client
import json
import threading
from urllib.parse import urlparse

import pytest
import uvicorn

from llds_jax.retrieval.server import bind_socket, create_app

from .test_server import QUERIES, service  # noqa: F401

pytestmark = pytest.mark.integration

TEN_MB = 10 * 2**20
MAX_REPLY_BYTES = 1024  # five field errors of at most 120 characters each, plus their paths
# Runs of the bodies' bulk and the surrogate escapes: none may come back in a reply.
ECHOES = (b"x" * 16, b"9" * 16, b"a" * 16, b'"q","q"', b'"q", "q"', b"\\ud8", b"\\udf", b"\xed\xa0\x80", b"\xff\xfe")


def hostile_requests() -> list[tuple[bytes, str, int | None]]:
    """(body, the field its reply must name, the exact status or None for any 4xx)."""
    kinds = [
        (b'{"queries": ["q"], "topk": NaN}', "topk", 400), (b'{"queries": ["q"], "topk": Infinity}', "topk", 400),
        (b'{"queries": ["q"], "topk": -Infinity}', "topk", 400), (b'{"queries": ["q"], "topk": 1e309}', "topk", 400),
        (b'{"queries": [NaN]}', "queries[0]", 400), (b'{"queries": ["q"], "return_scores": 1e309}', "return_scores", 400),
        (b'{"queries": ["q"], "note": -1e400}', "note", 400),
        (b'{"queries": ["\\ud800"]}', "queries[0]", 400), (b'{"queries": ["ok", "\\udfff tail"]}', "queries[1]", 400),
        (b'{"queries": ["q"], "topk": "\\ud800"}', "topk", 400),
        (b'{"queries": ["\xed\xa0\x80"]}', "queries[0]", 400), (b'{"queries": ["ok", "\xff\xfe"]}', "queries[1]", 400),
        (b"\xed\xa0\x80", "body", 400),
        (b'{"queries": 12}', "queries", 422), (b'{"queries": {"a": 1}}', "queries", 422),
        (b'{"queries": [true]}', "queries[0]", 422), (b'{"queries": ["q"], "topk": true}', "topk", 422),
        (b'{"queries": ["q"], "topk": 99999999999999999999999}', "topk", 400),
        (b'{"queries": ["q"], "topk": ' + b"9" * 5000 + b"}", "topk", 400),
        (b'{"queries": ["q"], "topk": -0.0}', "topk", 422), (b'{"queries": ["q"], "topk": 0}', "topk", 422),
        (b"[" * 100_000, "body", 400), (b'{"queries": ["q"]', "body", 400), (b"\x00\x01", "body", 400),
        (b'{"queries": ["q"], "topk": 3, "return_scores": null}', "return_scores", 422),
        (b'{"queries": ["q"], "topk": [' + b"1," * 1000 + b"1]}", "topk", 422),
        (json.dumps({"queries": ["q", "a" * 70_000]}).encode(), "queries[1]", 422),
    ]
    requests = [kinds[i % len(kinds)] for i in range(192)]
    requests += [(json.dumps({"queries": "x" * TEN_MB}).encode(), "queries", 422)] * 3  # 10 MB of the wrong type
    requests += [(json.dumps({"queries": ["q"], "topk": "9" * TEN_MB}).encode(), "topk", 422)] * 2
    requests += [(json.dumps({"queries": ["q"] * 1_000_000}).encode(), "queries", 413)] * 2  # 1M queries
    requests += [(b'{"queries": ["' + b"a" * (40 * 2**20) + b'"]}', "body", 413)]  # past the 32 MiB limit
    return requests


def check_reply(status: int, text: bytes, field: str, expected_status: int | None) -> str | None:
    """What is wrong with one reply, or None."""
    if not 400 <= status < 500 or (expected_status is not None and status != expected_status):
        return f"HTTP {status}, expected {expected_status or '4xx'}"
    if len(text) > MAX_REPLY_BYTES:
        return f"{len(text)}-byte reply (limit {MAX_REPLY_BYTES})"
    echoed = [run for run in ECHOES if run in text]
    if echoed:
        return f"reply echoes the input ({echoed[0][:16]!r})"
    detail = json.loads(text).get("detail")
    if not isinstance(detail, str) or not detail.startswith(field) or detail[len(field):len(field) + 1] not in (":", ""):
        return f"detail does not start with the field {field!r}: {str(detail)[:160]!r}"
    return None


def test_two_hundred_hostile_requests_get_short_4xx_replies_naming_the_field_on_one_kept_alive_connection(service):  # noqa: F811
    url = urlparse(service.url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    connection.auto_open = 0  # a dropped connection must fail loudly, not silently reconnect
    connection.connect()
    local_address = connection.sock.getsockname()
    requests = hostile_requests()
    assert len(requests) == 200
    failures = []
    for body, field, expected_status in requests:
        try:
            connection.request("POST", "/retrieve", body=body, headers={"content-type": "application/json"})
            reply = connection.getresponse()
            text = reply.read()
        except (OSError, http.client.HTTPException) as exc:
            failures.append((body[:60], f"connection broke: {exc!r}"))
            connection.close()
            connection.connect()  # go on counting on a fresh connection
            continue
        problem = check_reply(reply.status, text, field, expected_status)
        if problem is None and (connection.sock is None or reply.getheader("connection", "").lower() == "close"):
            problem = "the server closed the connection after replying"
        if problem is not None:
            failures.append((body[:60], problem))
    fatal = [f for f in failures if f[1].startswith(("HTTP 5", "connection broke"))]
    assert not failures, (f"{len(failures)} of {len(requests)} hostile requests went wrong ({len(fatal)} a 5xx or a"
                          f" broken connection), e.g. {(fatal or failures)[:4]}")
    assert connection.sock.getsockname() == local_address, "the keep-alive connection was replaced"
    connection.request("POST", "/retrieve", body=json.dumps({"queries": QUERIES, "topk": 3}),
                       headers={"content-type": "application/json"})
    reply = connection.getresponse()
    assert reply.status == 200 and len(json.loads(reply.read())["result"]) == len(QUERIES)


def test_a_chunked_body_past_the_byte_limit_gets_413_naming_the_limit_and_the_connection_survives(service):  # noqa: F811
    """No Content-Length to refuse up front: the count of bytes read so far must stop it."""
    url = urlparse(service.url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    connection.auto_open = 0
    connection.connect()
    limit = 32 * 2**20  # the default max_request_bytes
    pieces = [b'{"queries": ["'] + [b"a" * 2**20] * 33 + [b'"]}']
    connection.request("POST", "/retrieve", body=iter(pieces), encode_chunked=True,
                       headers={"content-type": "application/json", "transfer-encoding": "chunked"})
    reply = connection.getresponse()
    text = reply.read()
    assert reply.status == 413, text[:200]
    assert json.loads(text)["detail"] == f"body: more than {limit} bytes"
    connection.request("POST", "/retrieve", body=json.dumps({"queries": QUERIES[:1], "topk": 2}),
                       headers={"content-type": "application/json"})
    reply = connection.getresponse()
    assert reply.status == 200 and len(json.loads(reply.read())["result"][0]) == 2


class _FailingOnce:
    """A retriever whose first search raises, as a corrupt index shard or an OOM would."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def search(self, queries, topk):
        self.calls += 1
        if self.calls == 1:
            raise MemoryError("simulated")
        return self.inner.search(queries, topk)


@pytest.mark.unit
def test_a_failing_retriever_is_a_short_json_500_and_the_connection_and_service_survive(small_bm25):
    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(create_app(_FailingOnce(small_bm25)), log_level="critical"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        connection = http.client.HTTPConnection("127.0.0.1", sock.getsockname()[1], timeout=60)
        connection.auto_open = 0
        connection.connect()
        replies = []
        for _ in range(2):
            connection.request("POST", "/retrieve", body=json.dumps({"queries": QUERIES, "topk": 2}),
                               headers={"content-type": "application/json"})
            reply = connection.getresponse()
            replies.append((reply.status, json.loads(reply.read())))
        assert replies[0] == (500, {"detail": "retriever failed: MemoryError"})
        assert replies[1][0] == 200 and len(replies[1][1]["result"]) == len(QUERIES)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
