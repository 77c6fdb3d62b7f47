"""sweep.arms: named override sets crossed with the grid (configs/sweep_collapse_fixes.py)."""

from __future__ import annotations

import ml_collections
import pytest

from llds_jax.app.sweep import load_config_file, plan
from llds_jax.config import TrainConfigError

pytestmark = pytest.mark.unit


def test_collapse_fixes_sweep_validates_every_arm_with_its_own_fields():
    runs = dict(plan(load_config_file("configs/sweep_collapse_fixes.py")))
    assert list(runs) == ["grpo_s0", "llds_s0", "kl02_s0", "tis_s0", "rpp_s0", "dyn_s0", "llds_ma_s0"]
    tis = runs["tis_s0"]
    assert "--config.rl.rollout_correction=tis" in tis and "--config.workdir=/work/lab_runs/ff/tis_s0" in tis
    assert "--config.rl.advantage_estimator=reinforce_pp" in runs["rpp_s0"]
    assert "--config.rl.kl_coef=0.02" in runs["kl02_s0"] and "--config.train.dynamic_sampling=True" in runs["dyn_s0"]
    assert not any("rollout_correction" in arg for arg in runs["grpo_s0"])
    assert all("--config.seed=0" in args for args in runs.values())


def test_a_bad_arm_fails_naming_its_run():
    config = load_config_file("configs/sweep_collapse_fixes.py")
    config.sweep.arms = (("typo", (("rl.rollout_correction", "tiss"),)),)
    with pytest.raises(TrainConfigError, match=r"'rollout_correction=tiss'.*not one of"):
        plan(config)
    config.sweep.grid = (("seed", (1,)),)  # arms crossed with a grid: <arm>+<grid point>
    config.sweep.arms = (("grpo", (("rl.llds_coef", 0.0),)),)
    assert [name for name, _ in plan(config)] == ["grpo+seed=1"]
    config.sweep = ml_collections.ConfigDict(dict(base_config="configs/lab_spiral.py", grid=(("seed", (0,)),),
                                                  workdir_root="runs/x", launch=False, num_devices=0))
    assert [name for name, _ in plan(config)] == ["seed=0"]  # no arms: the grid alone, as before
