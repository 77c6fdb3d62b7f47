"""The Gram probe's pieces (lab/gram.py) on hand-built gradients, and first order against an exact step."""

import numpy as np
import pytest

from llds_jax.lab.gram import (
    first_order_delta,
    gram_matrices,
    question_strata,
    sign_agreement,
    stratified_subsets,
    subset_stats,
)

pytestmark = pytest.mark.unit


def test_gram_matrices_per_action_and_total():
    g = np.array([[[1.0, 0.0], [0.0, 1.0]], [[2.0, 0.0], [0.0, -1.0]]])  # 2 responses, 2 actions, P = 2
    per_action, total = gram_matrices(g)
    np.testing.assert_allclose(per_action[0], [[1, 2], [2, 4]])
    np.testing.assert_allclose(per_action[1], [[1, -1], [-1, 1]])
    np.testing.assert_allclose(total, [[2, 1], [1, 5]])  # (1, 1) and (2, -1)


def test_subset_margin_includes_the_diagonal_and_reads_the_grpo_step():
    # one correct response (row 0): m₊₊ = ‖g₊‖² = 1; the wrong ones' inner products with it 0.5 and 2.
    gram = np.array([[1.0, 0.5, 2.0], [0.5, 1.0, 0.0], [2.0, 0.0, 4.0]])
    out = subset_stats(gram, np.array([True, False, False]), np.arange(3))
    assert out["m_pp"] == 1.0 and out["m_pm"] == 1.25 and out["margin"] == 0.25
    assert out["norm_ratio"] == pytest.approx(1.5) and out["cos_pp"] is None
    assert out["cos_pm"] == pytest.approx((0.5 + 1.0) / 2)
    # The sign of the margin is the sign of first order's summed change: GRPO advantages, k = 1 of 3.
    a = np.array([2.0, -1.0, -1.0]) / np.sqrt(2.0)
    assert np.sign((gram @ a)[0]) == -np.sign(out["margin"])
    assert first_order_delta(gram, a) == pytest.approx((gram @ a)[0])


def test_stratified_subsets_have_exactly_k_correct_and_are_distinct():
    rng = np.random.default_rng(0)
    g = rng.standard_normal((16, 1, 5))
    correct = np.arange(16) < 5  # 5 correct of 16: k = 6 impossible
    out = stratified_subsets(gram_matrices(g)[1], correct, rng, max_subsets=50)
    assert set(out) == {1, 2, 4}
    for k, records in out.items():
        assert len(records) == 50 and len({tuple(r["members"]) for r in records}) == 50
        assert all(len(r["members"]) == 8 and sum(correct[r["members"]]) == k for r in records)
    # a small pool runs out before the cap: 1 correct and 8 wrong hold C(8, 7) = 8 subsets with k = 1
    few = stratified_subsets(gram_matrices(g[:9])[1], np.arange(9) < 1, rng, strata=(1,), max_subsets=50)
    assert len(few[1]) == 8


def test_question_strata_tags_questions_and_scores_each_action():
    rng = np.random.default_rng(1)
    g = rng.standard_normal((16, 3, 4))
    out = question_strata(g, (np.arange(16) < 8).astype(float), 7, rng, max_subsets=3)
    record = out[4][0]
    assert record["question"] == 7 and len(record["margin_by_action"]) == 3
    members = np.asarray(record["members"])
    per_action, _ = gram_matrices(g)
    assert record["margin_by_action"][2] == pytest.approx(
        subset_stats(per_action[2], np.arange(16) < 8, members)["margin"])


def test_first_order_predicts_an_exact_small_sgd_step_on_a_softmax_policy():
    """Responses are single tokens of a softmax over 6 logits θ: g_i = e_{y_i} − π, exact Δ log p known."""
    rng = np.random.default_rng(2)
    agree = []
    for _ in range(40):
        theta = rng.standard_normal(6)
        y = rng.integers(0, 6, 8)
        rewards = rng.integers(0, 2, 8).astype(float)
        if np.ptp(rewards) == 0:
            continue
        a = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        pi = np.exp(theta - theta.max()) / np.exp(theta - theta.max()).sum()
        g = (np.eye(6)[y] - pi)[:, None, :]  # [8, 1, 6]
        step = theta + 1e-3 * (a[:, None] * g[:, 0]).sum(axis=0)  # ascend Σ A log p
        logp = lambda t, y=y: t[y] - np.log(np.exp(t).sum())  # noqa: E731
        exact = float((logp(step) - logp(theta))[a > 0].mean())
        agree.append((first_order_delta(gram_matrices(g)[1], a), exact))
    result = sign_agreement(*zip(*agree))
    assert result["groups"] == len(agree) > 20 and result["agreement"] == 1.0 and result["first_order_ok"]
    assert not sign_agreement([1.0, 1.0, -1.0], [1.0, -1.0, 1.0])["first_order_ok"]
    assert sign_agreement([None], [1.0]) == {"groups": 0, "agreement": None, "first_order_ok": False}


