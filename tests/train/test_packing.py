"""Packed training rows (``train.packing``): the packer, per-segment isolation, and packed = padded.

Tolerances come from the quantities: packing changes only which tokens share a row, so every
difference is fp32 summation order — attention's online softmax over other key blocks, the LM
head's and the objective's sums over other partitions — bounded by a few ε₃₂ of the quantity's
own scale, and the parameter bound is the well-conditioned Adam bound of test_update_step.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from train_helpers import SEQ, mixed_rollout, tiny_train_config

from llds_jax.models.attention import AttentionMask, blockwise_attention, cudnn_attention, naive_attention
from llds_jax.models.logprobs import sequence_logprobs
from llds_jax.models.testing import tiny_model
from llds_jax.parallel.mesh import make_mesh
from llds_jax.parallel.placement import shard_model
from llds_jax.train.batch import TrainBatch, padded_length, scored_positions_per_row
from llds_jax.train.learner import Learner
from llds_jax.train.packing import (
    PackingSizes,
    computed_tokens,
    one_group,
    pack,
    pack_both,
    pack_on_device,
    packing_sizes,
    place,
    plan_rows,
)

pytestmark = pytest.mark.unit

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
F32_EPS = float(np.finfo(np.float32).eps)
WELL_CONDITIONED_EPS = 1e-4  # Adam eps at which the params after a step have a per-entry bound (test_update_step)


def _sizes(width=32, rows=2, scored=31, minis=2, mini=8):
    return PackingSizes(width=width, rows=rows, scored=scored, mini_batches=minis, mini_batch_size=mini)


def test_first_fit_keeps_each_mini_batch_and_cuts_nothing():
    arrays = mixed_rollout(seed=3, n=16, length=32)
    sizes = _sizes()
    packed = pack(arrays["input_ids"], arrays["attention_mask"], arrays["action_mask"], sizes)
    lengths = arrays["attention_mask"].sum(1)
    for j, length in enumerate(lengths):
        mini = j // sizes.mini_batch_size
        first, count = packed.mini_first[mini], packed.mini_count[mini]
        assert first <= packed.slot[j] < first + count, f"trajectory {j} left mini-batch {mini}'s micro-batches"
        row_ids = packed.input_ids[packed.slot[j], packed.row[j]]
        segments = packed.segment_ids[packed.slot[j], packed.row[j]]
        # the trajectory's tokens, whole and contiguous, under one segment id of its own
        columns = [c for c in range(sizes.width) if segments[c] > 0 and np.array_equal(
            row_ids[c:c + length], arrays["input_ids"][j, :length]) and np.all(segments[c:c + length] == segments[c])]
        assert columns, f"trajectory {j}'s {length} tokens are not in its row"
        start = packed.score_start[j]
        targets = np.flatnonzero(arrays["action_mask"][j, 1:])
        scored = packed.score_positions[packed.slot[j], packed.row[j], start:start + len(targets)]
        assert np.array_equal(row_ids[scored + 1], arrays["input_ids"][j, targets + 1]), f"trajectory {j}: targets"
    assert packed.mini_count.sum() <= sizes.slots
    assert np.array_equal(packed.mini_first, np.concatenate([[0], np.cumsum(packed.mini_count)[:-1]]))


def test_the_device_scatter_packs_exactly_what_the_host_packer_does():
    """Several hosts pack with ``pack_on_device`` (their tokens stay on their devices): same arrays as ``pack``."""
    arrays = mixed_rollout(seed=5, n=16, length=32)
    sizes = _sizes(rows=4)
    want = pack(arrays["input_ids"], arrays["attention_mask"], arrays["action_mask"], sizes)
    lengths = arrays["attention_mask"].sum(1)
    where = place(plan_rows(lengths, (arrays["action_mask"][:, 1:] > 0).sum(1), sizes), sizes)
    got = jax.jit(functools.partial(pack_on_device, sizes=sizes))(
        arrays["input_ids"], arrays["action_mask"], lengths.astype(np.int32), where)
    for name, a, b in zip(want._fields, want, got, strict=True):
        np.testing.assert_array_equal(np.asarray(b), a, err_msg=name)


def test_the_no_grad_passes_read_the_same_rows_as_one_group():
    """π_old, π_ref and Δ take no gradient, so their micro-batches ignore the mini-batches: 16 trajectories
    of 10 tokens fit 3 to a 32-token row; two mini-batches of 8 fill 3 rows each, 2 micro-batches of 2 rows
    each (8 rows computed), while the same 6 rows as one group make 3 micro-batches (6 rows computed)."""
    sizes = _sizes()  # rows of 32 tokens, 2 a micro-batch, 2 mini-batches of 8
    whole = sizes.whole_batch()
    assert (whole.mini_batches, whole.mini_batch_size, whole.rows, whole.width) == (1, 16, 2, 32)
    plan = plan_rows(np.full(16, 10), np.ones(16), sizes)
    assert computed_tokens(plan, sizes) == 8 * 32 and computed_tokens(one_group(plan, sizes), whole) == 6 * 32

    arrays = mixed_rollout(seed=3, n=16, length=32)
    update, passes = pack_both(arrays["input_ids"], arrays["attention_mask"], arrays["action_mask"], sizes)
    assert passes.mini_first.tolist() == [0] and passes.mini_count.sum() <= update.mini_count.sum()
    flat = lambda x: x.reshape(-1, x.shape[-1])  # [S, P, ·] → rows in slot order
    held = np.flatnonzero((flat(update.segment_ids) > 0).any(axis=1))  # the update's used rows, in order
    assert (flat(passes.segment_ids)[:len(held)] > 0).any(axis=1).all() and not flat(passes.segment_ids)[len(held):].any()
    for name in ("input_ids", "segment_ids", "score_positions"):  # the same rows, end to end
        np.testing.assert_array_equal(flat(getattr(passes, name))[:len(held)], flat(getattr(update, name))[held],
                                      err_msg=name)
    np.testing.assert_array_equal(passes.score_start, update.score_start)


@pytest.mark.parametrize(("tokens", "shards", "rows"), [
    (0, 1, 1), (0, 8, 8), (0, 3, 3),  # default: one row per data shard, the finest split
    (32, 8, 8), (96, 2, 4), (256, 1, 8),  # a token budget: whole rows, rounded up to the shards
    (10_000, 1, 8), (10_000, 3, 9),  # never above what a mini-batch (8) can fill, in whole shards
])
def test_rows_per_micro_batch_come_from_the_token_budget_in_whole_shards(tokens, shards, rows):
    config = tiny_train_config(packing=True, micro_batch_tokens=tokens, micro_batch_size=8, mini_batch_size=8)
    assert packing_sizes(config, width=SEQ, scored=SEQ - 1, data_parallel=shards).rows == rows


def test_paper_configs_pack_micro_batches_of_16_rows_whole_per_shard():
    """configs/_paper.py: 16-row micro-batches — as wide as the H100 ran efficiently (one 4,096-token row
    a micro-batch took 2.5× as long as 16) and narrow enough that a mini-batch's ≈ 47.5 rows round up
    to 48 (computed ÷ useful 1.15 on 8 shards, not 64 rows' 1.48: docs/performance.md). On 64 shards
    rows round up to one per shard."""
    for name in ("qwen0p5b", "qwen3b", "qwen7b"):
        spec = importlib.util.spec_from_file_location(name, CONFIGS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        config = module.get_config()
        width = padded_length(config)
        scored = scored_positions_per_row(config, width)
        for shards, rows in ((1, 16), (8, 16), (64, 64)):
            assert packing_sizes(config, width, scored, data_parallel=shards).rows == rows, (name, shards)


def test_a_row_holds_what_fits_and_a_full_length_trajectory_gets_its_own():
    sizes = _sizes(width=10, rows=1, scored=9, minis=1, mini=4)
    plan = plan_rows([10, 4, 6, 3], [2, 2, 2, 2], sizes)
    # first-fit decreasing: 10 fills row 0, 6 opens row 1, 4 joins it, 3 opens row 2
    assert plan.row.tolist() == [0, 1, 1, 2]
    assert plan.offset.tolist() == [0, 6, 0, 0]
    assert plan.slots_per_mini.tolist() == [3]
    assert plan_rows([3, 3, 3, 3], [5, 5, 5, 1], sizes).row.tolist() == [0, 1, 2, 0]  # the scored cap also closes rows
    with pytest.raises(ValueError, match="does not fit"):
        plan_rows([11, 1, 1, 1], [1, 1, 1, 1], sizes)


def _packed_qkv(seed=0, length=96, heads=4, kv_heads=2, head_dim=8):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.normal(size=(2, length, h, head_dim)), jnp.float32)
               for h in (heads, kv_heads, kv_heads))
    segments = np.zeros((2, length), np.int32)
    segments[0, :40], segments[0, 40:71], segments[0, 71:90] = 1, 2, 3  # then padding
    segments[1, :17], segments[1, 17:96] = 1, 2
    return q, k, v, jnp.asarray(segments)


def test_blockwise_packed_attention_matches_the_oracle_forward_and_backward():
    """Small blocks, so query pieces start past segment starts and skip key blocks."""
    q, k, v, segments = _packed_qkv()
    mask = AttentionMask.packed(segments)
    real = np.asarray(segments) > 0
    weights = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32) * real[:, :, None, None]

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v) * weights)

    blockwise = lambda q, k, v: blockwise_attention(q, k, v, mask, 16, query_block=16)
    oracle = lambda q, k, v: naive_attention(q, k, v, mask)
    # Jitted, each side once: value and gradient of the weighted sum, and the outputs themselves.
    run = lambda fn: jax.jit(lambda *a: (fn(*a), jax.grad(lambda *b: loss(fn, *b), argnums=(0, 1, 2))(*a)))
    (got, got_grads), (want, want_grads) = run(blockwise)(q, k, v), run(oracle)(q, k, v)
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=20 * F32_EPS * 4)
    for name, g, w in zip("qkv", got_grads, want_grads, strict=True):
        scale = float(jnp.max(jnp.abs(w)))
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=50 * F32_EPS * scale, err_msg=f"d{name}")
    cudnn = jax.jit(lambda q, k, v: cudnn_attention(q, k, v, mask, 16, implementation="xla"))
    cudnn_path = cudnn(q, k, v)  # packed: the blockwise kernel
    np.testing.assert_allclose(np.asarray(cudnn_path)[real], np.asarray(want)[real], atol=20 * F32_EPS * 4)


def test_splash_reads_one_segment_id_per_trajectory():
    _, _, _, segments = _packed_qkv()
    labels = np.asarray(AttentionMask.packed(segments).segment_ids())
    for row in range(2):
        seg = np.asarray(segments[row])
        for s in np.unique(seg[seg > 0]):
            assert len(np.unique(labels[row][seg == s])) == 1
        assert len(np.unique(labels[row][seg > 0])) == len(np.unique(seg[seg > 0]))
        assert np.all(labels[row][seg == 0] == 0)


# Trajectory lengths per packed row of 48 (three distinct lengths: the "alone" pass compiles once per length).
ROWS = [[13, 20, 9], [20, 13, 9], [9, 9, 9, 13], [20, 20], [13, 13, 13], [9, 20], [13], [20, 9, 9]]


@functools.cache
def _alone_step(attention: str):
    """log-probs, entropies and the parameter gradient of one unpacked trajectory [1, n], jitted: one
    compile per length (three), shared by the cases with the same attention (a mesh only placed the
    packed pass's parameters; their values, and the graph, are the unsharded model's)."""
    graphdef = nnx.split(tiny_model("qwen2", attention=attention), nnx.Param)[0]

    def alone_one(p, seq):
        logp, entropy = sequence_logprobs(nnx.merge(graphdef, p), seq, jnp.ones(seq.shape, bool), chunk_size=16)
        return jnp.sum(logp), (logp, entropy)

    return jax.jit(jax.value_and_grad(alone_one, has_aux=True))


@pytest.mark.parametrize("attention, mesh_shape, rows", [("xla_blockwise", None, 1), ("naive", None, 1),
                                                         ("xla_blockwise", (8, 1, 1), 8)])
def test_packed_rows_equal_their_trajectories_run_alone(attention, mesh_shape, rows):
    """Log-probs, entropies and the gradient of their sum, per trajectory, packed vs alone; with a mesh,
    the packed rows are sharded one per device of 8.

    Bounds: a log-prob differs only in the order its attention and LM-head sums run (64 ε₃₂ of its
    scale); the gradient sums ≈ 300 such per-token terms, whose orders differ too (256 ε₃₂ of the
    gradient's largest entry; the alone side adds its per-trajectory gradients in float64, which only
    removes rounding from its side of that bound).
    """
    model = tiny_model("qwen2", attention=attention)
    rng = np.random.default_rng(0)
    width = 48
    layout = [[rng.integers(1, 200, n).astype(np.int32) for n in lengths] for lengths in ROWS[:rows]]
    ids = np.zeros((rows, width), np.int32)
    segments = np.zeros((rows, width), np.int32)
    keep = np.zeros((rows, width - 1), bool)
    places = []
    for r, seqs in enumerate(layout):
        off = 0
        for s, seq in enumerate(seqs):
            ids[r, off:off + len(seq)], segments[r, off:off + len(seq)] = seq, s + 1
            keep[r, off:off + len(seq) - 1] = True  # targets inside the segment
            places.append((r, off, seq))
            off += len(seq)
    mesh = None if mesh_shape is None else make_mesh(mesh_shape)
    if mesh is not None:
        with jax.set_mesh(mesh):
            model = shard_model(model, mesh)
    graphdef, params = nnx.split(model, nnx.Param)

    def packed_sum(p, ids, segments):
        logp, entropy = sequence_logprobs(nnx.merge(graphdef, p), ids, None, segment_ids=segments, chunk_size=16)
        return jnp.sum(jnp.where(keep, logp, 0.0)), (logp, entropy)

    packed = jax.jit(jax.value_and_grad(packed_sum, has_aux=True))
    if mesh is None:
        (_, (packed_logp, packed_entropy)), packed_grad = packed(params, jnp.asarray(ids), jnp.asarray(segments))
    else:
        with jax.set_mesh(mesh):
            rows_sharding = jax.sharding.NamedSharding(mesh, jax.P(("data", "fsdp"), None))
            row_ids, row_segments = (jax.device_put(x, rows_sharding) for x in (ids, segments))
            (_, (packed_logp, packed_entropy)), packed_grad = packed(params, row_ids, row_segments)
            assert len(row_ids.sharding.device_set) == 8
        params = jax.device_get(params)

    # One trajectory per call; the gradient of the sum over trajectories is the sum of theirs, added
    # here in float64, so the oracle's own rounding only shrinks.
    alone_step = _alone_step(attention)
    params = jax.device_put(params, jax.devices()[0])
    alone, alone_grad = [], None
    for _, _, seq in places:
        (_, outs), grad = alone_step(params, jnp.asarray(seq[None]))
        alone.append(outs)
        grad = jax.tree.map(lambda g: np.asarray(g, np.float64), grad)
        alone_grad = grad if alone_grad is None else jax.tree.map(np.add, alone_grad, grad)
    packed_logp, packed_entropy = np.asarray(packed_logp), np.asarray(packed_entropy)
    for (logp, entropy), (r, off, seq) in zip(alone, places, strict=True):
        scale = float(np.max(np.abs(logp)))
        n = len(seq) - 1
        np.testing.assert_allclose(packed_logp[r, off:off + n], np.asarray(logp[0]), atol=64 * F32_EPS * scale,
                                   err_msg=f"log-probs of the trajectory at row {r}, column {off}")
        np.testing.assert_allclose(packed_entropy[r, off:off + n], np.asarray(entropy[0]), atol=64 * F32_EPS * scale,
                                   err_msg=f"entropies of the trajectory at row {r}, column {off}")
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(packed_grad), jax.tree.leaves(alone_grad),
                            strict=True):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        scale = max(float(np.max(np.abs(w))), 1e-30)
        err = float(np.max(np.abs(g - w))) / scale
        assert err <= 256 * F32_EPS, f"gradient {jax.tree_util.keystr(path)}: relative difference {err:.2e}"


def _learner(packing: bool, mesh_shape=(1, 1, 1), eps=WELL_CONDITIONED_EPS, **train):
    config = tiny_train_config(packing=packing, **train)
    config.optim.eps = eps
    config.mesh.shape = mesh_shape
    mesh = make_mesh(mesh_shape)
    with jax.set_mesh(mesh):
        model = shard_model(tiny_model("qwen2"), mesh)
    return Learner.create(model, config, mesh)


def _run(learner, seeds):
    history = []
    for seed in seeds:
        arrays = mixed_rollout(seed=seed)
        metrics, extra = learner.update(TrainBatch.from_arrays(arrays, length=learner.seq_len))
        extra["params"] = jax.tree.map(np.asarray, jax.device_get(learner.state.params))
        history.append((metrics, extra))
    return history


@pytest.fixture(scope="module")
def padded_step():
    return _run(_learner(False), [0])[0]


@pytest.mark.parametrize("mesh_shape", [(1, 1, 1), (8, 1, 1), (2, 2, 2)])
def test_packed_step_equals_padded_step(mesh_shape, padded_step):
    learner = _learner(True, mesh_shape)
    assert learner.packing is not None and learner.packing.rows % (mesh_shape[0] * mesh_shape[1]) == 0
    metrics, extra = _run(learner, [0])[0]
    ref_metrics, ref_extra = padded_step
    actions = mixed_rollout(seed=0)["action_mask"] > 0  # every reader masks π_old to action tokens
    old, ref_old = extra["old_logp"][:, :actions.shape[1]][actions], ref_extra["old_logp"][:, :actions.shape[1]][actions]
    np.testing.assert_allclose(old, ref_old, atol=64 * F32_EPS * float(np.max(np.abs(ref_old))), err_msg="π_old")
    mb, ref_mb = extra["per_mini_batch"], ref_extra["per_mini_batch"]
    assert mb.keys() == ref_mb.keys() and metrics.keys() == ref_metrics.keys()
    # Mini-batch 1 runs at the same θ: every metric is a ratio of sums over the same terms.
    for key, ref_values in ref_mb.items():
        want, got = float(ref_values[0]), float(mb[key][0])
        floor = 1.0 if key.startswith("loss/") else 0.1
        assert abs(got - want) <= 1e-5 * max(abs(want), floor), f"mini-batch 1 {key}: {got} vs {want}"
    lr = learner.config.optim.lr
    grad_scale = float(np.max(ref_mb["grad/norm_preclip"]))
    step_bound = len(ref_mb["grad/norm_preclip"]) * lr * min(2.0, F32_EPS * grad_scale / WELL_CONDITIONED_EPS)
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(extra["params"]),
                                 jax.tree.leaves(ref_extra["params"]), strict=True):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        ulps = 2 * np.spacing(np.maximum(np.abs(got), np.abs(want)).astype(np.float32)).astype(np.float64)
        excess = np.abs(got - want) - (step_bound + ulps)
        assert excess.max() <= 0, f"param {jax.tree_util.keystr(path)} beyond {step_bound / lr:.2e} lr"
    # Later mini-batches read θ after the (bounded) first update: the same logged numbers to 1e-4.
    for key in ("llds/value", "loss/pg", "kl/mean", "grad/norm_preclip"):
        np.testing.assert_allclose(mb[key][1:], ref_mb[key][1:], rtol=1e-4, atol=1e-6, err_msg=key)
    np.testing.assert_allclose(extra["advantages"], ref_extra["advantages"], atol=0, rtol=0)


def test_packed_passes_compile_once_while_lengths_and_micro_batch_counts_vary():
    learner = _learner(True, (2, 1, 1), micro_batch_tokens=128)  # one 128-token row per shard and micro-batch
    counts = []
    for seed in range(3):
        arrays = mixed_rollout(seed=seed + 10)
        if seed == 2:  # all full-length: one trajectory per row, the buffer's worst case
            arrays = mixed_rollout(seed=seed + 10, length=learner.seq_len)
            arrays["attention_mask"][:, :] = True
        host = TrainBatch.from_arrays(arrays, length=learner.seq_len)
        device = learner.upload(host)
        counts.append(int(np.asarray(device.packed.mini_count).sum()))
        assert int(np.asarray(device.packed_passes.mini_count).sum()) <= counts[-1]  # one group: no more rows
        learner.update(device)
    assert len(set(counts)) > 1, f"the steps used the same number of micro-batches {counts}: nothing varied"
    assert learner.compile_counts() == {"policy_logprobs": 1, "update": 1, "reference_logprobs": 1}
