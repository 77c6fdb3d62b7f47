"""The forward is layout-independent, and the rules table places parameters as the golden files say."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from llds_jax.models import (
    Decoder,
    DecoderConfig,
    cache_shardings,
    from_pretrained,
    init_cache,
    save_pretrained,
)
from llds_jax.models.logprobs import sequence_logprobs
from llds_jax.models.testing import tiny_model
from llds_jax.parallel import ShardingRules, constrain, logical_to_sharding, make_mesh, shard_model, use_rules
from llds_jax.parallel.placement import golden_path, iter_params, param_specs, specs_to_json, write_golden

pytestmark = pytest.mark.unit

MESHES = [(8, 1, 1), (2, 4, 1), (1, 2, 4)]
QWEN25_3B = DecoderConfig(vocab_size=151936, hidden_size=2048, num_layers=36, num_heads=16, num_kv_heads=2,
                          head_dim=128, intermediate_size=11008, family="qwen2", qkv_bias=True,
                          tie_embeddings=True, rope_theta=1000000.0)


def _batch():
    ids = jax.random.randint(jax.random.key(0), (8, 12), 0, 256, dtype=jnp.int32)
    mask = jnp.arange(12)[None, :] >= jnp.array([0, 3, 5, 0, 1, 7, 2, 4])[:, None]
    return ids, mask


def _outputs(model, ids, mask):
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, ids, mask):
        m = nnx.merge(graphdef, state)
        logits = m(ids, mask)
        logp, entropy = sequence_logprobs(m, ids, mask, chunk_size=4)
        cached, _ = m.forward_cached(ids, init_cache(m.config, ids.shape[0], 16), mask)
        return logits, logp, entropy, cached

    return run(state, ids, mask)


@pytest.fixture(scope="module")
def single_device_outputs():
    ids, mask = _batch()
    return [np.asarray(x) for x in _outputs(tiny_model("qwen2_untied"), ids, mask)]


@pytest.mark.codegen_sensitive
@pytest.mark.parametrize("mesh_shape", MESHES)
def test_forward_on_mesh_equals_single_device(mesh_shape, single_device_outputs):
    mesh = make_mesh(mesh_shape)
    model = shard_model(tiny_model("qwen2_untied"), mesh)
    assert model.layers.q_proj[...].sharding.spec != P(None, None, None, None) or mesh_shape == (8, 1, 1)
    ids, mask = _batch()
    batch_sharding = logical_to_sharding(("batch", "seq"), mesh, shape=ids.shape)
    ids, mask = jax.device_put(ids, batch_sharding), jax.device_put(mask, batch_sharding)
    with jax.set_mesh(mesh):
        outputs = _outputs(model, ids, mask)
    for name, got, want in zip(("logits", "logp", "entropy", "cached logits"), outputs, single_device_outputs):
        diff = float(np.max(np.abs(np.asarray(got) - want)))
        assert diff <= 1e-5, f"mesh {mesh_shape}: {name} differs from single device by {diff:.3g}"
    assert outputs[0].sharding.spec[0] in (("data", "fsdp"), "data", "fsdp"), outputs[0].sharding


GOLDEN_CASES = {
    "tiny_qwen2_untied_1x2x4": (lambda: tiny_model("qwen2_untied"), (1, 2, 4)),
    "tiny_qwen3_2x4x1": (lambda: tiny_model("qwen3"), (2, 4, 1)),
    "qwen2_5_3b_1x2x4": (lambda: Decoder(QWEN25_3B, rngs=nnx.Rngs(0)), (1, 2, 4)),
    "qwen2_5_3b_2x4x1": (lambda: Decoder(QWEN25_3B, rngs=nnx.Rngs(0)), (2, 4, 1)),
}


@pytest.mark.parametrize("case", sorted(GOLDEN_CASES))
def test_parameter_partition_specs_match_golden_file(case):
    """Regenerate after a deliberate rules change with LLDS_UPDATE_GOLDEN=1."""
    build, mesh_shape = GOLDEN_CASES[case]
    abstract = nnx.eval_shape(build)
    specs = param_specs(abstract, make_mesh(mesh_shape))
    if os.environ.get("LLDS_UPDATE_GOLDEN"):
        write_golden(case, specs)
    golden = json.loads(golden_path(case).read_text())
    got = specs_to_json(specs)
    changed = {k: (golden.get(k), got.get(k)) for k in set(golden) | set(got) if golden.get(k) != got.get(k)}
    assert not changed, f"{case}: parameter shardings changed (golden, now): {changed}"


def test_two_kv_heads_stay_replicated_on_a_tensor_axis_of_four():
    specs = param_specs(nnx.eval_shape(lambda: Decoder(QWEN25_3B, rngs=nnx.Rngs(0))), make_mesh((1, 2, 4)))
    assert specs["layers.k_proj"] == P(None, "fsdp", None, None)
    assert specs["layers.q_proj"] == P(None, "fsdp", "tensor", None)


def test_a_mesh_axis_used_twice_in_one_spec_is_refused():
    rules = ShardingRules.from_mapping(None, mlp="fsdp")
    with pytest.raises(ValueError, match=r"mesh axis 'fsdp' used twice in one spec: by 'embed' and 'mlp'"):
        rules.spec(("layers", "embed", "mlp"))


def test_unknown_logical_axis_is_named():
    with pytest.raises(KeyError, match="logical axis 'heads'"):
        ShardingRules().spec(("batch", "heads"))


def test_batch_shards_over_data_and_fsdp_and_drops_non_dividing_axes():
    mesh = make_mesh((2, 4, 1))
    assert ShardingRules().spec(("batch", "seq"), (8, 5), mesh) == P(("data", "fsdp"), None)
    assert ShardingRules().spec(("batch", "seq"), (6, 5), mesh) == P("data", None)


def test_constrain_is_identity_without_a_mesh_and_real_under_one():
    x = jnp.ones((8, 4))
    assert constrain(x, ("batch", "act_embed")) is x
    mesh = make_mesh((8, 1, 1))
    with jax.set_mesh(mesh):
        y = jax.jit(lambda a: constrain(a * 2, ("batch", "act_embed")))(x)
    assert y.sharding.spec[0] == "data", y.sharding


def test_make_mesh_rejects_shapes_that_do_not_fit_the_devices():
    with pytest.raises(ValueError, match="needs 16 devices, have 8"):
        make_mesh((4, 4, 1))
    with pytest.raises(ValueError, match="one entry per axis"):
        make_mesh((8, 1))
    assert dict(make_mesh((-1, 2, 1)).shape) == {"data": 4, "fsdp": 2, "tensor": 1}


def test_use_rules_changes_activation_constraints_traced_inside():
    mesh = make_mesh((2, 1, 4))
    x = jnp.ones((8, 16))
    replicated_batch = ShardingRules.from_mapping(None, batch=None, act_embed="tensor")
    with jax.set_mesh(mesh), use_rules(replicated_batch):
        y = jax.jit(lambda a: constrain(a + 1, ("batch", "act_embed")))(x)
    assert tuple(y.sharding.spec) == (None, "tensor"), y.sharding


def test_from_pretrained_places_each_weight_on_its_sharding(tmp_path, single_device_outputs):
    save_pretrained(tiny_model("qwen2_untied"), tmp_path)
    mesh = make_mesh((1, 2, 4))
    model = from_pretrained(tmp_path, mesh=mesh)
    specs = param_specs(model, mesh)
    for name, var in iter_params(model):
        assert var.get_value().sharding.spec == specs[name], f"{name}: {var.get_value().sharding}"
    ids, mask = _batch()
    with jax.set_mesh(mesh):
        logits = _outputs(model, ids, mask)[0]
    np.testing.assert_allclose(np.asarray(logits), single_device_outputs[0], atol=1e-5)


def test_cache_shardings_match_what_init_cache_produces_under_the_mesh():
    """The dense reference cache: one [B, KVH, S, Dh] buffer a layer, rows over data, KV heads over tensor."""
    mesh = make_mesh((2, 1, 4))
    cfg = tiny_model("qwen3").config.replace(num_kv_heads=4)
    expected = cache_shardings(cfg, batch=4, max_len=320, mesh=mesh)
    with jax.set_mesh(mesh):
        cache = jax.jit(lambda: init_cache(cfg, 4, 320))()
    assert len(expected.k) == cfg.num_layers
    assert cache.k[0].shape == (4, 4, 320, cfg.head_dim)
    assert all(want.spec == P("data", "tensor", None, None) for want in expected.k)
    for name in ("k", "v"):
        for layer, (array, want) in enumerate(zip(getattr(cache, name), getattr(expected, name), strict=True)):
            assert array.sharding.is_equivalent_to(want, array.ndim), f"{name}[{layer}]: {array.sharding} vs {want}"
    assert cache.valid.sharding.is_equivalent_to(expected.valid, 2), f"valid: {cache.valid.sharding} vs {expected.valid}"
