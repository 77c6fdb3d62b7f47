"""The Pallas Triton paged decode kernel (models/attention/decode_gpu.py).

On this CPU the kernel runs in Pallas' interpreter against the XLA path it replaces
(``paged.paged_attention``); the GPU program itself is compiled for an H100 from this host (the
compile-only target ``--mode=plan`` uses) and its HLO is checked: one Triton kernel per layer,
no loop with a traced trip count, no conditional.

Tolerances come from the dtype. fp32: outputs are convex combinations of O(1) values and only
the fp32 summation order inside the dots differs, so a few ulp of 1 per summed key bound them
(4 eps x the longest row). bf16: both sides round the same fp32 result to bf16, and the
probabilities cast to bf16 before the second matmul can round the other way: 2 bf16 eps of the
output's scale.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llds_jax.models import mlp_gpu
from llds_jax.models.attention import decode_gpu, paged, resolve_paged_backend

pytestmark = pytest.mark.unit

BLOCK, COLUMNS = 16, 3
LENGTHS = (0, 1, BLOCK - 1, BLOCK, BLOCK + 1, COLUMNS * BLOCK)  # idle, first key, around a block edge, full
SHAPES = {"qwen2.5-0.5b": (14, 2, 64), "qwen2.5-3b": (16, 2, 128)}  # heads, KV heads, Dh: G = 7 and G = 8


def _tolerance(dtype, scale: float, longest: int) -> float:
    eps = float(jnp.finfo(dtype).eps)
    return 4 * eps * longest if dtype == jnp.float32 else 2 * eps * max(scale, 1.0)


def _case(heads: int, kv_heads: int, head_dim: int, dtype, devices: int, lengths=LENGTHS, seed: int = 0):
    """Rows of the given lengths split over ``devices`` pools, their blocks scattered at random;
    each row's table names blocks only up to its length (the rest unallocated). Blocks no row
    reads, and the slots of a row's last block past its length, hold NaN in the kernel's pools (a
    read outside a row's live slots would show: a masked score's probability is 0, and 0 x NaN is
    NaN) and 0 or their values in the reference's (the XLA loop reads every row up to the longest
    one; masked there)."""
    batch = len(lengths)
    per_device, blocks = batch // devices, batch // devices * COLUMNS + 2
    rng = np.random.default_rng(seed)
    table = np.full((batch, COLUMNS), blocks, np.int32)
    read = np.zeros((devices, blocks), bool)
    past = np.zeros((devices, blocks, BLOCK), bool)  # slots of a row's blocks past its length
    for d in range(devices):
        free = rng.permutation(blocks)
        for r in range(per_device):
            b = d * per_device + r
            live = -(-lengths[b] // BLOCK)
            table[b, :live] = free[r * COLUMNS:r * COLUMNS + live]
            read[d, table[b, :live]] = True
            if live:
                past[d, table[b, live - 1], lengths[b] - (live - 1) * BLOCK:] = True
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (batch, heads, head_dim)).astype(dtype)
    shape = (devices, blocks, kv_heads, BLOCK, head_dim)
    pools = [jax.random.normal(key, shape).astype(dtype) for key in keys[1:]]
    unread = jnp.asarray(~read)[:, :, None, None, None]
    unread_slot = unread | jnp.asarray(past)[:, :, None, :, None]
    poisoned = [jnp.where(unread_slot, jnp.nan, p).astype(dtype) for p in pools]
    clean = [jnp.where(unread, 0, p).astype(dtype) for p in pools]
    return q, poisoned, clean, jnp.asarray(table), jnp.asarray(lengths, jnp.int32)


def _reference(q, k_pool, v_pool, table, lengths):
    slot = jnp.maximum(lengths - 1, 0)[:, None]
    return paged.paged_attention(q[:, None], k_pool, v_pool, table, slot, (lengths > 0)[:, None])[:, 0]


def _check(out, want, lengths, dtype):
    real = np.asarray(lengths) > 0
    out, want = np.asarray(out.astype(jnp.float32)), np.asarray(want.astype(jnp.float32))
    np.testing.assert_array_equal(out[~real], 0)  # a row that reads nothing gives 0
    tol = _tolerance(dtype, float(np.max(np.abs(want[real]))), int(np.max(lengths)))
    diff = float(np.max(np.abs(out[real] - want[real])))
    assert diff <= tol, f"kernel differs from the XLA path by {diff} (tolerance {tol})"


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("model", sorted(SHAPES))
def test_kernel_matches_the_xla_path_reading_only_live_slots(model, dtype, devices):
    """Key splits as chosen for these few rows (one per column), the partials combined in XLA."""
    q, (k_nan, v_nan), (k_pool, v_pool), table, lengths = _case(*SHAPES[model], dtype, devices)
    assert decode_gpu.decode_splits(len(LENGTHS) // devices, SHAPES[model][1], COLUMNS) == COLUMNS
    out = decode_gpu.paged_decode_attention(q, k_nan, v_nan, table, lengths, interpret=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    _check(out, _reference(q, k_pool, v_pool, table, lengths), lengths, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_one_split_writes_the_normalised_output_itself(dtype):
    """splits=1 (rows alone fill the GPU): no partials, no epilogue; mixed lengths on two pools."""
    lengths = (33, 0, 17, 5)
    q, (k_nan, v_nan), (k_pool, v_pool), table, lengths = _case(14, 2, 64, dtype, 2, lengths, seed=1)
    out = decode_gpu.paged_decode_attention(q, k_nan, v_nan, table, lengths, splits=1, interpret=True)
    _check(out, _reference(q, k_pool, v_pool, table, lengths), lengths, dtype)


def test_an_unallocated_entry_inside_a_rows_length_reads_zeros_like_the_gather():
    """The scheduler never leaves one, but the kernel keeps the XLA gather's fill (zeros), and
    never reads another device's block or past the pool through the folded index."""
    q, _, (k_pool, v_pool), table, lengths = _case(14, 2, 64, jnp.float32, 2, (40, 20), seed=2)
    table = table.at[0, 1].set(k_pool.shape[1])  # row 0's second block unallocated (NB)
    out = decode_gpu.paged_decode_attention(q, k_pool, v_pool, table, lengths, splits=1, interpret=True)
    _check(out, _reference(q, k_pool, v_pool, table, lengths), lengths, jnp.float32)


