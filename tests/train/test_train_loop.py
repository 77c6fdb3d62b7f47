"""The whole ``--mode=train`` path on a tiny random model with the real tokenizer and the bundled BM25 corpus.

Warm-up → RL (rollouts, EM, π_old/π_ref, sequential updates, Δ diagnostics, an entropy term, the
monitor) → checkpoint → HF export → eval, then a second invocation that resumes from the checkpoint
instead of warming up again.

The same job checks the metrics vocabulary (``llds_jax.diagnostics.keys.TABLE``): every key it writes
to ``metrics.jsonl`` must be a table entry of that phase, every table entry must be written, and every
per-mini-batch array the update returns must be either reduced into a logged key or declared
update-only. One module, one job: a second tiny job costs a minute of CI.
"""

from __future__ import annotations

import json

import pytest
from train_helpers import tiny_loop_config

from llds_jax.app.run import train
from llds_jax.diagnostics import keys
from llds_jax.train.learner import Learner
from llds_jax.train.metrics import read_metrics

pytestmark = pytest.mark.integration

ROW_FIELDS = {"step", "phase", "wall_time"}


@pytest.fixture(scope="module")
def loop_config(tmp_path_factory, shared_dir):
    config = tiny_loop_config(str(tmp_path_factory.mktemp("run")), str(shared_dir / "assets" / "qwen2_tokenizer"))
    config.train.peak_flops, config.train.peak_bytes_per_s = 1e12, 1e11  # known peaks: MFU checkable by hand
    # Rows of 128, not 256: the prompt's last 64 tokens and a 16 + 32 + 16-token response fit; every rollout,
    # log-prob pass and update (and the resumed job's) computes the ~152k-word LM head at each position.
    config.rollout.max_prompt_tokens, config.rollout.max_context = 64, 128
    return config


@pytest.fixture(scope="module")
def first_run(loop_config):
    """The first job's summary, its metrics.jsonl rows, and the per-mini-batch array names its updates returned."""
    assert loop_config.rl.entropy_coef > 0 and loop_config.train.delta_diagnostics and loop_config.monitor.enabled
    update_names = set()
    real_update = Learner.update

    def recording_update(self, *args, **kwargs):
        metrics, extra = real_update(self, *args, **kwargs)
        update_names.update(extra["per_mini_batch"])
        return metrics, extra

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Learner, "update", recording_update)
        summary = train(loop_config)
    return dict(summary=summary, rows=read_metrics(loop_config.workdir), update_names=update_names)


def test_metrics_jsonl_has_warmup_rl_and_eval_rows_with_contract_keys(first_run, loop_config):
    rows = first_run["rows"]
    phases = [r["phase"] for r in rows]
    assert phases == ["sft", "sft", "rl", "rl", "eval"], phases
    rl = [r for r in rows if r["phase"] == "rl"]
    for key in ("reward/mean", "llds/value", "rollout/searches",
                "time/rollout_s", "time/retrieval_s", "time/logprobs_s", "time/update_s", "time/step_s",
                "throughput/update_tokens_per_s", "grad/norm_preclip", "kl/mean", "ratio/max",
                "logprob_gap/abs_mean", "diag/ll_correct/all", "policy/entropy", "monitor/phase"):
        assert key in rl[0], f"metrics.jsonl row lacks {key!r}; has {sorted(rl[0])}"
    assert first_run["summary"]["compile_counts"] == {  # Δ every step (train.delta_every = 1): one reduction and
        # (packed rows) the count and scatter of the Δ pass's rows
        "policy_logprobs": 1, "update": 1, "reference_logprobs": 1, "step_reductions_delta": 1,
        "delta_row_counts": 1, "pack_delta_rows": 1}, \
        first_run["summary"]["compile_counts"]


def test_sampler_and_trainer_agree_on_old_logprobs(first_run):
    rl = [r for r in first_run["rows"] if r["phase"] == "rl"]
    # Same params, fp32, no top-p truncation (the sampler reports log-probs of the truncated,
    # renormalised distribution: with top_p=0.95 a near-uniform tiny model is off by log(1/0.95)).
    assert rl[0]["logprob_gap/abs_mean"] < 1e-3, rl[0]["logprob_gap/abs_mean"]


def test_run_leaves_checkpoint_export_eval_and_tensorboard(first_run, loop_config):
    from pathlib import Path

    workdir = Path(loop_config.workdir)
    assert (workdir / "checkpoints" / "1").is_dir()
    assert (workdir / "hf" / "step_1" / "config.json").exists()
    assert list((workdir / "eval").glob("*"))
    assert list((workdir / "tensorboard").glob("events.*"))
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["rl_steps"] == 2 and len(summary["reward_per_step"]) == 2


