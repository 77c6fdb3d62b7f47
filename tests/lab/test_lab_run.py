"""From a fresh cache, ``--config=configs/lab_grpo.py`` builds the lab and runs real RL steps.

A real subprocess of ``python -m llds_jax.main`` (one CPU device, as a user has), shrunk by
command-line overrides only: a tiny world, a 1000-entry tokenizer, a width-64 policy with a few
SFT steps (no accuracy expected), two RL steps. It pins the wiring — prepare hook, cached
artifacts, the trainer loading the lab policy like any HF directory — not the science.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.codegen_sensitive import child_xla_flags

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

SHRINK = {
    "lab.world.people": 24, "lab.world.cities": 6, "lab.world.countries": 3, "lab.world.companies": 4,
    "lab.world.train_questions": 40, "lab.world.dev_questions": 8,
    "lab.tokenizer.vocab_size": 1000,
    "lab.policy.hidden": 64, "lab.policy.intermediate": 128, "lab.policy.sft_steps": 3,
    "lab.policy.sft_batch_size": 4, "lab.policy.check_questions": 0, "lab.policy.min_build_em": 0.0,
    "train.total_steps": 2, "train.prompts_per_step": 2, "rollout.n_samples": 4, "train.mini_batch_size": 4,
    "train.micro_batch_size": 4, "train.logprob_batch_size": 8, "rollout.max_action_tokens": 12,
    "train.save_every": 0, "train.export_hf": False, "eval.data": "",
}


@pytest.mark.slow  # ≈35 s of CPU, 2 min wall on the shared 2-core box (compiles dominate)
def test_lab_grpo_builds_the_lab_and_logs_lld_diagnostics(tmp_path):
    workdir, lab_dir = tmp_path / "run", tmp_path / "lab"
    args = [f"--config.{key}={value}" for key, value in SHRINK.items()]
    env = dict(os.environ, XLA_FLAGS=child_xla_flags(), JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1",
               LLDS_JAX_CACHE=str(tmp_path / "cache"))
    result = subprocess.run(
        [sys.executable, "-m", "llds_jax.main", "--config=configs/lab_grpo.py", f"--config.workdir={workdir}",
         f"--config.lab.dir={lab_dir}", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    built = sorted(p.name.split("-")[0] for p in lab_dir.iterdir() if not p.name.startswith("."))
    assert built == ["policy", "tokenizer", "world"], built
    policy = next(lab_dir.glob("policy-*"))
    assert (policy / "config.json").exists() and (policy / "model.safetensors").exists()
    assert json.loads((policy / "config.json").read_text())["num_hidden_layers"] == 2
    config = json.loads((workdir / "config.json").read_text())
    assert config["model"]["source"] == str(policy), "the trainer must load the built policy"
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "diag/lld_rate" in row or "reward/mean" in row]
    assert len(steps) == 2, [sorted(r) for r in rows]
    for key in ("diag/lld_rate", "diag/ll_correct/all"):
        assert any(key in row for row in steps), f"{key} missing from {sorted(steps[-1])}"
