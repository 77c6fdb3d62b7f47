"""Closed-form FLOPs, bytes and peaks (``llds_jax.utils.flops``) against counts made by hand."""

import math

import numpy as np
import pytest

from llds_jax.models.loading import known_config
from llds_jax.models.testing import TINY_FAMILIES, tiny_config, tiny_model
from llds_jax.parallel.placement import iter_params
from llds_jax.utils import flops

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_parameter_count_is_the_models_own(family):
    model = tiny_model(family)
    assert flops.parameters(model.config) == sum(math.prod(var.shape) for _, var in iter_params(model))


def test_qwen2p5_0p5b_has_its_published_parameter_count():
    assert flops.parameters(known_config("Qwen2.5-0.5B")) == 494_032_768


def test_forward_flops_of_a_tiny_row_counted_by_hand():
    cfg = tiny_config("qwen2")  # d 64, 2 layers, 4 heads x 16, 2 KV heads, MLP 128, vocab 256
    # per layer and token: q 64x64, k and v 64x32 each, o 64x64, gate/up/down 3 x 64x128 → MACs
    macs = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128
    length, scored = 10, 3
    pairs = sum(t + 1 for t in range(length))               # causal: token t reads t + 1 keys
    body = 2 * 2 * macs * length + 2 * 4 * 16 * 2 * 2 * pairs  # 2 layers; QKᵀ and PV are 2 MACs per (pair, head dim)
    head = 2 * 64 * 256 * scored
    assert flops.forward_flops(cfg, rows=5, length=length, scored_per_row=scored) == 5 * (body + head)


def test_training_counts_two_forwards_for_the_backward_and_one_more_under_full_remat():
    cfg = tiny_config("qwen2")
    forward = flops.forward_flops(cfg, 2, 8, 4)
    assert flops.training_flops(cfg, 2, 8, 4, "none") == (3 * forward, 3 * forward)
    assert flops.training_flops(cfg, 2, 8, 4, "full") == (3 * forward, 4 * forward)


def test_decode_reads_the_weights_once_a_step_and_each_live_kv_entry():
    cfg = tiny_config("qwen2")
    kv_token = 2 * 2 * 2 * 16 * 2   # K and V x layers x KV heads x head dim x bf16 bytes
    assert flops.kv_bytes_per_token(cfg) == kv_token
    assert flops.decode_bytes(cfg, steps=7, key_reads=100) == 7 * flops.parameters(cfg) * 2 + 100 * kv_token


def test_utilisation_is_work_over_time_and_peak_and_nan_without_time():
    assert flops.utilisation(6e12, 2.0, 1e12, 3) == pytest.approx(1.0)
    assert np.isnan(flops.utilisation(1.0, 0.0, 1e12, 1))


@pytest.mark.parametrize("kind,platform,row", [
    ("NVIDIA H100 80GB HBM3", "gpu", "H100"), ("NVIDIA H200", "gpu", "H200"), ("TPU v5 lite", "tpu", "v5e"),
    ("TPU v5", "tpu", "v5p"), ("cpu", "cpu", None)])
def test_device_kinds_map_to_their_datasheet_row(kind, platform, row):
    assert flops.hardware_of(kind, platform) == row


def test_overrides_replace_the_datasheet_and_say_so():
    class Device:
        device_kind, platform = "NVIDIA H100 80GB HBM3", "gpu"

    assert flops.device_peak(Device()).flops == 989e12
    peak = flops.device_peak(Device(), flops_override=5e14)
    assert peak.flops == 5e14 and peak.bytes_per_s == 3.35e12 and "overridden" in peak.source


def test_mfu_of_packed_rows_counts_the_used_micro_batches_and_in_segment_attention():
    """A step whose 2 mini-batches used 2 + 1 micro-batches of 4 packed rows of 64 tokens (12 rows) and
    whose no-grad passes, packing the batch as one group, used 2 (8 rows); attention only inside each
    trajectory (lengths 10, 20, 30 here), the same pairs whatever rows hold them."""
    from types import SimpleNamespace

    from llds_jax.config import base_config
    from llds_jax.train.packing import PackingSizes
    from llds_jax.train.utilisation import computed_rows, step_utilisation

    config = base_config()
    config.train.peak_flops, config.train.peak_bytes_per_s = 1e12, 1e11
    packing = PackingSizes(width=64, rows=4, scored=8, mini_batches=2, mini_batch_size=4)
    learner = SimpleNamespace(packing=packing, config=config)
    batch = SimpleNamespace(packed=SimpleNamespace(mini_count=np.array([2, 1], np.int32)),
                            packed_passes=SimpleNamespace(mini_count=np.array([2], np.int32)))
    computed = computed_rows(learner, batch, [10, 20, 30])
    pairs = 55 + 210 + 465
    assert computed == (12, 8, 64, 8, pairs)  # the update's 3 micro-batches of 4 rows, a no-grad pass's 2
    cfg = tiny_config("qwen2")
    macs = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128
    row_flops = 2 * 2 * macs * 64 + 2 * 64 * 256 * 8  # the decoder's matmuls and the LM head's 8 positions
    attention = 2 * 2 * 4 * 16 * 2 * pairs  # inside each trajectory, however many rows hold them
    metrics = {"time/update_s": 2.0, "time/logprobs_s": 1.0}
    out = step_utilisation(cfg, config, metrics=metrics, rollout_timings={}, computed=computed, logprob_passes=2,
                           mesh_devices=4, sampler_devices=4, weight_bytes=4)
    assert out["throughput/update_mfu"] == pytest.approx(3 * (12 * row_flops + attention) / (2.0 * 1e12 * 4),
                                                         rel=1e-12)
    assert out["throughput/logprobs_mfu"] == pytest.approx(2 * (8 * row_flops + attention) / (1.0 * 1e12 * 4),
                                                           rel=1e-12)
