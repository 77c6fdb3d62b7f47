"""The whole ``--mode=train`` path on a tiny random model with the real tokenizer and the bundled BM25 corpus.

Warm-up → RL (rollouts, EM, π_old/π_ref, sequential updates, diagnostics) → checkpoint → HF export →
eval, then a second invocation that resumes from the checkpoint instead of warming up again.
"""

from __future__ import annotations

import json

import pytest
from train_helpers import tiny_loop_config

from llds_jax.app.run import train
from llds_jax.train.metrics import read_metrics


@pytest.fixture(scope="module")
def loop_config(tmp_path_factory, shared_dir):
    return tiny_loop_config(str(tmp_path_factory.mktemp("run")), str(shared_dir / "assets" / "qwen2_tokenizer"))


@pytest.fixture(scope="module")
def first_run(loop_config):
    return train(loop_config)


def test_metrics_jsonl_has_warmup_rl_and_eval_rows_with_contract_keys(first_run, loop_config):
    rows = read_metrics(loop_config.workdir)
    phases = [r["phase"] for r in rows]
    assert phases == ["sft", "sft", "rl", "rl", "eval"], phases
    rl = [r for r in rows if r["phase"] == "rl"]
    for key in ("reward/mean", "llds/value", "rollout/searches",
                "time/rollout_s", "time/retrieval_s", "time/logprobs_s", "time/update_s", "time/step_s",
                "throughput/update_tokens_per_s", "grad/norm_preclip", "kl/mean", "ratio/max",
                "logprob_gap/abs_mean", "diag/ll_correct/all", "policy/entropy", "monitor/phase"):
        assert key in rl[0], f"metrics.jsonl row lacks {key!r}; has {sorted(rl[0])}"
    assert (loop_config.workdir and (first_run["compile_counts"] == {
        "policy_logprobs": 1, "update": 1, "reference_logprobs": 1})), first_run["compile_counts"]


def test_sampler_and_trainer_agree_on_old_logprobs(first_run, loop_config):
    rl = [r for r in read_metrics(loop_config.workdir) if r["phase"] == "rl"]
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


def test_second_invocation_resumes_without_warmup(first_run, loop_config):
    config = loop_config.copy_and_resolve_references()
    config.train.total_steps = 3
    config.eval.data = ""
    summary = train(config)
    rows = read_metrics(config.workdir)
    assert [r["phase"] for r in rows].count("sft") == 2, "resume must not redo the warm-up"
    assert [r["step"] for r in rows if r["phase"] == "rl"] == [0, 1, 2]
    assert summary["rl_steps"] == 1
