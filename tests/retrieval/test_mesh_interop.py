"""``retrieval.method="mesh"`` through the real MiniLM encoder: Search-R1's ``e5_Flat.index``, our own
index directories, the rollout's feedback, ``--mode=serve``, and the bad inputs of issue #59 point 5."""

from __future__ import annotations

import itertools
import signal

import faiss
import numpy as np
import pytest
from fastapi.testclient import TestClient

from llds_jax.retrieval import Corpus, DenseRetriever, build_retriever, default_retrieval_config
from llds_jax.retrieval.config import BUNDLED_CORPUS, RetrievalConfigError, validate
from llds_jax.retrieval.dense import build_dense_index
from llds_jax.retrieval.mesh import MeshIndexError, MeshRetriever, read_faiss_flat
from llds_jax.rollout.protocol import batch_search_feedback

pytestmark = pytest.mark.integration

ROWS = 64
QUERIES = ["what carries blood away from the heart", "nobel prize in physics", "", "film director " * 5]


@pytest.fixture(scope="module")
def mini(tmp_path_factory, make_embedder):
    """64 bundled passages embedded by MiniLM into our index dir (3 shards), plus Search-R1's
    ``e5_Flat.index`` written from the same vectors as its ``index_builder.py`` writes it."""
    folder = tmp_path_factory.mktemp("mesh_interop")
    corpus_path = folder / "wiki-18.jsonl"
    with open(BUNDLED_CORPUS, "rb") as src, open(corpus_path, "wb") as dst:
        dst.writelines(itertools.islice(src, ROWS))
    corpus, embedder = Corpus(corpus_path), make_embedder(batch_size=32)
    index_dir = folder / "index"
    build_dense_index(corpus, embedder, index_dir, "Flat", 24, "minilm", show_progress=False)
    vectors = np.concatenate([np.load(p) for p in sorted((index_dir / "embeddings").glob("shard_*.npy"))])
    e5_flat = folder / "e5_Flat.index"
    write_flat(vectors, e5_flat)
    return {"corpus": corpus, "embedder": embedder, "index_dir": index_dir, "e5_flat": e5_flat, "vectors": vectors,
            "dense": DenseRetriever.load(index_dir, "Flat", embedder, corpus)}


def write_flat(vectors: np.ndarray, path, metric=faiss.METRIC_INNER_PRODUCT) -> None:
    index = faiss.index_factory(vectors.shape[1], "Flat", metric)
    index.add(np.ascontiguousarray(vectors, dtype=np.float32))
    faiss.write_index(index, str(path))


def mesh_config(mini, **fields):
    r = default_retrieval_config()
    r.method, r.corpus_path, r.batch_size = "mesh", str(mini["corpus"].path), 32
    for key, value in fields.items():
        setattr(r, key, str(value) if hasattr(value, "parent") else value)
    return r


def assert_same_hits(got, want):
    assert [[h.id for h in hits] for hits in got] == [[h.id for h in hits] for hits in want]
    assert [[h.contents for h in hits] for hits in got] == [[h.contents for h in hits] for hits in want]
    for g, w in zip(got, want):
        assert [h.score for h in g] == pytest.approx([h.score for h in w], abs=1e-5)


@pytest.fixture(scope="module")
def mesh_from_e5_flat(mini):
    return build_retriever(mesh_config(mini, mesh_index_file=mini["e5_flat"]))


def test_an_e5_flat_index_file_loads_and_answers_as_faiss_flat(mini, mesh_from_e5_flat):
    vectors, owner = read_faiss_flat(mini["e5_flat"])
    np.testing.assert_array_equal(vectors, mini["vectors"])
    assert isinstance(mesh_from_e5_flat, MeshRetriever) and mesh_from_e5_flat.index.num_shards == 8
    assert_same_hits(mesh_from_e5_flat.search(QUERIES, 5), mini["dense"].search(QUERIES, 5))


def test_the_rollouts_feedback_equals_the_faiss_flat_runs(mini, mesh_from_e5_flat):
    """The rollout's one batched call per turn (`batch_search_feedback`) gives the same text."""
    assert batch_search_feedback(mesh_from_e5_flat, QUERIES, 3) == batch_search_feedback(mini["dense"], QUERIES, 3)


def test_our_own_index_directory_serves_the_mesh_index(mini):
    retriever = build_retriever(mesh_config(mini, index_path=mini["index_dir"], mesh_dtype="bfloat16"))
    assert retriever.index.dtype_name == "bfloat16"
    got, want = retriever.search(QUERIES, 3), mini["dense"].search(QUERIES, 3)
    assert [hits[0].id for hits in got] == [hits[0].id for hits in want]
    for g, w in zip(got, want):
        assert [h.score for h in g] == pytest.approx([h.score for h in w], abs=2 * 2**-8)


