"""Cached prefill / decode / chunk-append equal the uncached forward.

Each test records the cached logits for every step, then runs ONE jitted uncached
forward over the final sequences and compares the logits at the matching positions.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from llds_jax.models import init_cache
from llds_jax.models.testing import tiny_model

pytestmark = [pytest.mark.unit, pytest.mark.codegen_sensitive]

TOL = 1e-4


def _left_pad(rows, width):
    ids = np.zeros((len(rows), width), np.int32)
    mask = np.zeros((len(rows), width), bool)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = row
        mask[i, width - len(row):] = True
    return ids, mask


def _jitted(model):
    graphdef, state = nnx.split(model)

    @jax.jit
    def cached(state, tokens, cache, token_mask):
        return nnx.merge(graphdef, state).forward_cached(tokens, cache, token_mask)

    @jax.jit
    def uncached(state, ids, mask):
        return nnx.merge(graphdef, state)(ids, mask)

    return (lambda tokens, cache, mask: cached(state, jnp.asarray(tokens), cache, jnp.asarray(mask)),
            lambda ids, mask: np.asarray(uncached(state, jnp.asarray(ids), jnp.asarray(mask))))


def _check_against_uncached(uncached, rows, recorded):
    """recorded: list of (logits [B,V], per-row length of the prefix they predict from)."""
    width = max(map(len, rows))
    ids, mask = _left_pad(rows, width)
    full = uncached(ids, mask)
    for step, (logits, prefix_lens) in enumerate(recorded):
        for b, n in enumerate(prefix_lens):
            want = full[b, width - len(rows[b]) + n - 1]
            diff = float(np.max(np.abs(np.asarray(logits[b]) - want)))
            assert diff <= TOL, f"step {step} row {b}: max |cached - uncached| = {diff:.3g} > {TOL}"


@pytest.mark.parametrize("family,scan", [("qwen2", True), ("qwen3", False), ("llama", True)])
def test_prefill_then_16_decode_steps_match_uncached_forward(family, scan):
    model = tiny_model(family, scan_layers=scan)
    cached, uncached = _jitted(model)
    rng = np.random.default_rng(0)
    rows = [list(rng.integers(0, 256, n)) for n in (5, 9, 2)]
    ids, mask = _left_pad(rows, 9)
    logits, cache = cached(ids, init_cache(model.config, batch=3, max_len=32), mask)
    recorded = [(logits, [len(r) for r in rows])]
    for _ in range(16):
        nxt = np.asarray(jnp.argmax(logits, -1), np.int32)
        rows = [row + [int(tok)] for row, tok in zip(rows, nxt)]
        logits, cache = cached(nxt[:, None], cache, np.ones((3, 1), bool))
        recorded.append((logits, [len(r) for r in rows]))
    _check_against_uncached(uncached, rows, recorded)
    assert np.asarray(cache.end).tolist() == [9 + 16] * 3


def test_appending_feedback_chunks_of_different_lengths_continues_each_row():
    model = tiny_model("qwen2_untied")
    cached, uncached = _jitted(model)
    rng = np.random.default_rng(1)
    rows = [list(rng.integers(0, 256, n)) for n in (4, 7)]
    ids, mask = _left_pad(rows, 7)
    _, cache = cached(ids, init_cache(model.config, batch=2, max_len=40), mask)
    chunk_rows = [list(rng.integers(0, 256, 6)), list(rng.integers(0, 256, 2))]
    chunk = np.zeros((2, 6), np.int32)
    chunk_mask = np.zeros((2, 6), bool)
    for i, extra in enumerate(chunk_rows):  # right-padded: row 0 appends 6 tokens, row 1 appends 2
        chunk[i, : len(extra)] = extra
        chunk_mask[i, : len(extra)] = True
    logits, cache = cached(chunk, cache, chunk_mask)
    rows = [row + extra for row, extra in zip(rows, chunk_rows)]
    assert np.asarray(cache.end).tolist() == [7 + 6, 7 + 2]
    recorded = [(logits, [len(r) for r in rows])]
    for _ in range(4):
        nxt = np.asarray(jnp.argmax(logits, -1), np.int32)
        rows = [row + [int(tok)] for row, tok in zip(rows, nxt)]
        logits, cache = cached(nxt[:, None], cache, np.ones((2, 1), bool))
        recorded.append((logits, [len(r) for r in rows]))
    _check_against_uncached(uncached, rows, recorded)


def test_finished_row_is_frozen_when_its_token_is_masked():
    model = tiny_model("llama")
    cached, _ = _jitted(model)
    ids, mask = _left_pad([[1, 2, 3], [4, 5]], 3)
    _, cache = cached(ids, init_cache(model.config, 2, 8), mask)
    _, after = cached(np.array([[7], [8]], np.int32), cache, np.array([[True], [False]]))
    assert np.asarray(after.end).tolist() == [4, 3]
    np.testing.assert_array_equal(np.asarray(after.valid[1]), np.asarray(cache.valid[1]))
