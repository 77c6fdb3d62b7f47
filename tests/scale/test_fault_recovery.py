"""Faults a long run meets, with real processes: kill -9 mid-step and mid-save, then resume.

The trainer runs as ``python -m llds_jax.main`` (a random tiny Qwen2 decoder with the real Qwen2.5
tokenizer, BM25 retriever, one device) exactly as a user would start it; a restarted run uses
the same command line. One uninterrupted reference run (module fixture) is what both kill -9
runs must reproduce, death-spiral monitor included.

The monitor is set so that its state is visible in every row from early on — a 3-step likelihood
window (read from ``ratio/mean``, which varies step to step; the tiny random policy never earns a
reward, so ``diag/ll_correct/all`` is always null), a 1-step surge window and a surge threshold
every finite gradient-norm ratio passes, so phase III latches at step 1. A run killed inside step 2
must replay the recorded steps on resume: without that its step 2 would have a one-point window
(slope null) and no surge history (phase 1).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.codegen_sensitive import child_xla_flags
from tests.processes import finish

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
STEPS = 3
MONITOR = {"monitor.likelihood_key": "ratio/mean", "monitor.window": 3, "monitor.surge_window": 1,
           "monitor.surge_ratio": 1e-6, "monitor.entropy_surge_ratio": 1e6, "monitor.patience": 1}
# Keys that legitimately differ between two runs of the same step: clocks and throughput.
# memory/device_peak_bytes is the process's high-water mark since it started (a resumed process has not run the
# steps before the kill, and its compiles differ), not a result of the step: like the timings it is not compared.
NONDETERMINISTIC_PREFIXES = ("time/", "throughput/", "wall_time", "memory/")


def train_command(workdir: Path, shared_dir: Path) -> list[str]:
    overrides = {
        "model.source": "tiny:qwen2", "model.tokenizer": str(shared_dir / "assets" / "qwen2_tokenizer"),
        "workdir": str(workdir), "train.total_steps": STEPS, "train.save_every": 1, "train.warmup_sft_steps": 0,
        "eval.data": "", "train.export_hf": False, "train.loggers": (),
        "train.prompts_per_step": 2, "rollout.n_samples": 2, "train.mini_batch_size": 2,
        "train.micro_batch_size": 2, "train.logprob_batch_size": 4, "rollout.max_turns": 1,
        "rollout.max_action_tokens": 8, "rollout.max_obs_tokens": 32, "rollout.max_prompt_tokens": 256,
        "rollout.max_context": 384, "rollout.top_p": 1.0, **MONITOR,
    }
    return [sys.executable, "-m", "llds_jax.main", "--config=configs/cpu_smoke.py",
            *(f"--config.{k}={v}" for k, v in overrides.items())]


def start(cmd: list[str], log: Path, cache: Path | None = None) -> subprocess.Popen:
    # One persistent compilation cache (the reference run's): later launches load the programs the
    # first compiled (the same executables, so results stay bit-identical) instead of recompiling.
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=child_xla_flags(1),
               JAX_COMPILATION_CACHE_DIR=str(cache or log.parent / "jax_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_for(predicate, proc: subprocess.Popen, log: Path, timeout: float = 600, poll: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            pytest.fail(f"process ended (exit {proc.returncode}) before the awaited state:\n{log.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"timed out waiting; log:\n{log.read_text()[-4000:]}")
        time.sleep(poll)


def rl_records(workdir: Path) -> dict[int, dict]:
    """The last ``rl`` record per step of ``metrics.jsonl`` (a resumed run appends to it)."""
    records = {}
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("phase") == "rl":
            records[record["step"]] = record
    return records


def comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(NONDETERMINISTIC_PREFIXES)}


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, shared_dir) -> tuple[Path, Path]:
    """The uninterrupted run: (its workdir, the compilation cache later launches share)."""
    root = tmp_path_factory.mktemp("reference")
    reference = start(train_command(root / "workdir", shared_dir), root / "reference.log")
    finish(reference, root / "reference.log")
    return root / "workdir", root / "jax_cache"


def assert_step_matches_reference(reference_dir: Path, resumed_dir: Path, step: int) -> dict:
    want, got = rl_records(reference_dir), rl_records(resumed_dir)
    assert sorted(got) == sorted(want) == list(range(STEPS))
    expected, actual = comparable(want[step]), comparable(got[step])
    differing = {k: (actual.get(k), expected[k]) for k in expected if actual.get(k) != expected[k]}
    assert not differing, f"step {step} after kill -9 + resume differs from the uninterrupted run: {differing}"
    return actual


@pytest.mark.slow
def test_kill_9_mid_step_then_same_command_resumes_and_matches_uninterrupted_run(tmp_path, shared_dir,
                                                                                  reference_run):
    reference_dir, cache = reference_run
    killed_dir = tmp_path / "killed"
    # A loop of several steps compiles each jitted step function exactly once.
    compile_counts = json.loads((reference_dir / "summary.json").read_text())["compile_counts"]
    assert compile_counts and set(compile_counts.values()) == {1}, compile_counts

    # Kill -9 as soon as step 1's checkpoint has committed: the process is then inside step 2.
    cmd = train_command(killed_dir, shared_dir)
    victim = start(cmd, tmp_path / "killed.log", cache)
    wait_for(lambda: (killed_dir / "checkpoints" / "1").is_dir(), victim, tmp_path / "killed.log")
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    assert victim.returncode == -signal.SIGKILL
    assert not (killed_dir / "checkpoints" / "2").exists(), "step 2 must not have completed before the kill"

    resumed = start(cmd, tmp_path / "resumed.log", cache)
    finish(resumed, tmp_path / "resumed.log")
    assert "resumed from step 1" in (tmp_path / "resumed.log").read_text()

    # The monitor's windows are full by step 2 and phase III latched at step 1: its state is non-trivial.
    want = rl_records(reference_dir)[2]
    assert want["monitor/phase"] == 3 and want["monitor/ll_slope"] is not None, want
    actual = assert_step_matches_reference(reference_dir, killed_dir, step=2)
    assert actual["loss/total"] is not None and actual["llds/value"] is not None


def save_in_progress(checkpoints: Path, step: int) -> bool:
    """Orbax writes step ``step`` under ``<step>.orbax-checkpoint-tmp-*`` until it commits (renames)."""
    try:
        return any(name.startswith(f"{step}.orbax-checkpoint-tmp") for name in os.listdir(checkpoints))
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_kill_9_mid_save_of_trainer_then_same_command_resumes_from_last_complete_checkpoint(
        tmp_path, shared_dir, reference_run):
    """Issue 9 acceptance: kill -9 the real trainer while it writes step 1's checkpoint.

    Step 0's checkpoint is complete, step 1's is a temporary directory: the restarted command
    must ignore the leftover, resume from step 0, redo step 1 exactly as the uninterrupted run
    did, and commit step 1 over the leftover.
    """
    from llds_jax.train.checkpoint import Checkpointer

    reference_dir, cache = reference_run
    killed_dir = tmp_path / "killed"
    checkpoints = killed_dir / "checkpoints"
    cmd = train_command(killed_dir, shared_dir)
    victim = start(cmd, tmp_path / "killed.log", cache)
    wait_for(lambda: (checkpoints / "0").is_dir() and save_in_progress(checkpoints, 1), victim,
             tmp_path / "killed.log", poll=0.002)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    assert victim.returncode == -signal.SIGKILL
    leftovers = [p.name for p in checkpoints.iterdir()]
    assert not (checkpoints / "1").exists(), f"step 1's save committed before the kill: {leftovers}"
    assert any(name.startswith("1.orbax-checkpoint-tmp") for name in leftovers), leftovers
    assert Checkpointer(killed_dir.resolve()).all_steps() == [0]
    # The killed run had logged step 1 (metrics are written before the checkpoint): it must be redone.
    assert sorted(rl_records(killed_dir)) == [0, 1]

    resumed = start(cmd, tmp_path / "resumed.log", cache)
    finish(resumed, tmp_path / "resumed.log")
    assert "resumed from step 0" in (tmp_path / "resumed.log").read_text()
    assert [r["step"] for r in map(json.loads, (killed_dir / "metrics.jsonl").read_text().splitlines())
            if r.get("phase") == "rl"] == [0, 1, 1, 2], "the resumed run must redo step 1 once"
    for step in (1, 2):
        actual = assert_step_matches_reference(reference_dir, killed_dir, step=step)
        assert actual["loss/total"] is not None and actual["llds/value"] is not None
    assert Checkpointer(killed_dir.resolve()).all_steps() == [0, 1, 2]
    assert not any(save_in_progress(checkpoints, step) for step in (0, 1)), list(checkpoints.iterdir())


MID_SAVE_WRITER = """
import sys, jax, jax.numpy as jnp
from llds_jax.train.checkpoint import Checkpointer
state = {"w": jnp.zeros((1024, 1024, 48), jnp.float32)}  # 200 MB: a save takes a while
ckpt = Checkpointer(sys.argv[1], keep=5)
ckpt.save(1, state, {"step": 1}); ckpt.wait()
print("step 1 committed", flush=True)
ckpt.save(2, jax.tree.map(lambda x: x + 2, state), {"step": 2}); ckpt.wait()
print("step 2 committed", flush=True)
"""


@pytest.mark.slow
def test_kill_9_mid_save_leaves_only_complete_checkpoints(tmp_path):
    from llds_jax.train.checkpoint import Checkpointer, abstract_like

    log = tmp_path / "writer.log"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=child_xla_flags(1))
    writer = subprocess.Popen([sys.executable, "-c", MID_SAVE_WRITER, str(tmp_path)], cwd=REPO, env=env,
                              stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    ckdir = tmp_path / "checkpoints"
    in_progress = lambda: any(p.name.startswith("2.") for p in ckdir.glob("*")) if ckdir.exists() else False
    wait_for(in_progress, writer, log, timeout=300)
    os.killpg(writer.pid, signal.SIGKILL)
    writer.wait()
    assert "step 2 committed" not in log.read_text()

    import jax
    import jax.numpy as jnp
    import numpy as np

    ckpt = Checkpointer(tmp_path)
    assert ckpt.all_steps() == [1], f"only the committed step may be listed, got {ckpt.all_steps()}"
    target = abstract_like({"w": jax.device_put(jnp.zeros((1024, 1024, 48), jnp.float32), jax.devices()[0])})
    restored = ckpt.restore_latest(target)
    assert restored.step == 1 and restored.extra == {"step": 1}
    assert float(np.asarray(restored.state["w"]).max()) == 0.0
    # The next save of step 2 replaces the leftover temporary directory.
    ckpt.save(2, {"w": restored.state["w"] + 2}, {"step": 2})
    ckpt.wait()
    assert ckpt.all_steps() == [1, 2]
