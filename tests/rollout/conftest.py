"""A real BM25 retriever over the shared wiki-18 cut (≈31k passages, built once per session)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def bm25(shared_dir):
    from llds_jax.retrieval import BM25Retriever, Corpus

    return BM25Retriever.build(Corpus(shared_dir / "data" / "corpus" / "wiki18_subset.jsonl"))


class RecordingRetriever:
    """Wraps a retriever and records every batched call (queries, topk)."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[tuple[list[str], int]] = []

    def search(self, queries, topk):
        self.calls.append((list(queries), topk))
        return self.inner.search(queries, topk)


@pytest.fixture
def recording_bm25(bm25):
    return RecordingRetriever(bm25)
