"""--mode=plan: shapes from known names, per-device accounting from shardings, AOT-compiled table."""

from __future__ import annotations

import math

import jax
import pytest
from flax import nnx

from llds_jax.models import Decoder
from llds_jax.train.config import base_config
from llds_jax.train.plan import (
    HARDWARE,
    PlanError,
    bytes_per_device,
    decoder_config_for,
    default_plan_config,
    format_plan,
    make_plan,
    plan_devices,
)
from tests.scale import toy_train


def _tiny_config():
    c = base_config()
    c.model.source = "tiny:qwen2"
    c.mesh.shape = (1, -1, 1)
    c.train.update(prompts_per_step=8, mini_batch_size=16, micro_batch_size=8, logprob_batch_size=16)
    c.rollout.update(n_samples=4, max_context=128, max_prompt_tokens=32)
    c.plan = default_plan_config()
    return c


@pytest.mark.parametrize("name, billions", [("Qwen2.5-3B", 3.086), ("Qwen2.5-7B", 7.616)])
def test_known_model_names_give_the_real_parameter_count(name, billions):
    c = base_config()
    c.model.source = f"/models/{name}"
    cfg = decoder_config_for(c)
    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert count / 1e9 == pytest.approx(billions, abs=0.001)


def test_unknown_model_source_and_missing_tpu_support_are_named():
    c = base_config()
    c.model.source = "/nowhere/Mystery-9B"
    with pytest.raises(PlanError, match="model.source='/nowhere/Mystery-9B'"):
        decoder_config_for(c)
    section = default_plan_config()
    section.topology = "v5e:2x2"
    if jax.devices()[0].platform == "cpu":
        with pytest.raises(PlanError, match="plan.topology='v5e:2x2'"):
            plan_devices(section)


def test_bytes_per_device_counts_shards_and_replicas():
    mesh = toy_train.make_mesh((2, 4))
    tree = toy_train.state_shardings(mesh)
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            jax.eval_shape(toy_train.init_state_host, 0), tree)
    # w [32, 16] over (2, 4) -> 16x4 floats; b [16] over fsdp -> 4 floats.
    assert bytes_per_device(abstract["params"]) == (16 * 4 + 4) * 4


@pytest.mark.slow
def test_plan_compiles_every_phase_and_prints_the_fit_table():
    plan = make_plan(_tiny_config())
    assert plan.mesh_shape == (1, 8, 1) and "XLA:CPU SPMD, 8 devices" in plan.compiler
    assert set(plan.programs) == {"update", "logprobs", "prefill", "decode"}
    # The update program receives params, Adam moments, reference and counters as arguments.
    update = plan.programs["update"]
    assert update.argument_bytes >= sum(plan.resident.values())
    assert update.alias_bytes > 0  # the train state is donated
    assert plan.peak_bytes == max(plan.phase_peak(p) for p in plan.programs)
    table = format_plan(plan)
    for label, _ in HARDWARE.values():
        assert f"{label:<28}fits" in table
    assert "decodes all 32 trajectories" in table
