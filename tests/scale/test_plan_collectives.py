"""The step-time model's data-parallel collectives (``plan/collectives.py``) against the programs XLA:GPU
compiles: what a micro-batch of each training pass gathers and reduce-scatters on 8 H100s under FSDP, and
which of those collectives run behind compute.

Why this test: the model charges every micro-batch one gather of the weights per no-grad pass, two per
update (forward, backward) and one reduce-scatter of the gradients (the layers' in the compute dtype, the
embedding and head's in fp32), and it lets the forward's layer gathers and the layers' reduce-scatters hide
behind a layer trip while the backward's layer gathers stay exposed (``parallel.overlap``). That is a
reading of the compiled programs, so it is checked against them: the bytes the compiled HLO's collectives
produce per trip of the micro-batch loop (the outermost loop whose trip count is traced), nested layer
loops counted by their known trip counts, must equal the closed form's; and in the scheduled layer-loop
bodies a hidden collective's start and done must have matmuls between them, an exposed one none.
"""

from __future__ import annotations

import re

import pytest

from llds_jax.models.testing import tiny_config
from llds_jax.plan import run as plan_run
from llds_jax.plan.collectives import GATHERS_PER_MICRO_BATCH, micro_batch_traffic
from llds_jax.plan.run import make_plan
from llds_jax.plan.targets import target_installed
from llds_jax.utils import flops
from tests.scale.test_plan import _tiny_config
from tools.roofline._hlo_reading import callees, computation_blocks, loop_trips

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(bool(target_installed("gpu")), reason=target_installed("gpu") or "installed")]

_RESULT = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = (.*?) "
                     r"(all-gather-done|all-gather|reduce-scatter-done|reduce-scatter|all-reduce-done|all-reduce)\(")


def _buffers(result: str, dtype: str) -> list[int]:
    """Element counts of the ``dtype`` buffers in an instruction's result (a shape or a tuple of shapes)."""
    out = []
    for dims in re.findall(rf"\b{dtype}\[([\d,]*)\]", result):
        count = 1
        for d in filter(None, dims.split(",")):
            count *= int(d)
        out.append(count)
    return out


def per_micro_batch(hlo: str, collective: str, dtype: str) -> list[int]:
    """Element counts of every ``collective`` result of ``dtype`` one trip of the micro-batch loop produces,
    a nested loop's as often as its known trip count says."""
    blocks = computation_blocks(hlo)
    trips = loop_trips(blocks)

    def reached(name: str) -> set[str]:
        inner = callees(blocks[name]) & blocks.keys()
        return inner.union(*(reached(callee) for callee in inner))

    traced = [body for body, count in trips.items() if count is None]  # the micro-batches, the head's chunks
    # the micro-batch loop; the update's twice: the collective pipeliner peels one mini-batch of the outer loop
    micro = [body for body in traced if not any(body in reached(other) for other in traced if other != body)]
    assert 1 <= len(micro) <= 2, f"the micro-batch loop (and its peeled copy) expected as the outermost traced loops: {trips}"

    def counts(name: str, times: int) -> list[int]:
        found = []
        for line in blocks[name].splitlines():
            if (m := _RESULT.match(line)) and m[2].startswith(collective):
                found += _buffers(m[1], dtype) * times
        for callee in callees(blocks[name]) & blocks.keys():
            found += counts(callee, times * (trips.get(callee) or 1))
        return found

    found = [sorted(counts(body, 1)) for body in micro]
    assert all(copy == found[0] for copy in found), f"the micro-batch loop's copies differ: {found}"
    return found[0]


@pytest.fixture(scope="module")
def compiled():
    """The tiny model's update and log-prob programs, bf16, compiled by XLA:GPU for one host of 8 H100s."""
    texts = {}
    original = plan_run.compile_ahead

    def keep_text(jitted, *args, platform="cpu"):
        program, refused = original(jitted, *args, platform=platform)
        texts[len(texts)] = program.as_text()
        return program, refused

    patch = pytest.MonkeyPatch()
    patch.setattr(plan_run, "compile_ahead", keep_text)
    try:
        config = _tiny_config()
        config.model.dtype = "bfloat16"
        # the LM head in chunks of 16 of a row's 48 scored positions (3): as the paper configs' 2,000 in 128s
        config.model.logprob_chunk_size = 16
        config.plan.update(gpu="h100", devices=8, gpus_per_host=8, phases=("update", "logprobs"))
        plan = make_plan(config)
    finally:
        patch.undo()
    assert plan.mesh_shape == (1, 8, 1) and len(texts) == 2
    update, logprobs = (text for text in texts.values())
    assert update.startswith("HloModule jit_update") and "jit_packed_logprobs" in logprobs.split("\n", 1)[0]
    return {"update": update, "logprobs": logprobs, "model": tiny_config("qwen2"), "mesh": plan.mesh_shape}