def test_empty_and_65536_character_queries_answer_as_the_dense_path(mini, mesh_from_e5_flat):
    """An empty query is encoded like any other (prefix only); a huge one is cut at max_length tokens."""
    huge = ("who directed the tamil film " * 3000)[:65_536]
    for queries in ([""], [huge], [huge, "", "heart"]):
        got = mesh_from_e5_flat.search(queries, 3)
        assert [len(hits) for hits in got] == [3] * len(queries)
        assert_same_hits(got, mini["dense"].search(queries, 3))
    assert mesh_from_e5_flat.search([], 3) == []
    with pytest.raises(TypeError, match="single str"):
        mesh_from_e5_flat.search("heart", 3)


def test_k_larger_than_the_corpus_returns_every_passage_once(mesh_from_e5_flat):
    (hits,) = mesh_from_e5_flat.search(["heart"], 1000)
    assert len(hits) == ROWS and len({h.id for h in hits}) == ROWS


def test_mode_serve_serves_the_mesh_index_over_post_retrieve(mini, monkeypatch):
    from llds_jax.retrieval import cli
    from llds_jax.retrieval.server import create_app

    served = {}
    monkeypatch.setattr(cli, "serve", lambda retriever, *args, **kwargs: served.setdefault("retriever", retriever))
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        cli.serve_main(type("Config", (), {"retrieval": mesh_config(mini, mesh_index_file=mini["e5_flat"])}))
    finally:
        for stop, handler in handlers.items():
            signal.signal(stop, handler)
    assert isinstance(served["retriever"], MeshRetriever)
    with TestClient(create_app(served["retriever"])) as client:
        reply = client.post("/retrieve", json={"queries": QUERIES[:2], "topk": 3, "return_scores": True})
    assert reply.status_code == 200, reply.text
    want = mini["dense"].search(QUERIES[:2], 3)
    assert [[h["document"]["id"] for h in hits] for hits in reply.json()["result"]] == [[h.id for h in w] for w in want]


def test_an_index_whose_count_or_dimension_does_not_match_is_refused_by_file_and_field(mini, tmp_path):
    short = tmp_path / "e5_Flat.index"
    write_flat(mini["vectors"][:-1], short)
    with pytest.raises(MeshIndexError, match=rf"{short}: ntotal={ROWS - 1} vectors but corpus .*has {ROWS} rows"):
        build_retriever(mesh_config(mini, mesh_index_file=short))
    narrow = tmp_path / "narrow.index"
    write_flat(mini["vectors"][:, :16], narrow)
    with pytest.raises(MeshIndexError, match=rf"{narrow}: dimension d=16 but the encoder .* produces 384-d"):
        build_retriever(mesh_config(mini, mesh_index_file=narrow))


def test_files_that_are_not_an_exact_inner_product_flat_index_are_refused_by_name(mini, tmp_path):
    l2 = tmp_path / "l2.index"
    write_flat(mini["vectors"], l2, faiss.METRIC_L2)
    hnsw = tmp_path / "hnsw.index"
    index = faiss.index_factory(384, "HNSW32", faiss.METRIC_INNER_PRODUCT)
    index.add(mini["vectors"])
    faiss.write_index(index, str(hnsw))
    garbage = tmp_path / "garbage.index"
    garbage.write_bytes(b"not a faiss file at all")
    for path, message in ((l2, "metric_type=1 is not METRIC_INNER_PRODUCT"), (hnsw, "IndexHNSWFlat, not an exact Flat"),
                          (garbage, "not a faiss index file"), (tmp_path / "missing.index", "no such file")):
        with pytest.raises(MeshIndexError, match=message):
            read_faiss_flat(path)


def test_an_unfinished_index_directory_is_refused_before_anything_is_placed(mini, tmp_path):
    (tmp_path / "embeddings").mkdir()
    (tmp_path / "meta.json").write_text((mini["index_dir"] / "meta.json").read_text())
    (tmp_path / "embeddings" / "shard_00000.npy").write_bytes((mini["index_dir"] / "embeddings" / "shard_00000.npy")
                                                              .read_bytes())
    with pytest.raises(MeshIndexError, match="1 shard files but meta.json's num_docs=64 needs 3"):
        build_retriever(mesh_config(mini, index_path=tmp_path))
    with pytest.raises(FileNotFoundError, match="--mode=index"):
        build_retriever(mesh_config(mini, index_path=tmp_path / "nothing"))


@pytest.mark.unit
def test_config_values_are_checked_by_field():
    r = default_retrieval_config()
    r.method = "mesh"
    validate(r)
    r.mesh_dtype = "float16"
    with pytest.raises(RetrievalConfigError, match="retrieval.mesh_dtype='float16'"):
        validate(r)
    r.mesh_dtype, r.mesh_chunk = "bfloat16", 0
    with pytest.raises(RetrievalConfigError, match="retrieval.mesh_chunk=0"):
        validate(r)
