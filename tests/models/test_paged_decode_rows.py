"""The paged TPU decode kernel's rows-per-program schedule (models/attention/decode_tpu.py,
``_paged_rows_kernel``), run in Pallas' interpreter on this CPU against the XLA paged path
(``attend_paged`` with ``xla_blockwise``): row counts around the program size (1, R - 1, R, R + 3:
a partial program, one full, one full plus a padded one, whose first block is prefetched by the
one before), two copy streams (as on a two-TensorCore chip), live lengths 0 to a full table, rows
whose token is not real, several KV heads and query groups; and, compile-only, that XLA:TPU's
real compiler lowers it at the paper's v5e decode shape in ``ceil(rows / R)`` programs a layer.

Tolerance: the blockwise kernel's (``test_attention.TOL``): outputs are convex combinations of
O(1) values and only the fp32 summation order differs (the new key first); the pools are compared
exactly (both write the same cast values).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llds_jax.models.attention.decode_tpu import ROWS_PER_PROGRAM, paged_decode_and_write
from llds_jax.models.attention.paged import attend_paged

pytestmark = pytest.mark.unit

TOL = 1e-5
BLOCK, COLUMNS, HEAD_DIM = 16, 4, 16
# (slot of the new token, whether it is real), cycled over the rows: mid-block, empty (slot 0),
# the table's last slot (reads every block), a finished row, a slot past the table (dropped, not
# attended), a block boundary (the new key opens a block), two more finished or mid rows.
ROWS = [(9, True), (0, True), (63, True), (40, False), (64, True), (16, True), (33, True), (17, False),
        (5, True), (48, True), (31, True)]


def _rows_case(rows: int, heads: int, kv_heads: int, dtype, *, seed: int = 0):
    """q, k_new, v_new, pools [1, NB, KVH, BLOCK, Dh], table, slot, real for ``rows`` rows cycling over ROWS.

    Each row holds the blocks up to the one its new token goes to (the rest of its table is
    unallocated, ``NB``), drawn at random from a pool with spare blocks; blocks no row holds are NaN."""
    spec = [ROWS[b % len(ROWS)] for b in range(rows)]
    slot = jnp.array([s for s, _ in spec], jnp.int32)
    real = jnp.array([r for _, r in spec])
    blocks = rows * COLUMNS + 3
    keys = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(keys[0], (rows, 1, heads, HEAD_DIM))
    k_new = jax.random.normal(keys[1], (rows, 1, kv_heads, HEAD_DIM))
    v_new = jax.random.normal(keys[2], (rows, 1, kv_heads, HEAD_DIM))
    order = np.random.default_rng(seed).permutation(blocks)
    table = np.full((rows, COLUMNS), blocks, np.int32)
    for b, (s, _) in enumerate(spec):
        holds = min(s // BLOCK + 1, COLUMNS)
        table[b, :holds] = order[b * COLUMNS:b * COLUMNS + holds]
    held = np.isin(np.arange(blocks), table)[None, :, None, None, None]
    k_pool, v_pool = (jnp.where(held, jax.random.normal(key, (1, blocks, kv_heads, BLOCK, HEAD_DIM)), jnp.nan)
                      .astype(dtype) for key in keys[3:])
    return q, k_new, v_new, k_pool, v_pool, jnp.asarray(table), slot, real


def _kernel(case, **kwargs):
    q, k_new, v_new, k_pool, v_pool, table, slot, real = case
    return paged_decode_and_write(q, k_new, v_new, k_pool, v_pool, table, slot, real, interpret=True, **kwargs)


def _reference(case):
    q, k_new, v_new, k_pool, v_pool, table, slot, real = case
    return attend_paged(q, k_new, v_new, k_pool, v_pool, table, slot[:, None], real[:, None], "xla_blockwise")


def _assert_new_value_only(out, case):
    """A row whose token is not real reads nothing: its output is its new value, per query head."""
    q, _, v_new, k_pool, _, _, _, real = case
    group = q.shape[2] // v_new.shape[2]
    expected = jnp.repeat(v_new.astype(k_pool.dtype).astype(q.dtype), group, axis=2)
    np.testing.assert_array_equal(np.asarray(out[~real]), np.asarray(expected[~real]))


# The row counts around a program's ROWS_PER_PROGRAM are bookkeeping (which rows a program holds), the same
# under either code generator; the arithmetic is the same kernel body in every case, so one fp32 and the bf16
# case carry the numeric re-run under the host's default code generator (tests/codegen_sensitive.py).
@pytest.mark.parametrize("rows,heads,kv_heads,dtype,streams", [
    (1, 6, 2, jnp.float32, 1), (ROWS_PER_PROGRAM - 1, 6, 2, jnp.float32, 1), (ROWS_PER_PROGRAM, 4, 4, jnp.float32, 1),
    pytest.param(ROWS_PER_PROGRAM + 3, 6, 2, jnp.float32, 1, marks=pytest.mark.codegen_sensitive),
    pytest.param(ROWS_PER_PROGRAM + 3, 4, 1, jnp.bfloat16, 1, marks=pytest.mark.codegen_sensitive),
    (3 * ROWS_PER_PROGRAM + 3, 6, 2, jnp.float32, 2)])
def test_the_rows_kernel_attends_and_writes_what_the_xla_paged_path_does(rows, heads, kv_heads, dtype, streams):
    case = _rows_case(rows, heads, kv_heads, dtype)
    real = case[-1]
    out, k_pool, v_pool = _kernel(case, streams=streams)
    ref, k_ref, v_ref = _reference(case)
    for ours, theirs in ((k_pool, k_ref), (v_pool, v_ref)):  # NaN where no row holds the block, on both sides
        np.testing.assert_array_equal(np.asarray(ours.astype(jnp.float32)), np.asarray(theirs.astype(jnp.float32)))
    assert bool(jnp.all(jnp.isfinite(out)))
    diff = float(jnp.max(jnp.abs(out[real] - ref[real])))
    assert diff <= TOL, f"rows kernel differs from the XLA paged path by {diff}"
    _assert_new_value_only(out, case)


@pytest.mark.codegen_sensitive
def test_each_row_reads_only_its_own_live_blocks_and_a_finished_row_none():
    """NaN in every block outside the real rows' live blocks (a finished row's blocks, the block a
    row's new token opens, the unreached rest of the pool): the outputs equal the clean pool's bit
    for bit. The XLA path over the same pool does read a poisoned block (its loop runs to the
    furthest row; 0 x NaN is NaN): checked, so the test can fail."""
    case = _rows_case(ROWS_PER_PROGRAM + 3, 6, 2, jnp.float32)
    q, k_new, v_new, k_pool, v_pool, table, slot, real = case
    live = np.where(np.asarray(real), -(-np.asarray(slot) // BLOCK), 0)
    read = np.zeros(k_pool.shape[1], bool)
    for b, n in enumerate(live):
        read[np.asarray(table)[b, :min(n, COLUMNS)]] = True
    read = jnp.asarray(read)[None, :, None, None, None]
    poisoned = (q, k_new, v_new, jnp.where(read, k_pool, jnp.nan), jnp.where(read, v_pool, jnp.nan), table, slot, real)
    clean, _, _ = _kernel(case)
    dirty, _, _ = _kernel(poisoned)
    np.testing.assert_array_equal(np.asarray(dirty), np.asarray(clean))
    _assert_new_value_only(dirty, poisoned)
    assert np.isnan(np.asarray(_reference(poisoned)[0][real])).any()


@pytest.mark.codegen_sensitive
def test_under_a_mesh_each_device_runs_the_kernel_over_its_own_rows_and_pool():
    """Rows and pools split over a 2-device data axis (the engine's layout): each device's rows
    (padded to a program there) read and write only its own pool; the result is each half's alone."""
    from llds_jax.parallel.mesh import make_mesh

    halves = [_rows_case(5, 6, 2, jnp.float32, seed=seed) for seed in (1, 2)]
    joined = [jnp.concatenate(parts, axis=0) for parts in zip(*halves, strict=True)]
    joined[3], joined[4] = (jnp.concatenate([h[i] for h in halves], axis=0) for i in (3, 4))  # [2, NB, ...]
    mesh = make_mesh((2, 1, 1), jax.devices()[:2])
    rows = jax.NamedSharding(mesh, jax.P("data"))
    with jax.set_mesh(mesh):
        out, k_pool, v_pool = jax.jit(lambda *a: _kernel(a))(*(jax.device_put(x, rows) for x in joined))
    for d, half in enumerate(halves):
        ours, k_ours, v_ours = _kernel(half)
        np.testing.assert_array_equal(np.asarray(out[5 * d:5 * (d + 1)]), np.asarray(ours))
        np.testing.assert_array_equal(np.asarray(k_pool[d]), np.asarray(k_ours[0]))
        np.testing.assert_array_equal(np.asarray(v_pool[d]), np.asarray(v_ours[0]))


@pytest.mark.codegen_sensitive
def test_the_decoder_through_the_rows_kernel_decodes_what_it_decodes_through_the_xla_loop(monkeypatch):
    """A tiny decoder's paged decode with the TPU kernel forced (interpreted here): prefill (the XLA
    path either way), then one-token steps, a row idle for some, one crossing a block edge; the
    logits match the XLA loop's and the pools are written identically."""
    from flax import nnx

    from llds_jax.models import PagedKVCache, decoder, init_paged_pools
    from llds_jax.models.attention import decode_tpu
    from llds_jax.models.testing import tiny_model

    model = tiny_model("qwen2")
    graphdef, state = nnx.split(model)
    k, v = init_paged_pools(model.config, 1, 8, BLOCK)
    table = jnp.array([[0, 3, 8, 8], [1, 2, 8, 8], [4, 8, 8, 8], [5, 6, 7, 8]], jnp.int32)
    prompt = jnp.asarray(np.random.default_rng(0).integers(1, 256, (4, 15)), jnp.int32)
    prompt_mask = jnp.arange(15)[None] < jnp.array([[15], [3], [9], [1]])

    def run():
        m = nnx.merge(graphdef, state)
        cache = PagedKVCache(k, v, table, jnp.zeros((4,), jnp.int32))
        logits, cache = m.forward_cached(prompt, cache, prompt_mask)
        steps = []
        for step in range(3):  # row 0 crosses its block edge (slot 15 -> 17)
            token = jnp.argmax(logits, axis=-1)[:, None]
            live = jnp.array([[True], [step != 1], [True], [step == 0]])
            new_logits, cache = m.forward_cached(token, cache, live)
            logits = jnp.where(live, new_logits, logits)  # an idle row's logits are unused: keep its last
            steps.append(logits)
        return jnp.stack(steps), cache

    xla_logits, xla_cache = jax.jit(run)()
    monkeypatch.setattr(decoder, "resolve_paged_backend", lambda *_: "splash")
    calls = []
    kernel = decode_tpu.paged_decode_and_write

    def interpreted(*args, **kwargs):
        calls.append(args[0].shape)
        return kernel(*args, **kwargs, interpret=True)

    monkeypatch.setattr(decode_tpu, "paged_decode_and_write", interpreted)
    kernel_logits, kernel_cache = jax.jit(lambda: run())()
    assert len(calls) == 3 * model.config.num_layers, f"the kernel ran {len(calls)} times"
    scale = float(jnp.max(jnp.abs(xla_logits)))
    diff = float(jnp.max(jnp.abs(kernel_logits - xla_logits)))
    assert diff <= TOL * max(scale, 1.0), f"logits differ by {diff} (scale {scale})"
    for ours, theirs in zip(jax.tree.leaves(kernel_cache), jax.tree.leaves(xla_cache), strict=True):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), atol=TOL * max(scale, 1.0), rtol=0)


