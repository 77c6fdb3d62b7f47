"""The step-time model's data-parallel collectives (``plan/collectives.py``) against the programs XLA:GPU
compiles: what a micro-batch of each training pass gathers and reduce-scatters on 8 H100s under FSDP.

Why this test: the model charges every micro-batch one gather of the weights per no-grad pass, two per
update (forward, backward) and one reduce-scatter of the gradients (the layers' in the compute dtype, the
embedding and head's in fp32). That is a reading of the compiled programs, so it is checked against them:
the bytes the compiled HLO's collectives produce per trip of the micro-batch loop (the outermost loop whose trip
count is traced), nested layer loops counted by their known trip counts, must equal the closed form's.
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

_RESULT = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = (.*?) (all-gather-done|all-gather|reduce-scatter-done|reduce-scatter)\(")


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
    micro = [body for body in traced if not any(body in reached(other) for other in traced if other != body)]
    assert len(micro) == 1, f"one outermost loop with a traced trip count (the micro-batches) expected: {trips}"

    def counts(name: str, times: int) -> list[int]:
        found = []
        for line in blocks[name].splitlines():
            if (m := _RESULT.match(line)) and m[2].startswith(collective):
                found += _buffers(m[1], dtype) * times
        for callee in callees(blocks[name]) & blocks.keys():
            found += counts(callee, times * (trips.get(callee) or 1))
        return found

    return counts(micro[0], 1)


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
        config.plan.update(gpu="h100", devices=8, gpus_per_host=8, phases=("update", "logprobs"))
        plan = make_plan(config)
    finally:
        patch.undo()
    assert plan.mesh_shape == (1, 8, 1) and len(texts) == 2
    update, logprobs = (text for text in texts.values())
    assert update.startswith("HloModule jit_update") and "jit_packed_logprobs" in logprobs.split("\n", 1)[0]
    return {"update": update, "logprobs": logprobs, "model": tiny_config("qwen2"), "mesh": plan.mesh_shape}


def test_each_pass_gathers_the_weights_in_bf16_as_often_as_the_model_charges(compiled):
    cfg, fsdp = compiled["model"], compiled["mesh"][1]
    traffic = micro_batch_traffic(cfg, compiled["mesh"], 2)
    gathered = traffic.gather * fsdp / (fsdp - 1)  # the whole gathered weights, a ring's (n-1)/n undone
    layers = cfg.num_layers * flops.layer_weights(cfg)
    assert gathered == (layers + cfg.vocab_size * cfg.hidden_size) * 2  # tied embeddings: one table
    for phase in ("logprobs", "update"):
        produced = sum(per_micro_batch(compiled[phase], "all-gather", "bf16")) * 2
        assert produced == GATHERS_PER_MICRO_BATCH[phase] * gathered, phase


def test_the_update_reduce_scatters_the_layers_gradients_in_bf16_and_the_embeddings_in_fp32(compiled):
    cfg, fsdp = compiled["model"], compiled["mesh"][1]
    traffic = micro_batch_traffic(cfg, compiled["mesh"], 2)
    layers = cfg.num_layers * flops.layer_weights(cfg)
    embedding = cfg.vocab_size * cfg.hidden_size
    assert traffic.reduce_scatter * fsdp / (fsdp - 1) == layers * 2 + embedding * 4
    assert sum(per_micro_batch(compiled["update"], "reduce-scatter", "bf16")) * fsdp == layers
    # the embedding's gradient shard, fp32, once a micro-batch (the other fp32 ones are the head's row sums)
    assert per_micro_batch(compiled["update"], "reduce-scatter", "f32").count(embedding // fsdp) == 1
    assert per_micro_batch(compiled["logprobs"], "reduce-scatter", "bf16") == []
