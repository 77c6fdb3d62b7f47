"""``rollout_rows_per_wave``: the waves policy's rows from a device-memory budget (the engine's one memory
plan, a slot sized for a whole ``max_context``), checked on Qwen2.5-3B's sizes (SPEC §10)."""

from __future__ import annotations

import pytest

from llds_jax.models.config import DecoderConfig
from llds_jax.rollout import default_config
from llds_jax.rollout.kv_plan import engine_memory, rollout_rows_per_wave, wave_plan
from llds_jax.rollout.memory import RolloutMemoryError, kv_bytes_per_slot, rollout_row_bytes, weight_bytes
from llds_jax.sampling.slots import cache_slot_limit

pytestmark = pytest.mark.unit

QWEN_3B = DecoderConfig(vocab_size=151936, hidden_size=2048, num_layers=36, num_heads=16, num_kv_heads=2,
                        head_dim=128, intermediate_size=11008, family="qwen2", qkv_bias=True, tie_embeddings=True,
                        dtype="bfloat16", param_dtype="bfloat16")
GB = 10**9


def test_qwen_3b_kv_bytes_and_weights_match_the_spec():
    assert kv_bytes_per_slot(QWEN_3B) == 2 * 36 * 2 * 128 * 2 + 1  # K and V, bf16, + the valid flag: 36.9 KB
    assert 6.1 * GB < weight_bytes(QWEN_3B) < 6.25 * GB  # SPEC §10: ≈3.09B params, 6.2 GB in bf16


def test_rows_follow_the_budget_formula_and_scale_with_data_devices():
    cfg = default_config()  # paper limits: max_context 4096, prefill_chunk 512, prefill_rows 16
    row = rollout_row_bytes(QWEN_3B, cfg)
    # a row holds the paged blocks of a whole max_context: 32 blocks of 128 tokens
    assert row["kv_cache"] == kv_bytes_per_slot(QWEN_3B) * 4096
    v5e = 16 * 2**30
    free = 0.9 * v5e - weight_bytes(QWEN_3B)
    expected = int((int(free) - 16 * row["prefill"]) // (row["decode"] + row["kv_cache"]))
    assert rollout_rows_per_wave(QWEN_3B, cfg, v5e, 1) == expected
    assert engine_memory(QWEN_3B, cfg, v5e, 10**6, slot_tokens=4096).slots_per_device == expected  # one plan
    assert rollout_rows_per_wave(QWEN_3B, cfg, v5e, 8) == 8 * expected
    # (14.4 GiB - 6.2 GB of weights - 16 rows' append workspace) / (151 MB of KV + the sampler's rows)
    assert 40 <= expected <= 60, f"{expected} rows per v5e chip for a 3B model at 4k context"
    cfg.memory_fraction = 0.5
    assert rollout_rows_per_wave(QWEN_3B, cfg, v5e, 1) < expected


def test_an_explicit_row_count_wins_and_an_impossible_budget_names_the_fields():
    cfg = default_config()
    cfg.max_concurrent_rows = 7
    assert rollout_rows_per_wave(QWEN_3B, cfg, 1, 1) == 7
    cfg.max_concurrent_rows = 0
    with pytest.raises(RolloutMemoryError, match="rollout.memory_fraction.*rollout.max_context"):
        rollout_rows_per_wave(QWEN_3B, cfg, 7 * GB, 1)


def test_cache_limit_is_one_key_block_at_least_and_the_context_rounded_up():
    assert cache_slot_limit(50) == 128 and cache_slot_limit(300) == 304 and cache_slot_limit(3000) == 3008
    assert cache_slot_limit(4096) == 4096


def test_wave_plan_pads_the_last_wave_to_the_wave_width():
    cfg = default_config()
    cfg.max_concurrent_rows = 4
    assert wave_plan(cfg, 10) == (4, 4)
    assert wave_plan(cfg, 3) == (3, 4)
    cfg.max_concurrent_rows = 0
    assert wave_plan(cfg, 10) == (10, 16)  # a scripted policy (no model config): all rows at once
