"""Our decoder computes what transformers' PyTorch models compute (fp32, random weights)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx
from tiny_hf_models import build_hf_model, hf_logits, padded_batch

from llds_jax.models import from_pretrained, save_pretrained
from llds_jax.models.testing import TINY_FAMILIES, tiny_model
from llds_jax.parallel.placement import iter_params

pytestmark = [pytest.mark.unit, pytest.mark.codegen_sensitive]

TOL = 1e-4


def _max_diff_on_real_tokens(ours, theirs, mask) -> float:
    keep = mask.astype(bool)[..., None]
    return float(np.max(np.abs(np.where(keep, np.asarray(ours) - theirs, 0.0))))


@pytest.fixture(scope="module", params=TINY_FAMILIES)
def hf_checkpoint(request, tmp_path_factory):
    family = request.param
    hf_model = build_hf_model(family)
    directory = tmp_path_factory.mktemp(f"hf_{family}")
    hf_model.save_pretrained(directory)
    return family, hf_model, directory


def _jit_logits(model):
    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda s, ids, mask: nnx.merge(graphdef, s)(ids, mask))
    return lambda ids, mask: np.asarray(fn(state, jnp.asarray(ids), jnp.asarray(mask)))


@pytest.mark.parametrize("side", ["left", "right"])
def test_logits_match_transformers_on_padded_batch(hf_checkpoint, side):
    family, hf_model, directory = hf_checkpoint
    model = from_pretrained(directory)
    ids, mask = padded_batch(side=side)
    diff = _max_diff_on_real_tokens(_jit_logits(model)(ids, mask), hf_logits(hf_model, ids, mask), mask)
    assert diff <= TOL, f"{family} {side}-padded: max |ours - transformers| logit diff {diff:.3g} > {TOL}"


def test_scan_and_unrolled_layers_compute_the_same(hf_checkpoint):
    family, _, directory = hf_checkpoint
    ids, mask = padded_batch(side="left")
    scanned = _jit_logits(from_pretrained(directory, scan_layers=True))(ids, mask)
    unrolled = _jit_logits(from_pretrained(directory, scan_layers=False, remat="full"))(ids, mask)
    diff = _max_diff_on_real_tokens(scanned, unrolled, mask)
    assert diff <= 1e-5, f"{family}: scan vs unrolled+remat differ by {diff:.3g}"


BF16_TOL = 0.15


@pytest.mark.parametrize("family", ["qwen2_untied", "qwen3"])
def test_bf16_stays_within_documented_tolerance(family, tmp_path):
    """bf16 weights and activations (fp32 softmax and norm statistics) vs fp32 transformers:
    within BF16_TOL on these O(1)-logit tiny models (bf16 keeps 8 mantissa bits)."""
    hf_model = build_hf_model(family, seed=1)
    hf_model.save_pretrained(tmp_path)
    ids, mask = padded_batch(side="left")
    ours = _jit_logits(from_pretrained(tmp_path, dtype="bfloat16"))(ids, mask)
    assert np.all(np.isfinite(ours))
    diff = _max_diff_on_real_tokens(ours, hf_logits(hf_model, ids, mask), mask)
    assert diff <= BF16_TOL, f"{family} bf16: max |ours - transformers fp32| = {diff:.3g} > {BF16_TOL}"


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_save_pretrained_loads_in_transformers_with_identical_logits(family, tmp_path):
    model = tiny_model(family, seed=3)
    # norms away from 1 so a swapped or mis-laid-out norm tensor cannot hide
    for i, (name, var) in enumerate(iter_params(model)):
        if "norm" in name:
            noise = jax.random.normal(jax.random.key(i), var.shape)
            var.set_value(var.get_value() + 0.2 * noise)
    save_pretrained(model, tmp_path)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype="float32").eval()
    assert type(hf_model).__name__.lower().startswith(model.config.family)
    ids, mask = padded_batch(seed=5, side="left")
    diff = _max_diff_on_real_tokens(_jit_logits(model)(ids, mask), hf_logits(hf_model, ids, mask), mask)
    assert diff <= TOL, f"{family}: ours vs transformers after save_pretrained differ by {diff:.3g}"
    reloaded = from_pretrained(tmp_path)
    again = _jit_logits(reloaded)(ids, mask)
    np.testing.assert_array_equal(again, _jit_logits(model)(ids, mask))


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
], ids=["linear", "llama3"])
def test_rope_scaling_matches_transformers(rope, tmp_path):
    hf_model = build_hf_model("llama", seed=2, rope_parameters=rope)
    hf_model.save_pretrained(tmp_path)
    model = from_pretrained(tmp_path)
    assert model.config.rope_scaling_dict["rope_type"] == rope["rope_type"]
    ids, mask = padded_batch(side="right")
    diff = _max_diff_on_real_tokens(_jit_logits(model)(ids, mask), hf_logits(hf_model, ids, mask), mask)
    assert diff <= TOL, f"llama {rope['rope_type']} RoPE: max logit diff {diff:.3g} > {TOL}"
