"""A retriever view that cuts every passage to its first ``max_doc_tokens`` tokens.

Search-R1 feeds whole 100-word passages (≈130 tokens each, ≈480 for top-3) back to the
policy. On a CPU that feedback dominates sequence length and so the cost of every rollout
and update; cutting each doc to ≈60 tokens makes sequences ≈30% shorter and the answer is
usually in a passage's opening (docs/decisions.md, Retrieval). It is a *view*: the underlying
retriever, its ranking and the SPEC §2 doc format are unchanged, and the warm-up, RL and
evaluation all see the same cut: ``build_retriever`` applies it from ``retrieval.max_doc_tokens``
(0 = whole passages, the reference).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from llds_jax.retrieval.hit import Hit, Retriever


class ShortDocsRetriever:
    def __init__(self, retriever: Retriever, tokenizer, max_doc_tokens: int):
        if max_doc_tokens < 1:
            raise ValueError(f"retrieval.max_doc_tokens={max_doc_tokens} must be ≥ 1 (0 disables the view)")
        self.retriever, self.tokenizer, self.max_doc_tokens = retriever, tokenizer, max_doc_tokens

    def cut(self, hit: Hit) -> Hit:
        """The hit with its text (not its title line) cut to ``max_doc_tokens`` tokens."""
        ids = self.tokenizer.encode(hit.text, add_special_tokens=False)
        if len(ids) <= self.max_doc_tokens:
            return hit
        return dataclasses.replace(hit, contents=f"{hit.title}\n{self.tokenizer.decode(ids[:self.max_doc_tokens])}")

    def search(self, queries: Sequence[str], topk: int) -> list[list[Hit]]:
        return [[self.cut(hit) for hit in row] for row in self.retriever.search(queries, topk)]


def maybe_short_docs(retriever: Retriever, tokenizer, max_doc_tokens: int) -> Retriever:
    return ShortDocsRetriever(retriever, tokenizer, max_doc_tokens) if max_doc_tokens else retriever
