"""One retrieved passage, the `Retriever` interface the rollout sees, and Search-R1's doc text.

The rollout never learns which retriever answered: BM25, dense or HTTP all return
``list[list[Hit]]`` (one best-first list per query), and `format_docs` turns one list
into the exact text Search-R1's trainer puts inside ``<information>…</information>``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


class RetrievalError(RuntimeError):
    """A retriever could not answer (service unreachable, bad reply, corrupt index)."""


@dataclass(frozen=True)
class Hit:
    """A corpus row as retrieved: ``contents`` is ``"Title"\\ntext`` in wiki-18 / FlashRAG corpora.

    ``title`` and ``text`` split ``contents`` exactly as Search-R1's ``_passages2string``
    (search_r1/llm_agent/generation.py) does: the title is the whole first line, *quotes
    kept* (wiki-18 titles are written ``"Title"``, so the model sees
    ``Doc 1(Title: "Title") …``); the text is everything after the first ``\\n``.
    ``bare_title`` strips the quotes, as the reference server's BM25 branch does for its
    ``title`` field, for display and answer checks — never for the model's input.
    """

    id: str
    contents: str
    score: float

    @property
    def title(self) -> str:
        return self.contents.split("\n", 1)[0]

    @property
    def text(self) -> str:
        return self.contents.partition("\n")[2]

    @property
    def bare_title(self) -> str:
        return self.title.strip('"')


def format_docs(hits: Sequence[Hit]) -> str:
    """Search-R1's doc block: ``Doc {i}(Title: {title}) {text}\\n`` per hit, i from 1.

    The caller wraps it as ``\\n\\n<information>`` + this + ``</information>\\n\\n``.
    """
    return "".join(f"Doc {i}(Title: {hit.title}) {hit.text}\n" for i, hit in enumerate(hits, start=1))


@runtime_checkable
class Retriever(Protocol):
    """Anything that answers a batch of queries with the top-``topk`` hits per query, best first."""

    def search(self, queries: Sequence[str], topk: int) -> list[list[Hit]]: ...


def check_search_args(queries: Sequence[str], topk: int) -> list[str]:
    """Reject what would otherwise fail deep inside bm25s/faiss with an unhelpful message.

    A bare ``str`` is refused because iterating it would silently search each character.
    """
    if isinstance(queries, str):
        raise TypeError("queries must be a sequence of strings, got a single str (wrap it in a list)")
    queries = list(queries)
    for position, query in enumerate(queries):
        if not isinstance(query, str):
            raise TypeError(f"queries[{position}] must be str, got {type(query).__name__}")
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk must be a positive int, got {topk!r}")
    return queries
