"""200 hostile requests on one keep-alive connection: 4xx only, short replies, the server stays up.

FastAPI's own validation handler echoed the offending value: NaN, ±Infinity, 1e309 and lone
surrogates cannot be rendered (a 500 that also closed the connection) and a 10 MB wrong-typed
body came back whole in the 422.
"""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlparse

from .test_server import QUERIES, service  # noqa: F401

TEN_MB = 10 * 2**20


def hostile_bodies() -> list[bytes]:
    kinds = [
        b'{"queries": ["q"], "topk": NaN}', b'{"queries": ["q"], "topk": Infinity}',
        b'{"queries": ["q"], "topk": -Infinity}', b'{"queries": ["q"], "topk": 1e309}',
        b'{"queries": [NaN]}', b'{"queries": ["q"], "return_scores": 1e309}',
        b'{"queries": ["\\ud800"]}', b'{"queries": ["ok", "\\udfff tail"]}', b'{"queries": ["q"], "topk": "\\ud800"}',
        b'{"queries": ["\xed\xa0\x80"]}', b'{"queries": ["\xff\xfe"]}', b"\xed\xa0\x80",
        b'{"queries": 12}', b'{"queries": {"a": 1}}', b'{"queries": [true]}', b'{"queries": ["q"], "topk": true}',
        b'{"queries": ["q"], "topk": 99999999999999999999999}', b'{"queries": ["q"], "topk": -0.0}',
        b"[" * 100_000, b'{"queries": ["q"]', b"\x00\x01", b'{"queries": ["q"], "topk": 3, "return_scores": null}',
        b'{"queries": ["q"], "topk": [' + b"1," * 1000 + b"1]}",
    ]
    bodies = [kinds[i % len(kinds)] for i in range(192)]
    bodies += [json.dumps({"queries": "x" * TEN_MB}).encode()] * 3  # 10 MB of the wrong type
    bodies += [json.dumps({"queries": ["q"], "topk": "9" * TEN_MB}).encode()] * 2
    bodies += [json.dumps({"queries": ["q"] * 1_000_000}).encode()] * 2  # 1M queries
    bodies += [b'{"queries": ["' + b"a" * (40 * 2**20) + b'"]}']  # over the byte limit
    return bodies


def test_two_hundred_hostile_requests_get_short_4xx_replies_on_one_kept_alive_connection(service):  # noqa: F811
    url = urlparse(service.url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    bodies = hostile_bodies()
    assert len(bodies) == 200
    failures, socket_ids = [], set()
    for body in bodies:
        connection.request("POST", "/retrieve", body=body, headers={"content-type": "application/json"})
        reply = connection.getresponse()
        text = reply.read()
        socket_ids.add(id(connection.sock))
        if not 400 <= reply.status < 500 or len(text) > 1024 or b"detail" not in text:
            failures.append((reply.status, len(text), body[:80], text[:200]))
        if reply.getheader("connection", "").lower() == "close":
            failures.append(("connection closed after", body[:80]))
    assert not failures, f"{len(failures)} bad replies, e.g. {failures[:4]}"
    assert len(socket_ids) == 1, "the keep-alive connection was dropped and reopened"
    connection.request("POST", "/retrieve", body=json.dumps({"queries": QUERIES, "topk": 3}),
                       headers={"content-type": "application/json"})
    reply = connection.getresponse()
    assert reply.status == 200 and len(json.loads(reply.read())["result"]) == len(QUERIES)
