"""Sampling from weights cast once to the compute dtype gives the same numbers as casting per use."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from llds_jax.models import params_in_compute_dtype
from llds_jax.models.testing import tiny_model
from llds_jax.sampling import decode_loop


def test_floating_leaves_are_cast_and_others_kept():
    tree = {"w": jnp.ones((2, 3), jnp.float32), "ids": jnp.arange(3, dtype=jnp.int32)}
    out = params_in_compute_dtype(tree, "bfloat16")
    assert out["w"].dtype == jnp.bfloat16 and out["ids"].dtype == jnp.int32


def test_bf16_compute_with_precast_weights_is_bit_identical():
    model = tiny_model("qwen2", seed=3, dtype="bfloat16")  # fp32 stored weights, bf16 compute
    assert jnp.dtype(model.config.compute_dtype) == jnp.bfloat16
    graphdef, params = nnx.split(model)
    cast = params_in_compute_dtype(params, "bfloat16")
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    ids = jnp.asarray(np.random.default_rng(0).integers(3, 200, (2, 20)), jnp.int32)
    mask = jnp.ones(ids.shape, bool)
    results = []
    for p in (params, cast):
        cache = decode_loop.new_cache(model.config, 2, 128)
        logits, cache = decode_loop.extend(graphdef, p, ids, mask, cache)
        step, _ = decode_loop.extend(graphdef, p, ids[:, :1], mask[:, :1], cache)
        results.append((np.asarray(logits), np.asarray(step)))
    for got, want in zip(results[1], results[0]):
        np.testing.assert_array_equal(got, want)
