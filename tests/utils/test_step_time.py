"""The plan's step-time model: the waves schedule and each phase's seconds, checked by hand."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from llds_jax.config import base_config
from llds_jax.data.lengths import TrajectoryLengths, load_lengths, reference_lengths, row_lengths
from llds_jax.models.testing import tiny_config
from llds_jax.plan.step_time import (
    ENGINE_LAUNCHES,
    LAUNCH_S,
    RANDOM_WEIGHTS_GPU_SAMPLER_READS,
    SAMPLER_ROW_READS,
    TRAINED_LIKE_LOGIT_STD,
    predict_step_time,
    step_lengths,
    waves_schedule,
)
from llds_jax.sampling.filtering_gpu import sampler_scratch_bytes
from llds_jax.utils import flops

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def _t(prompt, actions, feedback, searched=None):
    return TrajectoryLengths(prompt, tuple(actions), tuple(feedback), searched)


def test_waves_wait_for_each_turns_longest_action():
    trajectories = [_t(10, [5, 2], [4]), _t(10, [3, 6], [4]), _t(20, [7], [])]
    s = waves_schedule(trajectories, rows_per_wave=2, max_tokens=64, action_tokens=16)
    # wave 1: turn 0 max(5, 3) = 5, turn 1 max(2, 6) = 6; wave 2: 7
    assert s.decode_steps == 5 + 6 + 7
    assert s.decode_tokens == 5 + 2 + 3 + 6 + 7
    assert s.lower_bound_steps == max(9, 7, -(-23 // 2))  # the longest trajectory's own tokens vs tokens / slots
    assert s.retrieval_calls == 1  # wave 1's first turn; wave 2 never searches
    # live KV reads: row a 5 tokens from 10 then 2 from 19; row b 3 from 10 then 6 from 17; row c 7 from 20
    reads = lambda n, c: n * c + n * (n - 1) / 2
    assert s.key_reads == reads(5, 10) + reads(2, 19) + reads(3, 10) + reads(6, 17) + reads(7, 20)
    assert s.prefill_tokens == 10 + 4 + 10 + 4 + 20


def test_invalid_action_feedback_calls_no_retriever():
    s = waves_schedule([_t(10, [5, 2], [4], (False,))], rows_per_wave=1, max_tokens=64, action_tokens=16)
    assert s.retrieval_calls == 0 and s.prefill_tokens == 14


def test_step_lengths_apply_the_rollout_caps():
    config = base_config()
    config.rollout.max_turns, config.rollout.max_action_tokens, config.rollout.max_obs_tokens = 1, 50, 30
    config.rollout.max_context, config.rollout.max_prompt_tokens = 130, 40
    (t,) = step_lengths(config, [_t(60, [80, 20, 10], [100, 100])], 1)
    # prompt 40 (cut), action 50 (cap), feedback 30 (cap), then the 10 slots left of the context; the
    # third action is past max_turns + 1 = 2
    assert (t.prompt, t.actions, t.feedback) == (40, (50, 10), (30,))


def test_row_lengths_read_a_rollout_rows_masks():
    index = [-1, -1, 0, 0, 0, -1, -1, 1, 1, -1, -1, -1, 2, -1]
    feedback = [0, 0, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 0, 0]
    assert row_lengths(2, index, feedback, ["search", "invalid", None]) == {
        "prompt": 2, "actions": [3, 2, 1], "feedback": [2, 3], "searched": [True, False]}


def test_the_bundled_reference_is_searchr1_3bs_trajectories():
    lengths = reference_lengths()
    assert len(lengths) == 3250 and load_lengths("") == lengths
    mean = sum(t.total for t in lengths) / len(lengths)
    assert 650 < mean < 750 and all(t.searched is None for t in lengths)


def test_each_phase_is_its_count_over_the_stated_rate():
    config = base_config()
    config.rollout.max_turns, config.train.prompts_per_step, config.rollout.n_samples = 1, 2, 2
    config.plan.efficiency_matmul, config.plan.efficiency_hbm, config.plan.retrieval_s = 0.5, 0.25, 0.1
    config.plan.decode_step_overhead_s = 0.0
    config.train.save_every, config.plan.checkpoint_bytes_per_s = 10, 1e9
    cfg, peak = tiny_config("qwen2", dtype="bfloat16"), flops.Peak(1e12, 1e11, "test")
    lengths = [_t(10, [5, 2], [4]), _t(10, [3, 6], [4])]
    step = predict_step_time(config, cfg, platform="gpu", peak=peak, devices=2, hosts=1, rows_per_wave=4,
                             train_rows=4, train_length=64, scored_per_row=16, state_bytes=8e9, lengths=lengths)
    s = step.schedule
    # every row the step samples: its bf16 logits' passes and the top-p sampler's scratch
    sampler = (SAMPLER_ROW_READS["gpu"][0] * cfg.vocab_size * 2 + sampler_scratch_bytes(cfg.vocab_size)) * s.decode_steps * s.slots
    decode = max((flops.decode_bytes(cfg, s.decode_steps, s.key_reads / 2) + sampler / 2) / (1e11 * 0.25),
                 flops.decode_flops(cfg, s.decode_tokens, s.key_reads) / 2 / (1e12 * 0.5))
    forward = flops.forward_flops(cfg, 4, 64, 16)
    assert step.seconds["rollout_decode"] == pytest.approx(decode)
    assert step.seconds["rollout_retrieval"] == pytest.approx(0.1 * s.retrieval_calls)
    assert step.seconds["logprobs"] == pytest.approx(2 * forward / (1e12 * 0.5 * 2))  # π_old and π_ref (kl > 0)
    assert step.seconds["update"] == pytest.approx(flops.training_flops(cfg, 4, 64, 16, cfg.remat)[1] / 1e12)
    # an async save: the loop waits for the 2 devices' copies to host at 10 GB/s each, plus the part of the
    # 8 s write (1 GB/s) that the 10 steps it runs beside do not cover
    others = sum(v for k, v in step.seconds.items() if k not in ("rollout", "checkpoint", "total"))
    assert 8e9 / 1e9 > 10 * others  # this tiny job's steps are shorter than the write
    assert step.seconds["checkpoint"] == pytest.approx((8e9 / (2 * 10e9) + 8e9 / 1e9 - 10 * others) / 10)
    parts = [v for k, v in step.seconds.items() if k not in ("rollout", "total")]
    assert step.seconds["total"] == pytest.approx(sum(parts))
    assert {"peak", "matmul_efficiency", "forward_efficiency", "hbm_efficiency", "retrieval",
            "lengths"} <= set(step.assumptions)


def test_a_save_waits_for_the_copy_to_host_and_the_log_prob_passes_run_at_the_forwards_rate():
    """Orbax writes beside the next steps, so a write they outlast costs only the devices' copy to host;
    on a GPU the no-grad passes run at the H100-measured forward efficiency, the update at the update's."""
    config = base_config()
    config.rollout.max_turns, config.train.prompts_per_step, config.rollout.n_samples = 1, 2, 2
    config.plan.retrieval_s, config.plan.decode_step_overhead_s = 0.1, 0.0
    config.train.save_every, config.plan.checkpoint_bytes_per_s = 10, 1e12
    cfg, peak = tiny_config("qwen2", dtype="bfloat16"), flops.Peak(1e12, 1e11, "test")
    lengths = [_t(10, [5, 2], [4]), _t(10, [3, 6], [4])]
    step = predict_step_time(config, cfg, platform="gpu", peak=peak, devices=2, hosts=1, rows_per_wave=4,
                             train_rows=4, train_length=64, scored_per_row=16, state_bytes=8e9, lengths=lengths)
    assert step.seconds["checkpoint"] == pytest.approx(8e9 / (2 * 10e9) / 10)
    forward = flops.forward_flops(cfg, 4, 64, 16)
    update_flops = flops.training_flops(cfg, 4, 64, 16, cfg.remat)[1]
    assert step.seconds["logprobs"] == pytest.approx(2 * forward / (1e12 * 0.45 * 2))
    assert step.seconds["update"] == pytest.approx(update_flops / (1e12 * 0.42 * 2))
    assert step.assumptions["forward_efficiency"].startswith("0.45 of peak")


