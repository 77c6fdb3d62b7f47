"""--mode=plan: shapes from known names, per-device accounting from shardings, AOT-compiled table.

The compile-only TPU / GPU targets need ``pip install '.[plan-tpu]'`` / ``'.[plan-gpu]'``; their
tests skip (with the reason) when the package is absent, as in the default ``.[test]`` install.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from llds_jax.config import base_config
from llds_jax.models import Decoder
from llds_jax.models.loading import ModelSourceError, decoder_config
from llds_jax.plan.config import default_plan_config
from llds_jax.plan.run import (
    HARDWARE,
    CompiledProgram,
    Plan,
    PlanError,
    bytes_per_device,
    compile_program,
    format_plan,
    make_plan,
    plan_devices,
)
from llds_jax.plan.targets import resolve_target, target_installed
from llds_jax.train.step import StepSizes
from tests.scale import toy_train

pytestmark = pytest.mark.unit

needs_tpu = pytest.mark.skipif(bool(target_installed("tpu")), reason=target_installed("tpu") or "installed")
needs_gpu = pytest.mark.skipif(bool(target_installed("gpu")), reason=target_installed("gpu") or "installed")


def _tiny_config():
    c = base_config()
    c.model.source = "tiny:qwen2"
    c.mesh.shape = (1, -1, 1)
    c.train.update(prompts_per_step=8, mini_batch_size=16, micro_batch_size=8, logprob_batch_size=16)
    # ≤ 2 actions × 24 tokens: the update and log-prob programs score 48 of a row's 127 targets,
    # so every target's compiler below builds the gather that training runs.
    c.rollout.update(n_samples=4, max_context=128, max_prompt_tokens=32, max_turns=1, max_action_tokens=24)
    c.plan = default_plan_config()
    return c


def _section(**fields):
    section = default_plan_config()
    section.update(fields)
    return section


@pytest.mark.parametrize("name, billions", [("Qwen2.5-3B", 3.086), ("Qwen2.5-7B", 7.616)])
def test_known_model_names_give_the_real_parameter_count(name, billions):
    c = base_config()
    c.model.source = f"/models/{name}"
    cfg = decoder_config(c.model)
    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert count / 1e9 == pytest.approx(billions, abs=0.001)


def test_the_model_sections_switches_reach_the_decoder_config():
    c = base_config()
    c.model.update(dict(source="/models/Qwen2.5-3B", remat="full", attention="naive", scan_layers=False))
    cfg = decoder_config(c.model)
    assert (cfg.remat, cfg.attention, cfg.scan_layers) == ("full", "naive", False)
    c = base_config()
    c.model.source = "/models/Qwen2.5-3B"
    assert decoder_config(c.model).scan_layers is True


def test_unknown_model_source_and_bad_targets_are_named():
    c = base_config()
    c.model.source = "/nowhere/Mystery-9B"
    with pytest.raises(ModelSourceError, match="model.source='/nowhere/Mystery-9B'"):
        decoder_config(c.model)
    for topology in ("v5e", "v5e:8", "v5e:2x2x2x2", "8x8"):
        with pytest.raises(PlanError, match=f"plan.topology='{topology}': expected CHIP:AxB"):
            resolve_target(_section(topology=topology))
    with pytest.raises(PlanError, match="plan.gpu='a999': expected one of"):
        resolve_target(_section(gpu="a999"))
    with pytest.raises(PlanError, match="plan.devices=12 is not a multiple of plan.gpus_per_host=8"):
        resolve_target(_section(gpu="h100", devices=12))
    with pytest.raises(PlanError, match="plan.topology='v5e:2x2' and plan.gpu='h100': set one"):
        resolve_target(_section(topology="v5e:2x2", gpu="h100"))


def test_without_libtpu_a_topology_falls_back_to_xla_cpu_and_says_so(monkeypatch):
    from jax.experimental import topologies

    def missing(*args, **kwargs):
        raise RuntimeError("JAX TPU support not installed; cannot generate TPU topology.")

    monkeypatch.setattr(topologies, "get_topology_desc", missing)
    target = plan_devices(_section(topology="v5e:2x4"))
    assert target.platform == "cpu" and target.count == 8 and len(target.devices) == 8
    assert "proxy for v5e:2x4" in target.compiler and "libtpu) is not installed" in target.note
    assert "pip install '.[plan-tpu]'" in target.note and target.hardware == ""


@pytest.mark.integration
@needs_tpu
def test_libtpu_rejections_name_the_field():
    with pytest.raises(PlanError, match=r"plan.topology='v5e:3x3': libtpu rejected it: .*not divisible"):
        resolve_target(_section(topology="v5e:3x3"))
    with pytest.raises(PlanError, match=r"plan.topology='v9:2x2': libtpu rejected it"):
        resolve_target(_section(topology="v9:2x2"))


def test_bytes_per_device_counts_shards_and_replicas():
    mesh = toy_train.make_mesh((2, 4))
    tree = toy_train.state_shardings(mesh)
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            jax.eval_shape(toy_train.init_state_host, 0), tree)
    # w [32, 16] over (2, 4) -> 16x4 floats; b [16] over fsdp -> 4 floats.
    assert bytes_per_device(abstract["params"]) == (16 * 4 + 4) * 4


def test_the_table_names_the_compiled_chip_and_a_refusal():
    program = CompiledProgram("update", int(9e9), int(1e9), int(1e9), int(8e9), 0, 1.0,
                              refused="RESOURCE_EXHAUSTED: Ran out of memory on HBM")
    plan = Plan("m", 10, (1, 4, 1), "XLA:TPU (libtpu x), topology v5e:2x2: 4 x TPU v5 lite, 1 host(s)",
                {"params": int(1e9)}, {}, {"update": program}, [], target="v5e")
    table = format_plan(plan)
    assert "! XLA:TPU refused update for this chip: RESOURCE_EXHAUSTED" in table
    assert f"{HARDWARE['v5e'][0]:<28}DOES NOT FIT (the compiler refused update)   <- compiled for this chip" in table
    assert f"{HARDWARE['H100'][0]:<28}fits\n" in table and "reuse these numbers: a proxy" in table
    # A program that does not compile at all for the chip (one buffer > HBM) gives a lower bound.
    plan.programs["prefill"] = CompiledProgram("prefill", int(2e9), 0, 0, int(28e9), 0, 1.0, refused="...",
                                               lower_bound=True)
    table = format_plan(plan)
    assert "LOWER BOUND: not compilable for this chip" in table and "fits? peak at least 30.00 GB" in table
    assert f"{HARDWARE['H100'][0]:<28}unknown (prefill could not be compiled for the target chip)" in table
    assert f"{HARDWARE['v5e'][0]:<28}DOES NOT FIT (the compiler refused update, prefill)" in table


def test_sizes_are_read_from_xla_tpu_out_of_memory_messages():
    from llds_jax.plan.run import _bytes_named

    first = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries "
             "(31.93G) exceeds available HBM (15.75G).")
    second = ("RESOURCE_EXHAUSTED: Allocation (size=21474836480) would exceed memory (size=17179869184) :: "
              "%s3 = inlined_call_operand.hbm [shape: f32[40,2,8,2048,4096]]")
    assert _bytes_named(second) == 21474836480
    assert _bytes_named(f"{first} {second}") == int(31.93 * 2**30)
    assert _bytes_named("INTERNAL: something else") == 0


def _check_tiny_plan(plan, devices: int):
    assert set(plan.programs) == {"update", "logprobs", "prefill", "decode"}
    assert StepSizes.from_config(_tiny_config()).scored_positions == 48
    # The update program receives params, Adam moments, reference and counters as arguments.
    update = plan.programs["update"]
    assert update.argument_bytes >= sum(plan.resident.values())
    assert update.alias_bytes > 0  # the train state is donated
    assert 0 < update.temp_bytes < 1e9 and not update.refused
    assert plan.mesh_shape == (1, devices, 1)
    assert plan.peak_bytes == max(plan.phase_peak(p) for p in plan.programs) < 1e9


@pytest.fixture(scope="module")
def tiny_plan():
    """The tiny config's plan on the 8 simulated CPU devices, compiled once for the tests that read it."""
    return make_plan(_tiny_config())


