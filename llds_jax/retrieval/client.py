"""`HttpRetriever`: the `Retriever` interface over a Search-R1-compatible ``/retrieve`` service.

The reference trainer calls ``requests.post(url, json=payload).json()`` with no timeout
and no retry, so a restarting server kills a multi-day run with a JSONDecodeError
(Search-R1 #43). Here transport failures, 5xx and 429 are retried with exponential
backoff; a 4xx is the caller's bug and fails at once with the server's message; after
the last attempt the error names the URL, the attempts and the last cause.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

import httpx

from llds_jax.retrieval.hit import Hit, RetrievalError, check_search_args

RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})
DEFAULT_MAX_REQUEST_BYTES = 32 * 2**20  # our server's default ``max_request_bytes``


def retrieve_url(url: str) -> str:
    """Accept the service root or Search-R1's ``search_url`` (which already ends in /retrieve)."""
    url = url.rstrip("/")
    return url if url.endswith("/retrieve") else url + "/retrieve"


def _parse_hit(item: object) -> Hit:
    """One hit as any Search-R1-style server writes it.

    ``{"document": {...}, "score": s}`` (``return_scores``) or a bare document. Documents carry
    ``contents`` (all Search-R1 reads) and, from our server and the official dense one, the
    corpus row's ``id``; the official BM25 server writes ``{"title", "text", "contents"}``
    with no ``id``, and the id is then ``""`` (unknown) rather than a made-up one that could
    be mistaken for a corpus row.
    """
    document, score = (item["document"], item["score"]) if isinstance(item, dict) and "document" in item else (item, 0.0)
    contents = document["contents"]
    if not isinstance(contents, str):
        raise TypeError(f"'contents' is {type(contents).__name__}, not a string")
    return Hit(id=str(document.get("id", "")), contents=contents, score=float(score))


def _parse_hits(payload: object, expected: int, url: str) -> list[list[Hit]]:
    if not isinstance(payload, dict) or not isinstance(payload.get("result"), list):
        raise RetrievalError(f"{url}: reply has no 'result' list: {str(payload)[:200]}")
    result = payload["result"]
    if len(result) != expected:
        raise RetrievalError(f"{url}: {len(result)} result lists for {expected} queries")
    try:
        return [[_parse_hit(item) for item in hits] for hits in result]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise RetrievalError(f"{url}: malformed hit in reply ({exc!r}): {str(result)[:200]}") from None


class HttpRetriever:
    """Searches a remote service; thread-safe (one pooled ``httpx.Client``)."""

    def __init__(self, url: str, timeout: float = 30.0, retries: int = 5, backoff: float = 0.5,
                 max_backoff: float = 10.0, max_queries_per_request: int = 512,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES):
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.url = retrieve_url(url)
        self.retries = retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.max_queries_per_request = max_queries_per_request
        self.max_request_bytes = max_request_bytes
        self._client = httpx.Client(timeout=timeout)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> HttpRetriever:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def search(self, queries: Sequence[str], topk: int) -> list[list[Hit]]:
        """Long query lists are sent in chunks that fit the service's per-request limits."""
        queries = check_search_args(queries, topk)
        results: list[list[Hit]] = []
        for chunk in self._chunks(queries, topk):
            payload = {"queries": chunk, "topk": topk, "return_scores": True}
            results.extend(_parse_hits(self._post_with_retries(payload), len(chunk), self.url))
        return results

    @staticmethod
    def _json_bytes(value: object) -> int:
        return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())

    def _chunks(self, queries: list[str], topk: int) -> list[list[str]]:
        """Cut by count and by encoded bytes (as httpx writes JSON), so long queries never earn a 413.

        A single query longer than the byte limit goes alone; the server's 413 then names it.
        """
        overhead = self._json_bytes({"queries": [], "topk": topk, "return_scores": True})
        chunks: list[list[str]] = []
        chunk: list[str] = []
        size = overhead
        for position, query in enumerate(queries):
            try:
                query_bytes = self._json_bytes(query) + (1 if chunk else 0)
            except UnicodeEncodeError:
                raise ValueError(f"queries[{position}] is not valid Unicode (a lone surrogate)") from None
            if chunk and (len(chunk) >= self.max_queries_per_request or size + query_bytes > self.max_request_bytes):
                chunks.append(chunk)
                chunk, size, query_bytes = [], overhead, query_bytes - 1
            chunk.append(query)
            size += query_bytes
        return chunks + [chunk] if chunk else chunks

    def _post_with_retries(self, payload: dict) -> object:
        attempts = self.retries + 1
        last_error = ""
        for attempt in range(attempts):
            if attempt:
                time.sleep(min(self.backoff * 2 ** (attempt - 1), self.max_backoff))
            try:
                response = self._client.post(self.url, json=payload)
            except httpx.TransportError as exc:
                last_error = f"{type(exc).__name__}: {exc}"
                continue
            if response.status_code in RETRYABLE_STATUS:
                last_error = f"HTTP {response.status_code}: {response.text[:200]}"
                continue
            if response.is_error:
                raise RetrievalError(f"{self.url} rejected the request: HTTP {response.status_code}: {response.text[:500]}")
            try:
                return response.json()
            except ValueError:
                raise RetrievalError(f"{self.url}: reply is not JSON: {response.text[:200]!r}") from None
        raise RetrievalError(f"retrieval service {self.url} failed after {attempts} attempts; last error: {last_error}")
