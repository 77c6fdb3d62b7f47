"""tools/roofline/roofline.py: the ideal-work arithmetic against hand-computed numbers and the real
parameter tree, the HLO readers against programs the real compilers produced, and the report
end to end for a tiny model on XLA:CPU, XLA:TPU v5e and XLA:GPU H100 (compile-only)."""

from __future__ import annotations

import json
import math

import _xla_charges  # tools/roofline, on sys.path by this folder's conftest.py
import jax
import jax.numpy as jnp
import pytest
import roofline
from flax import nnx

from llds_jax.models import Decoder
from llds_jax.models.attention import CACHED_BLOCK
from llds_jax.models.testing import TINY_FAMILIES, tiny_config
from llds_jax.plan.targets import target_installed

pytestmark = pytest.mark.unit

needs_tpu = pytest.mark.skipif(bool(target_installed("tpu")), reason=target_installed("tpu") or "installed")
needs_gpu = pytest.mark.skipif(bool(target_installed("gpu")), reason=target_installed("gpu") or "installed")
# Given peaks: the report must not spend the test's time measuring the machine.
NO_MEASURE = ["--cpu-flops", "1e11", "--cpu-bandwidth", "1e10"]
# The compile-only XLA:TPU / XLA:GPU reports keep one of the tiny model's two blocks: what they check is per
# program and per layer (a layer's cache scatters, the embedding lookup, the slot dependence), and the decode
# programs unroll their layers, so one block compiles each program in about 2/3 of the CPU time.
ONE_LAYER = ["--layers", "1"]

# tiny qwen2 (tests/models/testing.py): vocab 256, d 64, 2 layers, 4 heads / 2 kv heads of 16, mlp 128,
# qkv bias, tied. Per layer: q 64*4*16 + k 64*2*16 + v 64*2*16 + o 4*16*64 = 12288, mlp 3*64*128 = 24576,
# two norms 128, biases (4+2+2)*16 = 128 -> 37120; two layers + final norm 64 -> 74304; head 64*256 = 16384.
TINY_N_LAYERS, TINY_HEAD = 74_304, 16_384


def test_parameter_counts_are_the_hand_computed_ones_for_the_tiny_model():
    shapes = roofline.Shapes(tiny_config("qwen2"))
    assert (shapes.n_layers, shapes.n_head, shapes.total_params) == (TINY_N_LAYERS, TINY_HEAD, TINY_N_LAYERS + TINY_HEAD)
    assert shapes.param_bytes == 4 * (TINY_N_LAYERS + TINY_HEAD)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_parameter_count_equals_the_decoders_own_parameter_tree(family):
    config = tiny_config(family)
    model = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
    real = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert roofline.Shapes(config).total_params == real


@pytest.mark.parametrize("model, expected_millions", [("smollm2-135m", 134.5), ("qwen2.5-3b", 3085.9)])
def test_named_models_have_their_published_sizes(model, expected_millions):
    config = roofline.MODELS[model]()
    tree = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
    real = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(tree, nnx.Param)))
    assert roofline.Shapes(config).total_params == real
    assert abs(real / 1e6 - expected_millions) < 0.1, real


def test_ideal_decode_is_weights_plus_live_kv_plus_logits_by_hand():
    shapes = roofline.Shapes(tiny_config("qwen2"))
    flops, bytes_ = roofline.ideal_decode(shapes, batch=8, live=128)
    weights = 4 * (TINY_N_LAYERS + TINY_HEAD)           # fp32, tied table read once (the unembed)
    kv_per_slot = 2 * 2 * 8 * 2 * 16 * 4               # k+v x layers x rows x kv heads x head_dim x fp32
    logits = 2 * 8 * 256 * 4                           # [8, 256] in the compute dtype (fp32) written and read once
    assert bytes_ == weights + kv_per_slot * (128 + 1) + logits == 907_520
    assert flops == 2 * 8 * (TINY_N_LAYERS + TINY_HEAD) + 4 * 8 * 2 * 4 * 16 * 128 == 1_975_296


def test_untied_decode_reads_only_the_looked_up_rows_of_the_input_table():
    tied = roofline.Shapes(tiny_config("qwen2"))
    untied = roofline.Shapes(tiny_config("qwen2_untied"))
    extra = roofline.ideal_decode(untied, 8, 128)[1] - roofline.ideal_decode(tied, 8, 128)[1]
    assert extra == 8 * 64 * 4  # 8 rows of the [256, 64] fp32 input table


