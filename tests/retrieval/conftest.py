"""Shared corpus cuts: real wiki-18 passages, small enough that every test builds its own index."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

SMALL_CORPUS_ROWS = 2000


@pytest.fixture(scope="session")
def shared_corpus_path(shared_dir) -> Path:
    return shared_dir / "data" / "corpus" / "wiki18_subset.jsonl"


@pytest.fixture(scope="session")
def small_corpus_path(shared_corpus_path, tmp_path_factory) -> Path:
    """The first 2,000 rows of the shared corpus, in a writable directory (offsets go beside it)."""
    target = tmp_path_factory.mktemp("corpus") / "wiki18_first2000.jsonl"
    with open(shared_corpus_path, "rb") as src, open(target, "wb") as dst:
        dst.writelines(itertools.islice(src, SMALL_CORPUS_ROWS))
    return target


@pytest.fixture(scope="session")
def small_corpus(small_corpus_path):
    from llds_jax.retrieval import Corpus

    return Corpus(small_corpus_path)


@pytest.fixture(scope="session")
def small_bm25(small_corpus):
    from llds_jax.retrieval import BM25Retriever

    return BM25Retriever.build(small_corpus)


@pytest.fixture(scope="session")
def minilm_model():
    """Real all-MiniLM-L6-v2 weights, loaded once (each `TextEmbedder` over it compiles its own shapes)."""
    from llds_jax.models.encoder_weights import load_bert_encoder
    from llds_jax.utils.assets import minilm_dir

    return load_bert_encoder(minilm_dir())


@pytest.fixture(scope="session")
def make_embedder(minilm_model):
    from tokenizers import Tokenizer

    from llds_jax.retrieval.embedder import EmbedderOptions, TextEmbedder
    from llds_jax.utils.assets import minilm_dir

    def make(**options) -> TextEmbedder:
        tokenizer = Tokenizer.from_file(str(minilm_dir() / "tokenizer.json"))
        return TextEmbedder(minilm_model, tokenizer, EmbedderOptions(**options))

    return make


@pytest.fixture(scope="session")
def minilm_embedder(make_embedder):
    return make_embedder(batch_size=8)
