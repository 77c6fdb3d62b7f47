"""Attention backends against the naive oracle: values and gradients, every mask shape.

Tolerance: outputs are convex combinations of O(1) values and the gradients are sums of
at most S = 64 O(1) terms; the backends reorder fp32 sums (online softmax, block-wise
accumulation), so their differences are a few fp32 ulps x S ≈ 1e-6. The issue's bound
1e-5 leaves a 10x margin and still fails on any masking or grouping mistake (those
give differences of O(0.1)).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llds_jax.models.attention import (
    AttentionMask,
    attend,
    blockwise_attention,
    naive_attention,
    resolve_backend,
    splash_attention,
)
from llds_jax.models.attention.cudnn import (
    _THD_ARGUMENTS,
    PACKED_RUNS,
    cudnn_attention,
    cudnn_packed_available,
    packed_runs,
    rotated_dot_product_attention,
    rows_are_contiguous,
)
from llds_jax.models.config import ConfigError
from llds_jax.models.testing import tiny_config

pytestmark = pytest.mark.unit

TOL = 1e-5


def _qkv(batch, length, slots, heads, kv_heads, head_dim=16, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, length, heads, head_dim))
    k = rng.standard_normal((batch, slots, kv_heads, head_dim))
    v = rng.standard_normal((batch, slots, kv_heads, head_dim))
    return tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v))


def _seen(mask: AttentionMask) -> np.ndarray:
    """[B, T, 1, 1] True where the query sees at least one key (the rows parity covers)."""
    return np.asarray(mask.dense().any(-1))[:, :, None, None]


def _out_and_grads(attention, q, k, v, mask, weights):
    """attention's output and d/dq, d/dk, d/dv of sum(output * weights)."""
    out, pullback = jax.vjp(lambda q, k, v: attention(q, k, v, mask), q, k, v)
    return out, pullback(weights)


# Jitted once per shape for the module: the oracle side is the same program in many tests.
_naive_out_and_grads = jax.jit(functools.partial(_out_and_grads, naive_attention))


def _max_differences(fn, q, k, v, mask, rows=None):
    """max |fn - naive| of the outputs and of d/dq, d/dk, d/dv of a random projection of
    them, over the query ``rows`` [B, T] (default: every row that sees a key). Each side is
    one jitted program (compiling beats dispatching a while loop's ops one at a time)."""
    seen = _seen(mask) if rows is None else np.asarray(rows)[:, :, None, None]
    weights = jnp.asarray(np.random.default_rng(7).standard_normal(q.shape), jnp.float32) * seen
    ref, grads_ref = _naive_out_and_grads(q, k, v, mask, weights)
    got, grads_got = jax.jit(functools.partial(_out_and_grads, fn))(q, k, v, mask, weights)
    assert np.all(np.isfinite(np.asarray(got))), "a query row came out non-finite"
    out_diff = float(jnp.max(jnp.where(seen, jnp.abs(ref - got), 0.0)))
    return [out_diff] + [float(jnp.max(jnp.abs(a - b))) for a, b in zip(grads_ref, grads_got)]


LEFT_AND_RIGHT = np.array([[0, 0, 0] + [1] * 18 + [0] * 3,   # left pads, then right pads
                           [1] * 17 + [0] * 7,               # right padding
                           [1] * 24], bool)                  # no padding


@pytest.mark.codegen_sensitive
@pytest.mark.parametrize("block", [5, 8, 24, 512])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (4, 1)])
def test_blockwise_matches_naive_on_left_and_right_padding(block, heads, kv_heads):
    q, k, v = _qkv(3, 24, 24, heads, kv_heads)
    diffs = _max_differences(lambda *a: blockwise_attention(*a, block_size=block), q, k, v,
                             AttentionMask.causal(jnp.asarray(LEFT_AND_RIGHT)))
    assert max(diffs) <= TOL, f"block={block} GQA {heads}/{kv_heads}: |out|,|dq|,|dk|,|dv| differ by {diffs}"