def test_under_a_mesh_each_device_attends_its_own_rows_over_its_own_pool():
    """Rows and pools split over a 2-device data axis (the engine's layout): the kernel runs per
    device inside shard_map and gives the unsharded result."""
    from llds_jax.parallel.mesh import make_mesh

    lengths = (33, 0, 17, 5)
    q, _, (k_pool, v_pool), table, lengths = _case(14, 2, 64, jnp.float32, 2, lengths, seed=3)
    mesh = make_mesh((2, 1, 1), jax.devices()[:2])
    rows = jax.NamedSharding(mesh, jax.P("data"))
    args = [jax.device_put(x, rows) for x in (q, k_pool, v_pool, table, lengths)]
    with jax.set_mesh(mesh):
        out = jax.jit(lambda *a: decode_gpu.paged_decode_attention(*a, splits=2, interpret=True))(*args)
    _check(out, _reference(q, k_pool, v_pool, table, lengths), lengths, jnp.float32)


def test_read_bytes_count_live_slots_only():
    heads, kv_heads, head_dim, itemsize = 14, 2, 64, 2
    group = 7 * head_dim * itemsize  # G = 7 query heads (the 16-row tile's padding is masked: read nothing)
    slot = 2 * head_dim * itemsize  # a key and a value
    idle = decode_gpu.decode_read_bytes([0], kv_heads, head_dim, BLOCK, itemsize, heads)
    assert idle == kv_heads * (4 + 2 * group)  # its length, q and the output: no block
    lengths = [0, 1, BLOCK, BLOCK + 1]  # 0 + 1 + 1 + 2 live blocks (table entries), 0 + 1 + 128 + 129 slots
    got = decode_gpu.decode_read_bytes(lengths, kv_heads, head_dim, BLOCK, itemsize, heads)
    assert got == 4 * idle + kv_heads * (4 * 4 + (2 * BLOCK + 2) * slot)


