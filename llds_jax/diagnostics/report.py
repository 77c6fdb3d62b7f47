"""``--mode=report``: plots and a Markdown summary of one run, or a comparison of several.

Reads ``<workdir>/metrics.jsonl`` (one flat JSON object per step, keys in
:mod:`llds_jax.diagnostics`), replays the death-spiral monitor over it to find the
phases, and writes PNGs with the phases shaded (II amber, III red) plus ``summary.md``
that embeds them. The compare form overlays runs (e.g. GRPO vs GRPO+LLDS from one seed)
and marks each run's phase onsets with dashed lines in the run's colour.

    python -m llds_jax.main --mode=report --config=configs/eval.py --config.workdir=RUN_DIR
    python -m llds_jax.main --mode=report --config=configs/eval.py \\
        --config.report.compare=RUN_A,RUN_B --config.report.out_dir=OUT
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from llds_jax.diagnostics import keys
from llds_jax.diagnostics.monitor import MonitorConfig, MonitorReport, Phase, phase_spans, replay
from llds_jax.errors import InputError

_STYLES = ("-", "--", ":", "-.")
PHASE_COLOURS = {Phase.STEADY_DECAY: "#f5b041", Phase.ACCELERATION: "#e74c3c"}
_ACTION_KEY = re.compile(r"^diag/(ll|logodds)_(correct|incorrect)/action(\d+)$")


@dataclasses.dataclass(frozen=True)
class Panel:
    """One PNG: a title, the metric keys drawn in it, and whether the y axis is logarithmic."""

    name: str
    title: str
    keys: tuple[str, ...]
    ylabel: str
    log_y: bool = False


def panels_for(present: set[str], first_action_only: bool = False) -> list[Panel]:
    """The panels, with only the keys in ``present``' families; ``first_action_only``: per-action
    panels keep action 0 (a comparison of many runs; action 0 is the one the paper sees decay first)."""
    def by_action(kind: str, measure: str = "ll") -> tuple[str, ...]:
        matches = [k for k in present if (m := _ACTION_KEY.match(k)) and m[1] == measure and m[2] == kind
                   and not (first_action_only and int(m[3]) > 0)]
        return tuple(sorted(matches, key=lambda k: int(_ACTION_KEY.match(k)[3])))

    return [
        Panel("reward", "Reward (EM)", (keys.REWARD_MEAN,), "mean reward"),
        Panel("likelihood", "Log-likelihood under π_old: correct (A>0) vs incorrect (A<0)",
              (keys.LL_CORRECT, keys.LL_INCORRECT, keys.LL_OFFICIAL_POS), "nats / token"),
        Panel("likelihood_correct_by_action", "Correct responses: log-likelihood by action index",
              by_action("correct"), "nats / token"),
        Panel("likelihood_incorrect_by_action", "Incorrect responses: log-likelihood by action index",
              by_action("incorrect"), "nats / token"),
        # Log-odds do not saturate where log-probs do (a falling margin is visible in phase II).
        Panel("logodds_by_action", "Log-odds log p − log(1−p) by action: correct vs incorrect",
              by_action("correct", "logodds") + by_action("incorrect", "logodds"), "log-odds / token"),
        Panel("lld_rate", "LLD rate: correct responses with Δ ≤ 0", (keys.LLD_RATE,), "fraction"),
        Panel("identical_first_action", "Mixed groups whose first actions are token-identical",
              (keys.IDENTICAL_FIRST_ACTION_FRAC,), "fraction"),
        Panel("grad_norm", "Gradient norm before clipping (and per active row)",
              (keys.GRAD_NORM, keys.GRAD_NORM_PER_ACTIVE_ROW), "global norm", log_y=True),
        Panel("entropy", "Token entropy of π_old (action tokens)", (keys.POLICY_ENTROPY,), "nats"),
        Panel("searches", "Searches per trajectory and valid-action rate",
              (keys.SEARCHES, keys.VALID_ACTION_RATE), "count / fraction"),
    ]


@dataclasses.dataclass
class Run:
    name: str
    rows: list[dict[str, float]]
    reports: list[MonitorReport]
    probes: list[dict] = dataclasses.field(default_factory=list)  # <workdir>/probe/<step>/probe.json, by step

    @property
    def steps(self) -> np.ndarray:
        return np.array([row["step"] for row in self.rows], dtype=np.float64)

    def series(self, key: str) -> np.ndarray:
        return np.array([_as_float(row.get(key)) for row in self.rows], dtype=np.float64)

    def onset(self, phase: Phase) -> MonitorReport | None:
        return next((r for r in self.reports if r.phase is phase and r.changed), None)


def load_metrics(path: str | Path, phase: str = "rl") -> list[dict[str, float]]:
    """:func:`read_rows`, failing when the file has no ``phase`` rows."""
    rows = read_rows(path, phase)
    if not rows:
        raise InputError(f"{path}: no {phase!r} metric rows")
    return rows


def read_rows(path: str | Path, phase: str = "rl") -> list[dict[str, float]]:
    """Rows of ``metrics.jsonl`` sorted by step; after a resume the last row of a step wins.

    Rows tagged with another ``phase`` (``sft`` warm-up, ``eval``) have their own step
    counters and are left out; untagged rows are kept. Files of older trainers are read with
    today's key names (``keys.RENAMED``), so the monitor and the plots read one name.
    """
    path = Path(path)
    by_step: dict[int, dict] = {}
    with path.open(encoding="utf-8") as handle:
        for line_number, text in enumerate(handle, start=1):
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as err:
                raise InputError(f"{path}:line {line_number}: not valid JSON ({err.msg})") from None
            if not isinstance(row, dict) or isinstance(row.get("step"), bool) or not isinstance(row.get("step"), int | float):
                raise InputError(f"{path}:line {line_number}: field 'step': missing or not a number")
            if row.get("phase", phase) != phase:
                continue
            by_step[int(row["step"])] = keys.upgrade_row(row)
    return [by_step[step] for step in sorted(by_step)]


def load_run(workdir: str | Path, monitor: MonitorConfig = MonitorConfig()) -> Run:
    workdir = Path(workdir)
    if not (workdir / "metrics.jsonl").is_file():
        raise InputError(f"{workdir}/metrics.jsonl does not exist: name a run directory with "
                         "--config.workdir=RUN_DIR (or --config.report.compare=RUN_A,RUN_B)")
    rows = load_metrics(workdir / "metrics.jsonl")
    return Run(workdir.name or str(workdir), rows, replay(rows, monitor), load_probes(workdir))


def load_probes(workdir: str | Path) -> list[dict]:
    """The per-sample probe results of a run (``llds_jax.lab.probe``), sorted by checkpoint step."""
    probes = []
    for path in Path(workdir).glob("probe/*/probe.json"):
        try:
            probes.append(json.loads(path.read_text(encoding="utf-8")))
        except json.JSONDecodeError as err:
            raise InputError(f"{path}: not valid JSON ({err.msg})") from None
    return sorted(probes, key=lambda p: p["step"])


def _draw_probe(runs: Sequence[Run], path: Path) -> bool:
    """``probe.png``: LLD share and Δ(x) over checkpoints for every run that has probes; False if none."""
    if not any(run.probes for run in runs):
        return False
    plt = _pyplot()
    figure, (share, delta) = plt.subplots(1, 2, figsize=(14, 4.2), constrained_layout=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, run in enumerate(r for r in runs if r.probes):
        colour = colours[index % len(colours)]
        steps = [p["step"] for p in run.probes]
        value = lambda p, key: math.nan if p.get(key) is None else p[key]  # noqa: E731
        share.plot(steps, [value(p, "lld_share") for p in run.probes], "-o", color=colour,
                   label=f"{run.name}: optimizer")
        share.plot(steps, [value(p, "lld_share_sgd") for p in run.probes], "--s", color=colour,
                   label=f"{run.name}: SGD, fixed |Δ log p|")
        delta.plot(steps, [value(p, "delta_mean") for p in run.probes], "-o", color=colour,
                   label=f"{run.name}: Δ(x) total")
        first = [math.nan if not p.get("delta_by_action") or p["delta_by_action"][0] is None
                 else p["delta_by_action"][0] for p in run.probes]
        delta.plot(steps, first, ":^", color=colour, label=f"{run.name}: Δ(x) action 0")
    share.axhline(0.5, color="grey", linewidth=0.8, linestyle=":")
    share.set(title="Probe: mixed groups with Δ(x) < 0 (lld_share)", xlabel="checkpoint step", ylabel="share")
    delta.axhline(0.0, color="grey", linewidth=0.8)
    delta.set(title="Probe: mean Δ(x) of correct responses (Eq. 3)", xlabel="checkpoint step", ylabel="nats")
    for axis in (share, delta):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True


def _pyplot():
    """matplotlib on the file-only backend, imported on first drawing (the trainer imports this module)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_report(runs: Sequence[Run], out_dir: str | Path) -> Path:
    """PNG per panel plus ``overview.png`` and ``summary.md``; returns the summary path."""
    plt = _pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    present = set().union(*(row.keys() for run in runs for row in run.rows))
    drawn = []
    for panel in panels_for(present, first_action_only=len(runs) > 2):
        if not any(np.isfinite(run.series(k)).any() for run in runs for k in panel.keys):
            continue
        figure, axis = plt.subplots(figsize=(8, 4.2), constrained_layout=True)
        _draw_panel(axis, panel, runs)
        figure.savefig(out_dir / f"{panel.name}.png", dpi=110)
        plt.close(figure)
        drawn.append(panel)
    _draw_overview(drawn, runs, out_dir / "overview.png")
    probed = _draw_probe(runs, out_dir / "probe.png")
    summary = out_dir / "summary.md"
    text = _summary_markdown(runs, drawn)
    if probed:
        text += ("\n## Per-sample probe over checkpoints (`--mode=probe`)\n\nShare of mixed groups whose correct "
                 "responses lose likelihood after one isolated GRPO update (Eq. 3): the run's optimizer (solid) "
                 "and a fixed-size SGD step (dashed); right: mean Δ(x) of action 0 and in total.\n\n"
                 "![probe](probe.png)\n")
    summary.write_text(text, encoding="utf-8")
    return summary


