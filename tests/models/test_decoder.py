"""Decoder structure: scan compiles one block, remat keeps gradients, config round-trips."""

import contextlib
import io
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from llds_jax.models import DecoderConfig, positions_from_mask
from llds_jax.models.logprobs import sequence_logprobs
from llds_jax.models.testing import tiny_config, tiny_model

pytestmark = pytest.mark.unit


def _count_dots(model) -> int:
    graphdef, state = nnx.split(model)
    ids = jnp.zeros((1, 4), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda s: nnx.merge(graphdef, s)(ids))(state)
    return str(jaxpr).count("dot_general")


def test_scanned_model_traces_one_block_whatever_the_depth():
    shallow = _count_dots(tiny_model("qwen2", num_layers=2))
    deep = _count_dots(tiny_model("qwen2", num_layers=6))
    unrolled = _count_dots(tiny_model("qwen2", num_layers=6, scan_layers=False))
    assert shallow == deep, f"scan over 6 layers traced {deep} dots vs {shallow} for 2 layers"
    assert unrolled > deep


@pytest.mark.codegen_sensitive
@pytest.mark.parametrize("remat", ["dots_saveable", "minimal", "full"])
def test_remat_and_scan_leave_gradients_unchanged(remat):
    ids = jax.random.randint(jax.random.key(1), (2, 9), 0, 256)
    mask = jnp.arange(9)[None, :] >= jnp.array([[0], [3]])

    def grads(model):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(p):
            logp, entropy = sequence_logprobs(nnx.merge(graphdef, p, rest), ids, mask, chunk_size=4)
            return jnp.sum(logp * mask[:, 1:]) + 0.01 * jnp.sum(entropy)

        return jax.jit(jax.grad(loss))(params)

    plain = grads(tiny_model("qwen3", scan_layers=False))
    checkpointed = grads(tiny_model("qwen3", scan_layers=True, remat=remat))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(plain), jax.tree.leaves(checkpointed)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4, err_msg=jax.tree_util.keystr(path))


def test_unrolled_layers_gradient_concatenates_per_layer_weights_instead_of_padding_each():
    """Slicing layer i out of a stacked weight has a pad to the whole stack as its gradient: summed
    over L layers that is L full-stack adds (SmolLM2's update spent 5.3 s in them). One split per
    weight transposes to one concatenate."""
    layers = 5
    model = tiny_model("qwen2", num_layers=layers, scan_layers=False)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ids = jnp.ones((1, 6), jnp.int32)

    def loss(p):
        return jnp.sum(nnx.merge(graphdef, p, rest)(ids))

    jaxpr = str(jax.make_jaxpr(jax.grad(loss))(params))
    stack_pads = re.findall(rf"f32\[{layers},[\d,]*\] = pad\[", jaxpr)
    assert not stack_pads, f"{len(stack_pads)} per-layer gradients padded to the whole [{layers}, ...] stack"
    assert re.search(rf"f32\[{layers},[\d,]*\] = concatenate\[", jaxpr), "no stacked gradient is concatenated"


_BATCH, _LENGTH = 2, 12


def _saved_per_layer_floats(remat: str, attention: str = "auto", num_layers: int = 3) -> int:
    """Elements the gradient of a log-prob loss keeps per layer (scan-stacked residuals, weights aside)."""
    model = tiny_model("llama", num_layers=num_layers, remat=remat, attention=attention)  # auto: xla_blockwise on CPU
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ids = jnp.ones((_BATCH, _LENGTH), jnp.int32)
    mask = jnp.ones((_BATCH, _LENGTH), bool)

    def loss(p):
        return sequence_logprobs(nnx.merge(graphdef, p, rest), ids, mask, chunk_size=_LENGTH)[0].sum()

    report = io.StringIO()  # print_saved_residuals is the public form of the residual list
    with contextlib.redirect_stdout(report):
        jax.ad_checkpoint.print_saved_residuals(loss, params)
    total = 0
    for line in report.getvalue().splitlines():  # "f32[3,2,12,64] output of scan from ..."
        shape = [int(n) for n in line[line.index("[") + 1:line.index("]")].split(",") if n]
        if shape and shape[0] == num_layers and "from the argument" not in line:
            total += math.prod(shape)
    return total // num_layers


