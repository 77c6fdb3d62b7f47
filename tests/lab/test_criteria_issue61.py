"""Issue 61's pre-registered criteria on synthetic inputs: every verdict reachable, each threshold at its edge."""

import json

import numpy as np
import pytest

from llds_jax.lab.criteria import (
    ablation_checks,
    break_step,
    checkpoint_displacement,
    decision,
    displacement_verdict,
    issue61,
    k_star,
    spearman,
    wilson_upper,
)
from llds_jax.train.metrics import MetricsWriter

pytestmark = pytest.mark.unit


def stratum(questions: int, share: float, per_question: int = 5, order: str = "same") -> list[dict]:
    """Subsets over ``questions`` questions, exactly ``share`` of them with m₊₋ > m₊₊; the norm ratio
    ranks like the margin (``same``), against it (``reverse``) or not at all (``flat``)."""
    n = questions * per_question
    positives = round(share * n)
    margins = np.r_[np.linspace(0.1, 1.0, positives), -np.linspace(0.1, 1.0, n - positives)]
    ratios = {"same": margins + 2.0, "reverse": 2.0 - margins, "flat": np.ones(n)}[order]
    return [{"question": i % questions, "margin": float(m), "norm_ratio": float(r)}
            for i, (m, r) in enumerate(zip(margins, ratios))]


def strata(top_share, k1_share=0.0, top_k=4, top_questions=20, order="same"):
    return {"1": stratum(40, k1_share), "2": stratum(30, k1_share), str(top_k): stratum(top_questions, top_share, order=order)}


def test_wilson_upper_matches_the_closed_form_and_is_taken_over_questions():
    z2 = 1.959963984540054 ** 2
    assert wilson_upper(0.0, 20) == pytest.approx(z2 / (20 + z2))  # 0.161: M− reachable with 20 questions
    assert wilson_upper(0.0, 20) < 0.20 < wilson_upper(0.0, 15)
    assert wilson_upper(0.10, 20) > 0.20 and wilson_upper(0.10, 400) < 0.20
    assert wilson_upper(0.5, 0) == 1.0
    out = checkpoint_displacement({"4": stratum(20, 0.0, per_question=50)})  # 1,000 subsets, 20 questions
    assert out["subsets_k_star"] == 1000 and out["upper95"] == pytest.approx(wilson_upper(0.0, 20))


def test_spearman_uses_average_ranks_for_ties_and_is_nan_when_undefined():
    # ranks (0, 1.5, 1.5, 3) and (0, 2, 1, 3): Pearson 4.5 / sqrt(4.5 · 5)
    assert spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(4.5 / np.sqrt(22.5))
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert np.isnan(spearman([1, 1, 1], [1, 2, 3])) and np.isnan(spearman([1, 2], [1, 2]))


def test_k_star_is_the_highest_stratum_with_twenty_questions():
    assert k_star({1: stratum(40, 0), 2: stratum(20, 0), 4: stratum(19, 0), 6: stratum(3, 0)}) == 2
    assert k_star({1: stratum(19, 0)}) is None
    out = checkpoint_displacement({"1": stratum(19, 0.5)})
    assert out == {"k_star": None, "m_plus": False, "m_minus": False}


@pytest.mark.parametrize("top_share, k1_share, order, expected", [
    (0.30, 0.10, "same", True),      # every clause exactly at its threshold (rise 0.30 − 0.10)
    (0.29, 0.0, "same", False),      # share below 0.30
    (0.30, 0.11, "same", False),     # rise 0.19
    (0.50, 0.0, "flat", False),      # Spearman undefined (constant ratio)
    (0.50, 0.0, "reverse", False),   # Spearman negative
])
def test_m_plus_needs_share_rise_and_spearman(top_share, k1_share, order, expected):
    out = checkpoint_displacement(strata(top_share, k1_share, order=order))
    assert out["k_star"] == 4 and out["m_plus"] is expected, out


def test_m_minus_needs_the_share_and_its_upper_bound():
    assert checkpoint_displacement(strata(0.0, top_questions=20))["m_minus"]          # bound 0.161
    assert not checkpoint_displacement(strata(0.10, top_questions=20))["m_minus"]     # bound 0.30
    assert checkpoint_displacement(strata(0.10, top_questions=400))["m_minus"]        # bound 0.13
    assert not checkpoint_displacement(strata(0.11, top_questions=400))["m_minus"]    # share above 0.10


