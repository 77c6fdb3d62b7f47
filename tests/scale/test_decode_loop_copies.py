"""XLA:TPU must not copy the KV cache inside the decode loop (issue 15: decode cost follows the
live bytes, not the cache's size). Compiled for a v5e from this CPU host, through the same
program builder as ``benchmarks/roofline.py``: with the Pallas decode kernel (attention
"auto" on TPU) the loop body holds no cache-sized op, and with the plain-XLA blockwise
kernel it holds copies (so the probe is shown to find what it looks for)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from llds_jax.plan.targets import target_installed

_BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SLOTS, BATCH = 256, 8


def _roofline():
    if "roofline" not in sys.modules:
        sys.path.insert(0, str(_BENCHMARKS))  # roofline imports its sibling _hlo_reading
        spec = importlib.util.spec_from_file_location("roofline", _BENCHMARKS / "roofline.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["roofline"] = module  # dataclasses look their module up while the file executes
        spec.loader.exec_module(module)
    return sys.modules["roofline"]


def _cache_ops_in_loop_body(attention: str) -> tuple[list[str], str]:
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compile-only: claim no chip
    from llds_jax.sampling.decode_loop import decode

    roofline = _roofline()
    config = roofline.MODELS["tiny"](dtype="bfloat16", param_dtype="float32", scan_layers=False, attention=attention)
    device, _ = roofline.target_device("tpu")
    mesh, _, args, _ = roofline.build_program("decode", config, device, batch=BATCH, slots=SLOTS)
    compiled, _ = roofline.compile_for(decode, args, dict(width=16), mesh, device.platform)
    hlo = compiled.as_text()
    cache_shape = f"[{BATCH},{config.num_kv_heads},{SLOTS},{config.head_dim}]"
    bodies = roofline.while_bodies(hlo)
    found = [f"{op['opcode']} {op['shape']} ({op['op_name']})" for op in roofline.largest_ops(hlo, top=10**6)
             if op["computation"] in bodies and op["shape"].endswith(cache_shape) and op["opcode"] != "custom-call"]
    return found, hlo


@pytest.mark.skipif(bool(target_installed("tpu")), reason=target_installed("tpu") or "installed")
def test_tpu_decode_loop_body_touches_no_whole_cache():
    kernel_ops, hlo = _cache_ops_in_loop_body("auto")
    assert hlo.count("decode_attention") >= 2, "the Pallas decode kernel is not in the TPU decode program"
    assert not kernel_ops, f"cache-sized ops inside the TPU decode loop: {kernel_ops}"
    blockwise_ops, _ = _cache_ops_in_loop_body("xla_blockwise")
    assert any(op.startswith("copy") for op in blockwise_ops), \
        f"the probe no longer finds the blockwise loop's cache copies ({blockwise_ops}): it may be blind"
