"""The Gram probe's pieces (lab/gram.py) on hand-built gradients, and first order against an exact step.
The probe on a tiny model shares the SGD probe's checkpoint run in ``test_probe.py``."""

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
