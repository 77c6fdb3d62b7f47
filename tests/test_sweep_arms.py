"""sweep.arms: named override sets crossed with the grid (configs/sweep_collapse_fixes.py)."""

from __future__ import annotations

import ml_collections
import pytest

from llds_jax.app.sweep import load_config_file, plan
from llds_jax.config import TrainConfigError


def test_collapse_fixes_sweep_validates_every_arm_with_its_own_fields():
    runs = dict(plan(load_config_file("configs/sweep_collapse_fixes.py")))
    assert list(runs) == [f"{arm}+lr=0.0004+seed=1" for arm in
                          ("grpo", "llds", "llds_ma", "tis", "kl_only", "reinforce_pp")]
    tis = runs["tis+lr=0.0004+seed=1"]
    assert "--config.rl.rollout_correction=tis" in tis and "--config.workdir=runs/collapse_fixes/tis+lr=0.0004+seed=1" in tis
    assert "--config.rl.advantage_estimator=reinforce_pp" in runs["reinforce_pp+lr=0.0004+seed=1"]
    assert not any("rollout_correction" in arg for arg in runs["grpo+lr=0.0004+seed=1"])


def test_a_bad_arm_fails_naming_its_run():
    config = load_config_file("configs/sweep_collapse_fixes.py")
    config.sweep.arms = (("typo", (("rl.rollout_correction", "tiss"),)),)
    with pytest.raises(TrainConfigError, match=r"rollout_correction=tiss\+lr=0.0004\+seed=1.*not one of"):
        plan(config)
    config.sweep = ml_collections.ConfigDict(dict(base_config="configs/lab_spiral.py", grid=(("seed", (0,)),),
                                                  workdir_root="runs/x", launch=False, num_devices=0))
    assert [name for name, _ in plan(config)] == ["seed=0"]  # no arms: the grid alone, as before
