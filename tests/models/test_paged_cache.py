"""The paged KV cache (pool + block table) gives the dense reference cache's logits bit for bit.

The bound is 0 ulp, not a tolerance: the paged read runs the dense blockwise kernel's ops in its
order on the same values (``attention/paged.py``: 128-slot blocks, the dense cache's key block,
``CACHED_BLOCK``), and the blocks one layout visits beyond the other's are fully masked, whose
online-softmax update is an exact no-op.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from llds_jax.models import PagedKVCache, init_cache, init_paged_pools
from llds_jax.models.testing import tiny_model

pytestmark = pytest.mark.unit

BLOCK = 128


def _jitted(model):
    graphdef, state = nnx.split(model)

    @jax.jit
    def cached(state, tokens, cache, token_mask):
        return nnx.merge(graphdef, state).forward_cached(tokens, cache, token_mask)

    return lambda tokens, mask, cache: cached(state, jnp.asarray(tokens), cache, jnp.asarray(mask))


def _right_padded(chunks):
    width = max(max(map(len, chunks)), 1)
    ids = np.zeros((len(chunks), width), np.int32)
    mask = np.zeros((len(chunks), width), bool)
    for i, row in enumerate(chunks):
        ids[i, :len(row)], mask[i, :len(row)] = row, True
    return ids, mask


def _run(model, cache, chunks_per_call, decode_masks):
    """Appends (right-padded chunks per row), then greedy decode steps with per-row masks; every call's logits."""
    cached = _jitted(model)
    out, logits = [], None
    for chunks in chunks_per_call:  # a row with no ids in a call keeps its logits (as the sessions do)
        ids, mask = _right_padded(chunks)
        new_logits, cache = cached(ids, mask, cache)
        logits = new_logits if logits is None else jnp.where(jnp.asarray(mask.any(axis=1))[:, None], new_logits, logits)
        out.append(np.asarray(logits))
    for active in decode_masks:
        token = np.asarray(jnp.argmax(logits, axis=-1))[:, None].astype(np.int32)
        new_logits, cache = cached(token, np.asarray(active)[:, None], cache)
        logits = jnp.where(jnp.asarray(active)[:, None], new_logits, logits)
        out.append(np.asarray(logits))
    return np.stack(out), cache


def _scattered_tables(rows: int, columns: int, blocks: int, devices: int, seed: int) -> np.ndarray:
    """Each row's blocks drawn at random from its own device's pool (no block shared)."""
    rng = np.random.default_rng(seed)
    per_device = rows // devices
    table = np.full((rows, columns), blocks, np.int32)
    for d in range(devices):
        free = rng.permutation(blocks)
        for r in range(per_device):
            table[d * per_device + r] = free[r * columns:(r + 1) * columns]
    return table


def test_paged_cache_gives_the_dense_caches_logits_bit_for_bit():
    """Rows cross block boundaries inside a prefill and an appended chunk; one row idles for some
    decode steps (its masked tokens are not written); blocks are scattered over the pool."""
    model = tiny_model("qwen2")
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(1, 256, n)) for n in (150, 40, 110, 7)]
    feedback = [list(rng.integers(1, 256, n)) for n in (60, 120, 5, 0)]
    decode_masks = [[True, True, step % 3 != 0, True] for step in range(20)]
    calls = [prompts, feedback]
    dense, dense_cache = _run(model, init_cache(model.config, 4, 384), calls, decode_masks)
    k, v = init_paged_pools(model.config, 1, 16, BLOCK)
    table = _scattered_tables(4, 3, 16, 1, seed=0)
    paged, paged_cache = _run(model, PagedKVCache(k, v, jnp.asarray(table), jnp.zeros((4,), jnp.int32)), calls,
                              decode_masks)
    np.testing.assert_array_equal(paged, dense)
    np.testing.assert_array_equal(np.asarray(paged_cache.end), np.asarray(dense_cache.end))
    # every key a row holds sits in the block its table names
    dense_k = np.asarray(dense_cache.layer_arrays()[0][0])  # layer 0: [B, KVH, S, Dh]
    pool = np.asarray(paged_cache.k[0])[0]                   # [NB, KVH, block, Dh]
    for row, end in enumerate(np.asarray(dense_cache.end)):
        for slot in range(int(end)):
            np.testing.assert_array_equal(pool[table[row, slot // BLOCK], :, slot % BLOCK], dense_k[row, :, slot])


def test_a_row_without_blocks_writes_nothing():
    """Unallocated table entries (one past the pool) drop writes: a row whose blocks went to
    another row (preempted) cannot overwrite them."""
    model = tiny_model("llama")
    k, v = init_paged_pools(model.config, 1, 4, BLOCK)
    table = np.array([[0, 4], [4, 4]], np.int32)  # row 1 holds nothing
    cache = PagedKVCache(k, v, jnp.asarray(table), jnp.zeros((2,), jnp.int32))
    _, after = _jitted(model)(np.array([[5, 6, 7], [8, 9, 10]], np.int32), np.ones((2, 3), bool), cache)
    pool = np.asarray(after.k[0])[0]
    assert np.any(pool[0, :, :3] != 0)
    np.testing.assert_array_equal(pool[1:], 0)
