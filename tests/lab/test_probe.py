"""The per-sample LLD probe (``--mode=probe``): hand-computed pieces, then one checkpoint of a tiny model,
probed once with the Gram probe on (``lab/gram.py``): the SGD probe's groups and the Gram probe's statistics
are read from the same run, so the model, learner and probe programs are built once for both tests."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llds_jax.lab.probe import ches, eq3_delta, mean_action_hidden, per_action_delta, summarise

pytestmark = pytest.mark.unit

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))


def test_per_action_delta_sums_new_minus_old_over_each_actions_tokens():
    # Row 0: action 0 on tokens 1-2 (+0.1, -0.3), action 1 on token 4 (+0.5); token 3 is feedback.
    old = np.zeros((2, 5))
    new = np.array([[9.0, 0.1, -0.3, 7.0, 0.5], [0.0, -1.0, 0.0, 0.0, 0.0]])
    mask = np.array([[0, 1, 1, 0, 1], [0, 1, 0, 0, 0]], np.float32)
    index = np.array([[-1, 0, 0, -1, 1], [-1, 0, -1, -1, -1]])
    np.testing.assert_allclose(per_action_delta(new, old, mask, index, 2), [[-0.2, 0.5], [-1.0, 0.0]])


def test_eq3_delta_is_the_mean_over_correct_responses_only():
    delta = np.array([[-0.2, 0.5], [-1.0, 0.0], [0.4, -0.1]])
    tokens = np.array([[2, 1], [1, 0], [3, 2]])
    advantages = np.array([1.0, 1.0, -2.0])
    # correct: rows 0, 1 -> totals 0.3, -1.0 -> -0.35; action 0: (-0.2 - 1.0) / 2; action 1: row 0 only.
    out = eq3_delta(delta, tokens, advantages)
    assert out["total"] == pytest.approx(-0.35)
    assert out["by_action"] == pytest.approx([-0.6, 0.5])
    out = eq3_delta(delta, np.array([[2, 0], [1, 0], [3, 2]]), advantages)
    assert out["by_action"][1] is None


def test_ches_is_cross_similarity_minus_positive_norm():
    h = np.array([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    advantages = np.array([1.0, -1.0, -1.0])
    # <h0, h1> = 0, <h0, h2> = 1 -> mean 0.5; ||h0||^2 = 1 -> -0.5.
    assert ches(h, advantages) == pytest.approx(-0.5)
    # Identical positive and negative: CHES = 0 (the largest a pair of equal-norm responses gets).
    assert ches(np.array([[1.0, 2.0], [1.0, 2.0]]), np.array([1.0, -1.0])) == pytest.approx(0.0)


def test_mean_action_hidden_reads_the_positions_that_predict_action_tokens():
    hidden = np.arange(8, dtype=float).reshape(1, 4, 2)  # positions 0..3: [0,1],[2,3],[4,5],[6,7]
    mask = np.array([[0, 0, 1, 1]])  # tokens 2, 3 are predicted by positions 1, 2
    np.testing.assert_allclose(mean_action_hidden(hidden, mask), [[3.0, 4.0]])


def test_summary_shares():
    groups = [{"delta": {"total": -0.1, "by_action": [-0.1, None]}, "delta_sgd": {"total": 0.2, "by_action": [0.2, None]},
               "ches": 1.0, "incorrect_logp": -0.5},
              {"delta": {"total": 0.3, "by_action": [0.1, 0.2]}, "delta_sgd": {"total": -0.2, "by_action": [-0.1, -0.1]},
               "ches": 3.0, "incorrect_logp": -1.5}]
    out = summarise(groups, 2)
    assert (out["lld_share"], out["lld_share_sgd"], out["mixed_groups"]) == (0.5, 0.5, 2)
    assert out["lld_share_by_action"] == [0.5, 0.0] and out["ches_mean"] == 2.0
    assert out["delta_by_action"] == pytest.approx([0.0, 0.2])
    assert summarise([], 2)["lld_share"] is None


@pytest.fixture(scope="module")
def probed(shared_dir, tmp_path_factory):
    """One checkpoint of a tiny random model probed with the Gram probe on (which adds to the SGD probe's
    groups, never changes them), shared by the two tests below: the model, the learner, the retriever and
    the probe's programs are built once. Also one fresh rollout of the first question (key 1) as a batch."""
    from train_helpers import tiny_loop_config

    from llds_jax.app.run import load_policy_and_retriever
    from llds_jax.data.prompts import load_questions
    from llds_jax.lab.gram import ResponseGrads
    from llds_jax.lab.probe import DEFAULT_PROBE, GroupModel, group_config, probe_checkpoint
    from llds_jax.parallel.mesh import make_mesh
    from llds_jax.rollout.multi_turn import run_rollouts
    from llds_jax.train.batch import TrainBatch
    from llds_jax.train.learner import Learner

    tokenizer_dir = str(shared_dir / "assets" / "qwen2_tokenizer")
    config = group_config(tiny_loop_config(str(tmp_path_factory.mktemp("probe")), tokenizer_dir))
    config.rollout.n_samples, config.rollout.max_action_tokens = 4, 8
    # Rows of 64, not the tiny job's 256: the prompt's last 16 tokens and 8 + 32 + 8 response tokens fit. The
    # cost is the ~152k-word LM head at every position (the per-response gradients, the SGD probe's passes,
    # the updates), so it shrinks with the rows; no check reads the length (a random model reads no question).
    config.rollout.max_prompt_tokens, config.rollout.max_context, config.rollout.pad_to_multiple = 16, 64, 64
    config.train.mini_batch_size = config.train.micro_batch_size = config.train.logprob_batch_size = 4
    mesh = make_mesh((1, 1, 1))
    model, tokenizer, retriever = load_policy_and_retriever(config, mesh)
    learner = Learner.create(model, config, mesh)
    saved = jax.tree.map(lambda x: jnp.array(x, copy=True), learner.state)
    records = load_questions(config.data.train)[:2]
    settings = {**DEFAULT_PROBE, "seed": 0, "sgd_mean_abs_dlogp": 0.02, "gram": True, "gram_samples": 8,
                "gram_subsets": 5}
    group_model = GroupModel(learner.graphdef, 1.0)
    grads = ResponseGrads(learner.graphdef, 1.0, int(config.rollout.max_turns) + 1)
    # A random model never answers right: alternate rewards so every group is mixed.
    result = probe_checkpoint(learner, saved, tokenizer, retriever, records, config, settings, group_model,
                              response_grads=grads, reward_fn=lambda answers, golden: np.arange(len(answers)) % 2 == 0)
    rollout = run_rollouts(learner.sampler_policy(), tokenizer, [records[0].question], retriever, config.rollout,
                           key=jax.random.key(1), group_ids=[0])
    batch = TrainBatch.from_rollout(rollout, (np.arange(4) % 2 == 0).astype(np.float32), length=learner.seq_len)
    return dict(result=result, saved=saved, group_model=group_model, grads=grads, batch=batch)