@pytest.mark.parametrize("heads", [16, 14])
def test_one_split_reads_and_writes_a_kv_heads_group_in_place(heads):
    """G = 8 (qwen2.5-3b) and G = 7 (qwen2.5-0.5b, 7b): each program loads its G query heads from
    ``[B, H, Dh]`` into a 16-row tile and stores its G output heads back, both masked (the last KV
    head's tile reaches past H): the read bytes count G rows in and G out, the padding none; several
    splits write the padded fp32 partials."""
    kv_heads, head_dim, itemsize = 2, 128, 2
    group = heads // kv_heads
    idle = decode_gpu.decode_read_bytes([0], kv_heads, head_dim, BLOCK, itemsize, heads)
    assert idle == kv_heads * (4 + 2 * group * head_dim * itemsize)  # its length, G heads in, G heads out
    split = decode_gpu.decode_read_bytes([0], kv_heads, head_dim, BLOCK, itemsize, heads, splits=4)
    assert split == 4 * kv_heads * (4 + group * head_dim * itemsize + 16 * head_dim * 4 + 2 * 16 * 4)
    q, (k_nan, v_nan), (k_pool, v_pool), table, lengths = _case(heads, kv_heads, head_dim, jnp.float32, 1, seed=4)
    out = decode_gpu.paged_decode_attention(q, k_nan, v_nan, table, lengths, splits=1, interpret=True)
    _check(out, _reference(q, k_pool, v_pool, table, lengths), lengths, jnp.float32)


def test_the_paged_backend_rule():
    """GPU: the Triton kernel unless the XLA loop is asked for by name (benchmarks compare the two)."""
    assert resolve_paged_backend("auto", "gpu") == "triton"
    assert resolve_paged_backend("xla_blockwise", "gpu") == "xla_blockwise"
    assert resolve_paged_backend("naive", "gpu") == "naive"
    assert resolve_paged_backend("auto", "tpu") == "splash"
    assert resolve_paged_backend("auto", "cpu") == "xla_blockwise"


def _record_calls(monkeypatch, module, name: str) -> list:
    """``module.name`` wrapped to record its first argument's shape a call; the list it fills."""
    calls, function = [], getattr(module, name)

    def recorded(*args, **kwargs):
        calls.append(args[0].shape)
        return function(*args, **kwargs)

    monkeypatch.setattr(module, name, recorded)
    return calls


def test_the_decoder_through_the_kernel_decodes_what_it_decodes_through_the_xla_loop(monkeypatch):
    """A tiny decoder's paged decode on two device pools, the GPU kernels forced (interpreted here):
    prefill (the XLA path either way), then one-token steps, a row idle for some, each layer's
    attention and gate/up through the kernels; the logits match the XLA path's and the pools are
    written identically (the same scatter)."""
    from flax import nnx

    from llds_jax.models import PagedKVCache, decoder, init_paged_pools
    from llds_jax.models.testing import tiny_model

    model = tiny_model("qwen2")
    graphdef, state = nnx.split(model)
    k, v = init_paged_pools(model.config, 2, 6, BLOCK)
    table = jnp.array([[0, 3, 6], [1, 2, 6], [4, 6, 6], [0, 1, 2]], jnp.int32)  # rows 0-1: pool 0; 2-3: pool 1
    prompt = jnp.asarray(np.random.default_rng(0).integers(1, 256, (4, 15)), jnp.int32)
    prompt_mask = jnp.arange(15)[None] < jnp.array([[15], [3], [9], [1]])

    def run():
        m = nnx.merge(graphdef, state)
        cache = PagedKVCache(k, v, table, jnp.zeros((4,), jnp.int32))
        logits, cache = m.forward_cached(prompt, cache, prompt_mask)
        steps = []
        for step in range(3):  # row 0 crosses its block edge (slot 15 → 17)
            token = jnp.argmax(logits, axis=-1)[:, None]
            live = jnp.array([[True], [step != 1], [True], [step == 0]])
            new_logits, cache = m.forward_cached(token, cache, live)
            logits = jnp.where(live, new_logits, logits)  # an idle row's logits are unused: keep its last
            steps.append(logits)
        return jnp.stack(steps), cache

    xla_logits, xla_cache = jax.jit(run)()
    monkeypatch.setattr(decoder, "resolve_paged_backend", lambda *_: "triton")
    calls = _record_calls(monkeypatch, decode_gpu, "paged_decode_attention")
    mlp_calls = _record_calls(monkeypatch, mlp_gpu, "gate_up_silu")
    kernel_logits, kernel_cache = jax.jit(lambda: run())()
    assert len(calls) == 3 * model.config.num_layers, f"the kernel ran {len(calls)} times"
    assert mlp_calls == [(4, model.config.hidden_size)] * (3 * model.config.num_layers), mlp_calls  # decode steps only
    scale = float(jnp.max(jnp.abs(xla_logits)))
    diff = float(jnp.max(jnp.abs(kernel_logits - xla_logits)))
    assert diff <= _tolerance(jnp.float32, scale, 18) * max(scale, 1.0), f"logits differ by {diff}"
    for ours, theirs in zip(jax.tree.leaves(kernel_cache), jax.tree.leaves(xla_cache), strict=True):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), atol=1e-5 * max(scale, 1.0), rtol=0)