def test_each_pass_gathers_the_layers_weights_in_bf16_as_often_as_the_model_charges(compiled):
    cfg, fsdp = compiled["model"], compiled["mesh"][1]
    traffic = micro_batch_traffic(cfg, compiled["mesh"], 2)
    layers = cfg.num_layers * flops.layer_weights(cfg)
    assert traffic.layers_gather * fsdp / (fsdp - 1) == layers * 2  # the whole weights, a ring's (n-1)/n undone
    for phase in ("logprobs", "update"):
        produced = sum(per_micro_batch(compiled[phase], "all-gather", "bf16")) * 2
        assert produced == GATHERS_PER_MICRO_BATCH[phase] * layers * 2, phase


def test_the_update_reduce_scatters_the_layers_gradients_in_bf16(compiled):
    cfg, fsdp = compiled["model"], compiled["mesh"][1]
    traffic = micro_batch_traffic(cfg, compiled["mesh"], 2)
    layers = cfg.num_layers * flops.layer_weights(cfg)
    assert traffic.layers_reduce_scatter * fsdp / (fsdp - 1) == layers * 2
    assert sum(per_micro_batch(compiled["update"], "reduce-scatter", "bf16")) * fsdp == layers
    assert per_micro_batch(compiled["logprobs"], "reduce-scatter", "bf16") == []


def test_the_lm_heads_table_moves_once_a_no_grad_pass_and_once_an_update_micro_batch_not_once_a_chunk(compiled):
    """The head scores a row's positions in chunks (3 here, 15 in the paper configs), each against the whole
    table; ``models.logprobs`` gathers the table before the chunks. Without that, XLA gathered it inside the
    chunk loop, every chunk, and in the update gathered it again and reduce-scattered its gradient every
    chunk. What the model charges: one gather in the compute dtype a no-grad pass, and an fp32 all-reduce
    of its gradient an update micro-batch (qwen3b's compiled update also gathers it in fp32 there: the
    third fp32 pass the model charges; this tiny table is gathered before the micro-batch loop)."""
    cfg = compiled["model"]
    table = cfg.vocab_size * cfg.hidden_size
    whole_table = re.compile(rf"= \(?[^=]*\b(?:bf16|f32)\[{cfg.vocab_size},{cfg.hidden_size}\][^=]* "
                             r"(all-gather-start|all-gather|reduce-scatter-start|all-reduce-start|all-reduce)\(")
    assert [m[1] for m in whole_table.finditer(compiled["logprobs"])] == ["all-gather-start"]
    for collective in ("all-gather", "reduce-scatter", "all-reduce"):
        for dtype in ("bf16", "f32"):
            assert table not in per_micro_batch(compiled["logprobs"], collective, dtype), (collective, dtype)
    assert per_micro_batch(compiled["update"], "all-reduce", "f32").count(table) == 1
    assert table not in per_micro_batch(compiled["update"], "all-gather", "bf16")
    assert table // compiled["mesh"][1] not in per_micro_batch(compiled["update"], "reduce-scatter", "f32")


_SCHEDULED = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = .*? ([\w\-]+)\((.*)$")


def matmuls_behind(body: str, collective: str) -> list[int]:
    """For each ``collective``-start in a scheduled computation: the matmuls (GEMM fusions, cuBLAS calls)
    scheduled between it and its done — the compute it runs behind."""
    windows, open_ = [], {}
    for line in body.splitlines():
        if not (m := _SCHEDULED.match(line)):
            continue
        name, op, rest = m.groups()
        if op == f"{collective}-start":
            open_[name] = 0
        elif op == f"{collective}-done":
            started = re.match(r"%([\w.\-]+)", rest)[1]
            windows.append(open_.pop(started))
        elif "gemm" in name or "__cublas" in rest:
            open_ = {key: count + 1 for key, count in open_.items()}
    return windows


def layer_bodies(hlo: str) -> dict[str, str]:
    """The layer loops' bodies: loops of known trip count that gather bf16 weights."""
    blocks = computation_blocks(hlo)
    return {name: blocks[name] for name, count in loop_trips(blocks).items()
            if count is not None and re.search(r"bf16\[[\d,]+\][^ ]*\)+ all-gather-start\(", blocks[name])}


def test_the_forwards_gathers_and_the_gradients_reduce_scatters_run_behind_a_layers_matmuls(compiled):
    """What ``plan.collectives`` hides under ``parallel.overlap.TRAINING_COMPILER_OPTIONS`` is what XLA:GPU
    schedules behind compute: every forward layer trip's weight gather (for the next trip) and every backward
    trip's gradient reduce-scatter (the previous trip's) span the MLP's matmuls; the backward's own weight
    gathers span none, and the model charges them whole."""
    forward = layer_bodies(compiled["logprobs"])
    assert forward and all(min(matmuls_behind(body, "all-gather")) >= 2 for body in forward.values())
    update = layer_bodies(compiled["update"])
    backward = {name: body for name, body in update.items() if "reduce-scatter-start(" in body}
    assert backward and len(backward) < len(update)
    for name, body in update.items():
        gathers = matmuls_behind(body, "all-gather")
        if name in backward:
            assert max(gathers) == 0, (name, gathers)
            assert min(matmuls_behind(body, "reduce-scatter")) >= 2, name
        else:
            assert min(gathers) >= 2, (name, gathers)
