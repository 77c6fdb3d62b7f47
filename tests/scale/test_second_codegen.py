"""``launch/test.sh`` runs every test that is not codegen-sensitive only under its second XLA:CPU code
generator (``tests/codegen_sensitive.SECOND_CODEGEN``). One of its flags, ``xla_backend_optimization_level``,
is not XLA:CPU's alone: it reaches every backend a process compiles for. The plan and memory tests read
compile-only XLA:TPU and XLA:GPU programs, so those must come out the same under either code generator —
the same optimised HLO, the same memory figures. A JAX or XLA upgrade that changes that fails here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llds_jax.plan.targets import target_installed
from tests.codegen_sensitive import SECOND_CODEGEN

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

# A scanned bf16 matmul + softmax block and its gradient, sharded over 4 devices, compiled for v5e and H100.
COMPILE_FOR_TPU_AND_GPU = '''
import hashlib, json, jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from llds_jax.plan.targets import gpu_target, tpu_target

def loss(w, x):
    def block(h, _):
        return jax.nn.softmax(h @ w, axis=-1) @ w.T + h, None
    y, _ = jax.lax.scan(block, x, None, length=4)
    return jnp.sum(jnp.log1p(jnp.abs(y)))

out = {}
for name, target in (("tpu", tpu_target("v5e:2x2")), ("gpu", gpu_target("h100", 4, 4))):
    mesh = Mesh(np.array(target.devices).reshape(4), ("d",))
    step = jax.jit(jax.grad(loss), in_shardings=(NamedSharding(mesh, P(None, "d")), NamedSharding(mesh, P("d"))))
    compiled = step.lower(jax.ShapeDtypeStruct((256, 1024), jnp.bfloat16),
                          jax.ShapeDtypeStruct((128, 256), jnp.bfloat16)).compile()
    stats = compiled.memory_analysis()
    out[name] = dict(platform=target.platform, hlo=hashlib.sha256(compiled.as_text().encode()).hexdigest(),
                     temp=stats.temp_size_in_bytes, argument=stats.argument_size_in_bytes,
                     output=stats.output_size_in_bytes, code=stats.generated_code_size_in_bytes)
print(json.dumps(out))
'''


def compile_under(xla_flags: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags)
    result = subprocess.run([sys.executable, "-c", COMPILE_FOR_TPU_AND_GPU], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=600, check=False)
    assert result.returncode == 0, f"XLA_FLAGS={xla_flags!r}: exit {result.returncode}\n{result.stderr[-3000:]}"
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(bool(target_installed("tpu") or target_installed("gpu")),
                    reason=target_installed("tpu") or target_installed("gpu") or "installed")
def test_compile_only_tpu_and_gpu_programs_are_the_same_under_either_code_generator():
    default, second = compile_under(""), compile_under(SECOND_CODEGEN)
    assert default["tpu"]["platform"] == "tpu" and default["gpu"]["platform"] == "gpu", default
    assert second == default, f"default code generator: {default}\nsecond code generator: {second}"
