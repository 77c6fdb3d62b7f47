"""The Search-R1 retrieval service: ``POST /retrieve`` and ``GET /health`` over any `Retriever`.

Wire format (SPEC §6, what Search-R1's trainer sends and parses):
request ``{"queries": [str], "topk": int | null, "return_scores": bool}``;
response ``{"result": [[{"document": {"id", "contents"}, "score"}, …], …]}`` per query,
best first, or bare ``{"id", "contents"}`` documents when ``return_scores`` is false
(the reference server crashes on that case: it unpacks a tuple it never built).

An empty ``queries`` list gets ``{"result": []}``, as from the official server: Search-R1's
trainer posts one on every search-enabled turn in which no row searches (a policy that
stopped searching, the collapse this project studies, does that every turn).

Robustness is the point of this module: a malformed request gets a 4xx naming the field,
never a 500 and never a dropped connection (Search-R1 #43: a dead server surfaces in the
trainer as a JSONDecodeError); only a failing retriever is a 500, which the client retries.
The body is parsed here, not by FastAPI: its validation handler echoes the offending value,
which cannot be rendered when it is NaN, ±Infinity, 1e309 or a lone surrogate (a 500 that
also drops the keep-alive connection) and which makes a 10 MB wrong-typed body come back
whole. Here such values are found after a strict parse and named by field path; replies are
short and never echo input. Size is limited by bytes (``max_request_bytes``, 413), not by a
small query count: the paper's batch is 512 prompts × 5 samples = 2,560 queries in one request.

Concurrent requests are coalesced by `MicroBatcher` into one ``retriever.search`` call, so
the dense encoder sees one large batch instead of many batches of one (FlashRAG #4: query
encoding dominates latency).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import socket
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, StrictBool, StrictInt, StrictStr, ValidationError
from starlette.requests import ClientDisconnect

from llds_jax.retrieval.hit import Hit, Retriever

logger = logging.getLogger(__name__)

READY_BANNER = "llds_jax retrieval service listening on"


@dataclass(frozen=True)
class ServiceLimits:
    """Bounds that keep one request from monopolising (or crashing) the service."""

    default_topk: int = 3
    max_topk: int = 100
    max_queries: int = 65_536  # 25x the paper's 2,560-query batch; a count far past it is an error
    # A query is at most one 500-token turn; Qwen2.5's longest token is 128 characters (a run of
    # spaces), so a degenerate policy's query stays under 500 x 128 = 64,000 characters.
    max_query_chars: int = 65_536
    max_batch_queries: int = 4096
    # The binding limit: 2,560 queries averaging 13,000 characters (26 per token of a 500-token turn).
    max_request_bytes: int = 32 * 2**20


class RetrieveRequest(BaseModel):
    """Strict types: ``"3"`` for topk or ``1`` for a query is a client bug worth a 422, not a guess."""

    queries: list[StrictStr]
    topk: StrictInt | None = None
    return_scores: StrictBool = False


@dataclass
class _Pending:
    queries: list[str]
    topk: int
    future: asyncio.Future = field(repr=False)


class MicroBatcher:
    """Serialises retriever calls on one worker thread and coalesces whatever queued meanwhile.

    No added waiting: an idle service answers a lone request at once; under load, every
    request that arrived during the previous call joins the next one (up to
    ``max_batch_queries``), searched with the largest topk and cut back per request.
    One worker thread also means the retriever never has to be thread-safe.
    """

    def __init__(self, retriever: Retriever, max_batch_queries: int):
        self.retriever = retriever
        self.max_batch_queries = max_batch_queries
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="retriever")
        self.batch_sizes: list[int] = []

    async def search(self, queries: list[str], topk: int) -> list[list[Hit]]:
        pending = _Pending(queries, topk, asyncio.get_running_loop().create_future())
        await self._queue.put(pending)
        return await pending.future

    def _drain(self, first: _Pending) -> list[_Pending]:
        batch, size = [first], len(first.queries)
        while size < self.max_batch_queries and not self._queue.empty():
            item = self._queue.get_nowait()
            batch.append(item)
            size += len(item.queries)
        return batch

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = self._drain(await self._queue.get())
            queries = [q for item in batch for q in item.queries]
            topk = max(item.topk for item in batch)
            self.batch_sizes.append(len(queries))
            try:
                results = await loop.run_in_executor(self._executor, self.retriever.search, queries, topk)
            except Exception as exc:  # the failure belongs to these requests, not to the service
                logger.exception("retriever failed on a batch of %d queries", len(queries))
                for item in batch:
                    if not item.future.done():
                        item.future.set_exception(exc)
                continue
            start = 0
            for item in batch:
                part = [hits[: item.topk] for hits in results[start : start + len(item.queries)]]
                start += len(item.queries)
                if not item.future.done():
                    item.future.set_result(part)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class RequestError(Exception):
    """A bad request: its HTTP status and a short message naming the field (never the input)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class _NotJson:
    """Stands in for a value strict JSON cannot carry, so the error can name the field it sat in."""

    def __init__(self, reason: str):
        self.reason = reason


