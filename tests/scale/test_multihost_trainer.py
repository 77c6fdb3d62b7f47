"""The whole ``--mode=train`` run in two localhost processes joined by ``jax.distributed``.

Format warm-up (every host builds the same SFT batch), then RL: each process has 4 simulated
CPU devices of the global 8-device mesh, rolls out its own half of the step's prompts with a
host-local copy of the policy, and feeds only its trajectory rows to ``Learner.update``; the
logged metrics are combined over both hosts and written once, by process 0. Export and eval
use params all-gathered to each host; process 0 writes them. Rollouts draw per-host sampling
keys, so the run is not expected to equal a one-process run trajectory for trajectory
(``test_multihost.py`` pins the update step itself).
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from tests.scale.test_multihost import REPO, run_two_processes

pytestmark = pytest.mark.integration

STEPS = 2


def tiny_run_overrides(workdir, shared_dir) -> dict:
    """16 trajectories a step (4 prompts × 4 samples), 2 mini-batches of 8, one per data shard of 8."""
    return {
        "model.source": "tiny:qwen2", "model.tokenizer": str(shared_dir / "assets" / "qwen2_tokenizer"),
        "workdir": str(workdir), "train.loggers": (),
        "train.prompts_per_step": 4, "rollout.n_samples": 4, "train.mini_batch_size": 8,
        "train.micro_batch_size": 8, "train.logprob_batch_size": 8,
        "rollout.max_turns": 1, "rollout.max_action_tokens": 8, "rollout.max_obs_tokens": 32,
        "rollout.max_prompt_tokens": 256, "rollout.max_context": 384, "rollout.top_p": 1.0,
    }


def flags(overrides: dict) -> list[str]:
    return ["--config=configs/cpu_smoke.py", *(f"--config.{k}={v}" for k, v in overrides.items())]


@pytest.mark.slow
def test_train_in_two_processes_warms_up_trains_logs_once_checkpoints_exports_and_evaluates(tmp_path, shared_dir):
    workdir = tmp_path / "run"
    overrides = {
        **tiny_run_overrides(workdir, shared_dir), "train.total_steps": STEPS, "train.save_every": 1,
        "train.warmup_sft_steps": 1, "sft.batch_size": 8, "sft.max_seq_len": 384,
        "rollout.max_action_tokens": 16,  # the warm-up's bare "<answer> … </answer>" takes 9+ Qwen tokens
        "eval.data": "bundled:nq_dev", "eval.limit": 2, "eval.batch_size": 2,
        "train.export_hf": True, "train.samples_per_step": 16,
    }
    run_two_processes("llds_jax.main", tmp_path, timeout=900, args=flags(overrides))

    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in records] == ["sft"] + ["rl"] * STEPS + ["eval"], [r["phase"] for r in records]
    rl = [r for r in records if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == list(range(STEPS)), "each step must be logged once (by process 0 only)"
    for r in rl:
        assert r["update/mini_batches"] == 2 and r["update/skipped"] == 0
        assert r["loss/total"] is not None and r["llds/value"] is not None
        assert 0.0 <= r["reward/mean"] <= 1.0 and r["rollout/searches"] is not None
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["rl_steps"] == STEPS and set(summary["compile_counts"].values()) == {1}
    assert summary["eval"] and (workdir / "hf" / f"step_{STEPS - 1}" / "config.json").exists()
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == ["0", "1"]
    # Process 0 logs its own trajectories' samples, whose groups are the first half of the prompts.
    samples = [json.loads(line) for line in (workdir / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == STEPS * 8, len(samples)


@pytest.mark.slow
def test_nonfinite_streak_stops_both_processes_at_the_same_step_with_a_checkpoint_of_the_last_finite_state(
        tmp_path, shared_dir):
    """NaN rewards from step 1 on (``nan_reward_train``): 2 skipped updates a step, limit 4.

    Both hosts see the same replicated skip flags, so both trip after step 2, save step 2 together
    (a step the schedule, every 2nd step, would not save) and exit with status 1 and the message.
    Step 1's scheduled checkpoint and the stop's hold the same params and Adam moments: a skipped
    update changes neither (``test_nonfinite_stop.py`` pins that on the learner itself).
    """
    from llds_jax.app.sweep import resolve_run
    from llds_jax.models.loading import load_model_and_tokenizer
    from llds_jax.parallel.mesh import make_mesh
    from llds_jax.train.checkpoint import Checkpointer
    from llds_jax.train.state_layout import train_state_layout

    workdir = tmp_path / "run"
    overrides = {**tiny_run_overrides(workdir, shared_dir), "train.total_steps": 5, "train.save_every": 2,
                 "train.max_nonfinite_updates": 4, "train.warmup_sft_steps": 0, "eval.data": "",
                 "train.export_hf": False}
    run_two_processes("tests.scale.nan_reward_train", tmp_path, timeout=900, args=flags(overrides),
                      expect_codes=(1, 1))
    for pid in range(2):
        log = (tmp_path / f"process_{pid}.log").read_text()
        assert "4 optimizer updates in a row" in log and "(limit 4;" in log, f"process {pid}:\n{log[-2000:]}"
    rl = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["update/skipped"]) for r in rl] == [(0, 0.0), (1, 2.0), (2, 2.0)]
    summary = json.loads((workdir / "summary.json").read_text())
    assert "4 optimizer updates in a row" in summary["stopped"] and summary["skipped_updates"] == 4
    assert summary["rl_steps"] == 3, summary
    committed = sorted(p.name for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    assert committed == ["1", "2"], committed

    # Read both back in this process, on one device: the run wrote them from 8 devices in two processes.
    config = resolve_run(str(REPO / "configs" / "cpu_smoke.py"), overrides, str(workdir))
    config.mesh.shape = (1, 1, 1)
    mesh = make_mesh((1, 1, 1))
    model, _ = load_model_and_tokenizer(config.model, mesh)
    abstract = train_state_layout(model, config, mesh).abstract
    ckpt = Checkpointer(workdir.resolve())
    scheduled, stopped = ckpt.restore(1, abstract), ckpt.restore(2, abstract)
    assert stopped.extra["stopped"] == summary["stopped"] and "stopped" not in scheduled.extra, scheduled.extra
    counts = [(int(r.state.updates), int(r.state.skipped_updates)) for r in (scheduled, stopped)]
    assert counts == [(2, 2), (2, 4)], counts
    for name in ("params", "opt_state"):
        got, want = (jax.tree.leaves(getattr(r.state, name)) for r in (stopped, scheduled))
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{name} changed by a skipped update")