@pytest.mark.parametrize("rows,per_program,streams,grid", [
    (1, 8, 1, (1, 1)), (8, 8, 1, (1, 1)), (11, 8, 1, (1, 2)), (40, 8, 1, (1, 5)), (40, 16, 1, (1, 3)),
    (40, 8, 2, (2, 3))])
def test_one_program_serves_rows_per_program_rows_and_every_kv_head(rows, per_program, streams, grid):
    """The grid is (streams, ``ceil(rows / (R * streams))``) programs, whatever the KV heads (traced, not run)."""
    jaxpr = jax.make_jaxpr(lambda *a: _kernel(a, rows_per_program=per_program, streams=streams))(
        *_rows_case(rows, 6, 2, jnp.float32))
    grids = [eqn.params["grid_mapping"].grid for eqn in jaxpr.eqns if eqn.primitive.name == "pallas_call"]
    assert grids == [grid]


def test_fewer_than_eight_rows_per_program_is_refused():
    with pytest.raises(ValueError, match="rows_per_program"):
        _kernel(_rows_case(2, 2, 2, jnp.float32), rows_per_program=4)


@pytest.mark.integration
@pytest.mark.parametrize("model,rows,blocks", [("Qwen2.5-3B", 40, 247), ("Qwen2.5-0.5B", 320, 10240)])
def test_xla_tpu_compiles_the_rows_kernel_at_the_paper_decode_shape(model, rows, blocks):
    """Compile-only for one v5e chip (libtpu's compiler, as ``--mode=plan``): v5e-qwen3b's engine shape
    (``benchmarks/_decode_step.paper_targets``: 40 rows, 247 blocks of 128, 32 columns) and the
    device-check shape's 0.5B model (14 heads over 2: a query group of 7, Dh 64); one Mosaic
    custom call of ``ceil(rows / 8)`` programs in one copy stream (a v5e has one TensorCore)."""
    import os

    from llds_jax.models.loading import known_config
    from llds_jax.plan.targets import target_installed, tpu_target

    if missing := target_installed("tpu"):
        pytest.skip(missing)
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compile-only: claim no chip
    config = known_config(model)
    device = tpu_target("v5e:2x2").devices[0]
    mesh = jax.sharding.Mesh([device], ("x",))
    here = jax.NamedSharding(mesh, jax.P())

    def arr(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=here)

    kv, dh = config.num_kv_heads, config.head_dim
    args = (arr((rows, 1, config.num_heads, dh)), arr((rows, 1, kv, dh)), arr((rows, 1, kv, dh)),
            arr((1, blocks, kv, 128, dh)), arr((1, blocks, kv, 128, dh)), arr((rows, 32), jnp.int32),
            arr((rows,), jnp.int32), arr((rows,), jnp.bool_))
    with jax.set_mesh(mesh):  # Mosaic reads the target chip from the ambient mesh
        jaxpr = jax.make_jaxpr(paged_decode_and_write)(*args)
        compiled = jax.jit(paged_decode_and_write, donate_argnums=(3, 4)).lower(*args).compile()
    grids = [eqn.params["grid_mapping"].grid for eqn in jaxpr.eqns if eqn.primitive.name == "pallas_call"]
    assert grids == [(1, -(-rows // ROWS_PER_PROGRAM))]
    assert compiled.as_text().count('custom_call_target="tpu_custom_call"') == 1