MAX_INTEGER_DIGITS = 20  # past int64; also keeps Python's 4,300-digit int conversion error (a 500) unreachable
_SURROGATE = re.compile("[\ud800-\udfff]")
_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,39}")


def _constant(name: str) -> _NotJson:
    return _NotJson(f"{name} is not JSON (RFC 8259 has no NaN or Infinity)")


def _float(text: str) -> float | _NotJson:
    value = float(text)
    return _NotJson("a number beyond the 64-bit float range") if math.isinf(value) else value


def _int(text: str) -> int | _NotJson:
    digits = len(text.lstrip("-"))
    return _NotJson(f"an integer of {digits} digits, past 64 bits") if digits > MAX_INTEGER_DIGITS else int(text)


def _key_name(key: str) -> str:
    """A key as it may appear in an error: a short plain name verbatim, anything else described."""
    return key if _PLAIN_KEY.fullmatch(key) else f"<a key of {len(key)} characters>"


def _first_unrenderable(payload: object) -> tuple[str, str] | None:
    """(field path, reason) of the first NaN/±Infinity/overflowing number or lone surrogate, if any.

    Invalid UTF-8 arrives here as lone surrogates (the body is decoded with ``surrogateescape``),
    so one walk names the field for every value that cannot be rendered back as JSON.
    Iterative: ``json.loads`` already bounded the depth, this must not add recursion of its own.
    """
    stack: list[tuple[str, object]] = [("", payload)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, _NotJson):
            return path or "body", value.reason
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return path or "body", "not valid Unicode (invalid UTF-8 or a lone surrogate)"
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in reversed(list(enumerate(value))))
        elif isinstance(value, dict):
            for key, item in reversed(list(value.items())):
                name = _key_name(key)
                if _SURROGATE.search(key):
                    return f"{path}.{name}" if path else name, "a key is not valid Unicode"
                stack.append((f"{path}.{name}" if path else name, item))
    return None


def _field_path(location: tuple) -> str:
    path = ""
    for part in location:
        part = part if isinstance(part, int) else _key_name(str(part))
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else part)
    return path or "body"


@dataclass(frozen=True)
class SearchRequest:
    """A request that passed every check: what the batcher searches and how the reply is shaped."""

    queries: list[str]
    topk: int
    return_scores: bool