def test_ideal_logprobs_and_update_by_hand():
    shapes = roofline.Shapes(tiny_config("qwen2"))
    attention = 2 * 4 * 2 * 4 * 16 * 256 * 256  # causal QK and PV: 2·B·L·H·Dh·T²
    flops, bytes_ = roofline.ideal_logprobs(shapes, 4, 256)
    assert flops == 2 * 1024 * (TINY_N_LAYERS + TINY_HEAD) + attention
    residual = 1024 * 64 * 4
    assert bytes_ == 4 * (TINY_N_LAYERS + TINY_HEAD) + 2 * 2 * residual + 1024 * 5 + 4 * 255 * 4
    flops, bytes_ = roofline.ideal_update(shapes, 4, 256)
    assert flops == 6 * 1024 * (TINY_N_LAYERS + TINY_HEAD) + 3 * attention
    params = TINY_N_LAYERS + TINY_HEAD
    assert bytes_ == 3 * 4 * params + 2 * 4 * params + 4 * 4 * params + 2 * 2 * residual
    # --scored 80: the head projects 4 x 80 positions, the layers every one of the 1024 tokens
    assert roofline.ideal_logprobs(shapes, 4, 256, scored=80)[0] == 2 * (1024 * TINY_N_LAYERS + 320 * TINY_HEAD) + attention
    assert roofline.ideal_update(shapes, 4, 256, scored=80)[0] == 6 * (1024 * TINY_N_LAYERS + 320 * TINY_HEAD) + 3 * attention
    assert roofline.ideal_update(shapes, 4, 256, scored=255) == roofline.ideal_update(shapes, 4, 256)  # = every target


def test_paper_precision_keeps_fp32_weights_and_a_bf16_cache():
    shapes = roofline.Shapes(tiny_config("qwen2", dtype="bfloat16", param_dtype="float32"))
    assert shapes.param_bytes == 4 * (TINY_N_LAYERS + TINY_HEAD)
    assert shapes.kv_bytes_per_slot(8) == 2 * 2 * 8 * 2 * 16 * 2
    # decode reads the sampler's bf16 copy of the weights, not the fp32 masters, and writes bf16 logits
    kv, logits = shapes.kv_bytes_per_slot(8) * 129, 2 * 8 * 256 * 2
    assert roofline.ideal_decode(shapes, 8, 128)[1] == 2 * (TINY_N_LAYERS + TINY_HEAD) + kv + logits


def test_hlo_readers_find_loops_their_trip_counts_and_the_largest_buffers():
    def ten_matmuls(x, w):
        return jax.lax.fori_loop(0, 10, lambda i, x: jnp.tanh(x @ w), x)

    x = jax.ShapeDtypeStruct((64, 128), jnp.float32)
    w = jax.ShapeDtypeStruct((128, 128), jnp.float32)
    compiled = jax.jit(ten_matmuls).lower(x, w).compile()
    hlo = compiled.as_text()
    loops = roofline.while_loops(hlo)
    assert len(loops) == 1 and "(trips=10)" in loops[0], loops
    # The reason the programs are compiled with single-trip loops: XLA counts the body once.
    flops, _, _ = roofline.xla_cost(compiled)
    assert flops < 2 * (2 * 64 * 128 * 128), flops
    assert roofline.custom_calls(hlo) == {}
    biggest = roofline.largest_ops(hlo, top=1)[0]
    assert biggest["shape"] in ("f32[64,128]", "f32[128,128]"), biggest


@pytest.mark.parametrize("inner", [1, 3])
def test_known_trip_loops_get_their_other_trips_added_times_the_loops_around_them(inner):
    """XLA costs a 10-trip loop's body once; ``uncounted_loop_trips`` adds the other 9 (and, for a
    3-trip loop inside it, 29 more bodies), so a program of 10 or 30 matmuls is charged 10 or 30."""
    def matmuls(x, w):
        body = (lambda i, y: jnp.tanh(y @ w)) if inner == 1 else (
            lambda i, y: jax.lax.fori_loop(0, inner, lambda j, z: jnp.tanh(z @ w), y))
        return jax.lax.fori_loop(0, 10, body, x)

    x = jax.ShapeDtypeStruct((64, 128), jnp.float32)
    w = jax.ShapeDtypeStruct((128, 128), jnp.float32)
    compiled = jax.jit(matmuls).lower(x, w).compile()
    one_matmul = 2 * 64 * 128 * 128
    flops, bytes_, _ = roofline.xla_cost(compiled)
    extra_flops, extra_bytes, lines = roofline.uncounted_loop_trips(roofline.optimised_hlo(compiled))
    assert len(lines) == (1 if inner == 1 else 2), lines
    # besides the matmuls only the loop counters' adds are flops (tanh is a transcendental)
    assert (flops + extra_flops) / one_matmul == pytest.approx(10 * inner, rel=1e-4)
    # every trip reads at least the carried activations and the weight
    assert extra_bytes >= (10 * inner - 1) * 4 * (64 * 128 + 128 * 128), (bytes_, extra_bytes)


