"""``--mode=plan`` under ``rollout.engine=continuous`` compiles the sampler on the engine's paged cache."""

from __future__ import annotations

import pytest

from llds_jax.models.loading import decoder_config
from llds_jax.models.paged_cache import paged_pool_bytes
from llds_jax.plan.run import make_plan
from tests.scale.test_plan import _tiny_config


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