def test_every_verdict_and_decision_is_reachable():
    plus, minus, middle = strata(0.5), strata(0.0), strata(0.2)
    both = displacement_verdict([minus, plus], [minus])
    assert both["verdict"] == "M+" and both["m_plus"] == {"free_form": True, "first_world": False}
    assert decision(both).startswith("M+ in the free-form world")
    first = displacement_verdict([minus], [plus])
    assert first["verdict"] == "M+" and decision(first).startswith("M+ only in the first world")
    closed = displacement_verdict([minus, minus], [minus])
    assert closed["verdict"] == "M-" and decision(closed).startswith("M-: the lab is closed")
    for free, first_world in (([minus, middle], [minus]), ([minus], []), ([minus, {"1": stratum(5, 0)}], [minus])):
        result = displacement_verdict(free, first_world)  # a share between, a world unprobed, no k*
        assert result["verdict"] == "inconclusive" and decision(result).startswith("inconclusive")


def rows(steps=100, valid=None, finished=None, entropy=None):
    out = []
    for step in range(steps):
        row = {"step": step, "rollout/valid_action_rate": 1.0 if valid is None else valid(step),
               "rollout/finished": 1.0 if finished is None else finished(step)}
        if entropy is not None:
            row["policy/entropy"] = entropy(step)
        out.append(row)
    return out


def test_break_is_the_first_step_whose_10_step_valid_or_finished_rate_is_below_half():
    # valid 0 from step 50: the trailing mean over 41..50 is 0.9, over 45..54 exactly 0.5, 46..55 0.4.
    assert break_step(rows(valid=lambda s: 0.0 if s >= 50 else 1.0)) == 55
    assert break_step(rows(finished=lambda s: 0.0 if s >= 30 else 1.0)) == 35
    assert break_step(rows()) is None


def test_ablation_checks_at_their_thresholds():
    f1 = rows(valid=lambda s: 0.0 if s >= 50 else 1.0)                       # breaks at 55
    a1 = lambda shift, h: rows(valid=lambda s: 0.0 if s >= 50 + shift else 1.0, entropy=lambda s: h)  # noqa: E731
    a2 = lambda h, v: rows(valid=lambda s: v, entropy=lambda s: h)  # noqa: E731
    out = ablation_checks(f1, a1(15, 1.5), a2(3.0, 0.9))
    assert (out["E1_surge_is_the_bonus"], out["E2_break_is_lr_driven"], out["E3_containment_is_anchoring"]) == (
        True, True, True)
    assert out["f1_break"] == 55 and out["a1_break"] == 70
    out = ablation_checks(f1, a1(16, 1.51), a2(2.99, 0.5))
    assert (out["E1_surge_is_the_bonus"], out["E2_break_is_lr_driven"], out["E3_containment_is_anchoring"]) == (
        False, False, False)
    assert ablation_checks(f1, a1(-15, 1.0), a2(0.4, 0.49))["E3_containment_is_anchoring"]  # valid < 0.5
    assert ablation_checks(f1, rows(), a2(0.4, 0.9))["E2_break_is_lr_driven"] is False      # A1 never breaks
    unknown = ablation_checks(rows(), rows(), a2(0.4, 0.9))  # a run that logged no entropy (before it was logged at entropy_coef = 0); F1 no break
    assert unknown["E1_surge_is_the_bonus"] is None and unknown["E2_break_is_lr_driven"] is None


def write_run(run, metric_rows, gram_checkpoints=()):
    with MetricsWriter(run, console=None) as writer:
        for row in metric_rows:
            writer.write(row["step"], {k: v for k, v in row.items() if k != "step"})
    for step, checkpoint in gram_checkpoints:
        (run / "probe" / str(step)).mkdir(parents=True)
        (run / "probe" / str(step) / "probe.json").write_text(json.dumps({"step": step, "gram": {"strata": checkpoint}}))
    return run


def test_issue61_reads_the_runs_directories(tmp_path):
    f1 = write_run(tmp_path / "f1", rows(valid=lambda s: 0.0 if s >= 50 else 1.0, entropy=lambda s: 5.0),
                   [(19, strata(0.0)), (39, strata(0.0))])
    w1 = write_run(tmp_path / "w1", rows(), [(49, strata(0.0))])
    a1 = write_run(tmp_path / "a1", rows(valid=lambda s: 0.0 if s >= 55 else 1.0))
    a2 = write_run(tmp_path / "a2", rows(entropy=lambda s: 0.4))
    out = issue61(f1, w1, a1, a2)
    assert out["verdict"] == "M-" and out["decision"].startswith("M-")
    assert len(out["checkpoints"]["free_form"]) == 2
    assert out["ablations"]["E1_surge_is_the_bonus"] is None and out["ablations"]["E2_break_is_lr_driven"]
    assert out["ablations"]["E3_containment_is_anchoring"] is False