@pytest.mark.integration
@pytest.mark.slow
def test_plan_compiles_every_phase_and_prints_the_fit_table(tiny_plan):
    plan = tiny_plan
    assert "XLA:CPU SPMD, 8 devices" in plan.compiler and plan.target == ""
    _check_tiny_plan(plan, 8)
    table = format_plan(plan)
    for label, _ in HARDWARE.values():
        assert f"{label:<28}fits" in table
    assert "decodes all 32 trajectories" in table and "no row's own compiler ran" in table


@pytest.mark.integration
@needs_tpu
def test_plan_compiles_with_xla_tpu_for_a_topology_from_a_cpu_host():
    c = _tiny_config()
    c.plan.topology = "v5e:2x4"
    plan = make_plan(c)
    assert plan.compiler.startswith("XLA:TPU (libtpu ") and "v5e:2x4: 8 x TPU v5 lite, 2 host(s)" in plan.compiler
    assert plan.target == "v5e"
    _check_tiny_plan(plan, 8)
    assert f"{HARDWARE['v5e'][0]:<28}fits   <- compiled for this chip" in format_plan(plan)


@pytest.mark.integration
@needs_tpu
def test_xla_tpu_refuses_a_program_beyond_hbm_and_the_plan_still_gets_its_numbers():
    from jax.experimental import topologies

    devices = np.array(topologies.get_topology_desc("v5e:2x2", "tpu").devices)
    mesh = jax.sharding.Mesh(devices, ("x",))
    # 8.6 GB per chip in, 8.6 GB out: more than a v5e's 16 GiB.
    big = jax.ShapeDtypeStruct((4 * 32768, 65536), jnp.float32, sharding=jax.NamedSharding(mesh, jax.P("x")))
    program = compile_program("big", jax.jit(lambda x: (jnp.exp(x) * 2 + x, x.sum())), big, platform="tpu")
    assert "RESOURCE_EXHAUSTED" in program.refused
    assert program.argument_bytes == 32768 * 65536 * 4 and program.peak_bytes > 16 * 2**30