def test_the_sampler_reads_are_the_platforms_count():
    """TPU's cut-off kernel reads the rows once (held in VMEM) and its draw and the rows' eviction three
    more, GPU's top-p sampler twice with its scratch and fallback: the planned decode bytes differ by
    exactly the two counts' difference, and the assumption names the platform's count."""
    config = base_config()
    config.rollout.max_turns, config.train.prompts_per_step, config.rollout.n_samples = 1, 2, 2
    cfg, peak = tiny_config("qwen2", dtype="bfloat16"), flops.Peak(1e12, 1e11, "test")
    lengths = [_t(10, [5, 2], [4]), _t(10, [3, 6], [4])]
    steps = {platform: predict_step_time(config, cfg, platform=platform, peak=peak, devices=2, hosts=1, rows_per_wave=4,
                                         train_rows=4, train_length=64, scored_per_row=16, state_bytes=8e9,
                                         lengths=lengths) for platform in ("gpu", "tpu")}
    s = steps["gpu"].schedule
    more = ((SAMPLER_ROW_READS["gpu"][0] - SAMPLER_ROW_READS["tpu"][0]) * cfg.vocab_size * 2
            + sampler_scratch_bytes(cfg.vocab_size)) * s.decode_steps * s.slots
    assert SAMPLER_ROW_READS["tpu"][0] != SAMPLER_ROW_READS["gpu"][0]
    assert steps["gpu"].details["decode_bytes"] - steps["tpu"].details["decode_bytes"] == pytest.approx(more / 2)
    for platform, step in steps.items():
        assert step.assumptions["sampler"].startswith(f"{SAMPLER_ROW_READS[platform][0]} passes over each sampled "
                                                      "row's bfloat16 logits")


