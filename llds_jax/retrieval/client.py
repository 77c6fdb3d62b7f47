"""`HttpRetriever`: the `Retriever` interface over a Search-R1-compatible ``/retrieve`` service.

The reference trainer calls ``requests.post(url, json=payload).json()`` with no timeout
and no retry, so a restarting server kills a multi-day run with a JSONDecodeError
(Search-R1 #43). Here transport failures, 5xx and 429 are retried with exponential
backoff; a 4xx is the caller's bug and fails at once with the server's message; after
the last attempt the error names the URL, the attempts and the last cause.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import httpx

from llds_jax.retrieval.hit import Hit, RetrievalError, check_search_args

RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})


def retrieve_url(url: str) -> str:
    """Accept the service root or Search-R1's ``search_url`` (which already ends in /retrieve)."""
    url = url.rstrip("/")
    return url if url.endswith("/retrieve") else url + "/retrieve"


def _parse_hit(item: object, rank: int) -> Hit:
    """One hit as any Search-R1-style server writes it.

    ``{"document": {...}, "score": s}`` (``return_scores``) or a bare document. Documents carry
    ``contents`` and, from our server and the official dense one, ``id``; the official BM25
    server writes ``{"title", "text", "contents"}`` with no ``id``: the rank stands in for it.
    """
    document, score = (item["document"], item["score"]) if isinstance(item, dict) and "document" in item else (item, 0.0)
    contents = document["contents"]
    if not isinstance(contents, str):
        raise TypeError(f"'contents' is {type(contents).__name__}, not a string")
    return Hit(id=str(document.get("id", rank)), contents=contents, score=float(score))


def _parse_hits(payload: object, expected: int, url: str) -> list[list[Hit]]:
    if not isinstance(payload, dict) or not isinstance(payload.get("result"), list):
        raise RetrievalError(f"{url}: reply has no 'result' list: {str(payload)[:200]}")
    result = payload["result"]
    if len(result) != expected:
        raise RetrievalError(f"{url}: {len(result)} result lists for {expected} queries")
    try:
        return [[_parse_hit(item, rank) for rank, item in enumerate(hits)] for hits in result]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise RetrievalError(f"{url}: malformed hit in reply ({exc!r}): {str(result)[:200]}") from None


class HttpRetriever:
    """Searches a remote service; thread-safe (one pooled ``httpx.Client``)."""

    def __init__(self, url: str, timeout: float = 30.0, retries: int = 5, backoff: float = 0.5,
                 max_backoff: float = 10.0, max_queries_per_request: int = 512):
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.url = retrieve_url(url)
        self.retries = retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.max_queries_per_request = max_queries_per_request
        self._client = httpx.Client(timeout=timeout)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> HttpRetriever:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def search(self, queries: Sequence[str], topk: int) -> list[list[Hit]]:
        """Long query lists are sent in chunks that fit the service's per-request limit."""
        queries = check_search_args(queries, topk)
        results: list[list[Hit]] = []
        for start in range(0, len(queries), self.max_queries_per_request):
            chunk = queries[start : start + self.max_queries_per_request]
            payload = {"queries": chunk, "topk": topk, "return_scores": True}
            results.extend(_parse_hits(self._post_with_retries(payload), len(chunk), self.url))
        return results

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
