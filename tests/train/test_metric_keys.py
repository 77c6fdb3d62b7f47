"""The metrics vocabulary (``llds_jax.diagnostics.keys.TABLE``) against what a real tiny training job logs.

One ``--mode=train`` job on a tiny random model (format warm-up, RL steps with Δ diagnostics,
an entropy term and the monitor on, eval): every key it writes to ``metrics.jsonl`` must be a
table entry of that phase, every table entry must be written, and every per-mini-batch array the
update returns must be either reduced into a logged key or declared update-only.
"""

from __future__ import annotations

import pytest
from train_helpers import tiny_loop_config

from llds_jax.app.run import train
from llds_jax.diagnostics import keys
from llds_jax.train.learner import Learner
from llds_jax.train.metrics import read_metrics

ROW_FIELDS = {"step", "phase", "wall_time"}


@pytest.fixture(scope="module")
def logged(tmp_path_factory, shared_dir):
    """(metrics.jsonl rows, the per-mini-batch array names the update returned) of one tiny job."""
    config = tiny_loop_config(str(tmp_path_factory.mktemp("keys")), str(shared_dir / "assets" / "qwen2_tokenizer"))
    config.train.warmup_sft_steps, config.train.total_steps, config.eval.limit = 1, 1, 1
    config.train.export_hf = False
    assert config.rl.entropy_coef > 0 and config.train.delta_diagnostics and config.monitor.enabled
    update_names = set()
    real_update = Learner.update

    def recording_update(self, *args, **kwargs):
        metrics, extra = real_update(self, *args, **kwargs)
        update_names.update(extra["per_mini_batch"])
        return metrics, extra

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Learner, "update", recording_update)
        train(config)
    return read_metrics(config.workdir), update_names


def test_every_logged_key_is_a_table_entry_of_its_phase(logged):
    rows, _ = logged
    assert {row["phase"] for row in rows} == {"sft", "rl", "eval"}
    unknown = sorted({(row["phase"], key) for row in rows for key in set(row) - ROW_FIELDS
                      if (entry := keys.lookup(key)) is None or row["phase"] not in entry.phases})
    assert not unknown, f"(phase, key) logged but not in keys.TABLE for that phase: {unknown}"


def test_every_table_entry_is_logged(logged):
    rows, _ = logged
    logged_pairs = {(row["phase"], key) for row in rows for key in row}
    orphans = sorted((phase, metric.name) for metric in keys.TABLE for phase in metric.phases
                     if not any(p == phase and metric.matches(k) for p, k in logged_pairs))
    assert not orphans, f"keys.TABLE entries no row of their phase carries: {orphans}"


def test_every_update_array_is_logged_or_declared_update_only(logged):
    _, update_names = logged
    reduced = {metric.from_update or metric.name for metric in keys.UPDATE_METRICS}
    assert not update_names - reduced - keys.UPDATE_ONLY, "per-mini-batch arrays neither logged nor in UPDATE_ONLY"
    assert not (reduced | keys.UPDATE_ONLY) - update_names, "table names arrays the update does not return"


def test_old_names_are_not_current_names():
    current = {metric.name for metric in keys.TABLE}
    assert not (set(keys.RENAMED) | keys.REMOVED) & current
    assert set(keys.RENAMED.values()) <= current
