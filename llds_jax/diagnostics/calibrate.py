"""Measure the monitor's detection delay and false-alarm rate on synthetic streams.

    python -m llds_jax.diagnostics.calibrate --seeds=50

For each setting: over ``seeds`` Fig. 2-shaped runs (II at step 60, III at 120), when
phase II and III are first flagged and how often II is flagged in time (before step
120); over ``seeds`` stable 1,000-step runs (flat and rising likelihood), how many raise
any flag, and the most negative likelihood t-statistic seen (the margin to ``decay_t``).
The numbers behind the defaults (docs/decisions.md, Diagnostics) come from here.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from absl import app, flags

from llds_jax.diagnostics.monitor import MonitorConfig, Phase, replay
from llds_jax.diagnostics.synthetic import SpiralShape, death_spiral_run, stable_run

_SEEDS = flags.DEFINE_integer("seeds", 50, "synthetic runs per kind")


def measure(config: MonitorConfig, seeds: int, shape: SpiralShape = SpiralShape()) -> dict[str, float]:
    first_two, first_three = [], []
    for seed in range(seeds):
        reports = replay(death_spiral_run(seed, shape), config)
        first_two.append(next((r.step for r in reports if r.phase >= Phase.STEADY_DECAY), math.inf))
        first_three.append(next((r.step for r in reports if r.phase is Phase.ACCELERATION), math.inf))
    alarms, lowest_t = 0, math.inf
    for seed in range(seeds):
        for rise in (0.0, 2e-4):
            reports = replay(stable_run(10_000 + seed, 1000, likelihood_rise_per_step=rise), config)
            alarms += any(r.phase is not Phase.STAGNATION for r in reports)
            lowest_t = min(lowest_t, min((r.ll_t_stat for r in reports if math.isfinite(r.ll_t_stat)), default=math.inf))
    first_two, first_three = np.array(first_two), np.array(first_three)
    return {
        "II in time": float(np.mean(first_two < shape.phase_three_start)),
        "II delay median": float(np.median(first_two - shape.phase_two_start)),
        "II delay max": float(np.max(first_two - shape.phase_two_start)),
        "III delay median": float(np.median(first_three - shape.phase_three_start)),
        "stable runs flagged": alarms / (2 * seeds),
        "lowest stable t": lowest_t,
    }


def main(argv):
    del argv
    settings = {
        "defaults": MonitorConfig(),
        "patience=1": dataclasses.replace(MonitorConfig(), patience=1),
        "decay_t=3": dataclasses.replace(MonitorConfig(), decay_t=3.0),
        "window=30": dataclasses.replace(MonitorConfig(), window=30),
        "window=80": dataclasses.replace(MonitorConfig(), window=80),
    }
    results = {name: measure(config, _SEEDS.value) for name, config in settings.items()}
    columns = list(next(iter(results.values())))
    print("| setting | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for name, row in results.items():
        print(f"| {name} | " + " | ".join(f"{row[c]:.3g}" for c in columns) + " |")


if __name__ == "__main__":
    app.run(main)