def parse_request(body: bytes, limits: ServiceLimits) -> SearchRequest:
    """Strict JSON, then sizes, then types, then ranges; every failure is a short `RequestError`.

    Order matters for cost: the query count is checked before the walk and pydantic, so a
    million-element list is refused without a million paths or validation errors.
    """
    text = body.decode("utf-8", errors="surrogateescape")
    try:
        payload = json.loads(text, parse_constant=_constant, parse_float=_float, parse_int=_int)
    except json.JSONDecodeError as err:
        raise RequestError(400, f"body: not valid JSON ({err.msg} at line {err.lineno} column {err.colno})") from None
    except RecursionError:
        raise RequestError(400, "body: JSON nested too deeply") from None
    queries = payload.get("queries") if isinstance(payload, dict) else None
    if isinstance(queries, list) and len(queries) > limits.max_queries:
        raise RequestError(413, f"queries: {len(queries)} queries exceed the limit of {limits.max_queries} per request")
    unrenderable = _first_unrenderable(payload)
    if unrenderable is not None:
        raise RequestError(400, f"{unrenderable[0]}: {unrenderable[1]}")
    if not isinstance(payload, dict):
        raise RequestError(422, f"body: expected a JSON object with 'queries', got {type(payload).__name__}")
    try:
        request = RetrieveRequest.model_validate(payload)
    except ValidationError as err:
        problems = [f"{_field_path(e['loc'])}: {e['msg'][:120]}" for e in err.errors(include_input=False)[:5]]
        more = f" (+{err.error_count() - 5} more)" if err.error_count() > 5 else ""
        raise RequestError(422, "; ".join(problems) + more) from None
    for position, query in enumerate(request.queries):
        if len(query) > limits.max_query_chars:
            raise RequestError(
                422, f"queries[{position}]: {len(query)} characters exceed the limit of {limits.max_query_chars}")
    topk = limits.default_topk if request.topk is None else request.topk
    if not 1 <= topk <= limits.max_topk:
        raise RequestError(422, f"topk: must be between 1 and {limits.max_topk}, got {topk}")
    return SearchRequest(list(request.queries), topk, request.return_scores)


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it is known to exceed ``limit`` bytes, chunked or not."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(413, f"body: {int(declared)} bytes exceed the limit of {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(413, f"body: more than {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _to_wire(results: Sequence[Sequence[Hit]], return_scores: bool) -> list[list[dict]]:
    if return_scores:
        return [[{"document": {"id": h.id, "contents": h.contents}, "score": h.score} for h in hits] for hits in results]
    return [[{"id": h.id, "contents": h.contents} for h in hits] for hits in results]


def create_app(retriever: Retriever, limits: ServiceLimits = ServiceLimits(), description: str = "",
               on_ready: Callable[[], None] | None = None) -> FastAPI:
    """The ASGI app; the batcher's worker task lives exactly as long as the app's lifespan."""
    batcher = MicroBatcher(retriever, limits.max_batch_queries)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        worker = asyncio.create_task(batcher.run())
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:
            worker.cancel()
            batcher.close()

    app = FastAPI(title="llds_jax retrieval", lifespan=lifespan)
    app.state.batcher = batcher

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "retriever": description or type(retriever).__name__}

    @app.post("/retrieve")
    async def retrieve(request: Request) -> JSONResponse:
        try:
            parsed = parse_request(await _read_body(request, limits.max_request_bytes), limits)
        except RequestError as err:
            return JSONResponse({"detail": err.message}, status_code=err.status)
        except ClientDisconnect:
            return JSONResponse({"detail": "body: the client disconnected mid-request"}, status_code=400)
        if not parsed.queries:  # the official server's reply; nothing to search
            return JSONResponse({"result": []})
        try:
            results = await batcher.search(parsed.queries, parsed.topk)
        except Exception as exc:  # logged by the batcher; a JSON 500 keeps the connection, the client retries
            return JSONResponse({"detail": f"retriever failed: {type(exc).__name__}"}, status_code=500)
        return JSONResponse({"result": _to_wire(results, parsed.return_scores)})

    return app


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind and listen before uvicorn starts: ``port=0`` yields a free port we can announce with
    no race, and a client that connects during startup waits in the backlog instead of being refused."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def serve(retriever: Retriever, host: str, port: int, limits: ServiceLimits = ServiceLimits(),
          description: str = "") -> None:
    """Run until SIGINT/SIGTERM; prints ``READY_BANNER http://host:port`` once the app is up."""
    sock = bind_socket(host, port)
    url = f"http://{host}:{sock.getsockname()[1]}"
    app = create_app(retriever, limits, description, on_ready=lambda: print(f"{READY_BANNER} {url}", flush=True))
    config = uvicorn.Config(app, log_level="warning", access_log=False)
    uvicorn.Server(config).run(sockets=[sock])
