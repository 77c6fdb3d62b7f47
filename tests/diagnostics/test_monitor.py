"""The death-spiral monitor on synthetic streams shaped like the paper's Fig. 2."""

from __future__ import annotations

import dataclasses
import math

import pytest

from llds_jax.diagnostics.monitor import (
    Action,
    DeathSpiralMonitor,
    MonitorConfig,
    Phase,
    phase_spans,
    replay,
    window_slope,
)
from llds_jax.diagnostics.synthetic import SpiralShape, death_spiral_run, stable_run

pytestmark = pytest.mark.unit

SHAPES = [
    SpiralShape(),  # the paper's boundaries: II at 60, III at 120
    SpiralShape(steps=240, phase_two_start=90, phase_three_start=150),
    SpiralShape(phase_two_start=40, phase_three_start=100, decay_per_step=6e-4, likelihood_noise=0.007),
]


def first_step_in(reports, phase: Phase) -> int | None:
    return next((r.step for r in reports if r.phase >= phase), None)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("shape", SHAPES, ids=["paper", "late", "slow-quiet"])
def test_phase_two_is_flagged_inside_phase_two_before_acceleration(shape, seed):
    reports = replay(death_spiral_run(seed, shape))
    flagged_two = first_step_in(reports, Phase.STEADY_DECAY)
    flagged_three = first_step_in(reports, Phase.ACCELERATION)
    assert flagged_two is not None, f"seed {seed}: phase II never flagged"
    assert shape.phase_two_start <= flagged_two < shape.phase_three_start, (
        f"seed {seed}: phase II flagged at step {flagged_two}, true span "
        f"[{shape.phase_two_start}, {shape.phase_three_start})")
    assert flagged_three is not None and shape.phase_three_start <= flagged_three <= shape.phase_three_start + 40, (
        f"seed {seed}: phase III flagged at {flagged_three}, began at {shape.phase_three_start}")


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("rise", [0.0, 2e-4], ids=["flat", "rising"])
def test_stable_stream_is_never_flagged_over_a_thousand_steps(seed, rise):
    reports = replay(stable_run(seed, 1000, likelihood_rise_per_step=rise))
    flagged = [(r.step, r.phase.name, r.message) for r in reports if r.phase is not Phase.STAGNATION]
    assert not flagged, f"seed {seed}: false alarm {flagged[:1]}"


def test_a_single_gradient_spike_is_not_a_surge():
    rows = stable_run(0, 300)
    rows[200]["grad/norm_preclip"] *= 50
    assert all(r.phase is Phase.STAGNATION for r in replay(rows))


def test_reports_carry_the_evidence():
    reports = replay(death_spiral_run(0))
    entered = next(r for r in reports if r.phase is Phase.STEADY_DECAY)
    assert entered.changed and entered.ll_slope < 0 and entered.ll_t_stat <= -MonitorConfig().decay_t
    assert "phase STAGNATION → STEADY_DECAY" in entered.message and "t=" in entered.message
    assert set(entered.as_metrics()) == {"monitor/phase", "monitor/ll_slope", "monitor/ll_t_stat",
                                         "monitor/grad_surge_ratio", "monitor/entropy_surge_ratio"}
    accelerated = next(r for r in reports if r.phase is Phase.ACCELERATION)
    assert accelerated.grad_surge_ratio >= 2.0 or accelerated.entropy_surge_ratio >= 2.0
    assert [s.phase for s in phase_spans(reports)] == [Phase.STAGNATION, Phase.STEADY_DECAY, Phase.ACCELERATION]


def run_monitor(monitor, rows):
    return [monitor.update(row["step"], row) for row in rows]


def test_stop_action_fires_once_on_entering_phase_two():
    monitor = DeathSpiralMonitor(MonitorConfig(on_phase_two="stop"))
    reports = run_monitor(monitor, death_spiral_run(1)[:120])
    assert [r.action for r in reports if r.action is not Action.NONE] == [Action.STOP]


