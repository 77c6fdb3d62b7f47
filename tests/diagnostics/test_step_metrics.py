"""Per-step diagnostics on hand-built batches whose answers are worked out in the comments."""

from __future__ import annotations

import math

import numpy as np
import pytest

from llds_jax.diagnostics.step_metrics import ResponseBatch, first_action_correctness, step_diagnostics

pytestmark = pytest.mark.unit

# Two GRPO groups of three; A = 2 action slots. Rows: r0..r5.
ADVANTAGE = [1.15, -0.58, -0.58, 0.58, 0.58, -1.15]  # correct: r0, r3, r4
TOKENS = [[4, 2], [5, 0], [2, 2], [2, 4], [10, 0], [1, 1]]
OLD_LOGP = [[-2.0, -1.0], [-5.0, 0.0], [-1.0, -3.0], [-0.2, -1.0], [-3.0, 0.0], [-2.0, -2.0]]
DELTA = [[0.3, -0.5], [0.1, 0.0], [-1.0, -1.0], [0.0, 0.1], [-0.4, 0.0], [0.2, 0.2]]
GROUP = [0, 0, 0, 1, 1, 1]
FIRST_DOCS = [("d1", "d2", "d3"), ("d3", "d2", "d1"), ("d4", "d5", "d6"), ("e1",), ("e2",), None]


def hand_batch(**overrides) -> ResponseBatch:
    fields = dict(
        advantage=np.array(ADVANTAGE), reward=np.array([1, 0, 0, 1, 1, 0]),
        old_logp_per_action=np.array(OLD_LOGP), tokens_per_action=np.array(TOKENS),
        delta_logp_per_action=np.array(DELTA), group_id=np.array(GROUP), first_search_docs=FIRST_DOCS,
    )
    fields.update(overrides)
    return ResponseBatch(**fields)


def assert_metrics(actual: dict, expected: dict):
    wrong = {k: (actual.get(k), v) for k, v in expected.items() if not math.isclose(actual.get(k, math.nan), v, abs_tol=1e-9)}
    assert not wrong, f"metric: (got, expected) {wrong}"


def test_likelihood_of_correct_and_incorrect_per_action_index():
    # correct action0: r0 -2/4, r3 -0.2/2, r4 -3/10 -> mean(-0.5, -0.1, -0.3) = -0.3
    # correct action1: r0 -1/2, r3 -1/4 -> -0.375 ; all: r0 -3/6, r3 -1.2/6, r4 -3/10 -> -1/3
    # incorrect action0: r1 -1, r2 -0.5, r5 -2 -> -7/6 ; action1: r2 -1.5, r5 -2 (r1 took none) -> -1.75
    assert_metrics(step_diagnostics(hand_batch()), {
        "diag/ll_correct/action0": -0.3, "diag/ll_correct/action1": -0.375, "diag/ll_correct/later": -0.375,
        "diag/ll_correct/all": -1 / 3, "diag/num_correct": 3,
        "diag/ll_incorrect/action0": -7 / 6, "diag/ll_incorrect/action1": -1.75, "diag/ll_incorrect/all": -4 / 3,
    })


def test_lld_rate_counts_correct_responses_whose_likelihood_did_not_rise():
    # Δ sums of correct responses: r0 -0.2 (LLD), r3 +0.1, r4 -0.4 (LLD) -> 2/3.
    # Per action: action0 Δ = 0.3, 0.0 (≤ 0 counts), -0.4 -> 2/3; action1 Δ = -0.5, 0.1 -> 1/2.
    assert_metrics(step_diagnostics(hand_batch()), {
        "diag/lld_rate": 2 / 3, "diag/lld_rate/action0": 2 / 3, "diag/lld_rate/action1": 0.5,
        "diag/delta_correct/action0": -0.1 / 3, "diag/delta_correct/all": -0.5 / 3,
        "diag/delta_incorrect/all": (0.1 - 2.0 + 0.4) / 3,
    })


def test_delta_metrics_are_absent_when_the_extra_forward_pass_is_switched_off():
    metrics = step_diagnostics(hand_batch(delta_logp_per_action=None))
    assert not [k for k in metrics if "lld_rate" in k or "delta" in k]


def test_shares_of_correct_and_incorrect_responses():
    assert_metrics(step_diagnostics(hand_batch()), {
        "diag/frac_correct": 0.5, "diag/frac_incorrect": 0.5, "diag/num_correct": 3, "diag/num_incorrect": 3,
    })


def test_first_action_correct_when_an_incorrect_response_retrieved_a_correct_ones_documents():
    # Eligible incorrect: r1 (same docs as r0, other order -> match), r2 (different), r5 (no search).
    assert first_action_correctness(FIRST_DOCS, GROUP, ADVANTAGE) == (pytest.approx(1 / 3), 3)
    # The same documents in another group do not count.
    assert first_action_correctness([("x",), ("y",), ("y",), ("x",)], [0, 0, 1, 1], [1, -1, 1, -1]) == (0.0, 2)


