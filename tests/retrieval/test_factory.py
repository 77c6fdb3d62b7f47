"""`build_retriever` and the config: what the trainer gets for each ``retrieval`` section."""

from __future__ import annotations

import importlib.util

import pytest

from llds_jax.retrieval import (
    BM25Retriever,
    HttpRetriever,
    Retriever,
    build_retriever,
    default_retrieval_config,
)
from llds_jax.retrieval.config import resolve_index_path

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLDS_JAX_CACHE", str(tmp_path / "cache"))


def test_config_has_every_field_the_cli_and_trainer_read():
    r = default_retrieval_config()
    for field in ("method", "corpus_path", "index_path", "encoder_path", "faiss_factory", "topk", "host", "port",
                  "query_prefix", "passage_prefix", "pooling", "batch_size", "url", "timeout", "retries", "backoff"):
        assert field in r, field
    assert r.host == "127.0.0.1" and r.method == "bm25"


def test_configs_retriever_py_wraps_the_defaults_in_a_retrieval_section():
    from .service_process import REPO

    spec = importlib.util.spec_from_file_location("retriever_config", REPO / "configs" / "retriever.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    assert config.retrieval.to_dict() == default_retrieval_config().to_dict()


def test_bm25_without_an_index_is_built_once_and_cached(small_corpus_path):
    r = default_retrieval_config()
    r.corpus_path = str(small_corpus_path)
    retriever = build_retriever(r)
    assert isinstance(retriever, BM25Retriever) and isinstance(retriever, Retriever)
    assert BM25Retriever.exists(resolve_index_path(r))
    assert build_retriever(r).search(["film"], 2) == retriever.search(["film"], 2)


def test_a_url_selects_the_http_client_whatever_the_method():
    r = default_retrieval_config()
    r.url = "http://127.0.0.1:9/"
    r.method = "dense"
    retriever = build_retriever(r)
    assert isinstance(retriever, HttpRetriever) and retriever.url == "http://127.0.0.1:9/retrieve"
    retriever.close()


def test_unknown_method_is_refused_by_name():
    r = default_retrieval_config()
    r.method = "splade"
    with pytest.raises(ValueError, match="splade"):
        build_retriever(r)