MLP_WIDTH = 192  # the compiled decoder's F: XLA's merged gate|up GEMM writes [64, 2F]


def _gpu_decode_hlo(attention: str) -> str:
    """A 2-layer tiny decoder's one-token paged decode step (bf16 pools, 64 rows of Qwen2.5-0.5B's
    attention shape) compiled by XLA:GPU for an H100 from this host."""
    from flax import nnx

    from llds_jax.models import PagedKVCache, init_paged_pools
    from llds_jax.models.testing import tiny_model
    from llds_jax.parallel.mesh import make_mesh
    from llds_jax.plan.targets import gpu_target

    mesh = make_mesh((1, 1, 1), [gpu_target("h100", 1, 1).devices[0]])
    model = tiny_model("qwen2", num_heads=14, num_kv_heads=2, head_dim=64, hidden_size=128, intermediate_size=MLP_WIDTH,
                       attention=attention)
    graphdef, state = nnx.split(model)
    batch, columns, block = 64, 8, 128
    k, v = init_paged_pools(model.config, 1, batch * columns, block, jnp.bfloat16)
    cache = PagedKVCache(k, v, jnp.zeros((batch, columns), jnp.int32), jnp.zeros((batch,), jnp.int32))

    def step(state, cache, tokens, live):
        return nnx.merge(graphdef, state).forward_cached(tokens, cache, live)

    replicated = jax.NamedSharding(mesh, jax.P())
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
                            (state, cache, jnp.zeros((batch, 1), jnp.int32), jnp.ones((batch, 1), bool)))
    with jax.set_mesh(mesh):
        return jax.jit(step, donate_argnums=1).lower(*abstract).compile().as_text()


def _target_missing() -> str:
    from llds_jax.plan.targets import target_installed

    return target_installed("gpu")


@pytest.mark.integration
@pytest.mark.skipif(bool(_target_missing()), reason=_target_missing() or "installed")
def test_xla_gpu_runs_one_triton_kernel_per_layer_and_no_host_driven_loop():
    hlo = _gpu_decode_hlo("auto")
    kernels = re.findall(r'custom_call_target="__gpu\$xla\.gpu\.triton"', hlo)
    assert len(kernels) == 4, f"{len(kernels)} Triton kernels for 2 layers (attention and gate/up each)"
    assert "paged_decode_attention_gpu" in hlo and mlp_gpu.NAME in hlo
    assert f"[64,{2 * MLP_WIDTH}]" not in hlo, "XLA's gate|up GEMM beside the kernel"
    for line in hlo.splitlines():  # every while left runs a constant number of times
        if re.search(r"= .* while\(", line):
            assert '"known_trip_count"' in line, line.strip()[:200]
    assert not re.search(r"\bconditional\(", hlo)
    # model.attention="xla_blockwise" keeps the XLA loop: a while whose trip count the host decides
    xla = _gpu_decode_hlo("xla_blockwise")
    loops = [line for line in xla.splitlines() if re.search(r"= .* while\(", line)]
    assert loops and not all('"known_trip_count"' in line for line in loops)
    assert f"[64,{2 * MLP_WIDTH}]" in xla and mlp_gpu.NAME not in xla  # and XLA's GEMMs for the MLP


