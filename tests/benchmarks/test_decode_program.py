"""``bench_rollout.py --decode-program``: the engine's per-token decode step compiled by the real XLA:GPU
(H100) and XLA:TPU (v5e) compilers, compile-only, on the tiny model (one CLI run, in a fresh
``JAX_PLATFORMS=cpu`` process as the compile-only GPU target needs), and the arithmetic it rests on.

``test_the_gpu_decode_step_has_no_dynamic_loop_and_no_conditional`` pins issue 57's goal and fails
on today's code (the paged attention's key-block ``fori_loop`` and the sampler's ``lax.cond``s)
until the GPU decode kernel and the static sampler land."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llds_jax.plan.targets import target_installed

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

needs_both = pytest.mark.skipif(bool(target_installed("gpu") or target_installed("tpu")),
                                reason=target_installed("gpu") or target_installed("tpu") or "installed")
FIELDS = {"dynamic_loops", "conditionals", "kernels", "bytes", "ideal_bytes"}


@pytest.fixture(scope="module")
def report() -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))  # this checkout's llds_jax
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_rollout.py"), "--decode-program", "--tiny",
                           "--json"], capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)  # exactly one JSON object on stdout


@needs_both
def test_the_report_has_every_field_for_each_target_compiler(report):
    assert set(report["targets"]) == {"h100-tiny", "v5e-tiny"}
    assert {"program", "live_lengths", "ideal", "compiler_options"} <= set(report["settings"])
    assert report["settings"]["compiler_options"] == {"xla_gpu_experimental_force_split_k": 1}  # K whole (slots)
    for name, target in report["targets"].items():
        assert FIELDS <= set(target), name
        assert all(isinstance(target[f], int) and target[f] >= 0 for f in FIELDS), target
        assert target["kernels"] > 0 and target["bytes"] > 0 and target["uncosted_calls"] == []
        assert target["segment_loop"]["known_trip_count"] is False  # decode_segment stops early: a checked loop
        assert target["live_lengths"]["max"] == max(_tiny_lengths())
        groups = target["kernel_groups"]  # where the bytes go: every kernel in one group, largest first
        assert sum(g["kernels"] for g in groups) == target["launches"] and groups[0]["bytes"] >= groups[-1]["bytes"]
    assert report["targets"]["h100-tiny"]["compiler"].startswith("XLA:GPU")
    assert report["targets"]["h100-tiny"]["bytes_detail"]["custom_calls"]["pallas gate/up GEMM"] > 0  # models/mlp_gpu
    assert report["targets"]["v5e-tiny"]["compiler"].startswith("XLA:TPU")


@needs_both
def test_the_tpu_step_prices_the_pallas_kernel_and_the_gpu_step_its_pool_reads_as_run(report):
    """v5e: the paged-decode kernel, a custom call XLA cannot see, is charged its declared reads, and
    the sampler's cut-off kernel (sampling/filtering_tpu.py) its pl.CostEstimate: one read of the
    [rows, vocab] logits in bf16 (the compute dtype: Decoder.forward_cached), three [rows, 128] knob
    tiles in and three result tiles out;
    H100 (today: XLA gathers and scatters on the pool): XLA's whole-pool charges are taken back, and
    the sampler's Triton kernel is charged the reads and the scratch its name states."""
    tpu, gpu = report["targets"]["v5e-tiny"], report["targets"]["h100-tiny"]
    assert tpu["bytes_detail"]["custom_calls"]["pallas decode_read_bytes"] > 0
    rows, vocab = tpu["rows"], 256  # the tiny qwen2's vocabulary (see the ideal's test)
    assert tpu["bytes_detail"]["custom_calls"]["pallas cost_estimate"] == rows * vocab * 2 + 6 * rows * 128 * 4
    # H100: the Triton top-p sampler (sampling/filtering_gpu.py), the reads its name states: its fast
    # path's 2 over the logits, its [rows] 4-byte columns (knobs in, results out) and its candidate scratch
    from llds_jax.sampling.filtering_gpu import FAST_READS, SAMPLER_COLUMNS, sampler_scratch_bytes

    assert gpu["bytes_detail"]["custom_calls"]["pallas sampler reads"] == (
        FAST_READS * gpu["rows"] * vocab * 2 + SAMPLER_COLUMNS * gpu["rows"] * 4
        + gpu["rows"] * sampler_scratch_bytes(vocab))
    detail = gpu["bytes_detail"]
    assert detail["xla_body_once"] + detail["loop_trips_added"] + detail["charged_not_run"] + sum(
        detail["custom_calls"].values()) == gpu["bytes"]
    assert detail["charged_not_run"] <= 0
    assert gpu["bytes"] == gpu["xla_cost_analysis_bytes"] and gpu["hbm_model"] is None
    # v5e: HBM traffic (_tpu_hbm's model of the same body) plus the kernels' declared bytes; XLA's
    # analysis, which charges VMEM prefetches at both ends, is kept beside it and is never below it
    hbm = tpu["hbm_model"]
    assert tpu["bytes"] == hbm["xla_ops"] + sum(tpu["bytes_detail"]["custom_calls"].values())
    assert 0 < hbm["xla_ops"] == sum(hbm["by_opcode"].values()) and tpu["bytes"] <= tpu["xla_cost_analysis_bytes"]


@needs_both
def test_the_ideal_is_weights_once_plus_live_kv_and_the_logits_stand_beside_it(report):
    """tiny qwen2 (tests/tools/roofline): 90,688 parameters in bf16, tied; 2 layers x 2 KV heads x 16;
    issue 57's ideal, and the bf16 [4, 256] logits written and read once beside it."""
    lengths = _tiny_lengths()
    per_slot = 2 * 2 * 2 * 16 * 2  # k+v x layers x kv heads x head_dim x bf16
    ideal = 90_688 * 2 + per_slot * (sum(lengths) + 4)
    assert {t["ideal_bytes"] for t in report["targets"].values()} == {ideal}
    assert {t["logits_bytes"] for t in report["targets"].values()} == {2 * 4 * 256 * 2}


@needs_both
def test_the_gpu_decode_step_has_no_dynamic_loop_and_no_conditional(report):
    """Issue 57's goal on XLA:GPU: one straight-line program a token (fails until the kernel and the
    static sampler land)."""
    gpu = report["targets"]["h100-tiny"]
    assert (gpu["dynamic_loops"], gpu["conditionals"]) == (0, 0), gpu["loops"]


def _tiny_lengths() -> list[int]:
    import _decode_step

    return _decode_step.mid_decode_lengths(4, max_context=512)


@pytest.mark.unit
def test_mid_decode_lengths_by_hand_for_the_first_reference_trajectory():
    """Trajectory 0: prompt 145, actions (65, 8), feedback (462,): 73 sampled tokens, the 37th is
    action 0's 37th, drawn with 145 + 36 slots live."""
    import _decode_step

    assert _decode_step.mid_decode_lengths(1) == [181]


@pytest.mark.unit
def test_tpu_decode_read_bytes_by_hand():
    from llds_jax.models.attention.decode_tpu import decode_read_bytes

    # rows at slots 0, 128, 129: 0 + 1 + 2 blocks; bf16 rows of 64 x 2 B; 2 KV heads, 8 heads (G 4);
    # the three rows' k and v tiles of 16 rows; 4 query heads, new k and v for the rows padded to 8
    row = 64 * 2
    assert decode_read_bytes([0, 128, 129], 2, 64, 128, 2, 8) == 2 * (2 * 3 * 128 * row + 3 * 2 * 16 * row
                                                                      + 8 * (4 * row + 2 * row))