def test_uniform_groups_are_neither_correct_nor_incorrect():
    batch = hand_batch(advantage=np.zeros(6))
    metrics = step_diagnostics(batch)
    assert metrics["diag/num_correct"] == 0 and math.isnan(metrics["diag/ll_correct/all"])
    assert math.isnan(metrics["diag/lld_rate"]) and math.isnan(metrics["diag/first_action_correct_rate"])


def test_every_step_reports_the_same_keys_whatever_the_batch():
    all_incorrect = hand_batch(advantage=-np.ones(6))
    assert set(step_diagnostics(all_incorrect)) == set(step_diagnostics(hand_batch()))


def test_mismatched_shapes_fail_loudly():
    with pytest.raises(ValueError, match="per-action arrays"):
        hand_batch(old_logp_per_action=np.zeros((6, 3)))
    with pytest.raises(ValueError, match="group_id has 5 rows"):
        hand_batch(group_id=np.zeros(5))


# -- issue 43: saturation-proof and dilution-proof quantities --------------------------------

def test_token_logodds_is_log_p_over_one_minus_p_and_clipped():
    from llds_jax.diagnostics.step_metrics import LOGODDS_CLIP, token_logodds

    # p = 0.5 -> 0; p = 0.98 -> log(49) = 3.8918; p = 0.2 -> log(0.25) = -1.3863; p = 1 -> +clip.
    logp = np.log([0.5, 0.98, 0.2]).tolist() + [0.0, -200.0]
    np.testing.assert_allclose(token_logodds(logp), [0.0, math.log(49.0), math.log(0.25), LOGODDS_CLIP, -LOGODDS_CLIP],
                               atol=1e-9)


def test_logodds_by_action_averages_token_means_over_responses():
    # Σ log-odds per action: r0 action0 over 4 tokens = 8 -> 2.0; r3 = 1/2 -> 0.5; r4 = 30/10 -> 3.0.
    # correct action0: mean(2, 0.5, 3) = 11/6; action1: r0 4/2 = 2, r3 -4/4 = -1 -> 0.5.
    # incorrect action0: r1 -5/5 = -1, r2 2/2 = 1, r5 -3/1 = -3 -> -1; action1: r2 6/2 = 3, r5 0 -> 1.5.
    odds = np.array([[8.0, 4.0], [-5.0, 0.0], [2.0, 6.0], [1.0, -4.0], [30.0, 0.0], [-3.0, 0.0]])
    assert_metrics(step_diagnostics(hand_batch(logodds_per_action=odds)), {
        "diag/logodds_correct/action0": 11 / 6, "diag/logodds_correct/action1": 0.5,
        "diag/logodds_incorrect/action0": -1.0, "diag/logodds_incorrect/action1": 1.5,
    })


def test_official_likelihood_divides_the_non_negative_responses_sum_by_all_tokens():
    # A ≥ 0: r0 (-3), r3 (-1.2), r4 (-3) -> -7.2; all action tokens: 6+5+4+6+10+2 = 33.
    assert_metrics(step_diagnostics(hand_batch()), {"diag/ll_official_pos": -7.2 / 33})
    # Zero-advantage responses count on the positive side (A ≥ 0), as in dp_actor.py.
    zero = hand_batch(advantage=np.array([0.0, -0.58, -0.58, 0.58, 0.58, -1.15]))
    assert_metrics(step_diagnostics(zero), {"diag/ll_official_pos": -7.2 / 33})
    assert_metrics(step_diagnostics(hand_batch(advantage=np.zeros(6))), {"diag/ll_official_pos": -20.2 / 33})


def test_identical_first_action_share_counts_mixed_groups_only():
    from llds_jax.diagnostics.step_metrics import identical_first_action_frac

    # Group 0 mixed, all first actions identical; group 1 mixed, one differs; group 2 uniform (A = 0)
    # with identical actions: not counted. -> 1/2.
    ids = [(1, 2), (1, 2), (1, 2), (3, 4), (3, 4), (3, 5), (7,), (7,)]
    groups = [0, 0, 0, 1, 1, 1, 2, 2]
    advantage = [1.0, -0.5, -0.5, 1.0, -0.5, -0.5, 0.0, 0.0]
    assert identical_first_action_frac(ids, groups, advantage) == 0.5
    assert math.isnan(identical_first_action_frac(ids[6:], groups[6:], advantage[6:]))
    batch = hand_batch(first_action_ids=[(1,), (1,), (1,), (2,), (2,), (9,)])
    assert step_diagnostics(batch)["diag/identical_first_action_frac"] == 0.5


def test_grad_norm_per_active_row_undoes_the_dilution_of_zero_advantage_rows():
    from llds_jax.train.learner import grad_norm_per_active_row

    assert grad_norm_per_active_row(0.3, np.array([1.0, -1.0, 0.0, 0.0, 0.0, 0.0])) == pytest.approx(0.9)
    assert math.isnan(grad_norm_per_active_row(0.3, np.zeros(4)))