@pytest.mark.codegen_sensitive
@pytest.mark.parametrize("query_block", [5, 8, 16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 1)])
def test_query_blocked_self_attention_matches_naive_on_left_and_right_padding(query_block, heads, kv_heads):
    q, k, v = _qkv(3, 24, 24, heads, kv_heads)
    diffs = _max_differences(lambda *a: blockwise_attention(*a, query_block=query_block), q, k, v,
                             AttentionMask.causal(jnp.asarray(LEFT_AND_RIGHT)))
    assert max(diffs) <= TOL, f"query_block={query_block} GQA {heads}/{kv_heads}: differences {diffs}"


@pytest.mark.codegen_sensitive
def test_a_query_block_never_reads_keys_past_its_own_last_query():
    """Queries 0..15 in pieces of 8 walk key blocks 0..1 only: NaN in keys/values 16.. cannot
    reach them (one [T, T] pass would read every key for every query: 0 x NaN = NaN)."""
    q, k, v = _qkv(2, 24, 24, 4, 2)
    mask = AttentionMask.causal(jnp.ones((2, 24), bool))
    blocked = jax.jit(lambda k, v: blockwise_attention(q, k, v, mask, query_block=8))  # one program, both calls
    clean = blocked(k, v)
    poisoned = blocked(k.at[:, 16:].set(jnp.nan), v.at[:, 16:].set(jnp.nan))
    np.testing.assert_array_equal(np.asarray(poisoned[:, :16]), np.asarray(clean[:, :16]))
    assert np.isnan(np.asarray(poisoned[:, 16:])).all()
    unblocked = jax.jit(lambda v: blockwise_attention(q, k, v, mask, block_size=24, query_block=24))(
        v.at[:, 16:].set(jnp.nan))
    assert np.isnan(np.asarray(unblocked[:, :16])).any(), "the one-pass form should read the poisoned values"


def test_long_sequences_get_longer_pieces_never_more_than_max_query_pieces():
    """Each piece is a key loop forward and backward: compile time follows their count."""
    from llds_jax.models.attention.blockwise import MAX_QUERY_PIECES, query_piece

    assert query_piece(512) == 128 and query_piece(4096) == 4096 // MAX_QUERY_PIECES
    q, k, v = _qkv(1, 64, 64, 4, 2)
    mask = AttentionMask.causal(jnp.ones((1, 64), bool))
    jaxpr = str(jax.make_jaxpr(lambda *a: blockwise_attention(*a, mask, query_block=2))(q, k, v))
    assert jaxpr.count("while[") == MAX_QUERY_PIECES, f"{jaxpr.count('while[')} key loops for 64 queries"


def _holey_cache_mask():
    """Two rows appending 3 tokens at different slots of a 40-slot cache with holes
    (right-padded earlier chunks left invalid slots inside the row) and left padding."""
    valid = np.zeros((2, 40), bool)
    valid[0, 2:9] = True      # left padding 0..1, prompt 2..8
    valid[0, 11:15] = True    # hole at 9..10 (an earlier chunk's right padding)
    valid[1, 0:20] = True
    valid[1, 5:8] = False     # a hole
    end = np.array([15, 20])
    slots = end[:, None] + np.arange(3)[None, :]
    token_mask = np.array([[1, 1, 0], [1, 1, 1]], bool)  # row 0 appends a right-padded chunk
    valid[np.arange(2)[:, None], slots] = token_mask
    return AttentionMask.cached(jnp.asarray(slots), jnp.asarray(valid))


@pytest.mark.codegen_sensitive
@pytest.mark.parametrize("block", [4, 7, 16, 512])
def test_blockwise_matches_naive_over_a_cache_with_holes(block):
    mask = _holey_cache_mask()
    q, k, v = _qkv(2, 3, 40, 4, 2)
    diffs = _max_differences(lambda *a: blockwise_attention(*a, block_size=block), q, k, v, mask)
    assert max(diffs) <= TOL, f"block={block}: |out|,|dq|,|dk|,|dv| differ by {diffs}"


@pytest.mark.codegen_sensitive
def test_query_with_no_visible_key_is_finite():
    """A left pad in a full-sequence forward sees nothing: the oracle averages all keys,
    blockwise the keys it read; both only need to be finite (the row is never used)."""
    q, k, v = _qkv(1, 9, 9, 4, 2)
    mask = AttentionMask.causal(jnp.asarray([[0, 0, 0, 0, 1, 1, 1, 1, 1]], bool))
    out, grads = jax.jit(functools.partial(_out_and_grads, lambda *a: blockwise_attention(*a, block_size=4)))(
        q, k, v, mask, jnp.ones_like(q))  # d/dq, d/dk, d/dv of sum(output)
    assert all(np.all(np.isfinite(np.asarray(x))) for x in (out, *grads))


