"""`DenseRetriever` with real MiniLM vectors and real faiss: exactness, resumable shards, guards."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from llds_jax.retrieval import Corpus, DenseRetriever, RetrievalError
from llds_jax.retrieval.dense import build_dense_index, faiss_file

pytestmark = pytest.mark.integration

DENSE_ROWS = 160
SHARD_SIZE = 64
PROBE_ROWS = (0, 70, 159)


@pytest.fixture(scope="module")
def dense_corpus(shared_corpus_path, tmp_path_factory):
    target = tmp_path_factory.mktemp("dense") / "wiki18_first160.jsonl"
    with open(shared_corpus_path, "rb") as src, open(target, "wb") as dst:
        dst.writelines(itertools.islice(src, DENSE_ROWS))
    return Corpus(target)


@pytest.fixture(scope="module")
def dense_index_dir(dense_corpus, make_embedder, tmp_path_factory):
    index_dir = tmp_path_factory.mktemp("dense_index")
    embedder = make_embedder(batch_size=32)
    for factory in ("Flat", "HNSW32"):
        build_dense_index(dense_corpus, embedder, index_dir, factory, SHARD_SIZE, "minilm", show_progress=False)
    return index_dir, embedder


def probe_queries(corpus):
    return [corpus.row(i)[1].split("\n", 1)[1][:160] for i in PROBE_ROWS]


def test_flat_scores_equal_the_exact_inner_products_of_the_stored_vectors(dense_index_dir, dense_corpus):
    index_dir, embedder = dense_index_dir
    retriever = DenseRetriever.load(index_dir, "Flat", embedder, dense_corpus)
    queries = probe_queries(dense_corpus)
    vectors = np.concatenate([np.load(p) for p in sorted((index_dir / "embeddings").glob("shard_*.npy"))])
    exact = embedder.encode_queries(queries) @ vectors.T
    for row, hits in zip(exact, retriever.search(queries, 5)):
        best = np.argsort(-row)[:5]
        assert [h.id for h in hits] == [dense_corpus.row(int(i))[0] for i in best]
        assert [h.score for h in hits] == pytest.approx(row[best].tolist(), abs=1e-5)


def test_a_passages_own_text_retrieves_it_first(dense_index_dir, dense_corpus):
    index_dir, embedder = dense_index_dir
    for factory in ("Flat", "HNSW32"):
        retriever = DenseRetriever.load(index_dir, factory, embedder, dense_corpus)
        tops = [hits[0].id for hits in retriever.search(probe_queries(dense_corpus), 3)]
        assert tops == [dense_corpus.row(i)[0] for i in PROBE_ROWS], factory


def test_an_interrupted_build_resumes_by_encoding_only_missing_shards(dense_index_dir, dense_corpus, tmp_path):
    index_dir, embedder = dense_index_dir
    copy = tmp_path / "copy"
    (copy / "embeddings").mkdir(parents=True)
    (copy / "meta.json").write_text((index_dir / "meta.json").read_text())
    kept = ["shard_00000.npy", "shard_00002.npy"]
    for name in kept:
        (copy / "embeddings" / name).write_bytes((index_dir / "embeddings" / name).read_bytes())
    stamps = {name: (copy / "embeddings" / name).stat().st_mtime_ns for name in kept}
    build_dense_index(dense_corpus, embedder, copy, "Flat", SHARD_SIZE, "minilm", show_progress=False)
    assert {name: (copy / "embeddings" / name).stat().st_mtime_ns for name in kept} == stamps
    rebuilt = np.load(copy / "embeddings" / "shard_00001.npy")
    assert np.abs(rebuilt - np.load(index_dir / "embeddings" / "shard_00001.npy")).max() <= 1e-5


def test_resuming_with_other_encoder_options_is_refused(dense_index_dir, dense_corpus, make_embedder):
    index_dir, _ = dense_index_dir
    prefixed = make_embedder(batch_size=32, passage_prefix="passage: ")
    with pytest.raises(RetrievalError, match="existing shards were built with other settings") as err:
        build_dense_index(dense_corpus, prefixed, index_dir, "Flat", SHARD_SIZE, "minilm", show_progress=False)
    assert "options:" in str(err.value) and "passage: " in str(err.value), "the message names what changed"
    assert "corpus_path" not in str(err.value), "only the differing settings are listed"
    assert json.loads((index_dir / "meta.json").read_text())["options"]["passage_prefix"] == ""


def test_resuming_through_a_relative_corpus_path_is_the_same_index(dense_index_dir, dense_corpus, monkeypatch):
    """The same corpus named relative to the working directory must not look like another corpus."""
    index_dir, embedder = dense_index_dir
    monkeypatch.chdir(dense_corpus.path.parent.parent)
    relative = Corpus(Path(dense_corpus.path.parent.name) / dense_corpus.path.name)
    build_dense_index(relative, embedder, index_dir, "Flat", SHARD_SIZE, "minilm", show_progress=False)
    assert json.loads((index_dir / "meta.json").read_text())["corpus_path"] == str(dense_corpus.path.resolve())


def test_index_over_another_corpus_size_is_refused(dense_index_dir, small_corpus):
    index_dir, embedder = dense_index_dir
    with pytest.raises(RetrievalError, match="160 vectors but corpus"):
        DenseRetriever.load(index_dir, "Flat", embedder, small_corpus)


def test_missing_factory_index_says_to_run_index_mode(dense_index_dir, dense_corpus):
    index_dir, embedder = dense_index_dir
    with pytest.raises(FileNotFoundError, match="--mode=index"):
        DenseRetriever.load(index_dir, "IVF8,PQ16", embedder, dense_corpus)
    assert faiss_file(index_dir, "IVF8,PQ16").name == "IVF8_PQ16.faiss"


def test_unknown_factory_string_is_refused_by_name(dense_index_dir, dense_corpus):
    index_dir, embedder = dense_index_dir
    with pytest.raises(ValueError, match="'Bogus99'"):
        build_dense_index(dense_corpus, embedder, index_dir, "Bogus99", SHARD_SIZE, "minilm", show_progress=False)


def test_a_shard_lock_held_by_a_live_worker_is_respected_and_a_dead_workers_lock_is_broken(tmp_path):
    import os
    import socket
    import subprocess
    import sys

    from llds_jax.retrieval.dense import _claim

    shard = tmp_path / "embeddings" / "shard_00000.npy"
    assert _claim(shard)
    assert not _claim(shard)  # our own live pid holds it
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (shard.parent / "shard_00000.npy.lock").write_text(f"{socket.gethostname()}:{finished.stdout.strip()}")
    assert _claim(shard)
    assert (shard.parent / "shard_00000.npy.lock").read_text() == f"{socket.gethostname()}:{os.getpid()}"
