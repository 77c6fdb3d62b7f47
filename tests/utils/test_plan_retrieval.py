"""The plan's retriever: the mesh index's bytes per device and a search's seconds per backend.

Why these tests: the plan once charged 0.5 s a retriever call whatever the index; an exact search
of wiki-18 on a host is tens of seconds a turn. The model must grow with queries and passages,
shrink with the mesh's chips, count Flat's 2·Q·N·d FLOPs, and its memory must be the bytes the
real `MeshIndex` puts on a device, so that a run whose index will not fit is refused before it starts.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from llds_jax.config import base_config
from llds_jax.plan.retrieval import (
    IndexShape,
    backend_of,
    index_memory,
    index_shape,
    mesh_index_bytes,
    search_cost,
)
from llds_jax.retrieval.mesh import shard_layout
from llds_jax.utils import flops

pytestmark = pytest.mark.unit

V5E = flops.Peak(197e12, 819e9, "v5e")


def _config(**retrieval):
    c = base_config()
    c.plan.host_flops = 1e12  # stated: no measurement in the unit tests
    c.retrieval.update(retrieval)
    return c


def _cost(c, backend, passages=1_000_000, dim=768, shards=4, **kw):
    return search_cost(c, backend, IndexShape(passages, dim, "test"), hardware="v5e", platform="tpu", peak=V5E,
                       shards=shards, matmul=0.5, hbm=0.7, **kw)


def test_flat_is_two_q_n_d_flops_at_the_host_rate():
    c = _config()
    cost = _cost(c, "flat", passages=21_015_324)
    assert cost.seconds(2560) == pytest.approx(2 * 2560 * 21_015_324 * 768 / 1e12)
    assert "2·N·d" in cost.why and "plan.host_flops" in cost.why
    assert cost.seconds(0) == 0.0


@pytest.mark.parametrize("backend", ["flat", "ivf", "bm25", "mesh"])
def test_every_backend_grows_with_queries_and_passages(backend):
    c = _config(faiss_factory="IVF4096,PQ64", ivf_nprobe=32)
    small, large = _cost(c, backend, passages=1_000_000), _cost(c, backend, passages=20_000_000)
    for q in (16, 256, 2560):
        assert small.seconds(q) < large.seconds(q)
        assert small.seconds(q) <= small.seconds(4 * q)
    assert large.seconds(2560) < large.seconds(40_000)


def test_ivf_charges_its_probed_fraction_and_the_coarse_quantizer():
    c = _config(method="dense", faiss_factory="IVF4096,PQ64", ivf_nprobe=32)
    n, d = 21_015_324, 768
    ivf = _cost(c, "ivf", passages=n, dim=d)
    assert backend_of(c.retrieval) == "ivf"
    assert ivf.seconds(1) == pytest.approx((2 * 4096 * d + 2 * n * d * 32 / 4096) / 1e12)
    assert ivf.seconds(100) < _cost(c, "flat", passages=n, dim=d).seconds(100) / 50


def test_the_mesh_search_shrinks_with_devices_and_bf16_halves_the_read():
    c = _config()
    seconds = [_cost(c, "mesh", passages=21_015_324, shards=s).seconds(2560) for s in (1, 4, 16, 64)]
    assert seconds == sorted(seconds, reverse=True) and seconds[0] > 8 * seconds[-1]
    assert _cost(c, "mesh", dtype="bfloat16").seconds(8) < _cost(c, "mesh", dtype="float32").seconds(8)
    # a paper turn on one host's 4 chips (fp32: HIGHEST precision) against a 1 TFLOP/s host
    assert _cost(c, "mesh", passages=21_015_324).seconds(2560) * 20 < _cost(c, "flat", passages=21_015_324).seconds(2560)


def test_plan_retrieval_s_overrides_every_backend_and_unmodelled_factories_say_so():
    c = _config(method="dense", faiss_factory="HNSW32")
    assert backend_of(c.retrieval) == "other" and "faiss_factory='HNSW32'" in _cost(c, "other").why
    c.plan.retrieval_s = 0.25
    assert _cost(c, "flat").seconds(1000) == 0.25 and "plan.retrieval_s" in _cost(c, "flat").why


def test_the_planned_index_bytes_are_the_mesh_index_own():
    """`mesh_index_bytes` pads as `MeshIndex` does: the same bytes a device, on 8 simulated devices."""
    from llds_jax.retrieval.mesh import MeshIndex

    vectors = np.random.default_rng(0).standard_normal((1001, 16)).astype(np.float32)
    for dtype, chunk in (("float32", 64), ("bfloat16", 50)):
        c = _config(mesh_dtype=dtype, mesh_chunk=chunk)
        index = MeshIndex(vectors, dtype=dtype, chunk=chunk)
        planned, workspace = mesh_index_bytes(c, IndexShape(1001, 16, "t"), len(jax.local_devices()), 3)
        assert planned == index.bytes_per_device and workspace == 2 * 8 * index.chunk * 4


def test_the_index_shape_comes_from_the_index_directory_else_the_stated_fields(tmp_path):
    c = _config(method="mesh", index_path=str(tmp_path))
    fallback = index_shape(c)
    assert (fallback.passages, fallback.dim) == (21_015_324, 768) and "plan.index_passages" in fallback.source
    (tmp_path / "meta.json").write_text(json.dumps({"num_docs": 1234, "dim": 384, "shard_size": 8192}))
    assert (index_shape(c).passages, index_shape(c).dim) == (1234, 384)
    c.retrieval.url = "http://127.0.0.1:8000/retrieve"  # a server's index is not the plan's to read
    assert index_shape(c).passages == 21_015_324 and "served by" in index_shape(c).source


def test_only_the_mesh_method_holds_device_memory(tmp_path):
    c = _config(method="dense", index_path=str(tmp_path))
    held, note = index_memory(c, 8, 1)
    assert held == {} and "nothing on the devices" in note
    c.retrieval.method = "mesh"
    held, note = index_memory(c, 64, 16)  # v5e:8x8: each host a copy over its 4 chips
    rows = -(-21_015_324 // 4)
    assert held["retrieval_index"] == pytest.approx(rows * 768 * 4, rel=1e-3)
    assert "retrieval.mesh_dtype='float32'" in note and "split over 4 device(s)" in note


def test_on_one_host_the_index_splits_over_the_trainers_mesh_or_its_named_axes(tmp_path):
    """`open_mesh` places the index on the trainer's mesh: all 8 devices, or only the named axes'
    (replicated over the rest), so the plan charges a shard of 1/8 or 1/4 of the passages."""
    c = _config(method="mesh", index_path=str(tmp_path))  # no index there: wiki-18's stated shape
    c.mesh.shape = (2, 4, 1)
    whole = index_memory(c, 8, 1)[0]["retrieval_index"]
    c.retrieval.mesh_axis = "fsdp"
    over_fsdp = index_memory(c, 8, 1)[0]["retrieval_index"]
    assert whole == shard_layout(21_015_324, 8, c.retrieval.mesh_chunk)[2] * 768 * 4
    assert over_fsdp == shard_layout(21_015_324, 4, c.retrieval.mesh_chunk)[2] * 768 * 4
    c.retrieval.mesh_axis = "data,fsdp"
    assert index_memory(c, 8, 1)[0]["retrieval_index"] == whole
