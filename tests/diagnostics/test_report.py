"""``--mode=report`` turns a metrics file written by the trainer's writer into PNGs and a summary."""

from __future__ import annotations

import re

import matplotlib.image
import ml_collections
import pytest

from llds_jax.diagnostics.report import load_metrics, report_main
from llds_jax.diagnostics.synthetic import death_spiral_run, stable_run
from llds_jax.train.metrics import MetricsWriter

pytestmark = pytest.mark.unit

PANELS = {"reward", "likelihood", "likelihood_correct_by_action", "likelihood_incorrect_by_action",
          "lld_rate", "grad_norm", "entropy", "searches", "overview"}


def write_run(workdir, rows, *, with_sft_rows=True):
    """Through the trainer's own writer: NaN becomes null, rows get ``phase`` and ``wall_time``."""
    with MetricsWriter(workdir, console=None) as writer:
        if with_sft_rows:
            for step in range(3):
                writer.write(step, {"loss/total": 1.0 / (step + 1)}, phase="sft")
        for row in rows:
            writer.write(row["step"], {k: v for k, v in row.items() if k != "step"})
    return workdir


def report_config(**values):
    config = ml_collections.ConfigDict({"workdir": "", "report": {"compare": "", "out_dir": ""}})
    config.update(values)
    return config


def assert_valid_png(path):
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    height, width, _ = matplotlib.image.imread(path).shape
    assert height > 200 and width > 300, f"{path} is {width}×{height}"


def test_report_writes_every_plot_and_a_summary_that_embeds_them(tmp_path):
    rows = death_spiral_run(0)
    rows[5]["diag/ll_correct/all"] = float("nan")  # a step without correct responses
    workdir = write_run(tmp_path / "grpo", rows)
    summary = report_main(report_config(workdir=str(workdir)))

    assert summary == workdir / "report" / "summary.md"
    pngs = {p.stem for p in summary.parent.glob("*.png")}
    assert pngs == PANELS
    for name in PANELS:
        assert_valid_png(summary.parent / f"{name}.png")
    text = summary.read_text()
    assert set(re.findall(r"!\[[^\]]*\]\(([^)]+)\.png\)", text)) == PANELS
    assert "STAGNATION → STEADY_DECAY" in text and "STEADY_DECAY → ACCELERATION" in text


def test_compare_form_overlays_runs_and_lists_each(tmp_path):
    spiral = write_run(tmp_path / "grpo", death_spiral_run(1))
    stable = write_run(tmp_path / "llds", stable_run(1, 200), with_sft_rows=False)
    out = tmp_path / "compare"
    summary = report_main(report_config(report={"compare": f"{spiral},{stable}", "out_dir": str(out)}))
    assert summary == out / "summary.md"
    assert_valid_png(out / "likelihood.png")
    table_rows = [line for line in summary.read_text().splitlines() if line.startswith("| grpo") or line.startswith("| llds")]
    assert len(table_rows) == 2
    assert table_rows[1].split("|")[3].strip() == "—", "the stable run must show no phase II onset"


def test_sft_rows_are_left_out_and_old_key_names_are_read_as_todays(tmp_path):
    old_row = {"step": 0, "grad/norm_preclip": 0.5, "policy/entropy": 0.0, "diag/entropy": 1.2,
               "rollout/searches_mean": 1.5, "diag/searches/mean": 1.5, "llds/value_first_minibatch": 0.0}
    workdir = write_run(tmp_path / "run", [old_row])
    (row,) = load_metrics(workdir / "metrics.jsonl")
    assert row["phase"] == "rl"
    assert (row["grad/norm_preclip"], row["policy/entropy"], row["rollout/searches"]) == (0.5, 1.2, 1.5), row
    assert not {"diag/entropy", "rollout/searches_mean", "diag/searches/mean", "llds/value_first_minibatch"} & set(row)


def test_bad_metrics_line_fails_with_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "reward/mean": 0.1}\n{"reward/mean": 0.2}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:line 2: field 'step'"):
        load_metrics(path)


def test_report_without_a_workdir_says_how_to_call_it():
    with pytest.raises(ValueError, match="--config.workdir=RUN_DIR"):
        report_main(report_config())


@pytest.mark.parametrize("steps", [1, 2, 8])
def test_runs_shorter_than_the_smoothing_window_are_drawn(tmp_path, steps):
    """A 1-step run (a smoke test's) crashed matplotlib: the rolling mean came back 9 long."""
    workdir = write_run(tmp_path / "short", death_spiral_run(0)[:steps])
    summary = report_main(report_config(workdir=str(workdir)))
    assert_valid_png(summary.parent / "reward.png")


def test_issue_43_quantities_get_their_panels_when_a_run_logged_them(tmp_path):
    rows = death_spiral_run(0)
    for index, row in enumerate(rows):
        row["diag/logodds_correct/action0"] = 4.0 - 0.01 * index
        row["diag/logodds_incorrect/action0"] = 2.0
        row["diag/identical_first_action_frac"] = 0.1
        row["grad/norm_per_active_row"] = 3.0
        row["diag/ll_official_pos"] = -0.05
    summary = report_main(report_config(workdir=str(write_run(tmp_path / "run", rows))))
    pngs = {p.stem for p in summary.parent.glob("*.png")}
    assert pngs == PANELS | {"logodds_by_action", "identical_first_action"}


def test_probe_results_beside_a_run_are_plotted_over_checkpoints(tmp_path):
    import json

    workdir = write_run(tmp_path / "run", death_spiral_run(0))
    for step, share in ((10, 0.2), (20, 0.6)):
        (workdir / "probe" / str(step)).mkdir(parents=True)
        (workdir / "probe" / str(step) / "probe.json").write_text(json.dumps(
            {"step": step, "lld_share": share, "lld_share_sgd": share / 2, "delta_mean": -share,
             "delta_by_action": [-share, None]}))
    summary = report_main(report_config(workdir=str(workdir)))
    assert_valid_png(summary.parent / "probe.png")
    assert "![probe](probe.png)" in summary.read_text()


def test_a_comparison_of_seven_runs_keeps_one_legend_entry_per_run_and_key(tmp_path):
    """The collapse-fixes page overlays 7 arms: per-action panels keep action 0, legends are runs + keys."""
    import matplotlib.pyplot as plt

    from llds_jax.diagnostics.report import Panel, _draw_panel, load_run, panels_for

    present = {f"diag/logodds_{kind}/action{k}" for kind in ("correct", "incorrect") for k in range(3)}
    logodds = next(p for p in panels_for(present, first_action_only=True) if p.name == "logodds_by_action")
    assert logodds.keys == ("diag/logodds_correct/action0", "diag/logodds_incorrect/action0")
    assert len(next(p for p in panels_for(present) if p.name == "logodds_by_action").keys) == 6

    runs = [write_run(tmp_path / f"arm{i}", death_spiral_run(i), with_sft_rows=False) for i in range(7)]
    summary = report_main(report_config(report={"compare": ",".join(map(str, runs)), "out_dir": str(tmp_path / "c")}))
    assert_valid_png(summary.parent / "overview.png")
    assert sum(line.startswith("| arm") for line in summary.read_text().splitlines()) == 7
    figure, axis = plt.subplots()
    _draw_panel(axis, Panel("ll", "ll", ("diag/ll_correct/all", "diag/ll_incorrect/all"), "nats"),
                [load_run(run) for run in runs])
    labels = [text.get_text() for text in axis.get_legend().get_texts() if "onset" not in text.get_text()]
    plt.close(figure)
    assert labels == [f"arm{i}" for i in range(7)] + ["diag/ll_correct/all", "diag/ll_incorrect/all"]