@pytest.mark.default_codegen_only
def test_xla_charges_a_lookup_the_whole_table_and_an_in_place_cache_write_the_whole_cache():
    """The cost-model rules ``_xla_charges`` subtracts, measured on XLA:CPU. If XLA stops
    charging either, the roofline's "without what XLA charges" line changes: this fails first."""
    charges = _xla_charges
    cpu = jax.devices("cpu")[0]
    vocab, hidden, batch = 1000, 64, 8
    table, rows, ids = vocab * hidden * 4, batch * hidden * 4, batch * 4
    assert abs(charges.gather_excess(cpu, vocab, hidden, jnp.float32, batch) - table) <= rows + ids
    pool_dims = (1, 16, 2, 128, 16)  # the engine's paged pool: [devices, blocks, KV heads, block, head dim]
    cache, token = math.prod(pool_dims) * 4, batch * 2 * 16 * 4
    # charged: pool in + pool out, plus the token (read, at most twice) and the indices (at most
    # four int64 per row); scatter_excess takes the token's one read and one write off that
    assert abs(charges.scatter_excess(cpu, pool_dims, jnp.float32, batch) - 2 * cache) <= 2 * token + 32 * batch
    # the sampled token's logit picked from each row: charged the whole [batch, vocab] array
    assert abs(charges.row_pick_excess(cpu, batch, vocab) - batch * vocab * 4) <= batch * (2 * 4 + 4)


# A cuBLAS call as XLA:GPU (jax-cuda12 0.10.2) prints it in Qwen2.5-3B's decode step, trimmed.
_GEMM_HLO = """
  %bitcast.5225 = bf16[8,256,2048]{2,1,0} bitcast(%wrapped_slice.180), metadata={op_name="jit(decode_steps)/slice"}
  %bitcast.3056.0 = bf16[8,8,256]{2,1,0} bitcast(%loop_convert_fusion.36), metadata={op_name="jit(decode_steps)/x"}
  %custom-call.4 = (f32[8,2048,8]{1,2,0}, s8[4194304]{0}) custom-call(%bitcast.5225, %bitcast.3056.0), \
custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(decode_steps)/dot_general"}
"""


def test_cublas_calls_are_added_back_as_their_operands_and_result_without_the_workspace():
    charges = _xla_charges
    expected = 8 * 256 * 2048 * 2 + 8 * 8 * 256 * 2 + 8 * 2048 * 8 * 4
    assert charges.gemm_call_bytes(_GEMM_HLO.replace("\\\n", "")) == expected


def test_attention_loop_trips_follow_the_peeled_first_key_block():
    assert roofline.attention_loop_trips("decode", CACHED_BLOCK) == {0}  # charged once, never runs
    assert roofline.attention_loop_trips("decode", CACHED_BLOCK + 1) == {1}
    assert roofline.attention_loop_trips("decode", 2 * CACHED_BLOCK) == {1}
    assert roofline.attention_loop_trips("logprobs", 256) == {0, 1}  # two causal pieces of 128 queries
    assert roofline.attention_loop_trips("update", 256) == {0, 1, 2}  # and their backward loops


def _report(argv):
    return roofline.run(roofline.parse_args(argv))


