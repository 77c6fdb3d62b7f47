"""Issue 43's acceptance criteria on hand-built runs: a textbook spiral passes (a)-(c), a stable run fails (a)."""

import json

import numpy as np
import pytest

from llds_jax.lab.criteria import calibrate_monitor, evaluate, results_table
from llds_jax.train.metrics import MetricsWriter

pytestmark = pytest.mark.unit


def write(run, rows, probes=()):
    with MetricsWriter(run, console=None) as writer:
        for row in rows:
            writer.write(row["step"], {k: v for k, v in row.items() if k != "step"})
    for step, share in probes:
        (run / "probe" / str(step)).mkdir(parents=True)
        (run / "probe" / str(step) / "probe.json").write_text(json.dumps({"step": step, "lld_share": share}))
    return run


def spiral_rows(seed=0, decay=True):
    rng = np.random.default_rng(seed)
    rows = []
    for step in range(130):
        broken = decay and step >= 90
        logodds = 4.0 - (0.04 * (step - 40) if decay and step >= 40 else 0.0)
        rows.append({"step": step, "reward/mean": (0.1 if broken else 0.5) + 0.02 * rng.standard_normal(),
                     "diag/logodds_correct/action0": logodds + 0.05 * rng.standard_normal(),
                     "grad/norm_per_active_row": (3.0 if broken else 1.0) + 0.05 * rng.standard_normal(),
                     "policy/entropy": (2.0 if broken else 0.5) + 0.01 * rng.standard_normal(),
                     "diag/identical_first_action_frac": 0.0})
    return rows


PROBES = [(39, 0.2), (49, 0.2), (59, 0.3), (69, 0.45), (79, 0.5)]


def test_a_textbook_spiral_meets_a_and_b_and_llds_that_holds_meets_c(tmp_path):
    grpo = write(tmp_path / "grpo", spiral_rows(), PROBES)
    llds = write(tmp_path / "llds", spiral_rows(1, decay=False), [(s, 0.1) for s, _ in PROBES])
    result = evaluate(grpo, llds)
    assert result["a_phase_two"], result
    window = result["a_windows"][0]
    assert 40 <= window["start"] and window["end"] <= 89 and window["logodds_t"] <= -3
    assert result["b_acceleration"]["ok"], result["b_acceleration"]
    assert result["b_acceleration"]["fall_step"] in range(90, 100)
    assert result["llds"]["c_protects"]


def test_no_phase_two_without_a_rising_probe_share_or_with_flat_log_odds(tmp_path):
    flat_probe = write(tmp_path / "flat_probe", spiral_rows(), [(s, 0.1) for s, _ in PROBES])
    assert not evaluate(flat_probe)["a_phase_two"]
    stable = write(tmp_path / "stable", spiral_rows(2, decay=False), PROBES)
    result = evaluate(stable)
    assert not result["a_phase_two"] and result["describe"]["fall_step"] is None


def test_the_monitor_on_log_odds_warns_before_the_fall_of_a_textbook_spiral(tmp_path):
    result = evaluate(write(tmp_path / "grpo", spiral_rows(), PROBES))
    logodds = result["monitor"]["logodds"]
    assert logodds["phase2"] is not None and logodds["lead"] >= 20, logodds


def test_d_kl_protects_less_only_when_llds_holds_and_kl_does_not(tmp_path):
    grpo = write(tmp_path / "grpo", spiral_rows(), PROBES)
    llds = write(tmp_path / "llds", spiral_rows(1, decay=False))
    kl_falls = write(tmp_path / "kl_falls", spiral_rows(3))
    kl_holds = write(tmp_path / "kl_holds", spiral_rows(4, decay=False))
    assert evaluate(grpo, llds, kl_falls)["kl"]["d_kl_protects_less"]
    both = evaluate(grpo, llds, kl_holds)["kl"]
    assert both["protects_by_c"]
    # both hold: decided by the final rewards alone (two draws of the same stable level)
    finals = evaluate(grpo, llds)["llds"]["describe"]["reward10_final"], both["describe"]["reward10_final"]
    assert both["d_kl_protects_less"] == (finals[0] > finals[1])
    assert not evaluate(grpo, kl_falls, llds)["kl"]["d_kl_protects_less"]  # "LLDS" that falls protects nothing


def test_monitor_calibration_picks_a_quiet_setting_that_warns_early_and_none_without_stable_runs(tmp_path):
    spirals = [write(tmp_path / f"spiral{s}", spiral_rows(s)) for s in range(2)]
    stables = [write(tmp_path / f"stable{s}", spiral_rows(10 + s, decay=False)) for s in range(2)]
    result = calibrate_monitor(spirals + stables)
    assert result["stable_runs"] == sorted(str(s) for s in stables)
    chosen = result["settings"][result["chosen"]]
    assert chosen["false_alarms"] == [] and chosen["min_lead"] >= 20, chosen
    assert calibrate_monitor(spirals)["chosen"] is None


def test_results_table_has_one_row_per_run_with_its_fall_step(tmp_path):
    spiral = write(tmp_path / "spiral", spiral_rows(), PROBES)
    stable = write(tmp_path / "stable", spiral_rows(5, decay=False))
    header, rule, *rows = results_table({"grpo": spiral, "llds": stable})
    assert header.count("|") == rule.count("|") == rows[0].count("|") == rows[1].count("|")
    fall = evaluate(spiral)["describe"]["fall_step"]
    assert rows[0].startswith("| grpo |") and f"| {fall} |" in rows[0] and "0.50 (79)" in rows[0]
    assert rows[1].startswith("| llds |") and "| none |" in rows[1]
