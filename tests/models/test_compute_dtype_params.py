"""Sampling from, and differentiating through, weights cast once to the compute dtype gives the same
numbers as casting per use (the sampler casts once per policy, the update once per optimizer update)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from llds_jax.models import PagedKVCache, init_paged_pools, params_in_compute_dtype
from llds_jax.models.testing import tiny_model
from llds_jax.train.step import forward_logprobs

pytestmark = pytest.mark.unit


def test_floating_leaves_are_cast_and_others_kept():
    tree = {"w": jnp.ones((2, 3), jnp.float32), "ids": jnp.arange(3, dtype=jnp.int32)}
    out = params_in_compute_dtype(tree, "bfloat16")
    assert out["w"].dtype == jnp.bfloat16 and out["ids"].dtype == jnp.int32


def test_narrower_leaves_are_not_widened():
    """bf16 reference weights under fp32 compute: the model widens them per use; a copy would only cost memory."""
    tree = {"ref": jnp.ones((2, 3), jnp.bfloat16), "master": jnp.ones((2, 3), jnp.float32)}
    out = params_in_compute_dtype(tree, "float32")
    assert out["ref"].dtype == jnp.bfloat16 and out["master"].dtype == jnp.float32


@pytest.mark.codegen_sensitive
def test_bf16_compute_with_precast_weights_is_bit_identical():
    """A prefill and one more token through the paged cache (the sampler's: ``slots.SlotSession``),
    each row in one 128-slot block of its own."""
    model = tiny_model("qwen2", seed=3, dtype="bfloat16")  # fp32 stored weights, bf16 compute
    assert jnp.dtype(model.config.compute_dtype) == jnp.bfloat16
    graphdef, params = nnx.split(model)
    cast = params_in_compute_dtype(params, "bfloat16")
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    ids = jnp.asarray(np.random.default_rng(0).integers(3, 200, (2, 20)), jnp.int32)
    mask = jnp.ones(ids.shape, bool)

    @jax.jit
    def forward(p, tokens, token_mask, cache):
        return nnx.merge(graphdef, p).forward_cached(tokens, cache, token_mask=token_mask)

    results = []
    for p in (params, cast):
        k, v = init_paged_pools(model.config, 1, 2, 128)
        cache = PagedKVCache(k, v, jnp.asarray([[0], [1]], jnp.int32), jnp.zeros((2,), jnp.int32))
        logits, cache = forward(p, ids, mask, cache)
        step, _ = forward(p, ids[:, :1], mask[:, :1], cache)
        results.append((np.asarray(logits), np.asarray(step)))
    for got, want in zip(results[1], results[0]):
        np.testing.assert_array_equal(got, want)


@pytest.mark.codegen_sensitive
@pytest.mark.parametrize("tied", [True, False])
def test_the_cached_forward_writes_the_heads_logits_rounded_once_to_the_compute_dtype(tied):
    """What the sampler draws from (``Decoder.forward_cached``): a bf16 model's logits in bf16, the
    head's fp32 accumulators rounded once: within half a bf16 ulp of the fp32 head's logits, plus what
    two fp32 dot products of D terms may differ by in their summation order (γ_D·Σ|h·w| each; the
    two compile to different XLA:CPU dots); an fp32 model's (the CPU default job's) in fp32."""
    for dtype in ("bfloat16", "float32"):
        model = tiny_model("qwen2", seed=3, dtype=dtype, tie_embeddings=tied)
        graphdef, params = nnx.split(model)
        ids = jnp.asarray(np.random.default_rng(0).integers(3, 200, (2, 6)), jnp.int32)
        k, v = init_paged_pools(model.config, 1, 2, 128)
        cache = PagedKVCache(k, v, jnp.asarray([[0], [1]], jnp.int32), jnp.zeros((2,), jnp.int32))
        logits, _ = jax.jit(lambda p, c, t, g=graphdef: nnx.merge(g, p).forward_cached(t, c))(params, cache, ids)
        assert logits.dtype == jnp.dtype(dtype) and logits.shape == (2, model.config.vocab_size)
    hidden = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3, model.config.hidden_size)), jnp.bfloat16)
    model = tiny_model("qwen2", seed=3, dtype="bfloat16", tie_embeddings=tied)
    rounded = jax.jit(lambda h: model.logits_from_hidden(h, jnp.bfloat16))(hidden)
    wide = jax.jit(lambda h: model.logits_from_hidden(h))(hidden)
    assert rounded.dtype == jnp.bfloat16 and wide.dtype == jnp.float32
    table, vocab_major = model.output_head()
    weights = np.abs(np.asarray(table, np.float64))
    magnitude = np.abs(np.asarray(hidden, np.float64)) @ (weights.T if vocab_major else weights)  # Σ|h·w| a logit
    depth = model.config.hidden_size
    summed = 2 * depth * 2.0 ** -24 / (1 - depth * 2.0 ** -24) * magnitude
    half_ulp = float(jnp.finfo(jnp.bfloat16).eps) / 2 * (np.abs(np.asarray(wide, np.float64)) + summed)
    assert np.all(np.abs(np.asarray(rounded, np.float64) - np.asarray(wide, np.float64)) <= half_ulp + summed)


@pytest.mark.codegen_sensitive
@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("family, tied", [("qwen2", True), ("qwen2", False)])
def test_the_gradient_through_weights_cast_once_is_the_masters_gradient(family, tied):
    """The update differentiates w.r.t. weights cast once per optimizer update, the embedding table
    kept fp32: every gradient is bit-identical to casting per use. Casting the table too would sum a
    repeated token's (and the tied head's) cotangents in bf16: measurably different."""
    model = tiny_model(family, seed=3, dtype="bfloat16", tie_embeddings=tied)
    graphdef, params = nnx.split(model)
    ids = jnp.asarray(np.random.default_rng(0).integers(3, 200, (2, 24)), jnp.int32)
    mask = jnp.ones(ids.shape, bool)

    def loss(p):
        logp, _ = forward_logprobs(graphdef, p, ids, mask, temperature=1.0, chunk_size=8, with_entropy=False)
        return logp.astype(jnp.float32).sum()

    def grads_through(keep_lookup_tables):
        cast = functools.partial(params_in_compute_dtype, dtype="bfloat16", keep_lookup_tables=keep_lookup_tables)
        return jax.jit(lambda p: jax.tree.map(lambda g: g.astype(jnp.float32), jax.grad(loss)(cast(p))))(params)

    per_use = jax.jit(jax.grad(loss))(params)
    for (path, want), got in zip(jax.tree_util.tree_leaves_with_path(per_use), jax.tree.leaves(grads_through(True)),
                                 strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=jax.tree_util.keystr(path))
    bf16_table = grads_through(False)["embed"][...]
    assert np.any(np.asarray(bf16_table) != np.asarray(per_use["embed"][...]))
