"""Injected NaN gradients: each update is skipped and counted, K in a row stop the run with a checkpoint.

Documented behaviour (issue 9, "Faults"): a non-finite loss or gradient norm makes the update
step keep params and Adam moments unchanged and count the update in ``skipped_updates``; the
loop feeds the per-mini-batch skip flags to ``NonFiniteStreak``, which after K in a row asks
for a stop: the state (the last finite one) is checkpointed and the run exits with the message.
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


@pytest.mark.slow
def test_trainer_stops_after_k_nonfinite_updates_with_a_checkpoint_of_the_last_finite_state(
        tmp_path, shared_dir, monkeypatch):
    """``train()`` end to end: step 0 is finite, then every reward is NaN (so every loss is NaN).

    With 2 mini-batches per step and ``max_nonfinite_updates=4``, steps 1 and 2 skip 4 updates
    in a row: the run checkpoints step 2, says why in the checkpoint, summary.json and the
    exception, and the step-2 checkpoint holds exactly the params and Adam moments of step 0.
    """
    import json

    from llds_jax.app.run import train
    from llds_jax.app.run_control import NonFiniteStop
    from llds_jax.models.loading import load_model_and_tokenizer
    from llds_jax.train import loop
    from llds_jax.train.metrics import read_metrics

    c = tiny_config((1, 1, 1))
    c.workdir = str(tmp_path / "run")
    c.model.tokenizer = str(shared_dir / "assets" / "qwen2_tokenizer")
    c.rollout.update(dict(n_samples=2, max_turns=1, max_action_tokens=8, max_obs_tokens=32, max_prompt_tokens=224,
                          max_context=256, pad_to_multiple=128))
    t = c.train
    t.prompts_per_step, t.mini_batch_size, t.micro_batch_size, t.logprob_batch_size = 4, 4, 4, 8
    t.total_steps, t.warmup_sft_steps, t.save_every, t.max_nonfinite_updates = 6, 0, 1, 4
    t.export_hf, t.tensorboard, c.retrieval.max_doc_tokens = False, False, 16
    c.eval.data = ""

    finite_em = loop.em_rewards
    calls = []

    def em_then_nan(answers, golden):
        calls.append(1)
        rewards = finite_em(answers, golden)
        return rewards if len(calls) == 1 else np.full_like(rewards, np.nan)

    monkeypatch.setattr(loop, "em_rewards", em_then_nan)
    with pytest.raises(NonFiniteStop) as stop:
        train(c)
    message = str(stop.value)
    assert "4 optimizer updates in a row" in message and "(limit 4;" in message, message
    assert len(calls) == 3, f"the run must stop after step 2, it scored {len(calls)} steps"

    workdir = tmp_path / "run"
    rl = [r for r in read_metrics(workdir) if r["phase"] == "rl"]
    assert [(r["step"], r["update/skipped"]) for r in rl] == [(0, 0.0), (1, 2.0), (2, 2.0)]
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["stopped"] == message and summary["skipped_updates"] == 4 and summary["rl_steps"] == 3

    mesh = make_mesh((1, 1, 1))
    model, _ = load_model_and_tokenizer(c.model, mesh)
    abstract = abstract_like(Learner.create(model, c, mesh).state)
    ckpt = Checkpointer(workdir.resolve())
    assert ckpt.all_steps() == [0, 1, 2]
    last, finite = ckpt.restore(2, abstract), ckpt.restore(0, abstract)
    assert last.extra["stopped"] == message
    assert int(last.state.skipped_updates) == 4 and int(last.state.updates) == 2
    for name in ("params", "opt_state"):
        for got, want in zip(jax.tree.leaves(host(getattr(last.state, name))),
                             jax.tree.leaves(host(getattr(finite.state, name)))):
            np.testing.assert_array_equal(got, want, err_msg=f"{name} changed by a skipped update")