def test_minimal_remat_keeps_exactly_the_named_values():
    """Per token: the layer input and mid-block residual (2·D), gate and up (2·F), and the blockwise
    kernel's q and output (2·H·Dh), k and v (2·KVH·Dh) and log-sum-exp (H). A lost name would drop
    a term (its producer, a matmul or the attention kernel, rerun in the backward); an unnamed
    intermediate kept would add one."""
    c = tiny_config("llama")
    per_token = (2 * c.hidden_size + 2 * c.intermediate_size + 2 * c.num_heads * c.head_dim
                 + 2 * c.num_kv_heads * c.head_dim + c.num_heads)
    minimal = _saved_per_layer_floats("minimal")
    assert minimal == _BATCH * _LENGTH * per_token
    assert _saved_per_layer_floats("none") > 1.5 * minimal


def test_minimal_remat_keeps_the_inputs_of_an_opaque_kernel():
    """A kernel that keeps its residuals inside (naive here; splash and cuDNN on TPU/GPU) is rerun in
    the backward from the saved q, k, v [B, T, H|KVH, Dh], not from a rerun of the projections."""
    c = tiny_config("llama")
    per_token = (2 * c.hidden_size + 2 * c.intermediate_size + c.num_heads * c.head_dim
                 + 2 * c.num_kv_heads * c.head_dim)
    assert _saved_per_layer_floats("minimal", attention="naive") == _BATCH * _LENGTH * per_token


def test_positions_from_mask_handles_left_and_right_padding():
    mask = jnp.array([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]])
    assert positions_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 2, 2]]


@pytest.mark.parametrize("family", ["qwen2", "qwen2_untied", "qwen3", "llama"])
def test_config_round_trips_through_hf_json(family):
    cfg = tiny_config(family)
    again = DecoderConfig.from_hf_config(cfg.to_hf_config())
    assert again == cfg


def test_config_is_hashable_for_jit_static_use():
    cfg = tiny_config("llama", rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert hash(cfg) == hash(cfg.replace())
    assert cfg.rope_scaling_dict == {"rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize("overrides,message", [
    (dict(num_heads=4, num_kv_heads=3), "num_heads=4 is not a multiple of num_kv_heads=3"),
    (dict(family="gpt2"), "family='gpt2'"),
    (dict(remat="some"), "remat='some'"),
    (dict(dtype="float13"), "dtype='float13'"),
])
def test_invalid_config_values_are_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_config("qwen2").replace(**overrides)


def test_random_weights_spread_their_logits_by_the_asked_nats():
    """``model.random_logit_std``: the final norm is the only weight that changes, and every row's logits
    spread the asked nats over the vocabulary. Given a row's normed hidden state (RMS 1), its logits are
    V draws of N(0, (INIT_STD · scale)² · D), so a row's sample std is within a few 1/sqrt(2V) of the
    asked value (6 of them here)."""
    from llds_jax.models.decoder import INIT_STD
    from llds_jax.models.loading import random_model

    cfg = tiny_config("qwen2", vocab_size=4096)
    flat, spread = random_model(cfg, seed=0), random_model(cfg, seed=0, logit_std=5.0)
    flat_state, spread_state = nnx.to_flat_state(nnx.state(flat)), nnx.to_flat_state(nnx.state(spread))
    changed = [path for (path, a), (_, b) in zip(flat_state, spread_state, strict=True)
               if not np.array_equal(np.asarray(a[...]), np.asarray(b[...]))]
    assert changed == [("final_norm",)]
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 8)), jnp.int32)
    mask = jnp.ones(ids.shape, bool)
    bound = 6 / math.sqrt(2 * cfg.vocab_size)
    for model, std in ((spread, 5.0), (flat, INIT_STD * math.sqrt(cfg.hidden_size))):
        row_std = np.asarray(model(ids, mask), np.float64).reshape(-1, cfg.vocab_size).std(axis=1)
        np.testing.assert_array_less(np.abs(row_std / std - 1), bound)