@pytest.mark.codegen_sensitive
def test_decode_never_reads_key_blocks_past_the_furthest_query():
    """One-token decode at slot 9 of a 64-slot cache reads blocks 0..1 of 8 keys only:
    NaN written into slots 16.. cannot reach the output (the naive form, which reads
    every slot, turns 0 x NaN into NaN there — checked, so this test can fail)."""
    q, k, v = _qkv(2, 1, 64, 4, 2)
    valid = jnp.arange(64)[None, :] <= jnp.array([[9], [7]])
    mask = AttentionMask.cached(jnp.array([[9], [7]]), valid)
    blocked = jax.jit(lambda k, v: blockwise_attention(q, k, v, mask, block_size=8))  # each: one program, two calls
    naive = jax.jit(lambda k, v: naive_attention(q, k, v, mask))
    clean = blocked(k, v)
    poisoned_k, poisoned_v = k.at[:, 16:].set(jnp.nan), v.at[:, 16:].set(jnp.nan)
    poisoned = blocked(poisoned_k, poisoned_v)
    np.testing.assert_array_equal(np.asarray(poisoned), np.asarray(clean))
    assert np.isnan(np.asarray(naive(poisoned_k, poisoned_v))).any()
    diff = float(jnp.max(jnp.abs(clean - naive(k, v))))
    assert diff <= TOL, f"decode output differs from naive by {diff}"


@pytest.mark.codegen_sensitive
def test_causal_by_index_and_segment_ids_equal_our_mask_on_real_tokens():
    """What splash evaluates (t >= s and segment[t] == segment[s], pads segment 0) is our
    mask on every real query row; pad rows differ but see at least themselves."""
    rng = np.random.default_rng(3)
    real = rng.random((16, 20)) < 0.7
    ours = np.asarray(AttentionMask.causal(jnp.asarray(real)).dense())
    index = np.arange(20)
    splash_view = (index[:, None] >= index[None, :])[None] & (real[:, :, None] == real[:, None, :])
    np.testing.assert_array_equal(ours[real], splash_view[real])
    assert splash_view[~real].any(-1).all(), "a pad row would be empty for splash"


@pytest.mark.codegen_sensitive
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (2, 2)])
def test_splash_kernel_matches_naive_in_the_pallas_interpreter(heads, kv_heads):
    """The real splash kernel (interpreted on CPU) with our segment-id mapping and
    sequence padding to the 128-lane block: values and gradients on real-token rows
    (right-pad rows read earlier real keys in our mask, only pads in splash's)."""
    real = np.ones((2, 100), bool)
    real[0, :9] = False    # left padding
    real[1, 90:] = False   # right padding
    q, k, v = _qkv(2, 100, 100, heads, kv_heads)
    mask = AttentionMask.causal(jnp.asarray(real))
    diffs = _max_differences(lambda *a: splash_attention(*a, interpret=True), q, k, v, mask, rows=real)
    assert max(diffs) <= TOL, f"splash |out|,|dq|,|dk|,|dv| differ by {diffs}"


@pytest.mark.codegen_sensitive
def test_splash_kernel_keeps_packed_trajectories_apart_in_the_pallas_interpreter():
    """Packed rows (several trajectories per row, ``AttentionMask.packed``): splash's segment ids
    are one per trajectory, so values and gradients on real tokens equal the oracle's packed mask."""
    segments = np.zeros((2, 100), np.int32)
    segments[0, :30], segments[0, 30:75], segments[0, 75:96] = 1, 2, 3  # then padding
    segments[1, :60], segments[1, 60:] = 1, 2
    q, k, v = _qkv(2, 100, 100, 4, 2)
    mask = AttentionMask.packed(jnp.asarray(segments))
    diffs = _max_differences(lambda *a: splash_attention(*a, interpret=True), q, k, v, mask, rows=segments > 0)
    assert max(diffs) <= TOL, f"splash |out|,|dq|,|dk|,|dv| differ by {diffs}"