def _check_report(report, target, layers=0):
    """``layers``: the report's ``--layers`` (0: the tiny model's own 2)."""
    rows = report["rows"]
    depth = f" {layers} layers" if layers else ""
    assert [(r["program"], r["shape"]) for r in rows] == [
        ("decode", f"B=8 slots=512 live=256 greedy{depth}"), ("decode", f"B=8 slots=2048 live=256 greedy{depth}"),
        ("logprobs", f"4x256{depth}"), ("update", f"16x256{depth}")]
    for r in rows:
        assert r["target"] == target and r["xla_flops"] > 0 and r["xla_bytes"] > 0, r
        assert r["bytes_ratio"] == pytest.approx(r["xla_bytes"] / r["ideal_bytes"]), r
        assert r["seconds_xla"] == pytest.approx(max(r["xla_flops"] / report["chips"][target]["flops"],
                                                     r["xla_bytes"] / report["chips"][target]["bandwidth"])), r
    low, high = rows[0], rows[1]
    assert low["ideal_bytes"] == high["ideal_bytes"]  # the ideal follows live slots, not the buffer
    dep = report["slot_dependence"][f"tiny {target}"]
    kv_per_slot = roofline.Shapes(roofline.model_config(
        "tiny", layers, dtype=roofline.PRECISIONS[rows[0]["precision"]][0])).kv_bytes_per_slot(8)
    assert dep["whole_cache_passes"] == pytest.approx((high["xla_bytes"] - low["xla_bytes"]) / 1536 / kv_per_slot)
    # the engine's real decode loop: its bodies copy no whole pool on any target (in-place scatter on
    # CPU/GPU, the Pallas kernel on TPU), so its cost does not grow with the pool
    assert dep["loop_cache_copies"] == (0, 0), [r["loop_cache_copies"] for r in rows[:2]]
    assert low["loop_bytes"] > 0 and high["loop_bytes"] > 0
    # one more token: one embedding lookup, and (scatter path) one in-place write into each layer's
    # k and v pool of the paged cache (on TPU the Pallas kernel writes the token into the pools itself)
    num_layers = roofline.model_config("tiny", layers).num_layers
    for row in (low, high):
        scatters = 0 if "tpu_custom_call" in str(low["note"]) else 2 * num_layers
        assert f"{scatters} in-place cache scatters" in row["charged_detail"], row["charged_detail"]
        assert "1 embedding lookups" in row["charged_detail"], row["charged_detail"]
        assert 0 < row["charged_not_run"] < row["xla_bytes"], row
    if target == "cpu":  # XLA's scatters and key-block gathers charged the whole pool taken back: as run,
        # one more token costs the same at 4x the pool (XLA:GPU compiles the two pool sizes differently:
        # not claimed there; XLA:TPU's own cost analysis is not this one)
        assert low["bytes_ratio_run"] == pytest.approx(high["bytes_ratio_run"], rel=0.01), (low, high)
    json.dumps(report)  # --json prints it: it must serialise
    text = roofline.format_report(report)
    assert "whole-cache passes per step" in text and "tiny" in text


@pytest.fixture(scope="module")
def cpu_report():
    """The tiny model's report on XLA:CPU, every program: compiled once for the tests that read it."""
    return _report(["--model", "tiny", "--target", "cpu", *NO_MEASURE])


@pytest.mark.default_codegen_only
@pytest.mark.integration
def test_report_runs_for_a_tiny_model_on_xla_cpu(cpu_report):
    _check_report(cpu_report, "cpu")


@pytest.mark.default_codegen_only
@pytest.mark.integration
def test_scored_programs_drop_at_least_the_head_work_the_ideal_drops(cpu_report):
    """``--scored 48``: the trainer's compacted log-prob pass and update, 48 of 255 targets per row
    through the LM head. XLA counts every dot exactly, so its saving is at least the ideal's
    (2 or 6 · B · (T - K) · D · V) plus the softmax's elementwise work; a compaction that
    stopped applying would save nothing."""
    argv = ["--model", "tiny", "--target", "cpu", "--program", "logprobs", "update", *NO_MEASURE]
    full = [r for r in cpu_report["rows"] if r["program"] != "decode"]  # the same two programs, every target scored
    scored = _report([*argv, "--scored", "48"])["rows"]
    assert [r["shape"] for r in full] == ["4x256", "16x256"]
    assert [r["shape"] for r in scored] == ["4x256 scoring 48", "16x256 scoring 48"]
    for a, b in zip(full, scored):
        assert a["ideal_flops"] - b["ideal_flops"] == (2 if a["program"] == "logprobs" else 6) * int(
            a["shape"].split("x")[0]) * (256 - 48) * TINY_HEAD, (a, b)
        assert a["xla_flops"] - b["xla_flops"] >= a["ideal_flops"] - b["ideal_flops"], (a["program"], a, b)


def test_cpu_peaks_are_measured_when_not_given():
    chip = roofline.measure_cpu_chip("float32")
    assert chip.flops > 1e9 and chip.bandwidth > 1e8, chip