def test_random_weights_pay_the_gpu_samplers_fallback_unless_their_logits_spread_like_a_trained_models():
    """A ``random:`` model at the init's spread has near-flat logits, so the GPU top-p sampler takes its
    full-row path for every row: its decode bytes carry those reads, a trained model's the fast path's.
    Scaled to ``TRAINED_LIKE_LOGIT_STD`` (the device check's ``model.random_logit_std``) it pays a trained model's."""
    config = base_config()
    config.rollout.max_turns, config.train.prompts_per_step, config.rollout.n_samples = 1, 2, 2
    cfg, peak = tiny_config("qwen2", dtype="bfloat16"), flops.Peak(1e12, 1e11, "test")
    lengths = [_t(10, [5, 2], [4]), _t(10, [3, 6], [4])]

    def step(source):
        config.model.source = source
        return predict_step_time(config, cfg, platform="gpu", peak=peak, devices=2, hosts=1, rows_per_wave=4,
                                 train_rows=4, train_length=64, scored_per_row=16, state_bytes=8e9, lengths=lengths)

    trained, random = step("smollm2"), step("random:Qwen2.5-0.5B")
    s = trained.schedule
    more = (RANDOM_WEIGHTS_GPU_SAMPLER_READS[0] - SAMPLER_ROW_READS["gpu"][0]) * cfg.vocab_size * 2 * s.decode_steps * s.slots
    assert random.details["decode_bytes"] - trained.details["decode_bytes"] == pytest.approx(more / 2)
    assert random.assumptions["sampler"].startswith(f"{RANDOM_WEIGHTS_GPU_SAMPLER_READS[0]} passes")
    config.model.random_logit_std = TRAINED_LIKE_LOGIT_STD
    spread = step("random:Qwen2.5-0.5B")
    assert spread.details["decode_bytes"] == trained.details["decode_bytes"]
    assert spread.assumptions["sampler"] == trained.assumptions["sampler"]


def test_both_policies_carry_the_engines_launches_and_the_override_wins():
    """The waves are a policy of the engine (one decode program), so their steps cost the engine's
    launches too; ``plan.decode_step_overhead_s`` ≥ 0 replaces that fixed cost for every schedule."""
    config = base_config()
    config.rollout.max_turns, config.train.prompts_per_step, config.rollout.n_samples = 1, 2, 2
    cfg, peak = tiny_config("qwen2", dtype="bfloat16"), flops.Peak(1e12, 1e11, "test")
    lengths = [_t(10, [5, 2], [4]), _t(10, [3, 6], [4])]

    def decode(overhead: float) -> tuple[float, int, str]:
        config.plan.decode_step_overhead_s = overhead
        step = predict_step_time(config, cfg, platform="gpu", peak=peak, devices=1, hosts=1, rows_per_wave=4,
                                 train_rows=4, train_length=64, scored_per_row=16, state_bytes=8e9, lengths=lengths)
        assert step.schedule.name == "waves"
        return step.seconds["rollout_decode"], step.schedule.decode_steps, step.assumptions["decode_step_overhead"]

    per_layer, per_step = ENGINE_LAUNCHES["gpu"]
    launches = (per_layer * cfg.num_layers + per_step) * LAUNCH_S["gpu"][0]
    (bytes_only, steps, _), (default, _, why), (fixed, _, fixed_why) = decode(0.0), decode(-1.0), decode(0.01)
    assert default == pytest.approx(bytes_only + launches * steps) and "kernel launches" in why
    assert fixed == pytest.approx(bytes_only + 0.01 * steps) and "plan.decode_step_overhead_s" in fixed_why