@pytest.mark.codegen_sensitive
def test_cudnn_rotation_to_right_padding_matches_naive():
    """The cuDNN path's rotation (left pads moved behind the row, per-row lengths),
    run through jax's reference kernel since this host has no cuDNN."""
    q, k, v = _qkv(3, 24, 24, 4, 2)
    mask = AttentionMask.causal(jnp.asarray(LEFT_AND_RIGHT))
    diffs = _max_differences(lambda q, k, v, m: rotated_dot_product_attention(q, k, v, m.key_valid, "xla"),
                             q, k, v, mask, rows=LEFT_AND_RIGHT)
    assert max(diffs) <= TOL, f"rotated |out|,|dq|,|dk|,|dv| differ by {diffs}"


@pytest.mark.codegen_sensitive
def test_cudnn_path_falls_back_to_blockwise_when_a_row_has_a_hole():
    holey = LEFT_AND_RIGHT.copy()
    holey[2, 10:12] = False
    assert bool(rows_are_contiguous(jnp.asarray(LEFT_AND_RIGHT)))
    assert not bool(rows_are_contiguous(jnp.asarray(holey)))
    assert bool(rows_are_contiguous(jnp.zeros((2, 5), bool))), "all-pad rows have no hole"
    q, k, v = _qkv(3, 24, 24, 4, 2)
    diffs = _max_differences(lambda *a: cudnn_attention(*a, implementation="xla"), q, k, v,
                             AttentionMask.causal(jnp.asarray(holey)))
    assert max(diffs) <= TOL, f"cudnn path on a holey row: |out|,|dq|,|dk|,|dv| differ by {diffs}"


def _thd_reference(q, k, v, *, q_seqlen, kv_seqlen, q_offsets, kv_offsets, scale):
    """cuDNN's packed ("THD") causal attention as its JAX entry point documents it, densely (this
    host has no cuDNN): run i of row b is tokens [offset, offset + length); a query reads earlier
    keys of its own run; a token in no run gets 0."""
    assert q_seqlen is kv_seqlen and q_offsets is kv_offsets, "self-attention: one description"
    length = q.shape[1]
    index = jnp.arange(length)
    begin, size = q_offsets[:, :-1, None], q_seqlen[:, :, None]
    inside = (size >= 0) & (index[None, None, :] >= begin) & (index[None, None, :] < begin + size)  # [B, M, T]
    covered = inside.any(1)
    run_begin = jnp.max(jnp.where(inside, begin, 0), axis=1)  # a token's run starts here
    index_b = jnp.broadcast_to(index, covered.shape).astype(jnp.int32)
    mask = AttentionMask(index_b, covered, True, key_start=jnp.where(covered, run_begin, index_b).astype(jnp.int32))
    dense = naive_attention(q, k, v, mask)
    assert scale == pytest.approx(q.shape[-1] ** -0.5)
    return jnp.where(covered[:, :, None, None], dense, 0.0)