def test_profile_of_step_1_is_written_and_no_other(first_run, loop_config):
    from pathlib import Path

    profile = Path(loop_config.workdir) / "profile"
    assert list((profile / "step_1").rglob("*.xplane.pb")), f"no trace under {profile}"
    assert sorted(p.name for p in profile.iterdir()) == ["step_1"]


@pytest.mark.parametrize("backend", ["mlflow", "wandb"])
def test_optional_loggers_hold_the_jsonl_keys_and_values(first_run, loop_config, backend):
    """W&B (offline) and MLflow (file store) runs of this job: the same rows as metrics.jsonl, and the config."""
    from pathlib import Path

    from test_loggers_and_profiling import jsonl_history, mlflow_history, wandb_history

    if backend not in loop_config.train.loggers:
        pytest.skip(f"{backend} is the optional extra llds-jax[{backend}], not installed here")
    history, config = (mlflow_history if backend == "mlflow" else wandb_history)(Path(loop_config.workdir))
    expected = jsonl_history(first_run["rows"])
    if backend == "mlflow":
        expected = {key: sorted(points) for key, points in expected.items()}
    assert set(history) == set(expected)
    for key, want in expected.items():
        got = history[key]
        assert [step for step, _ in got] == [step for step, _ in want], key
        assert [value for _, value in got] == pytest.approx([value for _, value in want], rel=1e-6), key
    assert config["rl"]["llds_coef"] == loop_config.rl.llds_coef


def test_every_logged_key_is_a_table_entry_of_its_phase(first_run):
    rows = first_run["rows"]
    assert {row["phase"] for row in rows} == {"sft", "rl", "eval"}
    unknown = sorted({(row["phase"], key) for row in rows for key in set(row) - ROW_FIELDS
                      if (entry := keys.lookup(key)) is None or row["phase"] not in entry.phases})
    assert not unknown, f"(phase, key) logged but not in keys.TABLE for that phase: {unknown}"


def test_every_table_entry_is_logged(first_run):
    logged_pairs = {(row["phase"], key) for row in first_run["rows"] for key in row}
    orphans = sorted((phase, metric.name) for metric in keys.TABLE for phase in metric.phases
                     if not any(p == phase and metric.matches(k) for p, k in logged_pairs))
    assert not orphans, f"keys.TABLE entries no row of their phase carries: {orphans}"


def test_every_update_array_is_logged_or_declared_update_only(first_run):
    update_names = first_run["update_names"]
    reduced = {metric.from_update or metric.name for metric in keys.UPDATE_METRICS}
    assert not update_names - reduced - keys.UPDATE_ONLY, "per-mini-batch arrays neither logged nor in UPDATE_ONLY"
    assert not (reduced | keys.UPDATE_ONLY) - update_names, "table names arrays the update does not return"


@pytest.mark.unit
def test_old_names_are_not_current_names():
    current = {metric.name for metric in keys.TABLE}
    assert not (set(keys.RENAMED) | keys.REMOVED) & current
    assert set(keys.RENAMED.values()) <= current


def test_second_invocation_resumes_without_warmup(first_run, loop_config, tmp_path):
    """Resumes a copy of the first run's workdir, which the other tests read (so they pass in any order)."""
    import shutil

    config = loop_config.copy_and_resolve_references()
    config.workdir = str(shutil.copytree(loop_config.workdir, tmp_path / "run"))
    config.train.total_steps = 3
    config.eval.data = ""
    summary = train(config)
    rows = read_metrics(config.workdir)
    assert [r["phase"] for r in rows].count("sft") == 2, "resume must not redo the warm-up"
    assert [r["step"] for r in rows if r["phase"] == "rl"] == [0, 1, 2]
    assert summary["rl_steps"] == 1


def test_utilisation_of_the_passes_is_their_shared_flops_over_their_seconds(first_run):
    """The update and the log-prob passes run over the same computed rows: MFU x seconds x peak x devices
    is 3 forwards for the update and one per log-prob pass (π_ref is π_old in the first step). The
    counts themselves are checked by hand in tests/utils/test_flops.py."""
    rl = [r for r in first_run["rows"] if r["phase"] == "rl"]
    for step, row in enumerate(rl):
        update = row["throughput/update_mfu"] * row["time/update_s"]
        logprobs = row["throughput/logprobs_mfu"] * row["time/logprobs_s"]
        assert update / logprobs == pytest.approx(3 / (1 if step == 0 else 2), rel=1e-9)
        assert 0 < row["throughput/decode_mbu"] < 1 and row["memory/device_peak_bytes"] > 0
