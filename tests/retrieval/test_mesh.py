"""`MeshIndex` against faiss ``IndexFlatIP`` on the same vectors: ids id for id, on 1 and 8 devices.

The 1,000-query check uses `HashedEmbedder` vectors of the bundled corpus (the BERT encoder
would take minutes on a CPU and the check is about the search); the real encoder path is
covered in ``test_mesh_interop.py``.
"""

from __future__ import annotations

import faiss
import jax
import numpy as np
import pytest

from llds_jax.retrieval import Corpus
from llds_jax.retrieval.config import BUNDLED_CORPUS
from llds_jax.retrieval.hashed import HashedEmbedder, bundled_queries
from llds_jax.retrieval.mesh import MeshIndex, MeshIndexError

pytestmark = pytest.mark.unit

MIN_QUERIES = 1000


@pytest.fixture(scope="module")
def bundled_vectors():
    corpus = Corpus(BUNDLED_CORPUS)
    embedder = HashedEmbedder(dim=256)
    queries = bundled_queries(corpus, MIN_QUERIES + 200)
    return embedder.encode_passages(list(corpus.iter_contents())), embedder.encode_queries(queries)


def flat_ip(vectors: np.ndarray) -> faiss.IndexFlatIP:
    index = faiss.IndexFlatIP(vectors.shape[1])
    index.add(np.ascontiguousarray(vectors, dtype=np.float32))
    return index


def one_axis_mesh(devices: int) -> jax.sharding.Mesh:
    return jax.make_mesh((devices,), ("passages",), devices=jax.devices()[:devices],
                         axis_types=(jax.sharding.AxisType.Auto,))


@pytest.mark.parametrize("devices", [1, 8])
def test_ids_equal_faiss_flat_id_for_id_on_over_1000_bundled_queries(bundled_vectors, devices):
    passages, queries = bundled_vectors
    assert len(queries) >= MIN_QUERIES and len(passages) % 8, "the bundled corpus does not divide 8 devices: pads"
    index = MeshIndex(passages, mesh=one_axis_mesh(devices), chunk=1024)
    assert index.num_shards == devices and index.padded_passages > len(passages)
    for k in (3, 10):
        want_scores, want_ids = flat_ip(passages).search(queries, k)
        scores, ids = index.search(queries, k)
        agreement = float((ids == want_ids).all(axis=1).mean())
        assert agreement == 1.0, f"k={k}: {agreement:.4f} of queries agree; first differing {np.argwhere(ids != want_ids)[:3]}"
        np.testing.assert_allclose(scores, want_scores, atol=1e-5)


def test_exact_ties_are_listed_as_faiss_flat_lists_them_and_cut_by_lower_id(bundled_vectors):
    """Duplicated vectors score exactly equal. A tied run wholly inside the top k: the same ids in
    faiss's order (highest id first). A run cut by the k-th place: faiss's pick depends on its heap's
    scan history; ours is the lowest ids (stated rule), listed the same way."""
    rng = np.random.default_rng(0)
    base = bundled_vectors[0][:40]
    passages = base[rng.integers(0, len(base), size=1500)]
    index = MeshIndex(passages, chunk=64)
    for queries in (bundled_vectors[1][:1], bundled_vectors[1][:64]):
        for k in (1, 5, 40, 80):
            want_scores, want_ids = flat_ip(passages).search(queries, k)
            scores, ids = index.search(queries, k)
            np.testing.assert_allclose(scores, want_scores, atol=1e-5)
            for row in range(len(queries)):
                inside = want_scores[row] > want_scores[row, -1] + 1e-5
                assert (ids[row, inside] == want_ids[row, inside]).all(), f"k={k}, query {row}"
                cut = ~inside
                group = np.flatnonzero((passages == passages[ids[row, -1]]).all(axis=1))
                assert list(ids[row, cut]) == sorted(group[: cut.sum()], reverse=True), f"k={k}, query {row}"


