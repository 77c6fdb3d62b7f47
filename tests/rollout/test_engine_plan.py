"""``--mode=plan`` under ``rollout.engine=continuous`` compiles the sampler on the engine's paged cache."""

from __future__ import annotations

import pytest

from llds_jax.models.loading import decoder_config
from llds_jax.models.paged_cache import paged_pool_bytes
from llds_jax.plan.run import make_plan
from tests.scale.test_plan import _tiny_config, needs_tpu

pytestmark = pytest.mark.integration


@pytest.mark.slow
def test_the_plan_compiles_prefill_and_decode_on_the_engines_paged_pool():
    """8 slots over 8 devices (one each) with 3 blocks of 128 tokens per device: the decode program's
    KV argument is each device's pool, exactly, and the note names slots and blocks."""
    c = _tiny_config()
    c.rollout.update(engine="continuous", max_concurrent_rows=8, kv_blocks=3)
    plan = make_plan(c)
    note = " ".join(plan.notes)
    assert "runs 1 slots and a pool of 3 KV blocks of 128 tokens (384 tokens) per device" in note, note
    pool = paged_pool_bytes(decoder_config(c.model), 3, 128)
    table_and_end = 4 * (1 + 1)  # one row per device: its 1-column table and its end, int32
    assert plan.phase_extra["decode"]["kv_cache"] == pool + table_and_end
    decode = plan.programs["decode"]
    assert decode.argument_bytes >= pool and decode.alias_bytes >= pool  # the pool is donated: updated in place


@pytest.mark.slow
@needs_tpu
def test_the_paged_decode_compiles_for_xla_tpu_with_the_pallas_kernel():
    """On a v5e topology (compile-only, from this CPU) the plan's paged decode fits, and its one-token
    step is the Pallas kernel reading the block table, not the XLA gather loop."""
    import jax
    import jax.numpy as jnp

    from llds_jax.parallel.mesh import make_mesh
    from llds_jax.parallel.rules import DEFAULT
    from llds_jax.plan.aot import abstract_train_state
    from llds_jax.plan.run import _abstract_paged_cache, _cached_forward, _row_array
    from llds_jax.plan.targets import tpu_target
    from llds_jax.rollout.kv_plan import EngineMemory

    c = _tiny_config()
    c.rollout.update(engine="continuous", max_concurrent_rows=16, kv_blocks=4)
    c.plan.update(topology="v5e:2x4", phases=("decode",), step_time=False)
    plan = make_plan(c)
    assert plan.compiler.startswith("XLA:TPU") and not plan.programs["decode"].refused
    target = tpu_target("v5e:2x4")
    mesh = make_mesh((1, 8, 1), list(target.devices))
    model_cfg = decoder_config(c.model)
    graphdef, state, _ = abstract_train_state(c, model_cfg, mesh, DEFAULT)
    cache = _abstract_paged_cache(model_cfg, c.rollout, EngineMemory(2, 4, 128, 0, 0, 0), 8, mesh, DEFAULT)
    with jax.set_mesh(mesh):
        hlo = _cached_forward(graphdef, mesh, DEFAULT).lower(
            state.params, _row_array((16, 1), jnp.int32, mesh, DEFAULT), cache,
            _row_array((16, 1), jnp.bool_, mesh, DEFAULT)).compile().as_text()
    assert "paged_decode_attention" in hlo