def report_main(config) -> Path:
    """Entry point of ``--mode=report`` (see the module docstring for the command lines)."""
    section = _get(config, "report", {}) or {}
    compare = _get(section, "compare", "")
    workdirs = [w for w in (compare.split(",") if isinstance(compare, str) else list(compare)) if w]
    if not workdirs:
        workdir = _get(config, "workdir", "")
        if not workdir:
            raise InputError("--mode=report needs --config.workdir=RUN_DIR or --config.report.compare=RUN_A,RUN_B")
        workdirs = [workdir]
    out_dir = _get(section, "out_dir", "") or str(Path(workdirs[0]) / ("report" if len(workdirs) == 1 else "compare"))
    monitor = MonitorConfig.from_mapping(_get(config, "monitor", None))
    summary = write_report([load_run(w, monitor) for w in workdirs], out_dir)
    print(f"report written: {summary}")
    return summary


def _draw_panel(axis, panel: Panel, runs: Sequence[Run]) -> None:
    plt = _pyplot()
    single = len(runs) == 1
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for run_index, run in enumerate(runs):
        run_labelled = False
        for key_index, key in enumerate(panel.keys):
            values = run.series(key)
            if not np.isfinite(values).any():
                continue
            colour = colours[(key_index if single else run_index) % len(colours)]
            style = "-" if single else _STYLES[key_index % len(_STYLES)]
            # Compare: a run's colour and a key's line style each get one legend entry (not runs × keys).
            label = key if single else (None if run_labelled else run.name)
            run_labelled = True
            steps = run.steps
            axis.plot(steps, values, color=colour, alpha=0.25, linewidth=0.8)
            axis.plot(steps, _rolling_mean(values, 9), color=colour, linestyle=style, linewidth=1.6, label=label)
        if single:
            for span in phase_spans(run.reports):
                if span.phase in PHASE_COLOURS:
                    axis.axvspan(span.start_step, span.end_step + 1, color=PHASE_COLOURS[span.phase], alpha=0.18,
                                 label=f"phase {span.phase.name.lower().replace('_', ' ')}")
        else:
            for phase in PHASE_COLOURS:
                onset = run.onset(phase)
                if onset is not None:
                    axis.axvline(onset.step, color=colours[run_index % len(colours)],
                                 linestyle="--" if phase is Phase.STEADY_DECAY else ":", linewidth=1.2,
                                 label=f"{run.name}: phase {int(phase)} onset")
    if not single and len(panel.keys) > 1:
        for key_index, key in enumerate(panel.keys):
            axis.plot([], [], color="grey", linestyle=_STYLES[key_index % len(_STYLES)], label=key)
    if panel.log_y:
        axis.set_yscale("log")
    axis.set_title(panel.title, fontsize=10)
    axis.set_xlabel("step")
    axis.set_ylabel(panel.ylabel)
    axis.grid(alpha=0.3)
    handles, labels = axis.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    axis.legend(unique.values(), unique.keys(), fontsize=7, loc="best")


