"""remat="minimal_no_gate": minimal's kept values less the MLP gate projection's output (rerun in the backward)."""

from __future__ import annotations

import contextlib
import io
import math

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from llds_jax.models.logprobs import sequence_logprobs
from llds_jax.models.testing import tiny_config, tiny_model

pytestmark = pytest.mark.unit

_BATCH, _LENGTH, _LAYERS = 2, 12, 3


def _saved_per_layer_floats(remat: str) -> int:
    """Elements the gradient of a log-prob loss keeps per layer (scan-stacked residuals, weights aside)."""
    model = tiny_model("llama", num_layers=_LAYERS, remat=remat)  # auto: xla_blockwise on CPU
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ids = jnp.ones((_BATCH, _LENGTH), jnp.int32)
    mask = jnp.ones((_BATCH, _LENGTH), bool)

    def loss(p):
        return sequence_logprobs(nnx.merge(graphdef, p, rest), ids, mask, chunk_size=_LENGTH)[0].sum()

    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        jax.ad_checkpoint.print_saved_residuals(loss, params)
    total = 0
    for line in report.getvalue().splitlines():  # "f32[3,2,12,64] output of scan from ..."
        shape = [int(n) for n in line[line.index("[") + 1:line.index("]")].split(",") if n]
        if shape and shape[0] == _LAYERS and "from the argument" not in line:
            total += math.prod(shape)
    return total // _LAYERS


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