def test_raise_lambda_turns_zero_into_the_paper_value_and_then_multiplies():
    monitor = DeathSpiralMonitor(MonitorConfig(on_phase_two="raise_lambda", lambda_factor=2.0), llds_lambda=0.0)
    # A long steady decay: the monitor re-detects it on post-raise data and raises again.
    rows = death_spiral_run(2, SpiralShape(steps=400, phase_two_start=30, phase_three_start=400))
    raises = [r for r in run_monitor(monitor, rows) if r.action is Action.RAISE_LAMBDA]
    assert [r.llds_lambda for r in raises[:2]] == [pytest.approx(0.1), pytest.approx(0.2)]
    assert raises[1].step - raises[0].step >= MonitorConfig().window, "second raise must use fresh evidence"


def test_raise_lambda_stops_at_lambda_max():
    monitor = DeathSpiralMonitor(MonitorConfig(on_phase_two="raise_lambda", lambda_max=0.15), llds_lambda=0.1)
    rows = death_spiral_run(3, SpiralShape(steps=400, phase_two_start=30, phase_three_start=400))
    reports = run_monitor(monitor, rows)
    assert max(r.llds_lambda for r in reports) == pytest.approx(0.15)
    assert any("lambda_max" in r.message for r in reports)


def test_steps_without_a_likelihood_are_skipped_not_zero_filled():
    rows = death_spiral_run(0)
    for row in rows[::3]:
        row["diag/ll_correct/all"] = math.nan
    assert first_step_in(replay(rows), Phase.STEADY_DECAY) < SpiralShape().phase_three_start


def test_window_slope_matches_a_known_line():
    slope, t_stat = window_slope([(0, 1.0), (1, 0.5), (2, 0.0), (3, -0.5)])
    assert slope == pytest.approx(-0.5) and t_stat == -math.inf


def test_config_rejects_unknown_actions_and_settings():
    with pytest.raises(ValueError, match="choose log, stop or raise_lambda"):
        MonitorConfig(on_phase_two="panic")
    with pytest.raises(ValueError, match="unknown monitor settings"):
        MonitorConfig.from_mapping({"windw": 10})
    assert MonitorConfig.from_mapping({"window": 30}) == dataclasses.replace(MonitorConfig(), window=30)


def test_warm_up_after_resume_restores_the_phase_without_acting():
    rows = death_spiral_run(4)
    uninterrupted = replay(rows)[109]
    resumed = DeathSpiralMonitor(MonitorConfig(on_phase_two="stop"))
    resumed.warm_up(rows[:109])
    report = resumed.update(109, rows[109])
    assert report.phase is uninterrupted.phase is Phase.STEADY_DECAY
    assert report.ll_t_stat == pytest.approx(uninterrupted.ll_t_stat) and report.action is Action.NONE


def test_warm_up_replays_a_lambda_raise_so_the_window_restarts_where_it_did():
    """A raise in the history cleared the likelihood window: the replay must clear it at the same step."""
    config = MonitorConfig(on_phase_two="raise_lambda")
    rows = death_spiral_run(4)
    live = DeathSpiralMonitor(config, llds_lambda=0.1)
    for row in rows[:110]:
        row["llds/lambda"] = live.llds_lambda  # what the trainer logs: the λ the step ran with
        live.update(row["step"], row)
    raised_at = [r["step"] for r in rows[1:110] if r["llds/lambda"] != rows[r["step"] - 1]["llds/lambda"]]
    assert raised_at, "the spiral must trigger at least one λ raise in 110 steps"
    resumed = DeathSpiralMonitor(config, llds_lambda=live.llds_lambda)
    resumed.warm_up(rows[:110])
    assert (list(resumed._likelihood), resumed.phase, resumed.llds_lambda) == (
        list(live._likelihood), live.phase, live.llds_lambda)