@pytest.mark.integration
@pytest.mark.slow
@needs_tpu
def test_report_runs_for_a_tiny_model_on_xla_tpu_v5e():
    report = _report(["--model", "tiny", "--target", "tpu", *ONE_LAYER])
    _check_report(report, "tpu", layers=1)
    assert report["chips"]["tpu"]["flops"] == 197e12 and "XLA:TPU" in report["compilers"]["tpu"]
    for row in (r for r in report["rows"] if r["program"] != "decode"):  # HBM as run, and what it predicts
        hbm, chip = row["hbm"], report["chips"]["tpu"]
        # every fp32 master is read at least once (the cast to bf16); the prediction is the roofline of
        # XLA's FLOPs + the splash kernels' and these bytes, never faster than the FLOPs alone
        assert hbm["bytes"] >= 4 * report["models"]["tiny"]["parameters"], (row["program"], hbm)
        assert hbm["seconds"] == pytest.approx(max((row["xla_flops"] + hbm["kernel_flops"]) / chip["flops"],
                                                   hbm["bytes"] / chip["bandwidth"]), rel=1e-12)
        assert 0 < hbm["compute_share"] <= 1.0 and hbm["kernel_calls"] > 0, hbm
    assert "TPU log-probs / update as run (HBM)" in roofline.format_report(report)


@pytest.mark.integration
@pytest.mark.slow
@needs_gpu
def test_report_runs_for_a_tiny_model_on_xla_gpu_h100():
    report = _report(["--model", "tiny", "--target", "gpu", *ONE_LAYER])
    _check_report(report, "gpu", layers=1)
    assert report["chips"]["gpu"]["bandwidth"] == 3.35e12 and "XLA:GPU" in report["compilers"]["gpu"]


def test_bad_flags_are_refused_with_the_values():
    with pytest.raises(SystemExit):
        roofline.parse_args(["--live", "4096", "--slots", "512"])
    with pytest.raises(SystemExit):
        roofline.parse_args(["--update-shape", "16by256"])
    with pytest.raises(SystemExit):
        roofline.parse_args(["--scored", "-1"])
    with pytest.raises(SystemExit):
        roofline.parse_args(["--layers", "-2"])


def test_layers_keeps_the_first_blocks_and_the_ideal_follows_the_depth():
    full, four = roofline.model_config("qwen2.5-3b"), roofline.model_config("qwen2.5-3b", 4)
    assert (full.num_layers, four.num_layers) == (36, 4)
    assert {k: v for k, v in vars(four).items() if k != "num_layers"} == {
        k: v for k, v in vars(full).items() if k != "num_layers"}
    dropped = roofline.Shapes(full).n_layers - roofline.Shapes(four).n_layers  # the final norm is in both
    assert dropped == roofline.Shapes(full).layer_params // 36 * 32
    assert roofline.Shapes(four).n_head == roofline.Shapes(full).n_head  # the tied table stays whole
    flops_full = roofline.ideal_update(roofline.Shapes(full), 16, 256, 80)[0]
    flops_four = roofline.ideal_update(roofline.Shapes(four), 16, 256, 80)[0]
    attention_per_layer = 3 * 2.0 * 16 * 16 * 128 * 256 * 256  # 3 x 2·B·H·Dh·T² a layer
    assert flops_full - flops_four == pytest.approx(6 * 16 * 256 * dropped + 32 * attention_per_layer, rel=1e-12)
    assert roofline.parse_args(["--layers", "4"]).layers == 4


def test_kernel_custom_calls_are_reported_and_xla_tpu_bookkeeping_calls_are_not():
    # Lines as XLA:TPU prints them (from a compiled decode step and a splash-attention log-prob pass).
    hlo = "\n".join([
        '  %custom-call.377 = bf16[8,3,2048,64]{3,2,1,0} custom-call(%p), custom_call_target="ConcatBitcast"',
        '  %custom-call.12 = s32[8,2]{1,0} custom-call(%i), custom_call_target="GatherScatterIndicesBitpacked"',
        '  %custom-call.40 = f32[4,9,256,64]{3,2,1,0} custom-call(%q, %k, %v), custom_call_target="tpu_custom_call"',
        '  %custom-call.41 = f32[4,9,256,64]{3,2,1,0} custom-call(%q, %k, %v), custom_call_target="tpu_custom_call"',
    ])
    assert roofline.custom_calls(hlo) == {"tpu_custom_call": 2}
