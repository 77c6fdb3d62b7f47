"""The engine's decode step (``slots.decode_segment``, the rollout's one decode program) must not copy
a KV pool per token (issue 15: decode cost follows the live bytes, not the cache's size). Each case
compiles the step as ``bench_rollout.py --decode-program --tiny`` does (``benchmarks/_decode_step.py``:
the engine's shapes, the paged pools carried through its token loops) and reads the ops of its
while-loop bodies (what runs per token) whose result is a whole pool.

XLA:TPU, compiled for a v5e from this CPU host: with the Pallas paged decode kernel (attention "auto")
the bodies hold no pool-sized XLA op at all (the kernel writes the token's k and v into the pools it
aliases); with the plain-XLA blockwise loop they copy every pool each token (so the probe is shown to
find what it looks for). XLA:GPU, compiled for an H100: the only pool-sized ops are the scatters that
write the token in place. XLA:CPU: the same, and what it does with the blocks it reads is pinned too.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import jax
import pytest

from llds_jax.models.testing import tiny_config
from llds_jax.plan.targets import target_installed
from tests.hlo_helpers import ops_outside_fusions, while_bodies

pytestmark = pytest.mark.unit

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import _decode_step  # noqa: E402  (benchmarks/: the report's own compile of the step)


def _elements(shape: str) -> int:
    return math.prod(int(d) for d in re.search(r"\[([\d,]*)\]", shape)[1].split(",") if d)


def _loop_body_ops(platform: str, attention: str = "auto", dtype: str = "bfloat16"):
    """(config, target, HLO, the unfused ops of the step's loop bodies) of ``decode_segment`` on the tiny
    target's shapes, compiled for one device of ``platform`` ("cpu", "gpu": an H100, "tpu": a v5e)."""
    target = _decode_step.tiny_targets()["v5e-tiny" if platform == "tpu" else "h100-tiny"]
    config = tiny_config("qwen2", dtype=dtype, scan_layers=False, attention=attention)
    device = jax.devices("cpu")[0] if platform == "cpu" else _decode_step._device(platform)[0]
    compiled, _ = _decode_step.compile_segment(target, config, device)
    hlo = compiled.as_text()
    bodies = while_bodies(hlo)
    return config, target, hlo, [op for op in ops_outside_fusions(hlo) if op["computation"] in bodies]


def _pool_sized(ops, config, target):
    """The ops whose result has a pool's elements (with or without the pool's device axis)."""
    pool = target.kv_blocks * config.num_kv_heads * target.block * config.head_dim
    return [op for op in ops if _elements(op["shape"]) == pool]


def _writes(ops):
    """The pool writes: fusions of the step's scatter (named for it, or — XLA:CPU without its fusion
    emitters, the second code generator — a ``select_dynamic-update-slice`` fusion of the same op)."""
    return [op for op in ops if op["opcode"] == "fusion"
            and ("scatter" in op["name"] or op["op_name"].endswith("/scatter"))]


@pytest.mark.integration
@pytest.mark.skipif(bool(target_installed("tpu")), reason=target_installed("tpu") or "installed")
def test_tpu_engine_decode_loop_body_touches_no_whole_pool():
    config, target, hlo, ops = _loop_body_ops("tpu")
    assert "paged_decode_attention" in hlo, "the Pallas paged decode kernel is not in the TPU decode program"
    assert not _pool_sized(ops, config, target), f"pool-sized ops inside the TPU decode loop: {_pool_sized(ops, config, target)}"
    config, target, _, blockwise = _loop_body_ops("tpu", "xla_blockwise")
    copies = [op for op in _pool_sized(blockwise, config, target) if op["opcode"] == "copy"]
    assert len(copies) >= 2 * config.num_layers, \
        f"the probe no longer finds the blockwise loop's pool copies ({blockwise}): it may be blind"


@pytest.mark.integration
@pytest.mark.skipif(bool(target_installed("gpu")), reason=target_installed("gpu") or "installed")
def test_gpu_engine_decode_loop_body_touches_no_whole_pool_but_its_writes():
    """Inside the H100 step's loops, the only ops whose result is a whole KV pool are the scatter
    fusions that write the new token in place (seen, so the probe is not blind); no copy of a pool a token."""
    config, target, _, ops = _loop_body_ops("gpu")
    pool_ops = _pool_sized(ops, config, target)
    writes = _writes(pool_ops)
    assert len(writes) == 2 * config.num_layers, f"expected a k and a v write a layer: {pool_ops}"
    assert writes == pool_ops, f"pool-sized ops other than the in-place writes in the GPU decode loop: {pool_ops}"


@pytest.mark.default_codegen_only  # the ops XLA:CPU's default code generator emits (the second also transposes each block)
def test_cpu_engine_decode_loop_writes_in_place_and_gathers_each_visited_block():
    """XLA:CPU (the CPU default job decodes on this step): the only pool-sized ops per token are the
    in-place scatters of the token's k and v (one each a layer). What the step does copy, pinned so a
    change is seen: every key block it visits is gathered out of the pool for every row
    (``attention/paged.py::gather_column``, a ``jnp.take`` of one block a row, materialised as a
    ``[rows, kv_heads, block, head_dim]`` fusion before the dots), a k and a v block a layer for the
    peeled first block in the token body and again in each layer's key-block loop. Those copies are
    the live blocks (twice the live KV bytes moved, plus their read), never the pool: the step's cost
    follows the rows' lengths, not the pool's size."""
    config, target, _, ops = _loop_body_ops("cpu", dtype="float32")
    pool_ops = _pool_sized(ops, config, target)
    writes = _writes(pool_ops)
    assert len(writes) == 2 * config.num_layers and writes == pool_ops, \
        f"pool-sized ops other than a k and a v write a layer in the CPU decode loop: {pool_ops}"
    block = target.rows * config.num_kv_heads * target.block * config.head_dim
    gathers = [op for op in ops if _elements(op["shape"]) == block]
    assert gathers and all(op["opcode"] == "fusion" and "_take" in op["op_name"] for op in gathers), gathers
    per_body: dict[str, int] = {}
    for op in gathers:
        per_body[op["computation"]] = per_body.get(op["computation"], 0) + 1
    token_body = next(op["computation"] for op in writes)
    assert per_body.pop(token_body) == 2 * config.num_layers, gathers  # block 0 of each layer's k and v
    assert len(per_body) == config.num_layers and set(per_body.values()) == {2}, gathers  # the key-block loops
