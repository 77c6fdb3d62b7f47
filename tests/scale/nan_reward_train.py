"""``python -m tests.scale.nan_reward_train <llds_jax.main flags>``: the real trainer with a fault injected.

The first step's rewards are the real EM; from the second step on every reward is NaN, so every
loss and gradient is NaN and every update is skipped — the fastest honest way to make the
non-finite streak trip in a subprocess (the config has no fault-injection knob on purpose).
"""

from __future__ import annotations

import numpy as np
from absl import app

from llds_jax import main as trainer_main
from llds_jax.train import loop

_finite_em = loop.em_rewards
_calls = []


def em_then_nan(answers, golden) -> np.ndarray:
    _calls.append(1)
    rewards = _finite_em(answers, golden)
    return rewards if len(_calls) == 1 else np.full_like(rewards, np.nan)


if __name__ == "__main__":
    loop.em_rewards = em_then_nan
    app.run(trainer_main.main)