@pytest.mark.integration
@pytest.mark.slow  # the shared fixture: a tiny random model, two probed groups plus the Gram probe's fresh sample
def test_probe_checkpoint_isolates_each_group_and_sizes_the_sgd_step(probed):
    from llds_jax.lab.probe import sgd_probe

    result = probed["result"]
    assert result["mixed_groups"] == 2 and len(result["groups"]) == 2
    for group in result["groups"]:
        assert group["sgd_mean_abs_dlogp"] == pytest.approx(0.02, rel=0.1)
        assert math.isfinite(group["delta"]["total"]) and group["delta"]["total"] != 0.0
        assert math.isfinite(group["ches"]) and group["incorrect_logp"] < 0
    # First order, the SGD step raises Σ A·log p (it descends −Σ A·log p): a sign error fails here.
    batch = probed["batch"]
    advantages = jnp.asarray([1.0, -1.0, 1.0, -1.0])
    delta, eta, achieved = sgd_probe(probed["group_model"], probed["saved"].params, jnp.asarray(batch.input_ids),
                                     jnp.asarray(batch.attention_mask), jnp.asarray(batch.action_mask), advantages, 0.01)
    assert eta > 0 and achieved == pytest.approx(0.01, rel=0.1)
    assert float((np.asarray(advantages)[:, None] * delta).sum()) > 0


@pytest.mark.integration
@pytest.mark.slow  # the shared fixture above
def test_gram_probe_on_a_tiny_model_matches_the_sgd_probe_and_the_batch_gradient(probed):
    """The Gram probe (``lab/gram.py``, its pieces on hand-built gradients in ``test_gram.py``) on the same
    checkpoint: first order agrees with the exact SGD step on both groups, and the per-response gradients
    are aligned with the loss gradient of the batch."""
    from jax.flatten_util import ravel_pytree

    result, batch, saved = probed["result"], probed["batch"], probed["saved"]
    gram = result["gram"]
    assert gram["validation"]["groups"] == 2 and gram["validation"]["agreement"] >= 0.9, gram["validation"]
    assert gram["validation"]["first_order_ok"]
    assert gram["questions_by_stratum"] == {"4": 2}  # 4 of 8 correct: the whole group, k = 4 only
    assert all(np.isfinite(r["margin"]) and r["norm_ratio"] > 0 for r in gram["strata"]["4"])
    assert all(np.isfinite(g["delta_fresh_adam"]["total"]) for g in result["groups"])
    assert result["lld_share_fresh_adam"] in (0.0, 0.5, 1.0)
    # Σ_i A_i g_i / (action tokens) is minus the SGD probe's loss gradient: the per-response gradients are aligned.
    a = np.array([1.0, -1.0, 1.0, -1.0], np.float32)
    per_response = probed["grads"](saved.params, batch.input_ids, batch.attention_mask, batch.action_mask,
                                   batch.action_index)
    loss_grad = probed["group_model"].grad(saved.params, jnp.asarray(batch.input_ids),
                                           jnp.asarray(batch.attention_mask),
                                           jnp.asarray(batch.action_mask, jnp.float32), jnp.asarray(a))
    flat = np.asarray(ravel_pytree(loss_grad)[0], np.float64)
    leaves = np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(loss_grad)])
    assert flat.size == per_response.shape[-1] == leaves.size
    mine = -(a[:, None] * per_response.sum(axis=1)).sum(axis=0) / np.asarray(batch.action_mask).sum()
    np.testing.assert_allclose(mine, leaves, rtol=1e-3, atol=1e-6 * np.abs(leaves).max())