def test_packed_runs_describe_each_segment_and_each_padding_run():
    segments = jnp.asarray([[1, 1, 1, 2, 2, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    offsets, lengths, runs = packed_runs(AttentionMask.packed(segments).key_start, max_runs=4)
    np.testing.assert_array_equal(offsets, [[0, 3, 5, -1, -1], [0, -1, -1, -1, -1]])
    np.testing.assert_array_equal(lengths, [[3, 2, 3, -1], [8, -1, -1, -1]])
    np.testing.assert_array_equal(runs, [3, 1])


@pytest.mark.codegen_sensitive
def test_cudnn_packed_layout_matches_naive_on_packed_rows():
    """The packed-row mapping (runs -> offsets and lengths) through a dense stand-in for cuDNN's
    packed kernel: values and gradients equal the oracle's packed mask on real tokens."""
    segments = np.zeros((2, 40), np.int32)
    segments[0, :11], segments[0, 11:25], segments[0, 25:33] = 1, 2, 3  # then padding
    segments[1, :5], segments[1, 5:40] = 1, 2
    q, k, v = _qkv(2, 40, 40, 4, 2)
    mask = AttentionMask.packed(jnp.asarray(segments))
    diffs = _max_differences(lambda *a: cudnn_attention(*a, packed_kernel=_thd_reference), q, k, v, mask,
                             rows=segments > 0)
    assert max(diffs) <= TOL, f"packed cuDNN layout |out|,|dq|,|dk|,|dv| differ by {diffs}"


def test_a_row_with_more_runs_than_the_packed_layout_holds_takes_the_blockwise_kernel():
    length = 2 * (PACKED_RUNS + 1)
    segments = jnp.asarray(np.repeat(np.arange(1, PACKED_RUNS + 2), 2)[None, :], jnp.int32)  # 65 runs of 2
    q, k, v = _qkv(1, length, length, 2, 1)
    poisoned = lambda q, *_, **__: jnp.full_like(q, jnp.nan)  # noqa: E731  (taken: the output is NaN)
    mask = AttentionMask.packed(segments)
    got = jax.jit(lambda *a: cudnn_attention(*a, mask, packed_kernel=poisoned))(q, k, v)
    np.testing.assert_allclose(got, naive_attention(q, k, v, mask), atol=TOL)


def test_the_private_cudnn_entry_point_still_takes_the_packed_arguments():
    """The packed path calls a private JAX module: fail here, on the JAX that CI installs, when its
    signature drifts (on a GPU host, ``cudnn_packed_available`` then falls back to blockwise)."""
    import inspect  # noqa: PLC0415

    from jax._src.cudnn import fused_attention_stablehlo as fused  # noqa: PLC0415

    assert _THD_ARGUMENTS <= set(inspect.signature(fused.dot_product_attention).parameters)
    assert hasattr(fused.MaskType, "PADDING_CAUSAL")
    if jax.default_backend() != "gpu":
        assert not cudnn_packed_available(), "no GPU in this process: the packed path must stay off"


@pytest.mark.parametrize("requested,platform,expected", [
    ("auto", "cpu", "xla_blockwise"), ("auto", "tpu", "splash"), ("auto", "gpu", "xla_blockwise"),
    ("xla_blockwise", "tpu", "xla_blockwise"), ("naive", "cpu", "naive"), ("splash", "tpu", "splash"),
])
def test_backend_is_resolved_from_the_target_platform(requested, platform, expected):
    """(This host has no cuDNN, so "auto" on a GPU target is the blockwise kernel.)"""
    assert resolve_backend(requested, platform) == expected


@pytest.mark.parametrize("requested,platform,message", [
    ("splash", "cpu", "model.attention='splash' needs a TPU; this program compiles for 'cpu'"),
    ("cudnn", "gpu", "model.attention='cudnn' needs an NVIDIA GPU with cuDNN"),
    ("flash", "cpu", "model.attention='flash': expected one of"),
])
def test_impossible_backend_requests_are_named(requested, platform, message):
    with pytest.raises(ConfigError, match=message):
        resolve_backend(requested, platform)


def test_config_rejects_an_unknown_attention_backend_by_name():
    with pytest.raises(ConfigError, match=r"attention='flash2': expected one of \('auto'"):
        tiny_config("qwen2", attention="flash2")


def test_attend_refuses_an_unresolved_backend():
    q, k, v = _qkv(1, 4, 4, 2, 2)
    with pytest.raises(ValueError, match="backend='auto' is not resolved"):
        attend(q, k, v, AttentionMask.causal(jnp.ones((1, 4), bool)), "auto")


@pytest.mark.codegen_sensitive
def test_float32_queries_under_cudnn_run_the_blockwise_kernel():
    """cuDNN's fused kernel takes half precision only (it raised on the first H100 run of an fp32
    job under "auto"): a float32 program resolved to "cudnn" computes with the blockwise kernel,
    bit for bit, and never reaches cuDNN (this host has none, so reaching it would raise)."""
    q, k, v = _qkv(2, 64, 64, 4, 2)
    mask = AttentionMask.causal(jnp.asarray(np.arange(64)[None, :] >= np.array([[0], [5]])))
    np.testing.assert_array_equal(np.asarray(attend(q, k, v, mask, "cudnn")),
                                  np.asarray(attend(q, k, v, mask, "xla_blockwise")))


def test_config_refuses_cudnn_for_a_float32_model():
    with pytest.raises(ConfigError, match=r"attention='cudnn' with dtype='float32'"):
        tiny_config("qwen2", attention="cudnn")
    assert tiny_config("qwen2", attention="cudnn", dtype="bfloat16").attention == "cudnn"