@pytest.mark.integration
@pytest.mark.slow  # XLA:GPU compiles the four tiny programs in 15-55 s here
@needs_gpu
def test_plan_compiles_with_xla_gpu_for_h100s_from_a_cpu_host():
    c = _tiny_config()
    c.plan.update(gpu="h100", devices=8, gpus_per_host=4)
    plan = make_plan(c)
    assert plan.compiler.startswith("XLA:GPU (jax-cuda12-pjrt ") and "8 x NVIDIA H100 80GB HBM3" in plan.compiler
    assert "2 host(s) x 4" in plan.compiler and plan.target == "H100"
    _check_tiny_plan(plan, 8)
    assert f"{HARDWARE['H100'][0]:<28}fits   <- compiled for this chip" in format_plan(plan)


@pytest.mark.integration
def test_a_run_that_will_not_fit_is_refused_naming_the_phase_and_the_field():
    """``check_fits_before_training`` compiles the run's own programs; 100 kB per device fits none."""
    from llds_jax.errors import InputError
    from llds_jax.plan.run import check_fits_before_training

    c = _tiny_config()
    c.plan.update(check_before_train="always", device_memory_bytes=100_000)
    with pytest.raises(InputError, match="rollout.memory_fraction"):  # the derived wave: not one row fits
        check_fits_before_training(c, jax.devices())
    c.rollout.max_concurrent_rows = 8
    with pytest.raises(PlanError) as error:
        check_fits_before_training(c, jax.devices())
    message = str(error.value)
    for phase, field in (("update", "train.micro_batch_size"), ("logprobs", "train.logprob_batch_size"),
                         ("decode", "rollout.max_concurrent_rows")):
        assert f"  {phase}: " in message and field in message, message
    c.plan.device_memory_bytes = 10 * 2**30
    plan = check_fits_before_training(c, jax.devices())
    assert plan is not None and set(plan.programs) == {"update", "logprobs", "prefill", "decode"}


