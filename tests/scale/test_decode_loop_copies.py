"""The decode loop must not copy the KV cache (issue 15: decode cost follows the live bytes, not
the cache's size), compiled through the planner's AOT front-end (``plan.aot``).

XLA:TPU, compiled for a v5e from this CPU host: with the Pallas decode kernel (attention "auto"
on TPU) the loop body holds no cache-sized op, and with the plain-XLA blockwise kernel it holds
copies (so the probe is shown to find what it looks for). XLA:GPU, compiled for an H100: the
engine's step (``slots.decode_segment``, the paged pools carried through its token loop) holds no
pool-sized op but the in-place writes. XLA:CPU: the cache is held per key block
(``attention.cache_block``) and the body's only block-sized ops are the in-place writes; held as one
buffer per layer, every visited block is sliced out (copied) for its dots."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from llds_jax.models.testing import tiny_config
from llds_jax.plan.targets import target_installed
from tests.hlo_helpers import compiled_decode_loop, ops_outside_fusions, while_bodies

pytestmark = pytest.mark.unit

SLOTS, BATCH = 256, 8


def _cache_ops_in_loop_body(attention: str, target: str = "tpu", slots_per_op: int = SLOTS,
                            dtype: str = "bfloat16") -> tuple[list[str], str]:
    """The ops in the decode loop's bodies whose result is a ``slots_per_op``-slot cache buffer."""
    config = tiny_config("qwen2", dtype=dtype, param_dtype="float32", scan_layers=False, attention=attention)
    hlo = compiled_decode_loop(config, target, batch=BATCH, slots=SLOTS, width=16)
    cache_shape = f"[{BATCH},{config.num_kv_heads},{slots_per_op},{config.head_dim}]"
    bodies = while_bodies(hlo)
    found = [f"{op['opcode']} {op['name']} {op['shape']} ({op['op_name']})" for op in ops_outside_fusions(hlo)
             if op["computation"] in bodies and op["shape"].endswith(cache_shape) and op["opcode"] != "custom-call"]
    return found, hlo


@pytest.mark.integration
@pytest.mark.skipif(bool(target_installed("tpu")), reason=target_installed("tpu") or "installed")
def test_tpu_decode_loop_body_touches_no_whole_cache():
    kernel_ops, hlo = _cache_ops_in_loop_body("auto")
    assert hlo.count("decode_attention") >= 2, "the Pallas decode kernel is not in the TPU decode program"
    assert not kernel_ops, f"cache-sized ops inside the TPU decode loop: {kernel_ops}"
    blockwise_ops, _ = _cache_ops_in_loop_body("xla_blockwise")
    assert any(op.startswith("copy") for op in blockwise_ops), \
        f"the probe no longer finds the blockwise loop's cache copies ({blockwise_ops}): it may be blind"


@pytest.mark.integration
@pytest.mark.skipif(bool(target_installed("gpu")), reason=target_installed("gpu") or "installed")
def test_gpu_engine_decode_loop_body_touches_no_whole_pool_but_its_writes():
    """The engine's decode step as ``bench_rollout.py --decode-program --tiny`` compiles it for an H100:
    inside its loops, the only ops whose result is a whole KV pool are the scatter fusions that write
    the new token in place (seen, so the probe is not blind); no copy of a pool a token."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import _decode_step  # noqa: PLC0415  (benchmarks/: the report's own compile of the step)

    target = _decode_step.tiny_targets()["h100-tiny"]
    config = _decode_step._decoder_config(target.model)
    device, _ = _decode_step._device("gpu")
    compiled, _ = _decode_step.compile_segment(target, config, device)
    hlo = compiled.as_text()
    pool = f"[1,{target.kv_blocks},{config.num_kv_heads},{target.block},{config.head_dim}]"
    bodies = while_bodies(hlo)
    ops = [op for op in ops_outside_fusions(hlo) if op["computation"] in bodies and op["shape"].endswith(pool)]
    writes = [op for op in ops if op["opcode"] == "fusion" and "scatter" in op["name"]]
    assert len(writes) == 2 * config.num_layers, f"expected a k and a v write a layer: {ops}"
    assert writes == ops, f"pool-sized ops other than the in-place writes in the GPU decode loop: {ops}"


def test_cpu_decode_loop_reads_its_key_blocks_in_place(monkeypatch):
    from llds_jax.models import decoder
    from llds_jax.models.attention import CACHED_BLOCK

    block_ops, _ = _cache_ops_in_loop_body("auto", "cpu", CACHED_BLOCK, "float32")
    writes = [op for op in block_ops if "scatter" in op]
    assert writes and len(writes) == len(block_ops), f"block-sized ops other than the writes: {block_ops}"
    monkeypatch.setattr(decoder, "cache_block", lambda backend, platform: 0)  # one buffer per layer
    one_buffer_ops, _ = _cache_ops_in_loop_body("auto", "cpu", CACHED_BLOCK, "float32")
    assert any("slice" in op for op in one_buffer_ops), \
        f"the probe no longer finds the one-buffer loop's key-block copies ({one_buffer_ops}): it may be blind"
