"""The lab's pre-registered criteria (issues 43 and 61), computed from runs' files (no judgement by eye).

    python -m llds_jax.lab.criteria RUN_GRPO [RUN_LLDS [RUN_KL]]     # JSON to stdout
    python -m llds_jax.lab.criteria --calibrate RUN [RUN ...]        # the monitor on recorded runs
    python -m llds_jax.lab.criteria --table LABEL=RUN [...]          # the results table (markdown)
    python -m llds_jax.lab.criteria --issue61 F1 W1 A1 A2           # issue 61: M±, E1–E3, decision

Reads ``<run>/metrics.jsonl`` (RL rows) and ``<run>/probe/<step>/probe.json``. The criteria, fixed
before the free-form runs (docs/death_spiral_lab.md, "Pre-registered criteria"):

(a) **phase II**: some window of ≥ ``PHASE_TWO_STEPS`` steps where the reward does not fall (OLS
    t of the per-step reward > −2), the action-0 log-odds of correct responses fall (OLS t ≤ −3),
    the probe's ``lld_share`` rises from ≤ 0.25 (first checkpoint in the window) to ≥ 0.4
    (last), and the 5-step median of ``grad/norm_per_active_row`` stays within 1.5× of the
    run's median up to the window's end;
(b) **acceleration before the fall**: within ``ACCELERATION_STEPS`` after that window the 5-step
    median entropy reaches 3× the window's mean and the 5-step median normalised grad norm 2×
    the window's median, at or before the first step whose 10-step reward is below half its
    peak so far;
(c) **LLDS protects**: the LLDS run's final 10-step reward ≥ 70 % of its own peak and ≥ GRPO's;
(d) **KL 0.02 protects less**: LLDS meets (c) and the KL run does not, or both do and LLDS's final
    10-step reward is higher (if KL protects as well, LLDS acts as a generic anchor here). The
    monitor half of (d) is :func:`calibrate_monitor`: settings are judged on stable runs (no fall)
    for false alarms first, then on the collapses for lead time.

The honest negative: (a) absent — the report says when the log-odds started to fall relative to
the break and what the probe share was.

Issue 61's criteria (M+, M−, E1–E3 and the decision rule) are the block near the end of this file,
committed before any of that issue's runs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from llds_jax.diagnostics import keys
from llds_jax.diagnostics.monitor import MonitorConfig, Phase, replay, window_slope
from llds_jax.diagnostics.report import load_probes, read_rows

PHASE_TWO_STEPS = 30
ACCELERATION_STEPS = 60
LOGODDS_KEY = keys.LOGODDS_CORRECT_FIRST


def series(rows, key: str) -> np.ndarray:
    return np.array([np.nan if row.get(key) is None else float(row[key]) for row in rows], np.float64)


def rolling(values: np.ndarray, width: int, fn=np.nanmean) -> np.ndarray:
    """Trailing statistic over the last ``width`` steps (fewer at the start); nan where all are nan."""
    out = np.full(values.shape, np.nan)
    for i in range(values.size):
        chunk = values[max(0, i - width + 1): i + 1]
        if np.isfinite(chunk).any():
            out[i] = fn(chunk)
    return out


def t_stat(steps: np.ndarray, values: np.ndarray) -> float:
    finite = np.isfinite(values)
    if finite.sum() < 3:
        return float("nan")
    return float(window_slope(zip(steps[finite].tolist(), values[finite].tolist()))[1])


def collapse_step(steps: np.ndarray, reward: np.ndarray) -> int | None:
    """First step whose 10-step reward is below half of its peak so far (None if never)."""
    r10 = rolling(reward, 10)
    peak = np.fmax.accumulate(np.where(np.isfinite(r10), r10, -np.inf))
    below = np.flatnonzero((r10 < 0.5 * peak) & (peak > 0))
    return int(steps[below[0]]) if below.size else None


def phase_two_windows(rows, probes, length: int = PHASE_TWO_STEPS) -> list[dict]:
    """Every window start at which all four (a) conditions hold (steps are the run's own)."""
    steps = series(rows, "step")
    reward, logodds = series(rows, keys.REWARD_MEAN), series(rows, LOGODDS_KEY)
    grad = series(rows, keys.GRAD_NORM_PER_ACTIVE_ROW)
    grad5 = rolling(grad, 5, np.nanmedian)
    shares = {p["step"]: p.get("lld_share") for p in probes}
    found = []
    for start in range(0, len(rows) - length + 1):
        end = start + length
        s, e = steps[start], steps[end - 1]
        inside = [shares[k] for k in sorted(shares) if s <= k <= e and shares[k] is not None]
        median = np.nanmedian(grad[:end]) if np.isfinite(grad[:end]).any() else np.nan
        checks = {
            "reward_t": t_stat(steps[start:end], reward[start:end]),
            "logodds_t": t_stat(steps[start:end], logodds[start:end]),
            "probe_share_first": inside[0] if inside else None,
            "probe_share_last": inside[-1] if inside else None,
            "grad_ratio_max": float(np.nanmax(np.maximum(grad5[start:end] / median, median / grad5[start:end])))
            if np.isfinite(median) and np.isfinite(grad5[start:end]).any() else float("nan"),
        }
        ok = (checks["reward_t"] > -2 and checks["logodds_t"] <= -3 and len(inside) >= 2
              and inside[0] <= 0.25 and inside[-1] >= 0.4 and checks["grad_ratio_max"] <= 1.5)
        if ok:
            found.append({"start": int(s), "end": int(e), **checks})
    return found


def acceleration(rows, window: dict, horizon: int = ACCELERATION_STEPS) -> dict:
    """(b) after a phase-II window: surge steps and the fall step, and whether the surges came first."""
    steps = series(rows, "step")
    entropy, grad = series(rows, keys.POLICY_ENTROPY), series(rows, keys.GRAD_NORM_PER_ACTIVE_ROW)
    inside = (steps >= window["start"]) & (steps <= window["end"])
    after = (steps > window["end"]) & (steps <= window["end"] + horizon)
    entropy5, grad5 = rolling(entropy, 5, np.nanmedian), rolling(grad, 5, np.nanmedian)
    first = lambda mask: int(steps[np.flatnonzero(mask)[0]]) if mask.any() else None  # noqa: E731
    entropy_step = first(after & (entropy5 >= 3 * np.nanmean(entropy[inside])))
    grad_step = first(after & (grad5 >= 2 * np.nanmedian(grad[inside])))
    fall = collapse_step(steps, series(rows, keys.REWARD_MEAN))
    ok = (entropy_step is not None and grad_step is not None and fall is not None
          and max(entropy_step, grad_step) <= fall <= window["end"] + horizon)
    return {"entropy_3x_step": entropy_step, "grad_2x_step": grad_step, "fall_step": fall, "ok": ok}


def describe(rows, probes) -> dict:
    """What a run did, whatever the criteria say: the numbers the report's table quotes."""
    steps, reward = series(rows, "step"), series(rows, keys.REWARD_MEAN)
    r10 = rolling(reward, 10)
    logodds = series(rows, LOGODDS_KEY)
    fall = collapse_step(steps, reward)
    out = {
        "steps": int(len(rows)),
        "entropy_step0": float(series(rows, keys.POLICY_ENTROPY)[0]) if rows else None,
        "identical_first_action_frac_mean": float(np.nanmean(series(rows, keys.IDENTICAL_FIRST_ACTION_FRAC))),
        "reward10_peak": float(np.nanmax(r10)), "reward10_peak_step": int(steps[np.nanargmax(r10)]),
        "reward10_final": float(r10[-1]), "fall_step": fall,
        "logodds0_first10": float(np.nanmean(logodds[:10])), "logodds0_last10": float(np.nanmean(logodds[-10:])),
        "logodds0_t_whole_run": t_stat(steps, logodds),
        "probe_lld_share": {int(p["step"]): p.get("lld_share") for p in probes},
        "probe_lld_share_sgd": {int(p["step"]): p.get("lld_share_sgd") for p in probes},
    }
    if fall is not None:  # when did the log-odds start falling, relative to the fall?
        before = steps <= fall
        out["logodds0_t_last30_before_fall"] = t_stat(steps[before][-30:], logodds[before][-30:])
        out["logodds0_t_last10_before_fall"] = t_stat(steps[before][-10:], logodds[before][-10:])
    return out


# The monitor as shipped (likelihood in nats, raw grad norm) and read on issue 43's quantities.
MONITORS = {
    "default": MonitorConfig(),
    "logodds": MonitorConfig(likelihood_key=LOGODDS_KEY, grad_norm_key=keys.GRAD_NORM_PER_ACTIVE_ROW),
    "logodds_w30": MonitorConfig(likelihood_key=LOGODDS_KEY, grad_norm_key=keys.GRAD_NORM_PER_ACTIVE_ROW,
                                 window=30, decay_t=4.0, patience=5),
}


def monitor_onsets(rows, fall_step: int | None) -> dict:
    """Per monitor setting: first phase-II and phase-III steps, and phase II's lead over the fall."""
    out = {}
    for name, config in MONITORS.items():
        reports = replay(rows, config)
        onset = {phase: next((r.step for r in reports if r.phase is phase and r.changed), None)
                 for phase in (Phase.STEADY_DECAY, Phase.ACCELERATION)}
        two = onset[Phase.STEADY_DECAY]
        out[name] = {"phase2": two, "phase3": onset[Phase.ACCELERATION],
                     "lead": None if two is None or fall_step is None else fall_step - two}
    return out


def protects(run: dict, grpo: dict) -> bool:
    """(c)'s rule for one regularised run's ``describe`` against its GRPO seed's."""
    return bool(run["reward10_final"] >= 0.7 * run["reward10_peak"] and run["reward10_final"] >= grpo["reward10_final"])


def evaluate(grpo_dir: str | Path, llds_dir: str | Path | None = None, kl_dir: str | Path | None = None) -> dict:
    rows, probes = read_rows(Path(grpo_dir) / "metrics.jsonl"), load_probes(grpo_dir)
    windows = phase_two_windows(rows, probes)
    result = {"run": str(grpo_dir), "describe": describe(rows, probes), "a_phase_two": bool(windows),
              "a_windows": windows[:3]}
    if windows:
        result["b_acceleration"] = acceleration(rows, windows[0])
    result["monitor"] = monitor_onsets(rows, result["describe"]["fall_step"])
    if llds_dir is not None:
        llds_rows = read_rows(Path(llds_dir) / "metrics.jsonl")
        llds = describe(llds_rows, load_probes(llds_dir))
        result["llds"] = {"run": str(llds_dir), "describe": llds,
                          "monitor": monitor_onsets(llds_rows, llds["fall_step"]),
                          "c_protects": protects(llds, result["describe"])}
    if kl_dir is not None:
        kl_rows = read_rows(Path(kl_dir) / "metrics.jsonl")
        kl = describe(kl_rows, load_probes(kl_dir))
        kl_ok = protects(kl, result["describe"])
        entry = {"run": str(kl_dir), "describe": kl, "monitor": monitor_onsets(kl_rows, kl["fall_step"]),
                 "protects_by_c": kl_ok}
        if llds_dir is not None:
            llds_ok = result["llds"]["c_protects"]
            entry["d_kl_protects_less"] = bool(llds_ok and (not kl_ok or result["llds"]["describe"]["reward10_final"]
                                                            > kl["reward10_final"]))
        result["kl"] = entry
    return result


def results_table(runs: dict[str, str | Path], monitor: MonitorConfig | None = None) -> list[str]:
    """One markdown row per run (label → run dir): the numbers docs/death_spiral_lab.md quotes."""
    monitor = monitor or MONITORS["logodds"]
    lines = ["| arm | steps | entropy step 0 | 10-step reward peak (step) → final | fall | valid actions 0–49 → last 10 "
             "| action-0 log-odds (correct) 0–9 / 40–49 / last 10 | t, last 30 before fall | entropy 40–49 → last 10 "
             "| grad norm per active row 40–49 → max (5-step median) | probe lld_share (step) | monitor phase II |",
             "|---" * 12 + "|"]
    for label, run_dir in runs.items():
        rows = read_rows(Path(run_dir) / "metrics.jsonl")
        d = describe(rows, load_probes(run_dir))
        valid, logodds = series(rows, keys.VALID_ACTION_RATE), series(rows, LOGODDS_KEY)
        entropy, grad = series(rows, keys.POLICY_ENTROPY), series(rows, keys.GRAD_NORM_PER_ACTIVE_ROW)
        two = next((r.step for r in replay(rows, monitor) if r.phase >= Phase.STEADY_DECAY), None)
        shares = ", ".join(f"{v:.2f} ({k})" for k, v in d["probe_lld_share"].items() if v is not None) or "—"
        fmt = lambda v: "—" if v is None or not np.isfinite(v) else f"{v:.2f}"  # noqa: E731
        mean = lambda v: np.nanmean(v) if np.isfinite(v).any() else np.nan  # noqa: E731
        median = lambda v: np.nanmedian(v) if np.isfinite(v).any() else np.nan  # noqa: E731
        lines.append(
            f"| {label} | {d['steps']} | {fmt(d['entropy_step0'])} | {d['reward10_peak']:.3f} ({d['reward10_peak_step']}) → "
            f"{d['reward10_final']:.3f} | {d['fall_step'] if d['fall_step'] is not None else 'none'} | "
            f"{fmt(mean(valid[:50]))} → {fmt(mean(valid[-10:]))} | {fmt(mean(logodds[:10]))} / "
            f"{fmt(mean(logodds[40:50]))} / {fmt(mean(logodds[-10:]))} | "
            f"{fmt(d.get('logodds0_t_last30_before_fall'))} | {fmt(mean(entropy[40:50]))} → "
            f"{fmt(mean(entropy[-10:]))} | {fmt(median(grad[40:50]))} → "
            f"{fmt(np.nanmax(rolling(grad, 5, np.nanmedian)) if np.isfinite(grad).any() else np.nan)} | {shares} | {two if two is not None else 'none'} |")
    return lines


# The monitor's phase-II rule on log-odds, over a grid: false alarms on stable runs first, then lead.
MONITOR_GRID = {
    f"w{window}_t{decay_t:g}_p{patience}": MonitorConfig(
        likelihood_key=LOGODDS_KEY, grad_norm_key=keys.GRAD_NORM_PER_ACTIVE_ROW,
        window=window, decay_t=decay_t, patience=patience)
    for window in (20, 30, 50) for decay_t in (3.0, 4.0, 5.0) for patience in (3, 5, 10)
}


def calibrate_monitor(run_dirs, grid: dict[str, MonitorConfig] | None = None) -> dict:
    """Replay each setting over recorded runs. A run is *stable* when its 10-step reward never falls
    below half its peak (:func:`collapse_step`); any phase II/III flag on it is a false alarm. On the
    others, lead = fall step − phase-II onset (negative: after the fall; None: never flagged).

    The chosen setting is the one with no false alarm and the largest smallest lead (ties: the
    most conservative, i.e. highest ``decay_t``, then ``patience``); with no stable run among the
    inputs nothing is chosen — false alarms cannot be measured, and a rule picked on the
    collapses alone would be fitted to them.
    """
    grid = MONITOR_GRID if grid is None else grid
    runs = {}
    for run_dir in run_dirs:
        rows = read_rows(Path(run_dir) / "metrics.jsonl")
        runs[str(run_dir)] = (rows, collapse_step(series(rows, "step"), series(rows, keys.REWARD_MEAN)))
    stable = sorted(name for name, (_, fall) in runs.items() if fall is None)
    table = {}
    for setting, config in grid.items():
        alarms, leads = [], {}
        for name, (rows, fall) in runs.items():
            reports = replay(rows, config)
            flagged = next((r.step for r in reports if r.phase >= Phase.STEADY_DECAY), None)
            if fall is None:
                if flagged is not None:
                    alarms.append(name)
            else:
                two = next((r.step for r in reports if r.phase is Phase.STEADY_DECAY and r.changed), None)
                leads[name] = None if two is None else fall - two
        known = [lead for lead in leads.values() if lead is not None]
        table[setting] = {"false_alarms": alarms, "leads": leads,
                          "min_lead": min(known) if known and len(known) == len(leads) else None}
    chosen = None
    if stable:
        quiet = [(table[s]["min_lead"], grid[s].decay_t, grid[s].patience, s) for s in table
                 if not table[s]["false_alarms"] and table[s]["min_lead"] is not None]
        chosen = max(quiet)[3] if quiet else None
    return {"stable_runs": stable, "collapsing_runs": {n: f for n, (_, f) in runs.items() if f is not None},
            "chosen": chosen, "settings": table}



# -- issue 61: pre-registered before its runs (the Gram probe, the ablations A1/A2, the decision) ----
#
# Fixed here before any of its runs; the runs' commits come after this one. Inputs are the Gram
# probe's subsets (``probe.json["gram"]["strata"][k]["subsets"]``: one record per random
# 8-member subset of a question's 16 responses with exactly k correct, carrying ``question``,
# ``margin`` = m₊₋ − m₊₊ and ``norm_ratio`` = ‖g₋‖/‖g₊‖) and the runs' ``metrics.jsonl`` rows.
# Pinned readings where the issue's text leaves a choice:
#   * the share at a stratum is pooled over its subsets (margin > 0 strictly);
#   * k* is chosen per checkpoint; a checkpoint without a stratum of ≥ 20 questions has no k*;
#   * M−'s upper 95 % bound is the Wilson score bound (two-sided 95 %, z = 1.96) with n = the
#     stratum's *questions*, not its subsets: a question's subsets share its 16 gradients, so the
#     question is the independent unit and counting subsets would overstate n up to 50×;
#   * Spearman is over the k* subsets of the same checkpoint (average ranks for ties);
#   * M+ holds in a world when one of its probed checkpoints meets all three clauses; M− needs
#     every probed checkpoint of both worlds (each with a k*) to meet both of its clauses;
#   * "break" is the lab pages' rule: the first step whose 10-step trailing valid-action or
#     finished rate is below 0.5; "last-10" is the mean over the run's last 10 logged steps;
#   * thresholds compare with ``TOL`` slack, so a share of counts that equals one exactly
#     (0.30 − 0.10 is 0.19999999999999998 in floats) meets it.

GRAM_STRATA = (1, 2, 4, 6)
KSTAR_MIN_QUESTIONS = 20
M_PLUS_SHARE, M_PLUS_RISE, M_PLUS_SPEARMAN = 0.30, 0.20, 0.3
M_MINUS_SHARE, M_MINUS_UPPER = 0.10, 0.20
WILSON_Z = 1.959963984540054
E1_MAX_ENTROPY = 1.5  # nats/token, A1's last 10 steps (GRPO s1 reached 7.15)
E2_MAX_SHIFT = 15  # steps between A1's and F1's breaks
E3_MIN_ENTROPY, E3_MAX_VALID = 3.0, 0.5
BREAK_RATE = 0.5
TOL = 1e-9
FINISHED_KEY = "rollout/finished"


def wilson_upper(share: float, n: int, z: float = WILSON_Z) -> float:
    """Upper end of the Wilson score interval for an observed share over n units (1.0 when n = 0)."""
    if n <= 0:
        return 1.0
    centre = share + z * z / (2 * n)
    spread = z * np.sqrt(share * (1 - share) / n + z * z / (4 * n * n))
    return float(min(1.0, (centre + spread) / (1 + z * z / n)))


def _ranks(values: np.ndarray) -> np.ndarray:
    order = np.argsort(values, kind="mergesort")
    ranks = np.empty(len(values))
    ranks[order] = np.arange(len(values), dtype=np.float64)
    for value in np.unique(values):  # ties share their average rank
        tied = values == value
        ranks[tied] = ranks[tied].mean()
    return ranks


def spearman(x, y) -> float:
    """Spearman's rank correlation; nan with fewer than 3 finite pairs or a constant side."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    keep = np.isfinite(x) & np.isfinite(y)
    x, y = x[keep], y[keep]
    if x.size < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return float("nan")
    return float(np.corrcoef(_ranks(x), _ranks(y))[0, 1])


def stratum_stats(subsets: list[dict]) -> dict:
    """Share of subsets with m₊₋ > m₊₊, its Wilson bound over questions, and Spearman(ratio, margin)."""
    margins = np.array([s["margin"] for s in subsets], np.float64)
    questions = len({s["question"] for s in subsets})
    share = float(np.mean(margins > 0)) if margins.size else float("nan")
    return {"subsets": int(margins.size), "questions": questions, "share": share,
            "upper95": wilson_upper(share, questions) if questions else 1.0,
            "spearman": spearman([s["norm_ratio"] for s in subsets], margins)}


def k_star(strata: dict) -> int | None:
    """The highest stratum k with ≥ ``KSTAR_MIN_QUESTIONS`` questions (None if none has)."""
    full = [int(k) for k, subsets in strata.items()
            if len({s["question"] for s in subsets}) >= KSTAR_MIN_QUESTIONS]
    return max(full) if full else None


def checkpoint_displacement(strata: dict) -> dict:
    """M+ and M− clauses at one checkpoint; ``strata`` maps k (int or str) → subset records."""
    strata = {int(k): list(v) for k, v in strata.items()}
    star = k_star(strata)
    out = {"k_star": star, "m_plus": False, "m_minus": False}
    if star is None:
        return out
    top = stratum_stats(strata[star])
    one = stratum_stats(strata.get(1, []))
    rise = top["share"] - one["share"]
    out.update(share_k_star=top["share"], share_k1=one["share"], rise=rise, upper95=top["upper95"],
               spearman=top["spearman"], questions_k_star=top["questions"], subsets_k_star=top["subsets"])
    out["m_plus"] = bool(top["share"] >= M_PLUS_SHARE - TOL and rise >= M_PLUS_RISE - TOL
                         and top["spearman"] >= M_PLUS_SPEARMAN - TOL)
    out["m_minus"] = bool(top["share"] <= M_MINUS_SHARE + TOL and top["upper95"] <= M_MINUS_UPPER + TOL)
    return out


def displacement_verdict(free_form: list[dict], first_world: list[dict]) -> dict:
    """M+ / M− / inconclusive from each world's checkpoints (each a ``strata`` dict)."""
    worlds = {"free_form": [checkpoint_displacement(c) for c in free_form],
              "first_world": [checkpoint_displacement(c) for c in first_world]}
    m_plus = {w: any(c["m_plus"] for c in cs) for w, cs in worlds.items()}
    m_minus = all(cs and all(c["m_minus"] for c in cs) for cs in worlds.values())
    verdict = "M+" if any(m_plus.values()) else "M-" if m_minus else "inconclusive"
    return {"verdict": verdict, "m_plus": m_plus, "m_minus": bool(m_minus), "checkpoints": worlds}


def decision(verdict: dict) -> str:
    """The issue's decision rule on :func:`displacement_verdict`'s output."""
    if verdict["m_plus"]["free_form"]:
        return "M+ in the free-form world: describe (do not run) the one paper-like world it justifies"
    if verdict["m_plus"]["first_world"]:
        return "M+ only in the first world: that world is the better testbed"
    if verdict["m_minus"]:
        return "M-: the lab is closed as science and stays as a test fixture and a tool"
    return "inconclusive: reported as such"


def break_step(rows) -> int | None:
    """First step whose 10-step trailing valid-action or finished rate is below ``BREAK_RATE``."""
    steps = series(rows, "step")
    low = np.zeros(len(rows), bool)
    for key in (keys.VALID_ACTION_RATE, FINISHED_KEY):
        rate = rolling(series(rows, key), 10)
        low |= np.isfinite(rate) & (rate < BREAK_RATE)
    hit = np.flatnonzero(low)
    return int(steps[hit[0]]) if hit.size else None


def last10(rows, key: str) -> float | None:
    """Mean of ``key`` over the run's last 10 rows (None when it was never logged there)."""
    values = series(rows[-10:], key)
    return float(np.nanmean(values)) if np.isfinite(values).any() else None


def ablation_checks(f1_rows, a1_rows, a2_rows) -> dict:
    """E1–E3 (None: not evaluable, e.g. A1 without ``policy/entropy`` or F1 without a break)."""
    a1_entropy, a2_entropy = last10(a1_rows, keys.POLICY_ENTROPY), last10(a2_rows, keys.POLICY_ENTROPY)
    a2_valid = last10(a2_rows, keys.VALID_ACTION_RATE)
    f1_break, a1_break = break_step(f1_rows), break_step(a1_rows)
    e1 = None if a1_entropy is None else a1_entropy <= E1_MAX_ENTROPY + TOL
    e2 = None if f1_break is None else a1_break is not None and abs(a1_break - f1_break) <= E2_MAX_SHIFT
    e3 = None if a2_entropy is None and a2_valid is None else bool(
        (a2_entropy is not None and a2_entropy >= E3_MIN_ENTROPY - TOL) or (a2_valid is not None and a2_valid < E3_MAX_VALID))
    return {"E1_surge_is_the_bonus": e1, "E2_break_is_lr_driven": e2, "E3_containment_is_anchoring": e3,
            "f1_break": f1_break, "a1_break": a1_break, "a1_last10_entropy": a1_entropy,
            "a2_last10_entropy": a2_entropy, "a2_last10_valid": a2_valid}


def gram_strata(run_dir: str | Path) -> list[dict]:
    """Each probed checkpoint's Gram strata (``probe.json["gram"]["strata"]``), by step."""
    return [p["gram"]["strata"] for p in load_probes(run_dir) if p.get("gram")]


def issue61(f1: str | Path, w1: str | Path, a1: str | Path, a2: str | Path) -> dict:
    """The result table's inputs: M±, E1–E3 and the decision from the four runs' directories."""
    verdict = displacement_verdict(gram_strata(f1), gram_strata(w1))
    rows = [read_rows(Path(run) / "metrics.jsonl") for run in (f1, a1, a2)]
    return {**verdict, "decision": decision(verdict), "ablations": ablation_checks(*rows)}

if __name__ == "__main__":
    if sys.argv[1:2] == ["--table"]:  # --table label=RUN ...
        print("\n".join(results_table(dict(arg.split("=", 1) for arg in sys.argv[2:]))))
    elif sys.argv[1:2] == ["--issue61"]:  # --issue61 F1 W1 A1 A2
        print(json.dumps(issue61(*sys.argv[2:6]), indent=1, default=str))
    elif sys.argv[1:2] == ["--calibrate"]:
        print(json.dumps(calibrate_monitor(sys.argv[2:]), indent=1, default=str))
    else:
        print(json.dumps(evaluate(*sys.argv[1:4]), indent=1, default=str))
