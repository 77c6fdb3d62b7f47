"""--mode=plan compiles the programs a run with the collapse fixes trains with (the sampler's log-probs
in the batch, π_ref kept for REINFORCE++'s reward KL with rl.kl_coef = 0)."""

from __future__ import annotations

import pytest

from llds_jax.plan.run import make_plan
from tests.scale.test_plan import _tiny_config

pytestmark = pytest.mark.integration


def test_plan_compiles_rollout_correction_and_reinforce_pp():
    config = _tiny_config()
    config.rl.update({"rollout_correction": "tis", "advantage_estimator": "reinforce_pp", "kl_coef": 0.0,
                      "reinforce_pp_kl_coef": 0.001})
    plan = make_plan(config)
    assert plan.resident["reference"] > 0, "REINFORCE++ with β > 0 needs π_ref even with rl.kl_coef = 0"
    assert plan.programs, "no program compiled"