def test_bfloat16_halves_the_bytes_and_keeps_scores_within_bf16_tolerance(bundled_vectors):
    passages, queries = bundled_vectors
    fp32 = MeshIndex(passages, chunk=1024)
    bf16 = MeshIndex(passages, dtype="bfloat16", chunk=1024)
    assert bf16.bytes_per_device * 2 == fp32.bytes_per_device
    want_scores, want_ids = flat_ip(passages).search(queries, 3)
    scores, ids = bf16.search(queries, 3)
    # query and passage each rounded to 8 mantissa bits: |error| ≤ 2 x 2^-8 x |q||p| for unit vectors
    np.testing.assert_allclose(scores, want_scores, atol=2 * 2**-8)
    assert (ids[:, 0] == want_ids[:, 0]).mean() > 0.9, "bf16 swaps near-ties only"


def test_a_named_axis_shards_over_that_axis_only():
    rng = np.random.default_rng(1)
    passages = rng.standard_normal((301, 32)).astype(np.float32)
    queries = rng.standard_normal((50, 32)).astype(np.float32)
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    index = MeshIndex(passages, mesh=mesh, axes="fsdp", chunk=16)
    assert index.num_shards == 4 and index.vectors.sharding.spec == jax.sharding.PartitionSpec(("fsdp",), None)
    want_scores, want_ids = flat_ip(passages).search(queries, 7)
    scores, ids = index.search(queries, 7)
    assert (ids == want_ids).all()
    with pytest.raises(MeshIndexError, match="retrieval.mesh_axis.*'tensor'"):
        MeshIndex(passages, mesh=mesh, axes="tensor")


@pytest.mark.parametrize("rows", [1, 3, 13])
def test_a_corpus_that_does_not_divide_the_devices_is_padded_never_dropped(rows):
    rng = np.random.default_rng(rows)
    passages = rng.standard_normal((rows, 8)).astype(np.float32)
    queries = rng.standard_normal((5, 8)).astype(np.float32)
    index = MeshIndex(passages, chunk=1)
    assert index.padded_passages % 8 == 0 and index.padded_passages >= rows
    scores, ids = index.search(queries, rows)
    assert all(sorted(row) == list(range(rows)) for row in ids), "every passage is retrievable, no pad row is"
    assert (ids == flat_ip(passages).search(queries, rows)[1]).all()


def test_k_larger_than_the_corpus_returns_the_whole_corpus_ranked():
    rng = np.random.default_rng(2)
    passages = rng.standard_normal((13, 8)).astype(np.float32)
    queries = rng.standard_normal((3, 8)).astype(np.float32)
    scores, ids = MeshIndex(passages).search(queries, 100)
    assert ids.shape == (3, 13) and np.isfinite(scores).all()
    assert (ids == flat_ip(passages).search(queries, 13)[1]).all()


def test_bad_vectors_and_arguments_are_refused_by_name():
    with pytest.raises(MeshIndexError, match="at least one row"):
        MeshIndex(np.zeros((0, 8), np.float32))
    with pytest.raises(MeshIndexError, match="retrieval.mesh_dtype='float16'"):
        MeshIndex(np.zeros((4, 8), np.float32), dtype="float16")
    with pytest.raises(MeshIndexError, match="retrieval.mesh_chunk=0"):
        MeshIndex(np.zeros((4, 8), np.float32), chunk=0)
    broken = np.ones((20, 8), np.float32)
    broken[17, 3] = np.nan
    with pytest.raises(MeshIndexError, match="passage vector 17 is not finite"):
        MeshIndex(broken, source="e5_Flat.index")
    index = MeshIndex(np.eye(4, dtype=np.float32))
    with pytest.raises(ValueError, match=r"queries must be \[n, 4\]"):
        index.search(np.zeros((2, 3), np.float32), 1)
    with pytest.raises(ValueError, match="k must be a positive int"):
        index.search(np.zeros((2, 4), np.float32), 0)
    scores, ids = index.search(np.zeros((0, 4), np.float32), 2)
    assert ids.shape == (0, 2)
