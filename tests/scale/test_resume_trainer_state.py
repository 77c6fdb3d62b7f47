"""The trainer's real TrainState through the Checkpointer: a (2, 4) checkpoint resumes on (4, 2) and (1, 8).

Acceptance (issue 9): restore a checkpoint saved on a (2, 4) mesh onto a (4, 2) and a (1, 8)
mesh of 8 simulated devices; the next step matches. "The next step" is the trainer's own
update (π_old forward, sequential mini-batch AdamW updates) on the tiny Decoder.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from llds_jax.config import base_config
from llds_jax.models.testing import tiny_model
from llds_jax.parallel.mesh import make_mesh
from llds_jax.parallel.placement import shard_model
from llds_jax.train.batch import TrainBatch
from llds_jax.train.checkpoint import Checkpointer, with_shardings
from llds_jax.train.learner import Learner

pytestmark = pytest.mark.unit

PROMPTS, GROUP, SEQ = 4, 4, 32


def tiny_config(mesh_shape):
    c = base_config()
    c.model.source = "tiny:qwen2"
    c.model.logprob_chunk_size = 16
    c.mesh.shape = mesh_shape
    c.train.update(prompts_per_step=PROMPTS, mini_batch_size=8, micro_batch_size=8, logprob_batch_size=8,
                   total_steps=10)
    c.rollout.update(n_samples=GROUP, max_context=SEQ)
    c.optim.update(lr=1e-3, warmup_ratio=0.0, lr_first_step_zero=False)
    return c


def rollout(seed: int) -> dict[str, np.ndarray]:
    """Rollout-shaped arrays: prompt, two actions around a masked feedback span, an answer span."""
    rng = np.random.default_rng(seed)
    n = PROMPTS * GROUP
    action = np.zeros((n, SEQ), np.float32)
    action[:, 8:14] = action[:, 20:27] = 1
    index = np.full((n, SEQ), -1, np.int32)
    index[:, 8:14], index[:, 20:27] = 0, 1
    answer = np.zeros((n, SEQ), np.float32)
    answer[:, 22:27] = 1
    attention = np.ones((n, SEQ), bool)
    attention[:, 28:] = False
    return dict(input_ids=rng.integers(1, 256, (n, SEQ)).astype(np.int32), attention_mask=attention,
                action_mask=action, action_index=index, answer_mask=answer, num_searches=np.ones(n, np.float32),
                rewards=(rng.random(n) < 0.5).astype(np.float32), group_ids=np.repeat(np.arange(PROMPTS), GROUP))


def learner_on(mesh_shape) -> Learner:
    mesh = make_mesh(mesh_shape)
    with jax.set_mesh(mesh):
        model = shard_model(tiny_model("qwen2", seed=0), mesh)
    return Learner.create(model, tiny_config(mesh_shape), mesh)


def step(learner: Learner, seed: int):
    arrays = rollout(seed)
    metrics, _ = learner.update(TrainBatch.from_arrays(arrays, length=learner.seq_len))
    return metrics, jax.tree.map(np.asarray, jax.device_get(learner.state.params))


@pytest.fixture(scope="module")
def saved_after_one_step(tmp_path_factory):
    """Step 1 checkpointed from (2, 4, 1), and what the uninterrupted run's step 2 produced."""
    workdir = tmp_path_factory.mktemp("trainer_ckpt")
    learner = learner_on((2, 4, 1))
    step(learner, seed=0)
    with Checkpointer(workdir) as ckpt:
        ckpt.save(1, learner.state, {"data": {"cursor": 16}})
    return workdir, step(learner, seed=1)


@pytest.mark.parametrize("mesh_shape", [(4, 2, 1), (1, 8, 1)])
def test_trainer_state_restores_onto_other_mesh_and_next_update_matches(saved_after_one_step, mesh_shape):
    workdir, (want_metrics, want_params) = saved_after_one_step
    learner = learner_on(mesh_shape)
    abstract = with_shardings(jax.eval_shape(lambda: learner.state), learner.state_shardings)
    restored = Checkpointer(workdir).restore_latest(abstract)
    assert restored.step == 1 and restored.extra == {"data": {"cursor": 16}}
    assert int(restored.state.step) == 1 and int(restored.state.updates) == 2
    learner.state = restored.state

    got_metrics, got_params = step(learner, seed=1)
    # Same values on a different device layout: reductions differ in order (fp32 rounding).
    for name in ("loss/total", "grad/norm_preclip_max", "llds/value_last_minibatch"):
        np.testing.assert_allclose(got_metrics[name], want_metrics[name], rtol=2e-5, atol=1e-7, err_msg=name)
    for got, want in zip(jax.tree.leaves(got_params), jax.tree.leaves(want_params)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)
