"""kill -9 mid-run, same command again: the resumed run's death-spiral monitor carries on as if never stopped.

Real processes (``python -m llds_jax.main``, the machinery of ``tests/scale/test_fault_recovery.py``):
an uninterrupted run of ``STEPS`` steps, and a run killed inside step 2 (after step 1's checkpoint)
then restarted. The monitor is set so that its state is visible in every row from early on — a
3-step likelihood window (read from ``ratio/mean``, which varies step to step; the tiny random
policy never earns a reward, so ``diag/ll_correct/all`` is always null), a 1-step surge window and
a surge threshold every finite gradient-norm ratio passes, so phase III latches at step 1. Without
replaying the recorded steps the resumed step 2 would have a one-point window (slope null) and no
surge history (phase 1).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from scale.test_fault_recovery import finish, rl_records, start, train_command, wait_for

STEPS = 4
MONITOR = {"monitor.likelihood_key": "ratio/mean", "monitor.window": 3, "monitor.surge_window": 1,
           "monitor.surge_ratio": 1e-6, "monitor.entropy_surge_ratio": 1e6, "monitor.patience": 1}
MONITOR_KEYS = ("monitor/phase", "monitor/ll_slope", "monitor/ll_t_stat", "monitor/grad_surge_ratio",
                "monitor/entropy_surge_ratio")


def command(workdir: Path, shared_dir: Path) -> list[str]:
    overrides = {"train.total_steps": STEPS, **MONITOR}
    base = [arg for arg in train_command(workdir, shared_dir)
            if not any(arg.startswith(f"--config.{key}=") for key in overrides)]
    return base + [f"--config.{key}={value}" for key, value in overrides.items()]


@pytest.mark.slow
def test_monitor_state_after_kill_9_and_resume_equals_the_uninterrupted_runs(tmp_path, shared_dir):
    reference_dir, killed_dir = tmp_path / "reference", tmp_path / "killed"
    reference = start(command(reference_dir, shared_dir), tmp_path / "reference.log")
    finish(reference, tmp_path / "reference.log")

    cache = tmp_path / "jax_cache"
    victim = start(command(killed_dir, shared_dir), tmp_path / "killed.log", cache)
    wait_for(lambda: (killed_dir / "checkpoints" / "1").is_dir(), victim, tmp_path / "killed.log")
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    assert not (killed_dir / "checkpoints" / "2").exists(), "step 2 must not have completed before the kill"

    resumed = start(command(killed_dir, shared_dir), tmp_path / "resumed.log", cache)
    finish(resumed, tmp_path / "resumed.log")
    assert "resumed from step 1" in (tmp_path / "resumed.log").read_text()

    want, got = rl_records(reference_dir), rl_records(killed_dir)
    assert sorted(got) == sorted(want) == list(range(STEPS))
    # The windows are full by step 2 and phase III latched at step 1: the state is non-trivial.
    assert want[2]["monitor/phase"] == 3 and want[2]["monitor/ll_slope"] is not None, want[2]
    for step in range(2, STEPS):
        differing = {k: (got[step].get(k), want[step][k]) for k in MONITOR_KEYS if got[step].get(k) != want[step][k]}
        assert not differing, f"resumed step {step}: monitor (resumed, uninterrupted) differ: {differing}"
