"""The update's hardware FLOPs per remat policy (``utils.flops.update_hardware_flops``), and the plan charging them."""

from __future__ import annotations

import pytest

from llds_jax.config import base_config
from llds_jax.data.lengths import TrajectoryLengths
from llds_jax.models.testing import tiny_config
from llds_jax.plan.step_time import attention_is_opaque, predict_step_time
from llds_jax.utils import flops

pytestmark = pytest.mark.unit


def _terms(cfg, rows, length, scored):
    attention = rows * flops.attention_flops(cfg, flops.causal_pairs(length))
    head = rows * 2.0 * cfg.hidden_size * cfg.vocab_size * scored
    return flops.forward_flops(cfg, rows, length, scored) - head, attention, head


@pytest.mark.parametrize("remat", ["full", "nothing_saveable"])
def test_full_remat_with_a_chunked_head_is_four_forwards_as_before(remat):
    cfg = tiny_config("qwen2")
    hardware = flops.update_hardware_flops(cfg, 4, 64, 16, remat, head_chunked=True)
    assert hardware == pytest.approx(flops.training_flops(cfg, 4, 64, 16, remat)[1])
    body, _, head = _terms(cfg, 4, 64, 16)
    assert flops.update_hardware_flops(cfg, 4, 64, 16, remat) == pytest.approx(4 * body + 3 * head)


@pytest.mark.parametrize("remat", ["minimal", "dots_saveable"])
def test_policies_keeping_the_matmuls_rerun_only_an_opaque_attention_kernel(remat):
    cfg = tiny_config("qwen2")
    body, attention, head = _terms(cfg, 4, 64, 16)
    assert flops.update_hardware_flops(cfg, 4, 64, 16, remat) == pytest.approx(3 * (body + head))
    assert flops.update_hardware_flops(cfg, 4, 64, 16, remat, opaque_attention=True, head_chunked=True) == \
        pytest.approx(3 * (body + head) + attention + head)


def test_no_remat_reruns_only_the_chunked_head():
    cfg = tiny_config("qwen2")
    body, _, head = _terms(cfg, 4, 64, 16)
    assert flops.update_hardware_flops(cfg, 4, 64, 16, "none", opaque_attention=True) == \
        pytest.approx(flops.training_flops(cfg, 4, 64, 16, "none")[1])
    assert flops.update_hardware_flops(cfg, 4, 64, 16, "none", head_chunked=True) == pytest.approx(3 * body + 4 * head)


def test_opaque_attention_is_cudnn_on_gpu_and_splash_on_tpu():
    assert attention_is_opaque("auto", "gpu") and attention_is_opaque("cudnn", "gpu")
    assert attention_is_opaque("auto", "tpu") and attention_is_opaque("splash", "tpu")
    assert not attention_is_opaque("xla_blockwise", "gpu") and not attention_is_opaque("auto", "cpu")


@pytest.mark.parametrize("remat", ["full", "minimal"])
def test_the_plan_charges_the_update_its_policys_flops_and_says_which(remat):
    config = base_config()
    config.rollout.max_turns, config.train.prompts_per_step, config.rollout.n_samples = 1, 2, 2
    config.plan.efficiency_matmul, config.plan.efficiency_hbm, config.plan.retrieval_s = 0.5, 0.25, 0.1
    config.model.logprob_chunk_size = 8  # 16 scored positions a row: two checkpointed chunks
    cfg = tiny_config("qwen2", dtype="bfloat16", remat=remat)
    peak = flops.Peak(1e12, 1e11, "test")
    lengths = [TrajectoryLengths(10, (5, 2), (4,)), TrajectoryLengths(10, (3, 6), (4,))]
    step = predict_step_time(config, cfg, platform="gpu", peak=peak, devices=2, hosts=1, rows_per_wave=4,
                             train_rows=4, train_length=64, scored_per_row=16, state_bytes=8e9, lengths=lengths)
    hardware = flops.update_hardware_flops(cfg, 4, 64, 16, remat, opaque_attention=True, head_chunked=True)
    assert step.seconds["update"] == pytest.approx(hardware / (1e12 * 0.5 * 2))
    assert f"remat={remat!r}" in step.assumptions["update_flops"]
    assert "chunks of 8" in step.assumptions["update_flops"]
    assert ("cuDNN" in step.assumptions["update_flops"]) == (remat == "minimal")


def test_qwen3b_keeps_the_matmuls_on_a_gpu_and_all_but_the_mlp_gate_on_a_tpu():
    """configs/qwen3b.py: the update's compiled peak per device (``--mode=plan``, phase update) is 12.19 GB
    under full remat and 29.06 GB under ``minimal`` on 8 x H100 (80 GB: fits with 44 GB to spare), but
    16.74 GB under ``minimal`` on a v5e:8x8 chip (16 GB: refused) and 13.50 GB under ``minimal_no_gate``,
    so GPUs run ``minimal`` and the rest ``minimal_no_gate``."""
    import importlib.util
    from pathlib import Path

    from llds_jax.models.loading import decoder_config

    path = Path(__file__).resolve().parents[2] / "configs" / "qwen3b.py"
    spec = importlib.util.spec_from_file_location("qwen3b", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    assert decoder_config(config.model, "gpu").remat == "minimal"
    assert decoder_config(config.model, "tpu").remat == "minimal_no_gate"
    assert decoder_config(config.model).remat == "minimal_no_gate"


def test_minimal_no_gate_also_reruns_the_mlp_gate_projection():
    cfg = tiny_config("qwen2")
    gate = 4 * 64 * 2.0 * cfg.num_layers * cfg.hidden_size * cfg.intermediate_size
    assert flops.update_hardware_flops(cfg, 4, 64, 16, "minimal_no_gate", opaque_attention=True) == \
        pytest.approx(flops.update_hardware_flops(cfg, 4, 64, 16, "minimal", opaque_attention=True) + gate)