def _against_fp64_oracle(model: str, dtype, *, batch: int, columns: int, block: int, splits, interpret: bool):
    """The kernel on random rows (lengths from 0 to full, blocks scattered) against a float64
    numpy softmax over each row's keys gathered through its table. Returns (diff, tolerance)."""
    heads, kv_heads, head_dim = SHAPES[model]
    rng = np.random.default_rng(7)
    blocks = batch * columns
    lengths = rng.integers(0, columns * block + 1, batch)
    lengths[:3] = (0, 1, columns * block)
    table = rng.permutation(blocks).reshape(batch, columns).astype(np.int32)
    q = rng.standard_normal((batch, heads, head_dim)).astype(np.float32)
    pools = rng.standard_normal((2, 1, blocks, kv_heads, block, head_dim)).astype(np.float32)
    q, pools = (np.asarray(jnp.asarray(x).astype(dtype).astype(jnp.float32)) for x in (q, pools))  # dtype's values
    out = decode_gpu.paged_decode_attention(
        jnp.asarray(q, dtype), jnp.asarray(pools[0], dtype), jnp.asarray(pools[1], dtype), jnp.asarray(table),
        jnp.asarray(lengths, jnp.int32), splits=splits, interpret=interpret)
    out = np.asarray(out.astype(jnp.float32)).astype(np.float64)
    want = np.zeros_like(out)
    group = heads // kv_heads
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        k, v = (pool[0, table[b]].transpose(1, 0, 2, 3).reshape(kv_heads, -1, head_dim)[:, :n] for pool in pools)
        grouped = q[b].reshape(kv_heads, group, head_dim).astype(np.float64)
        scores = np.einsum("kgd,ksd->kgs", grouped, k.astype(np.float64)) / np.sqrt(head_dim)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        want[b] = (np.einsum("kgs,ksd->kgd", probs, v.astype(np.float64)) / probs.sum(-1, keepdims=True)
                   ).reshape(heads, head_dim)
    assert np.all(out[lengths == 0] == 0)
    return float(np.max(np.abs(out - want))), _tolerance(dtype, float(np.max(np.abs(pools[1]))), columns * block)


@pytest.mark.integration
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (JAX_PLATFORMS=cuda)")
@pytest.mark.parametrize("splits", [None, 1])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("model", sorted(SHAPES))
def test_on_a_gpu_the_compiled_kernel_matches_a_float64_oracle(model, dtype, splits):
    """The Triton-compiled kernel at the rollout's shapes: 128-slot blocks, 2048-slot tables."""
    diff, tol = _against_fp64_oracle(model, dtype, batch=64, columns=16, block=128, splits=splits, interpret=False)
    assert diff <= tol, f"{diff} > {tol}"


def _bf16_decode_logits(attention: str) -> np.ndarray:
    """A tiny bf16 decoder's logits after a paged prefill and after each of four one-token steps."""
    from flax import nnx

    from llds_jax.models import PagedKVCache, init_paged_pools
    from llds_jax.models.testing import tiny_model

    model = tiny_model("qwen2", dtype="bfloat16", attention=attention)
    graphdef, state = nnx.split(model)
    k, v = init_paged_pools(model.config, 1, 8, BLOCK)
    table = jnp.array([[0, 1, 8], [2, 8, 8], [3, 4, 5], [6, 8, 8]], jnp.int32)
    prompt = jnp.asarray(np.random.default_rng(0).integers(1, 256, (4, 20)), jnp.int32)
    prompt_mask = jnp.arange(20)[None] < jnp.array([[20], [3], [12], [1]])
    tokens = jnp.asarray(np.random.default_rng(1).integers(1, 256, (4, 4)), jnp.int32)

    @jax.jit
    def run(state):
        m = nnx.merge(graphdef, state)
        logits, cache = m.forward_cached(prompt, PagedKVCache(k, v, table, jnp.zeros((4,), jnp.int32)), prompt_mask)
        steps = [logits]
        for token in tokens.T:  # fixed tokens: an argmax near a tie could flip and part the two runs
            logits, cache = m.forward_cached(token[:, None], cache)
            steps.append(logits)
        return jnp.stack(steps)

    return np.asarray(run(state))


@pytest.mark.integration
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (JAX_PLATFORMS=cuda)")
def test_on_a_gpu_the_decoder_decodes_through_the_kernel_what_it_decodes_through_the_xla_loop():
    """model.attention="auto" (the kernel) against "xla_blockwise" (the XLA loop): logits within
    bf16 rounding."""
    kernel, xla = _bf16_decode_logits("auto"), _bf16_decode_logits("xla_blockwise")
    scale = float(np.max(np.abs(xla)))
    assert float(np.max(np.abs(kernel - xla))) <= 4 * float(jnp.finfo(jnp.bfloat16).eps) * max(scale, 1.0)
