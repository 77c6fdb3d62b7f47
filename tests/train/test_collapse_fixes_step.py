"""Collapse fixes through the real update step (tiny Decoder, compacted scored positions): rl.rollout_correction, REINFORCE++.

The vector-level formulas are pinned in tests/rl/test_rollout_correction.py; here: the sampler's
log-probs reach the loss, weights of exactly 1 change nothing, a cap changes the loss without a
recompile, and masked IS that rejects every token leaves nothing in the policy term.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_update_step import _assert_close, tiny_learner
from train_helpers import synthetic_rollout, tiny_train_config

from llds_jax.train.batch import TrainBatch

pytestmark = pytest.mark.unit


def _learner(mode: str):
    config = tiny_train_config(max_action_tokens_per_row=16)  # 13 action tokens a row: the compacted view
    config.rl.rollout_correction = mode
    config.rl.kl_coef = config.rl.entropy_coef = 0.0  # mini-batch 1's gradient is the policy term's alone
    return tiny_learner(config)


@pytest.fixture(scope="module")
def pi_old():
    """Token-aligned π_old of the synthetic batch under the untrained tiny model (what a faithful sampler reports)."""
    learner = _learner("none")
    arrays = synthetic_rollout(seed=0)
    logp = learner.logprobs_now(learner.upload(TrainBatch.from_arrays(arrays, length=learner.seq_len)))
    _, extra = learner.update(TrainBatch.from_arrays(arrays, length=learner.seq_len))
    return arrays, np.asarray(logp)[:, : arrays["input_ids"].shape[1]], extra["per_mini_batch"]


def _step(learner, arrays, sampler_logp):
    batch = TrainBatch.from_arrays({**arrays, "sampler_logp": sampler_logp}, length=learner.seq_len)
    return learner.update(batch)[1]["per_mini_batch"]  # per mini-batch: [0] runs at θ = θ_old


def test_weights_of_one_leave_the_update_unchanged(pi_old):
    arrays, logp, plain = pi_old
    metrics = _step(_learner("tis"), arrays, logp)
    for key in ("loss/pg", "loss/total"):  # ≈ 0 by cancellation of O(1) per-token terms (|A| ~ 1): scale 1
        _assert_close(key, metrics[key], plain[key], floor=1.0)
    _assert_close("grad/norm_preclip", metrics["grad/norm_preclip"], plain["grad/norm_preclip"])
    assert plain["grad/norm_preclip"][0] > 1e-6


def test_a_sampler_gap_above_the_cap_scales_the_policy_term_without_recompiling(pi_old):
    arrays, logp, plain = pi_old
    learner = _learner("tis")
    # log π_old − log π_sampler = 1 on every action token: ρ = e > C = 2, so every weight is 2.
    first = _step(learner, arrays, logp - arrays["action_mask"])
    np.testing.assert_allclose(first["grad/norm_preclip"][0], 2 * plain["grad/norm_preclip"][0], rtol=1e-4)
    np.testing.assert_allclose(first["loss/pg"][0], 2 * plain["loss/pg"][0], rtol=1e-3, atol=1e-9)
    _step(learner, synthetic_rollout(seed=1), logp)
    assert learner.compile_counts()["update"] == 1


def test_masked_is_rejecting_every_token_leaves_no_policy_term(pi_old):
    arrays, logp, _ = pi_old
    metrics = _step(_learner("mis"), arrays, logp - arrays["action_mask"])
    assert np.all(metrics["loss/pg"] == 0.0) and np.all(metrics["grad/norm_preclip"] == 0.0)


def test_the_entropy_is_measured_at_coefficient_zero_and_adds_no_gradient(pi_old):
    """entropy_coef = 0 (the lab's A1 ablation): the monitor still reads the entropy; the gradient is
    the policy term's alone (the masked-IS case above: no policy term, a gradient of exactly 0)."""
    _, _, plain = pi_old
    assert np.all(plain["policy/entropy"] > 0.1)  # the untrained tiny model is near uniform over its vocabulary


def test_a_batch_without_sampler_logprobs_is_refused_by_name(pi_old):
    arrays, _, _ = pi_old
    learner = _learner("tis")
    with pytest.raises(ValueError, match="rollout_correction"):
        learner.update(TrainBatch.from_arrays(arrays, length=learner.seq_len))


def test_reinforce_pp_runs_token_advantages_through_the_update():
    """REINFORCE++ in the real step: per-row outputs are the row means of eqs. 8-10's token advantages.

    Step 0 reads π_ref = π_old (the reference is the policy), so the KL-to-go is 0 and every action
    token of a row carries (r − mean) / std over the batch's action tokens.
    """
    config = tiny_train_config(max_action_tokens_per_row=16)
    config.rl.update({"advantage_estimator": "reinforce_pp", "kl_coef": 0.0, "reinforce_pp_kl_coef": 0.1})
    learner = tiny_learner(config)
    arrays = synthetic_rollout(seed=3)
    metrics, extra = learner.update(TrainBatch.from_arrays(arrays, length=learner.seq_len))
    mask = arrays["action_mask"][:, 1:]
    tokens = np.repeat(arrays["rewards"], mask.sum(axis=1).astype(int))
    want = (arrays["rewards"] - tokens.mean()) / tokens.std()
    np.testing.assert_allclose(extra["advantages"], want, rtol=1e-5)
    assert np.isfinite(metrics["loss/total"]) and metrics["grad/norm_preclip"] > 0
    assert learner.compile_counts()["reference_logprobs"] <= 1
