"""remat="minimal_no_gate": minimal's kept values less the MLP gate projection's output (rerun in the backward)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from llds_jax.models.logprobs import sequence_logprobs
from llds_jax.models.testing import tiny_config, tiny_model
from tests.models.test_decoder import _BATCH, _LENGTH, _saved_per_layer_floats  # residuals a layer keeps

pytestmark = pytest.mark.unit


def test_minimal_no_gate_keeps_minimals_values_but_the_gate_projections():
    c = tiny_config("llama")
    assert _saved_per_layer_floats("minimal") - _saved_per_layer_floats("minimal_no_gate") == \
        _BATCH * _LENGTH * c.intermediate_size


def test_minimal_no_gate_gives_minimals_gradients():
    model = tiny_model("llama", num_layers=2)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ids = jnp.arange(_BATCH * _LENGTH, dtype=jnp.int32).reshape(_BATCH, _LENGTH) % 50 + 3
    mask = jnp.ones((_BATCH, _LENGTH), bool)

    def grads(remat):
        other = tiny_model("llama", num_layers=2, remat=remat)
        other_graphdef = nnx.split(other, nnx.Param, ...)[0]
        loss = lambda p: sequence_logprobs(nnx.merge(other_graphdef, p, rest), ids, mask)[0].sum()
        return jax.grad(loss)(params)

    del graphdef
    # The same arithmetic: only XLA's fusion around the recomputed gate differs, so a gradient element (a sum
    # over the batch's B·L positions) may be summed in another order: at most one rounding a position at the
    # leaf's scale. (Measured: 0 under this host's default code generator, <= 1.7 eps x max under the second.)
    bound = _BATCH * _LENGTH * float(jnp.finfo(jnp.float32).eps)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads("minimal")),
                            jax.tree.leaves(grads("minimal_no_gate")), strict=True):
        scale = float(jnp.max(jnp.abs(a)))
        assert float(jnp.max(jnp.abs(a - b))) <= bound * scale, jax.tree_util.keystr(path)
