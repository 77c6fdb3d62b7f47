"""`MicroBatcher`: concurrent requests become one retriever call and each gets exactly its own hits."""

from __future__ import annotations

import asyncio

import pytest

from llds_jax.retrieval.server import MicroBatcher

pytestmark = pytest.mark.unit


def test_requests_queued_together_are_searched_in_one_call_and_split_back(small_bm25):
    requests = [(["tamil film", "nobel prize"], 2), (["river"], 5), (["football club", "album", "war"], 1)]

    async def scenario():
        batcher = MicroBatcher(small_bm25, max_batch_queries=64)
        worker = asyncio.create_task(batcher.run())
        try:
            replies = await asyncio.gather(*(batcher.search(q, k) for q, k in requests))
        finally:
            worker.cancel()
            batcher.close()
        return batcher.batch_sizes, replies

    batch_sizes, replies = asyncio.run(scenario())
    assert batch_sizes == [6]
    for (queries, topk), reply in zip(requests, replies):
        assert reply == small_bm25.search(queries, topk)


def test_a_batch_stops_taking_requests_once_it_reaches_the_query_limit(small_bm25):
    async def scenario():
        batcher = MicroBatcher(small_bm25, max_batch_queries=3)
        worker = asyncio.create_task(batcher.run())
        try:
            await asyncio.gather(*(batcher.search([f"q{i}", "film"], 1) for i in range(4)))
        finally:
            worker.cancel()
            batcher.close()
        return batcher.batch_sizes

    assert asyncio.run(scenario()) == [4, 4]


def test_a_failing_search_fails_only_its_batch_and_the_worker_survives(small_bm25):
    async def scenario():
        batcher = MicroBatcher(small_bm25, max_batch_queries=64)
        worker = asyncio.create_task(batcher.run())
        try:
            failed = await asyncio.gather(batcher.search(["q"], 0), return_exceptions=True)
            ok = await batcher.search(["film"], 1)
        finally:
            worker.cancel()
            batcher.close()
        return failed, ok

    failed, ok = asyncio.run(scenario())
    assert isinstance(failed[0], ValueError) and len(ok[0]) == 1
