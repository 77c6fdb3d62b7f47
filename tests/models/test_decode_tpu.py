"""The Pallas TPU decode kernel (models/attention/decode_tpu.py), run in Pallas' interpreter on
this CPU: attention equals the naive oracle over the cache the scatter would have written, the
cache it returns equals that cache, and no row reads past its own live blocks.

Tolerance: outputs are convex combinations of O(1) values, so fp32 rounding bounds them by a few
ulp of 1 (the blockwise kernel's TOL); bf16 caches are compared with the oracle fed the same
bf16 keys and values, where only the fp32 summation order differs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llds_jax.models.attention import AttentionMask, attend_cached, naive_attention
from llds_jax.models.attention.decode_tpu import decode_and_write, decode_block, row_tile

pytestmark = pytest.mark.unit

TOL = 1e-5
SLOTS = 64


def _case(heads: int, kv_heads: int, dtype, *, head_dim: int = 16, seed: int = 0):
    """Four rows: mid-cache, late, a finished row (its token masked), slot 0; slot 3 is a hole."""
    keys = jax.random.split(jax.random.key(seed), 5)
    batch = 4
    q = jax.random.normal(keys[0], (batch, 1, heads, head_dim))
    k_cache = jax.random.normal(keys[1], (batch, kv_heads, SLOTS, head_dim)).astype(dtype)
    v_cache = jax.random.normal(keys[2], (batch, kv_heads, SLOTS, head_dim)).astype(dtype)
    k_new = jax.random.normal(keys[3], (batch, 1, kv_heads, head_dim))
    v_new = jax.random.normal(keys[4], (batch, 1, kv_heads, head_dim))
    slot = jnp.array([[9], [40], [63], [0]])
    token = jnp.array([[True], [True], [False], [True]])
    ids = jnp.arange(SLOTS)[None]
    valid = ((ids < slot) & (ids != 3)).at[jnp.arange(batch)[:, None], slot].set(token)
    return q, k_new, v_new, k_cache, v_cache, AttentionMask.cached(slot, valid)


def _scattered(k_new, v_new, k_cache, v_cache, mask):
    rows = jnp.arange(k_cache.shape[0])[:, None]
    return (k_cache.at[rows, :, mask.query_index].set(k_new.astype(k_cache.dtype), mode="drop"),
            v_cache.at[rows, :, mask.query_index].set(v_new.astype(v_cache.dtype), mode="drop"))


@pytest.mark.codegen_sensitive
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (2, 2)])
def test_kernel_matches_the_oracle_and_writes_what_the_scatter_writes(heads, kv_heads, dtype):
    q, k_new, v_new, k_cache, v_cache, mask = _case(heads, kv_heads, dtype)
    k_all, v_all = _scattered(k_new, v_new, k_cache, v_cache, mask)
    oracle = naive_attention(q, *(x.astype(jnp.float32).transpose(0, 2, 1, 3) for x in (k_all, v_all)), mask)
    out, k_out, v_out = decode_and_write(q, k_new, v_new, k_cache, v_cache, mask, block=16, interpret=True)
    np.testing.assert_array_equal(np.asarray(k_out.astype(jnp.float32)), np.asarray(k_all.astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(v_out.astype(jnp.float32)), np.asarray(v_all.astype(jnp.float32)))
    diff = float(jnp.max(jnp.abs(out - oracle)))
    assert diff <= TOL, f"decode kernel differs from the oracle by {diff}"


@pytest.mark.codegen_sensitive
def test_a_slot_past_the_cache_is_dropped_like_the_scatter_drops_it():
    q, k_new, v_new, k_cache, v_cache, mask = _case(4, 2, jnp.float32)
    full = AttentionMask.cached(mask.query_index.at[1, 0].set(SLOTS), mask.key_valid.at[1].set(True))
    k_all, v_all = _scattered(k_new, v_new, k_cache, v_cache, full)
    oracle = naive_attention(q, k_all.transpose(0, 2, 1, 3), v_all.transpose(0, 2, 1, 3), full)
    out, k_out, _ = decode_and_write(q, k_new, v_new, k_cache, v_cache, full, block=16, interpret=True)
    np.testing.assert_array_equal(np.asarray(k_out[1]), np.asarray(k_cache[1]))
    assert float(jnp.max(jnp.abs(out - oracle))) <= TOL


@pytest.mark.codegen_sensitive
def test_each_row_reads_only_its_own_live_blocks():
    """NaN in every slot from a row's first block past its slot on cannot reach its output (the
    oracle over the same poisoned cache turns 0 x NaN into NaN: checked, so the test can fail),
    and the slot's stale old content (here 1e4: inside a block that is read, so finite, as a
    real cache's is) counts for nothing."""
    q, k_new, v_new, k_cache, v_cache, mask = _case(4, 2, jnp.float32)
    block = 16
    slot = mask.query_index[:, 0]
    ids = jnp.arange(SLOTS)[None, None, :, None]
    first_unread = (-(-slot // block) * block)[:, None, None, None]
    unread, stale = ids >= first_unread, ids == slot[:, None, None, None]
    bad_k, bad_v = (jnp.where(unread, jnp.nan, jnp.where(stale, 1e4, x)) for x in (k_cache, v_cache))
    clean, _, _ = decode_and_write(q, k_new, v_new, k_cache, v_cache, mask, block=block, interpret=True)
    poisoned, k_out, _ = decode_and_write(q, k_new, v_new, bad_k, bad_v, mask, block=block, interpret=True)
    np.testing.assert_array_equal(np.asarray(poisoned), np.asarray(clean))
    rows = jnp.arange(4)
    in_cache = slot < SLOTS
    np.testing.assert_array_equal(np.asarray(k_out[rows, :, jnp.minimum(slot, SLOTS - 1)][in_cache]),
                                  np.asarray(k_new[:, 0][in_cache]))
    assert np.isnan(np.asarray(naive_attention(q, bad_k.transpose(0, 2, 1, 3), bad_v.transpose(0, 2, 1, 3),
                                               mask))).any()


@pytest.mark.codegen_sensitive
def test_attend_cached_on_the_blockwise_path_equals_the_kernel():
    """The two implementations of one contract: ``attend_cached`` with xla_blockwise (every
    backend but TPU) and the kernel return the same attention and caches."""
    q, k_new, v_new, k_cache, v_cache, mask = _case(6, 2, jnp.float32)
    ours = decode_and_write(q, k_new, v_new, k_cache, v_cache, mask, block=16, interpret=True)
    theirs = attend_cached(q, k_new, v_new, k_cache, v_cache, mask, "xla_blockwise")
    for a, b in zip(ours[1:], theirs[1:], strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(jnp.max(jnp.abs(ours[0] - theirs[0]))) <= TOL


@pytest.mark.parametrize("slots,block,dtype,expected", [
    (2048, 128, jnp.bfloat16, 128), (64, 128, jnp.float32, 64), (96, 128, jnp.float32, 96),
    (320, 128, jnp.bfloat16, 64), (40, 128, jnp.bfloat16, None), (12, 128, jnp.float32, None)])
def test_decode_block_divides_the_cache_in_whole_memory_tiles(slots, block, dtype, expected):
    assert decode_block(slots, block, dtype) == expected
    if expected is not None:
        assert slots % expected == 0 and expected % row_tile(dtype) == 0


@pytest.mark.codegen_sensitive
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_the_decoder_through_the_kernel_decodes_what_it_decodes_through_blockwise(family, monkeypatch):
    """The decoder's cached forward with the kernel swapped in (as on TPU, interpreted here):
    prefill (blockwise either way), then one-token steps whose logits and caches match the
    blockwise decoder's — the layers thread the kernel's written caches correctly."""
    from llds_jax.models import decoder, init_cache
    from llds_jax.models.attention import decode_tpu
    from llds_jax.models.testing import tiny_model

    model = tiny_model(family)
    prompt = jnp.array([[5, 6, 7, 8, 9], [0, 0, 11, 12, 13]])
    prompt_mask = prompt != 0

    def run():
        logits, cache = model.forward_cached(prompt, init_cache(model.config, batch=2, max_len=32), prompt_mask)
        steps = []
        for step in range(3):
            token = jnp.argmax(logits, axis=-1)[:, None]
            live = jnp.array([[True], [step < 1]])  # row 1 finishes after one token
            logits, cache = model.forward_cached(token, cache, live)
            steps.append(logits)
        return jnp.stack(steps), cache

    # Jitted, so the interpreted kernel runs as one program; a fresh lambda each time, so the second
    # call traces again (jit caches by function) with the kernel swapped in.
    blockwise_logits, blockwise_cache = jax.jit(lambda: run())()
    monkeypatch.setattr(decoder, "resolve_backend", lambda *_: "splash")
    calls = []

    def interpreted(*args, **kwargs):
        calls.append(args[0].shape)
        return kernel(*args, **kwargs, interpret=True)

    kernel = decode_tpu.decode_and_write  # counted as traced: the unrolled layers trace it once a call
    monkeypatch.setattr(decode_tpu, "decode_and_write", interpreted)
    kernel_logits, kernel_cache = jax.jit(lambda: run())()
    assert len(calls) == 3 * model.config.num_layers, f"the kernel ran {len(calls)} times"
    scale = float(jnp.max(jnp.abs(blockwise_logits)))
    diff = float(jnp.max(jnp.abs(kernel_logits - blockwise_logits)))
    assert diff <= TOL * max(scale, 1.0), f"logits differ by {diff} (scale {scale})"
    for ours, theirs in zip(jax.tree.leaves(kernel_cache), jax.tree.leaves(blockwise_cache), strict=True):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), atol=TOL * max(scale, 1.0), rtol=0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_paged_kernel_reads_each_rows_blocks_through_its_table_like_the_dense_kernel(dtype):
    """The same four rows with their 16-slot blocks scattered over a pool (NaN in every block no
    table names, so a read outside a row's own blocks would show): the output equals the dense
    kernel's bit for bit (same arithmetic, other addresses), and the new keys land where the
    table says; the masked row writes nothing."""
    from llds_jax.models.attention.decode_tpu import paged_decode_and_write

    q, k_new, v_new, k_cache, v_cache, _ = _case(4, 2, dtype)
    block, columns, blocks = 16, SLOTS // 16, 24
    slot = jnp.array([9, 40, 63, 0])
    token = jnp.array([True, True, False, True])
    ids = jnp.arange(SLOTS)[None]
    dense_mask = AttentionMask.cached(slot[:, None], (ids < slot[:, None]) | ((ids == slot[:, None]) & token[:, None]))
    table = np.random.default_rng(0).permutation(blocks)[:4 * columns].reshape(4, columns).astype(np.int32)

    def pool_of(cache):  # [B, KVH, S, Dh] -> [1, NB, KVH, block, Dh] through the table; NaN elsewhere
        pool = jnp.full((blocks, cache.shape[1], block, cache.shape[3]), jnp.nan, cache.dtype)
        for b in range(4):
            for c in range(columns):
                pool = pool.at[table[b, c]].set(cache[b, :, c * block:(c + 1) * block])
        return pool[None]

    k_pool, v_pool = pool_of(k_cache), pool_of(v_cache)
    dense, k_all, _ = decode_and_write(q, k_new, v_new, k_cache, v_cache, dense_mask, block=block, interpret=True)
    paged, k_out, _ = paged_decode_and_write(q, k_new, v_new, k_pool, v_pool, jnp.asarray(table), slot, token,
                                             interpret=True)
    np.testing.assert_array_equal(np.asarray(paged[token].astype(jnp.float32)),
                                  np.asarray(dense[token].astype(jnp.float32)))
    written = jnp.where(token[:, None, None, None], k_all, k_cache)  # the dense kernel writes masked rows too
    np.testing.assert_array_equal(np.asarray(pool_of(written)[0].astype(jnp.float32)),
                                  np.asarray(k_out[0].astype(jnp.float32)))