def test_the_engines_paged_step_costs_its_kernel_launches():
    """The engine decodes over the paged cache, whose step has no host-read loop or conditional: its fixed
    cost a step is its launches (per layer and per step) at the platform's launch cost, stated."""
    config = base_config()
    config.rollout.max_turns, config.train.prompts_per_step, config.rollout.n_samples = 1, 2, 2
    config.rollout.engine = "continuous"
    cfg, peak = tiny_config("qwen2", dtype="bfloat16"), flops.Peak(1e12, 1e11, "test")
    lengths = [_t(10, [5, 2], [4]), _t(10, [3, 6], [4])]

    config.plan.efficiency_matmul, config.plan.efficiency_hbm = 0.5, 0.25
    step = predict_step_time(config, cfg, platform="gpu", peak=peak, devices=1, hosts=1, rows_per_wave=4,
                             train_rows=4, train_length=64, scored_per_row=16, state_bytes=8e9, lengths=lengths)
    s, seconds = step.by_schedule["engine, dense rows"]
    why = step.assumptions["decode_step_overhead"]
    per_layer, per_step = ENGINE_LAUNCHES["gpu"]
    launches = per_layer * cfg.num_layers + per_step
    read = flops.decode_bytes(cfg, s.decode_steps, s.key_reads) + (
        SAMPLER_ROW_READS["gpu"][0] * cfg.vocab_size * 2 + sampler_scratch_bytes(cfg.vocab_size)) * s.decode_steps * s.slots
    bound = max(read / (1e11 * 0.25), flops.decode_flops(cfg, s.decode_tokens, s.key_reads) / (1e12 * 0.5))
    assert seconds["rollout_decode"] == pytest.approx(bound + launches * LAUNCH_S["gpu"][0] * s.decode_steps)
    assert f"{launches * LAUNCH_S['gpu'][0] * 1e3:.2f} ms" in why and "--decode-program" in why


def _plan_json(tmp_path, config: str, *extra: str) -> tuple[str, dict]:
    """``--mode=plan`` as a real process: the step time alone on 8 devices of 80 GB; (stdout, its JSON)."""
    out = tmp_path / "plan.json"
    proc = subprocess.run(
        [sys.executable, "-m", "llds_jax.main", "--mode=plan", f"--config={config}", "--config.plan.devices=8",
         "--config.plan.phases=()", "--config.plan.device_memory_bytes=80000000000", f"--config.plan.json_out={out}",
         *extra],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())


@pytest.mark.integration
def test_mode_plan_writes_the_step_time_as_json(tmp_path):
    """One process: qwen3b searching a bf16 mesh index of wiki-18 (the stated fields; its index dir is
    empty) at a stated host rate: the JSON holds the index per device and a paper turn's seconds."""
    stdout, plan = _plan_json(tmp_path, "configs/qwen3b.py", "--config.retrieval.method=mesh",
                              "--config.retrieval.url=", f"--config.retrieval.index_path={tmp_path}",
                              "--config.retrieval.mesh_dtype=bfloat16", "--config.plan.host_flops=2e12")
    assert "step time, predicted" in stdout and "36-54 s" in stdout
    assert set(plan["step_time_s"]) >= {"rollout", "logprobs", "update", "delta", "checkpoint", "total"}
    assert plan["step_time_s"]["total"] > plan["step_time_s"]["update"] > 0
    assert "matmul_efficiency" in plan["assumptions"] and "none charged" in plan["assumptions"]["collectives"]
    # the mesh index: wiki-18 x E5 in bf16 over the 8 devices of one host, padded as MeshIndex pads
    assert plan["resident_bytes"]["retrieval_index"] == pytest.approx(-(-21_015_324 // 8) * 768 * 2, rel=1e-4)
    assert "retrieval index" in stdout and "plan.index_passages" in plan["assumptions"]["retrieval"]
    turn = plan["retrieval_turn_s"]
    assert turn["queries"] == 2560 and turn["configured"] == turn["mesh_bfloat16"]
    assert turn["faiss_flat_host"] == pytest.approx(2 * 2560 * 21_015_324 * 768 / 2e12)
    assert 0 < turn["mesh_bfloat16"] <= turn["mesh_float32"]  # simulated CPU chips: matmul-bound either way
    assert "retrieval, one turn of 2,560 queries" in stdout


@pytest.mark.integration
def test_the_plan_puts_the_waves_and_the_engine_side_by_side(tmp_path):
    _, plan = _plan_json(tmp_path, "configs/qwen7b.py")
    by = plan["step_time_s_by_schedule"]
    assert set(by) == {"waves", "engine, dense rows", "engine, paged plan"}
    assert plan["step_time_s"] == by["engine, paged plan"]  # the configured rollout.engine: the paged engine
    schedules = plan["schedules"]
    # no turn barrier: fewer decode steps than the waves; the paged plan holds more slots than dense rows
    assert schedules["engine, dense rows"]["decode_steps"] < schedules["waves"]["decode_steps"]
    assert schedules["engine, paged plan"]["slots"] > schedules["engine, dense rows"]["slots"]
    assert by["engine, dense rows"]["rollout_retrieval"] == 0  # retrieval runs on a host thread
    # the training passes do not depend on the rollout's schedule
    assert {by[name]["update"] for name in by} == {by["waves"]["update"]}