@pytest.mark.integration
@pytest.mark.slow  # ≈ 40 s: a tiny random model, two probed groups plus the Gram probe's fresh sample
def test_gram_probe_on_a_tiny_model_matches_the_sgd_probe_and_the_batch_gradient(shared_dir, tmp_path):
    import sys
    from pathlib import Path

    import jax
    import jax.numpy as jnp
    from jax.flatten_util import ravel_pytree

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
    from train_helpers import tiny_loop_config

    from llds_jax.app.run import load_policy_and_retriever
    from llds_jax.data.prompts import load_questions
    from llds_jax.lab.gram import ResponseGrads
    from llds_jax.lab.probe import DEFAULT_PROBE, GroupModel, group_config, probe_checkpoint
    from llds_jax.parallel.mesh import make_mesh
    from llds_jax.train.learner import Learner

    config = group_config(tiny_loop_config(str(tmp_path), str(shared_dir / "assets" / "qwen2_tokenizer")))
    config.rollout.n_samples, config.rollout.max_action_tokens = 4, 8
    config.train.mini_batch_size = config.train.micro_batch_size = config.train.logprob_batch_size = 4
    mesh = make_mesh((1, 1, 1))
    model, tokenizer, retriever = load_policy_and_retriever(config, mesh)
    learner = Learner.create(model, config, mesh)
    saved = jax.tree.map(lambda x: jnp.array(x, copy=True), learner.state)
    records = load_questions(config.data.train)[:2]
    settings = {**DEFAULT_PROBE, "gram": True, "gram_samples": 8, "gram_subsets": 5}
    slots = int(config.rollout.max_turns) + 1
    grads = ResponseGrads(learner.graphdef, 1.0, slots)
    result = probe_checkpoint(learner, saved, tokenizer, retriever, records, config, settings,
                              GroupModel(learner.graphdef, 1.0), response_grads=grads,
                              reward_fn=lambda answers, golden: np.arange(len(answers)) % 2 == 0)
    gram = result["gram"]
    assert gram["validation"]["groups"] == 2 and gram["validation"]["agreement"] >= 0.9, gram["validation"]
    assert gram["validation"]["first_order_ok"]
    assert gram["questions_by_stratum"] == {"4": 2}  # 4 of 8 correct: the whole group, k = 4 only
    assert all(np.isfinite(r["margin"]) and r["norm_ratio"] > 0 for r in gram["strata"]["4"])
    assert all(np.isfinite(g["delta_fresh_adam"]["total"]) for g in result["groups"])
    assert result["lld_share_fresh_adam"] in (0.0, 0.5, 1.0)
    # Σ_i A_i g_i / (action tokens) is minus the SGD probe's loss gradient: the per-response gradients are aligned.
    from llds_jax.rollout.multi_turn import run_rollouts
    from llds_jax.train.batch import TrainBatch

    rollout = run_rollouts(learner.sampler_policy(), tokenizer, [records[0].question], retriever, config.rollout,
                           key=jax.random.key(1), group_ids=[0])
    batch = TrainBatch.from_rollout(rollout, (np.arange(4) % 2 == 0).astype(np.float32), length=learner.seq_len)
    a = np.array([1.0, -1.0, 1.0, -1.0], np.float32)
    per_response = grads(saved.params, batch.input_ids, batch.attention_mask, batch.action_mask, batch.action_index)
    loss_grad = GroupModel(learner.graphdef, 1.0).grad(saved.params, jnp.asarray(batch.input_ids),
                                                       jnp.asarray(batch.attention_mask),
                                                       jnp.asarray(batch.action_mask, jnp.float32), jnp.asarray(a))
    flat = np.asarray(ravel_pytree(loss_grad)[0], np.float64)
    leaves = np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(loss_grad)])
    assert flat.size == per_response.shape[-1] == leaves.size
    mine = -(a[:, None] * per_response.sum(axis=1)).sum(axis=0) / np.asarray(batch.action_mask).sum()
    np.testing.assert_allclose(mine, leaves, rtol=1e-3, atol=1e-6 * np.abs(leaves).max())
