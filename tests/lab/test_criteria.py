"""Issue 43's acceptance criteria on hand-built runs: a textbook spiral passes (a)-(c), a stable run fails (a)."""

import json

import numpy as np

from llds_jax.lab.criteria import evaluate
from llds_jax.train.metrics import MetricsWriter


def write(run, rows, probes=()):
    with MetricsWriter(run, tensorboard=False, console=None) as writer:
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
