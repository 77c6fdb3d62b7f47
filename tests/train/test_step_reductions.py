"""The step's diagnostics inputs are reduced on device (``Learner.step_reductions``): the host gets
``[N, A]`` per-action sums and scalars, never an ``[N, T]`` log-prob array, and every ``diag/*``,
``logprob_gap/*`` and ``rollout_corr/*`` value is the one the host-side path computes — with packed rows
too, where the Δ pass computes the responses with a nonzero advantage only (the ones a Δ diagnostic reads)."""

from __future__ import annotations

import types

import jax
import numpy as np
import pinned_update
import pytest
from train_helpers import synthetic_rollout

from llds_jax.diagnostics.from_rollout import response_batch_from_rollout, response_batch_from_sums
from llds_jax.diagnostics.step_metrics import step_diagnostics
from llds_jax.parallel import distributed
from llds_jax.rl.rollout_correction import host_metrics
from llds_jax.train.batch import TrainBatch
from llds_jax.train.learner import logprob_gap

pytestmark = pytest.mark.unit

SLOTS = 2  # synthetic_rollout's two actions (max_turns + 1 of a one-search protocol)


def _rollout_record(arrays):
    """The fields of a ``RolloutBatch`` the diagnostics read, for synthetic_rollout's layout."""
    n, length = arrays["input_ids"].shape
    feedback = np.zeros((n, length), bool)
    feedback[:, 14:20] = True  # between action 0 (8:14) and action 1 (20:27)
    return types.SimpleNamespace(size=n, input_ids=arrays["input_ids"], action_mask=arrays["action_mask"],
                                 action_index=arrays["action_index"], group_ids=arrays["group_ids"],
                                 feedback_mask=feedback, action_feedback=[["search", None]] * n)


@pytest.fixture(scope="module", params=[False, True], ids=["padded", "packed"])
def step(request):
    learner = pinned_update.learner((1, 2, 1), packing=request.param)
    arrays = synthetic_rollout(seed=7)
    arrays["rewards"][:4] = 1.0  # group 0 all correct: A = 0 for its 4 responses (packed: no Δ computed)
    arrays["rewards"][4:8] = [1.0, 0.0, 0.0, 1.0]  # group 1 mixed
    rng = np.random.default_rng(7)
    mask = arrays["action_mask"] > 0
    _, extra = learner.update(TrainBatch.from_arrays(arrays, length=learner.seq_len))
    # A sampler that disagrees a little with the trainer: π_old plus noise on action tokens.
    old = np.asarray(extra["batch"].old_logp)[:, :mask.shape[1]]
    sampler = np.where(mask, old + rng.normal(0.0, 0.05, mask.shape), 0.0).astype(np.float32)
    return learner, arrays, sampler, extra


def test_no_token_array_reaches_the_host(step, monkeypatch):
    learner, arrays, sampler, _ = step
    fetched = []

    def recording(fetch):
        def wrapped(tree, *args):
            out = fetch(tree, *args)
            fetched.extend(np.shape(x) for x in jax.tree.leaves(out))
            return out
        return wrapped

    monkeypatch.setattr(distributed, "local_rows", recording(distributed.local_rows))
    monkeypatch.setattr(distributed, "fetch_to_host", recording(distributed.fetch_to_host))
    _, extra = learner.update(TrainBatch.from_arrays(arrays, length=learner.seq_len))
    sums, metrics = learner.step_reductions(extra["batch"], sampler, SLOTS, with_delta=True,
                                            advantages=extra["advantages"])
    assert fetched, "the learner downloads through distributed.local_rows / fetch_to_host"
    wide = [shape for shape in fetched if len(shape) >= 2 and shape[-1] >= arrays["input_ids"].shape[1]]
    assert not wide, f"[N, T] arrays came to the host during the step: {wide}"
    assert {k: v.shape for k, v in sums.items()} == {k: (16, SLOTS) for k in ("old_logp", "tokens", "logodds",
                                                                              "delta_logp")}
    assert all(np.ndim(v) == 0 for v in metrics.values())


def test_every_diag_value_equals_the_host_path(step):
    """The host path (``response_batch_from_rollout`` over downloaded [N, T] arrays, float64) vs the sums
    reduced on device in fp32: every ``diag/*`` value within 1e-6 of the quantity's magnitude (≥ 1)."""
    learner, arrays, sampler, extra = step
    record = _rollout_record(arrays)
    advantages, rewards = extra["advantages"], arrays["rewards"]
    assert (advantages[:4] == 0).all() and (advantages[4:8] != 0).all()
    for with_delta in (True, False):
        sums, metrics = learner.step_reductions(extra["batch"], sampler, SLOTS, with_delta=with_delta,
                                                advantages=advantages)
        new = learner.logprobs_now(extra["batch"]) if with_delta else None  # every response's
        want = step_diagnostics(response_batch_from_rollout(
            record, advantage=advantages, reward=rewards, old_logprobs=extra["old_logp"], new_logprobs=new,
            num_action_slots=SLOTS))
        got = step_diagnostics(response_batch_from_sums(record, advantage=advantages, reward=rewards, sums=sums))
        assert sorted(got) == sorted(want)
        for key, value in want.items():
            if np.isnan(value):
                assert np.isnan(got[key]), key
            else:
                assert abs(got[key] - value) <= 1e-6 * max(1.0, abs(value)), (key, got[key], value)
        mask = arrays["action_mask"]
        host = {**logprob_gap(sampler, extra["old_logp"], mask),
                **host_metrics(sampler, extra["old_logp"], mask, learner.config.rl)}
        if with_delta:  # packed: the Δ pass skipped group 0 (A = 0) and reported its Δ as 0
            computed = np.asarray(advantages) != 0 if learner.packing is not None else np.ones(len(advantages), bool)
            assert metrics.pop("throughput/delta_responses_frac") == computed.mean()
            assert (sums["delta_logp"][~computed] == 0).all() and (sums["delta_logp"][computed] != 0).any()
        assert sorted(k for k in metrics if k != "time/delta_logprobs_s") == sorted(host)
        for key, value in host.items():  # fp32 on device vs float64 on the host: the correlation to 1e-5
            assert abs(metrics[key] - value) <= 1e-5 * max(1.0, abs(value)), (key, metrics[key], value)
    assert learner.compile_counts()["step_reductions_delta"] == 1
    assert learner.compile_counts()["step_reductions"] == 1
    assert learner.compile_counts()["policy_logprobs"] == 1  # the Δ pass's rows in the passes' shapes
    for name in ("delta_row_counts", "pack_delta_rows"):
        assert learner.compile_counts().get(name, 0) == (learner.packing is not None), name
