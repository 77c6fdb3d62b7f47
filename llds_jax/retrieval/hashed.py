"""A fast deterministic text embedder: hashed bag of words through a fixed random projection.

Checking the mesh index id for id against faiss needs thousands of queries over thousands
of passages; the BERT encoder takes minutes for that on a CPU, and the check is about the
search, not the encoder. This embedder has the `TextEmbedder` surface the retrievers use
(``dim``, ``encode_queries``, ``encode_passages``) and gives unit vectors in milliseconds,
with real near-ties between related texts (shared words). Not a retrieval model: recall is
whatever word overlap gives.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

WORD = re.compile(r"\w+")
BUNDLED = Path(__file__).resolve().parents[1] / "data" / "bundled"


class HashedEmbedder:
    """``dim``-d unit vectors: the sum of one fixed Gaussian row per word (row = crc32(word) mod ``buckets``)."""

    def __init__(self, dim: int = 768, buckets: int = 1 << 15, seed: int = 0):
        self.dim = dim
        self.table = np.random.default_rng(seed).standard_normal((buckets, dim)).astype(np.float32)

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        if isinstance(texts, str):
            raise TypeError("encode expects a sequence of strings, got a single str")
        vectors = np.zeros((len(texts), self.dim), np.float32)
        for row, text in enumerate(texts):
            rows = [zlib.crc32(word.encode()) % len(self.table) for word in WORD.findall(text.lower())]
            if rows:
                vectors[row] = self.table[rows].sum(axis=0)
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        return vectors / np.where(norms > 0, norms, 1)  # a text with no word is the zero vector

    encode_queries = encode
    encode_passages = encode


def bundled_queries(corpus, count: int) -> list[str]:
    """Every bundled question (NQ train/dev, HotpotQA: 803), then a 12-word window from every 5th
    passage of ``corpus``, until ``count`` queries: the ≥ 1,000-query agreement check's queries."""
    queries = [json.loads(line)["question"] for name in ("nq_train", "nq_dev", "hotpotqa_train")
               for line in (BUNDLED / f"{name}.jsonl").read_text().splitlines() if line.strip()][:count]
    for row in range(0, len(corpus), 5):
        if len(queries) >= count:
            break
        words = corpus.row(row)[1].split()
        queries.append(" ".join(words[len(words) // 3 : len(words) // 3 + 12]))
    return queries
