"""launch/device_check.sh, the one-GPU check, runs its CPU dry run as a real process, so it cannot rot."""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from llds_jax.plan.measured import PHASES
from tests.codegen_sensitive import child_xla_flags

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_dry_run_runs_every_part_and_prints_the_table(tmp_path, shared_dir):
    # the passes at another model's shapes (a second shape for the plan's matmul efficiency), here tiny, one
    # row a micro-batch where the job packs two (as the next GPU's qwen3b passes take a device's 2 of 16)
    proc = subprocess.run(["bash", "launch/device_check.sh", "--dry-run", "--with-passes", "--out", str(tmp_path),
                           "--passes-model", "tiny:llama", "--passes-prompts", "2", "--passes-rows", "1",
                           "--tokenizer", str(shared_dir / "assets" / "qwen2_tokenizer")],
                          cwd=REPO, env=dict(os.environ, XLA_FLAGS=child_xla_flags(8, min_llvm_level=1)),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "device_check.json").read_text())
    fp32 = [r for r in result["parity"]["rows"] if r["dtype"] == "float32"]
    assert fp32 and all(r["max_abs_logprob_diff"] < 1e-4 for r in fp32), result["parity"]
    passes = result["passes"]
    assert set(passes["steady"]) == {"logprobs_s", "update_s", "delta_s"} and passes["model"] == "tiny:llama"
    assert passes["rows"] == 2 * 4 and all(passes["predicted"][k] > 0 for k in ("logprobs", "update", "delta"))
    assert passes["rows_per_micro_batch"] == 1
    assert result["train"]["exit"] == 0 and result["measured"]["steps"] == 2
    assert result["predicted"]["step_time"]["step_time_s"]["total"] > 0
    assert "packed rows" in result["predicted"]["step_time"]["assumptions"]["training_batch"]  # as the job trains
    # the stored record replays through the model to the very prediction the check made (what a recorded
    # device run's replay rests on)
    from llds_jax.plan.measured import replay

    again = replay(tmp_path / "device_check.json", {"model.tokenizer": str(shared_dir / "assets" / "qwen2_tokenizer")})
    predicted = result["predicted"]["step_time"]["step_time_s"]
    assert [p for _, _, p, _ in again["rows"]] == [predicted.get(key) for _, _, key in PHASES]
    table = (tmp_path / "device_check.md").read_text()
    for heading in ("Parity vs transformers", "Training passes after their compile (tiny:llama", "1 to a micro-batch",
                    "measured (median"):
        assert heading in table


def test_bad_arguments_are_refused_by_name():
    proc = subprocess.run(["bash", "launch/device_check.sh", "--bogus"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown option --bogus" in proc.stderr


@pytest.mark.unit
def test_the_wheel_list_names_versions_and_fits_a_device_call():
    lines = [line for line in (REPO / "launch" / "device_check_wheels.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    sizes = [re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9.]+\s+# ([\d,]+) bytes: .+", line) for line in lines]
    assert lines and all(sizes), lines
    assert sum(int(m.group(1).replace(",", "")) for m in sizes) <= 64 * 2**20
