"""Injected NaN gradients: each update is skipped and counted, K in a row stop the run with a checkpoint.

Documented behaviour (issue 9, "Faults"): a non-finite loss or gradient norm makes the update
step keep params and Adam moments unchanged and count the update in ``skipped_updates``; the
loop feeds the per-mini-batch skip flags to ``NonFiniteStreak``, which after K in a row asks
for a stop: the state (the last finite one) is checkpointed and the run exits with the message.
The whole trainer meeting a streak, as a user runs it: ``test_multihost_trainer.py``.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from llds_jax.app.run_control import NonFiniteStreak
from llds_jax.models.testing import tiny_model
from llds_jax.parallel.mesh import make_mesh
from llds_jax.parallel.placement import shard_model
from llds_jax.train.batch import TrainBatch
from llds_jax.train.checkpoint import Checkpointer, abstract_like
from llds_jax.train.learner import Learner
from tests.scale.test_resume_trainer_state import rollout, tiny_config

pytestmark = pytest.mark.integration


def host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


@pytest.mark.slow
def test_nan_gradients_are_skipped_counted_and_a_streak_stops_with_a_checkpoint(tmp_path):
    mesh = make_mesh((1, 1, 1))
    with jax.set_mesh(mesh):
        model = shard_model(tiny_model("qwen2", seed=0), mesh)
    learner = Learner.create(model, tiny_config((1, 1, 1)), mesh)
    streak = NonFiniteStreak(limit=3)

    arrays = rollout(seed=0)
    metrics, extra = learner.update(TrainBatch.from_arrays(arrays, length=learner.seq_len))
    assert metrics["update/skipped"] == 0 and not streak.record(extra["per_mini_batch"]["update/skipped"])
    finite_params, finite_opt = host(learner.state.params), host(learner.state.opt_state)

    # NaN rewards -> NaN advantages -> NaN loss and gradients in every mini-batch of the step.
    poisoned = np.full_like(arrays["rewards"], np.nan)
    for step in (1, 2):
        metrics, extra = learner.update(TrainBatch.from_arrays({**arrays, "rewards": poisoned}, length=learner.seq_len))
        assert metrics["update/skipped"] == metrics["update/mini_batches"] == 2
        stop = streak.record(extra["per_mini_batch"]["update/skipped"])
        assert stop == (step == 2), f"after step {step}: streak {streak.current}"
    assert int(learner.state.skipped_updates) == 4 and int(learner.state.updates) == 2
    for got, want in zip(jax.tree.leaves(host(learner.state.params)), jax.tree.leaves(finite_params)):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(jax.tree.leaves(host(learner.state.opt_state)), jax.tree.leaves(finite_opt)):
        np.testing.assert_array_equal(got, want)
    assert "4 optimizer updates in a row" in streak.message and "last finite state" in streak.message

    # The stop checkpoint restores the last finite weights.
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(2, learner.state, {"stopped": streak.message})
    restored = Checkpointer(tmp_path).restore_latest(abstract_like(learner.state))
    assert restored.extra["stopped"] == streak.message
    for got, want in zip(jax.tree.leaves(host(restored.state.params)), jax.tree.leaves(finite_params)):
        np.testing.assert_array_equal(got, want)
