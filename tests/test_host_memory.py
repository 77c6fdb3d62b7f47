"""A CPU run keeps freed host memory mapped: XLA:CPU's per-execution temporaries stop faulting in anew."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from llds_jax.errors import InputError
from llds_jax.main import COMPUTE_MODES
from llds_jax.utils.host_memory import ENV, wanted

# A program with a 128 MB temporary ([4096, 8192] fp32 product), run until its heap is warm, then
# three more times with the process's minor page faults counted around each execution; the fewest
# count (a temporary is freed just after its outputs are ready, so the next call can come first).
PROBE = textwrap.dedent("""
    import json, resource
    from llds_jax.utils.host_memory import keep_freed_memory
    applied = keep_freed_memory()
    import jax, jax.numpy as jnp
    x, w = jnp.ones((4096, 64), jnp.float32), jnp.ones((64, 8192), jnp.float32)
    f = jax.jit(lambda x, w: jnp.sum(jnp.sin(x @ w), axis=0))
    temp = f.lower(x, w).compile().memory_analysis().temp_size_in_bytes
    for _ in range(5):
        f(x, w).block_until_ready()
    faults = []
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        f(x, w).block_until_ready()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(json.dumps(dict(applied=applied, temp=temp, faults=min(faults))))
""")


def _probe(keep: str) -> dict:
    env = {**os.environ, ENV: keep, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_kept_memory_serves_the_next_execution_without_page_faults():
    kept = _probe("1")
    pages = kept["temp"] / resource.getpagesize()
    assert kept["applied"] and pages >= 2**15, kept
    # Every page of the temporary is already mapped: a handful of faults, not one per page.
    assert kept["faults"] < pages / 100, (kept, pages)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists() and "[always]" not in thp.read_text():  # 4 KB pages: glibc's default refaults them all
        released = _probe("0")
        assert not released["applied"] and released["faults"] >= pages / 2, (released, pages)


@pytest.mark.parametrize(("environ", "expected"), [
    ({"JAX_PLATFORMS": "cpu"}, True),
    ({"JAX_PLATFORMS": "cpu,tpu"}, True),
    ({"JAX_PLATFORMS": "tpu,cpu"}, False),
    ({}, False),  # an accelerator host, or a CPU run that did not say so
    ({"JAX_PLATFORMS": "tpu", ENV: "1"}, True),
    ({"JAX_PLATFORMS": "cpu", ENV: "off"}, False),
])
def test_wanted_on_cpu_runs_or_when_forced(environ, expected):
    assert wanted(environ) is expected


def test_a_bad_setting_names_the_variable_and_value():
    with pytest.raises(InputError, match=f"{ENV}='maybe'"):
        wanted({ENV: "maybe"})


def test_the_retrieval_server_keeps_glibc_arenas():
    assert "serve" not in COMPUTE_MODES and {"train", "sft", "eval", "sweep"} <= COMPUTE_MODES
