"""``bench_retrieval.py --mesh --json`` on its smallest settings: one parsable object with issue #59's keys."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
KEYS = {"queries", "devices", "id_agreement", "qps_mesh", "qps_faiss_flat", "turn_seconds"}


def test_bench_retrieval_mesh_json_prints_one_object_with_the_issues_keys():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # the script sets its own 8 simulated devices
    done = subprocess.run([sys.executable, str(BENCHMARKS / "bench_retrieval.py"), "--mesh", "--json", "--rows=300",
                           "--queries=64", "--dim=64", "--repeats=1", "--allow-noisy", "--max-load=-1"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=BENCHMARKS.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(done.stdout)
    assert KEYS <= set(record) and record["noisy"] is True
    assert record["queries"] == 64 and record["devices"] == 8 and record["id_agreement"] == 1.0
    assert record["qps_mesh"] > 0 and record["qps_faiss_flat"] > 0
    assert set(record["turn_seconds"]) == {"v5e:8x8", "8xH100"}
    for target in record["turn_seconds"].values():
        assert set(target) == {"faiss_flat_host", "mesh"} and 0 < target["mesh"] < target["faiss_flat_host"]