def _draw_overview(panels: Sequence[Panel], runs: Sequence[Run], path: Path) -> None:
    plt = _pyplot()
    columns = 2
    rows = max(1, math.ceil(len(panels) / columns))
    figure, axes = plt.subplots(rows, columns, figsize=(14, 3.6 * rows), constrained_layout=True, squeeze=False)
    for axis, panel in zip(axes.flat, panels):
        _draw_panel(axis, panel, runs)
    for axis in list(axes.flat)[len(panels):]:
        axis.set_visible(False)
    figure.savefig(path, dpi=90)
    plt.close(figure)


def _summary_markdown(runs: Sequence[Run], panels: Sequence[Panel]) -> str:
    title = runs[0].name if len(runs) == 1 else " vs ".join(run.name for run in runs)
    lines = [f"# Run report: {title}", "",
             "Phases from the death-spiral monitor replayed over the recorded metrics "
             "(I stagnation, II steady decay, III acceleration; paper §5.1). Single run: phase II "
             "shaded amber, III red. Compare: dashed line = a run's phase II onset, dotted = phase III. "
             "Thin lines are per-step values, thick ones a 9-step centred mean.", "",
             "| run | steps | phase II onset | phase III onset | reward first→last (max) | "
             "ll correct first→last | LLD rate last | grad norm median→max |",
             "|---|---|---|---|---|---|---|---|"]
    for run in runs:
        reward, ll = run.series(keys.REWARD_MEAN), run.series(keys.LL_CORRECT)
        grad, lld = run.series(keys.GRAD_NORM), run.series(keys.LLD_RATE)
        onsets = [run.onset(phase) for phase in (Phase.STEADY_DECAY, Phase.ACCELERATION)]
        lines.append(
            f"| {run.name} | {int(run.steps[0])}–{int(run.steps[-1])} | "
            + " | ".join(str(o.step) if o else "—" for o in onsets)
            + f" | {_edge(reward)} ({_fmt(np.nanmax(reward) if np.isfinite(reward).any() else math.nan)})"
            + f" | {_edge(ll)} | {_fmt(_last(lld))} | "
            + f"{_fmt(np.nanmedian(grad) if np.isfinite(grad).any() else math.nan)}→"
            + f"{_fmt(np.nanmax(grad) if np.isfinite(grad).any() else math.nan)} |")
    lines.append("")
    for run in runs:
        evidence = [r.message for r in run.reports if r.changed and r.message]
        if evidence:
            lines += [f"**{run.name}** monitor evidence:", ""] + [f"- {message}" for message in evidence] + [""]
    lines += ["![overview](overview.png)", ""]
    for panel in panels:
        lines += [f"## {panel.title}", "", f"![{panel.name}]({panel.name}.png)", ""]
    return "\n".join(lines)


def _rolling_mean(values: np.ndarray, width: int) -> np.ndarray:
    """Centered mean over finite values; gaps (nan) stay gaps; as long as ``values``."""
    finite = np.isfinite(values)
    kernel = np.ones(max(1, min(width, values.size)))  # np.convolve("same") returns the longer input
    sums = np.convolve(np.where(finite, values, 0.0), kernel, mode="same")
    counts = np.convolve(finite.astype(float), kernel, mode="same")
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(finite, sums / counts, np.nan)


def _edge(values: np.ndarray) -> str:
    finite = values[np.isfinite(values)]
    return f"{_fmt(finite[0])}→{_fmt(finite[-1])}" if finite.size else "—"


def _last(values: np.ndarray) -> float:
    finite = values[np.isfinite(values)]
    return float(finite[-1]) if finite.size else math.nan


def _fmt(value: float) -> str:
    return "—" if not math.isfinite(value) else f"{value:.3g}"


def _as_float(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _get(section, key: str, default):
    if section is None:
        return default
    if isinstance(section, Mapping) or hasattr(section, "get"):
        return section.get(key, default)
    return getattr(section, key, default)