def test_the_fit_check_is_skipped_where_devices_report_no_limit_unless_asked():
    from llds_jax.plan.run import check_fits_before_training

    c = _tiny_config()
    assert check_fits_before_training(c, jax.devices()) is None  # auto, CPU: no limit reported
    c.plan.check_before_train = "always"
    with pytest.raises(PlanError, match="plan.device_memory_bytes"):
        check_fits_before_training(c, jax.devices())
    c.plan.check_before_train = "sometimes"
    with pytest.raises(PlanError, match="check_before_train='sometimes'"):
        check_fits_before_training(c, jax.devices())


@pytest.mark.integration
def test_the_plan_decodes_in_the_trainers_waves(tiny_plan):
    """Same wave size as the rollout (rollout.max_concurrent_rows), so the KV cache is the trainer's."""
    c = _tiny_config()
    c.rollout.max_concurrent_rows = 8
    plan = make_plan(c)
    everything = tiny_plan  # CPU reports no memory: one wave of all 32 trajectories
    assert "32 trajectories in 4 wave(s) of 8 rows (rollout.max_concurrent_rows)" in " ".join(plan.notes), plan.notes
    assert plan.phase_extra["decode"]["kv_cache"] * 4 == pytest.approx(everything.phase_extra["decode"]["kv_cache"],
                                                                        rel=0.01)


def test_random_weights_take_a_known_models_shapes_and_name_an_unknown_one():
    c = base_config()
    c.model.source = "random:Qwen2.5-0.5B"
    assert decoder_config(c.model).num_layers == 24
    c.model.source = "random:Mystery-9B"
    with pytest.raises(ModelSourceError, match="model.source='random:Mystery-9B': not a known shape"):
        decoder_config(c.model)


def _mesh_retrieval(c, tmp_path, dtype="float32"):
    """The tiny config searching a mesh index the plan cannot read: wiki-18 x E5 (the stated fields)."""
    c.retrieval.update(method="mesh", url="", index_path=str(tmp_path), mesh_dtype=dtype)
    return c


@pytest.mark.integration  # make_plan compiles a program
def test_the_mesh_index_is_resident_in_the_plan_beside_the_model(tmp_path):
    """Compile-only XLA:CPU decode of the tiny model: the index's padded shard per device is counted
    in the phase's peak and printed as "retrieval index"."""
    c = _mesh_retrieval(_tiny_config(), tmp_path, "bfloat16")
    c.plan.phases, c.plan.step_time = ("decode",), False
    plan = make_plan(c)
    per_device = -(-21_015_324 // 8) * 768 * 2
    assert plan.resident["retrieval_index"] == pytest.approx(per_device, rel=1e-4)
    assert plan.phase_peak("decode") > plan.programs["decode"].peak_bytes + plan.resident["retrieval_index"]
    table = format_plan(plan)
    assert "retrieval index" in table and "retrieval.mesh_dtype='bfloat16'" in table
    assert f"{HARDWARE['v5e'][0]:<28}fits" in table  # 4.04 GB of index + the tiny model < 92 % of 16 GB


@pytest.mark.integration  # the trainer's fit check, as a run calls it
def test_a_mesh_index_that_will_not_fit_is_refused_before_compiling(tmp_path):
    """8 GB of fp32 wiki-18 per device against 2 GB: refused naming the method and the dtype field,
    without compiling a program; bf16 halves it."""
    from llds_jax.plan.run import check_fits_before_training

    c = _mesh_retrieval(_tiny_config(), tmp_path)
    c.plan.update(check_before_train="always", device_memory_bytes=2 * 10**9)
    with pytest.raises(PlanError) as error:
        check_fits_before_training(c, jax.devices())
    message = str(error.value)
    assert "retrieval.method='mesh'" in message and "retrieval.mesh_dtype='float32'" in message
    assert "8.07 GB per device" in message
    c.retrieval.mesh_dtype = "bfloat16"
    with pytest.raises(PlanError, match=r"4\.04 GB per device .*mesh_dtype='bfloat16'"):
        check_fits_before_training(c, jax.devices())
