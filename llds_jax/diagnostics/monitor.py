"""Online early warning for the LLD death spiral (paper §5.1, Fig. 2; SPEC §8).

The paper's three phases, as this monitor decides them from the per-step metrics:

- **I, early stagnation** — the default: no significant downward trend in the mean
  log-likelihood of correct responses.
- **II, steady decay** — the least-squares slope of that likelihood over the last
  ``window`` steps is significantly negative (t-statistic ≤ −``decay_t``) for
  ``patience`` consecutive steps, while the gradient norm is still stable. Reward may
  still be rising here; that is the point of watching likelihood instead.
- **III, acceleration** — the gradient norm (or the token entropy) surges: the median of
  the last ``surge_window`` steps is ``surge_ratio`` times the median of the ``window``
  steps before them. Latched: once the spiral accelerates the run does not recover.

Why these statistics: per-step likelihood estimates are noisy (fresh questions every
step), so a single drop means nothing; a t-statistic over a window scales the trend by
its own noise, so one threshold works for any model or batch size. Medians make the
surge test immune to one-off gradient spikes. ``patience`` turns rare chance excursions
of the t-statistic on a flat stream into a negligible false-alarm rate (measured in
docs/decisions.md, Diagnostics). Phase II is released back to I after ``window``
consecutive steps without the decay condition, so a raised λ can be judged on fresh data.

On entering phase II the monitor returns an action (``on_phase_two``): ``log``,
``stop`` (the trainer saves a checkpoint and stops) or ``raise_lambda`` (multiply λ by
``lambda_factor``; a zero λ becomes ``lambda_when_zero``; capped at ``lambda_max``). After a
λ raise the likelihood window restarts, so the next decision uses post-raise steps only.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections import deque
from collections.abc import Iterable, Mapping

import numpy as np

from llds_jax.diagnostics import keys


class Phase(enum.IntEnum):
    STAGNATION = 1
    STEADY_DECAY = 2
    ACCELERATION = 3


class Action(enum.StrEnum):
    NONE = "none"
    LOG = "log"
    STOP = "stop"
    RAISE_LAMBDA = "raise_lambda"


@dataclasses.dataclass(frozen=True)
class MonitorConfig:
    likelihood_key: str = keys.LL_CORRECT
    grad_norm_key: str = keys.GRAD_NORM
    entropy_key: str = keys.POLICY_ENTROPY
    window: int = 50
    decay_t: float = 4.0
    patience: int = 5
    surge_window: int = 10
    surge_ratio: float = 2.0
    entropy_surge_ratio: float = 2.0
    on_phase_two: str = "log"
    on_phase_three: str = "log"
    lambda_factor: float = 2.0
    lambda_when_zero: float = 0.1
    lambda_max: float = 1.0

    def __post_init__(self):
        for name in ("on_phase_two", "on_phase_three"):
            if getattr(self, name) not in {a.value for a in Action} - {Action.NONE.value}:
                raise ValueError(f"{name}={getattr(self, name)!r}; choose log, stop or raise_lambda")
        if self.window < 3 or self.surge_window < 1 or self.patience < 1:
            raise ValueError(f"window ≥ 3, surge_window ≥ 1 and patience ≥ 1 required: {self}")

    @classmethod
    def from_mapping(cls, values: Mapping | None) -> MonitorConfig:
        """From a config section (e.g. ``config.monitor``); unknown keys fail loudly.

        An ``enabled`` key is allowed and ignored here: whether to run the monitor at all
        is the trainer's decision, the settings are the monitor's.
        """
        if values is not None and hasattr(values, "to_dict"):
            values = values.to_dict()
        values = {k: v for k, v in dict(values or {}).items() if k != "enabled"}
        unknown = set(values) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown monitor settings {sorted(unknown)}")
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class MonitorReport:
    """What the monitor concluded at one step, with the numbers it concluded it from."""

    step: int
    phase: Phase
    changed: bool  # phase differs from the previous step's
    action: Action
    llds_lambda: float  # λ to use from now on (changed only by RAISE_LAMBDA)
    ll_slope: float  # nats/token per step, least squares over the window (nan until full)
    ll_t_stat: float
    grad_surge_ratio: float  # recent median / baseline median (nan until enough steps)
    entropy_surge_ratio: float
    message: str = ""

    def as_metrics(self) -> dict[str, float]:
        return {
            "monitor/phase": float(self.phase),
            "monitor/ll_slope": self.ll_slope,
            "monitor/ll_t_stat": self.ll_t_stat,
            "monitor/grad_surge_ratio": self.grad_surge_ratio,
            "monitor/entropy_surge_ratio": self.entropy_surge_ratio,
        }


class DeathSpiralMonitor:
    """Feed it each step's metrics dict; it returns a :class:`MonitorReport`.

    Missing or non-finite values are skipped (a step without correct responses has no
    likelihood), so windows count observed steps, and slopes use the real step numbers.
    """

    def __init__(self, config: MonitorConfig = MonitorConfig(), *, llds_lambda: float = 0.0):
        self.config = config
        self.llds_lambda = float(llds_lambda)
        self.phase = Phase.STAGNATION
        self._likelihood: deque[tuple[int, float]] = deque(maxlen=config.window)
        history = config.window + config.surge_window
        self._grad_norm: deque[float] = deque(maxlen=history)
        self._entropy: deque[float] = deque(maxlen=history)
        self._decay_streak = 0
        self._calm_streak = 0

    def update(self, step: int, metrics: Mapping[str, float]) -> MonitorReport:
        cfg = self.config
        _append_finite(self._likelihood, metrics.get(cfg.likelihood_key), lambda v: (step, v))
        _append_finite(self._grad_norm, metrics.get(cfg.grad_norm_key))
        _append_finite(self._entropy, metrics.get(cfg.entropy_key))

        slope, t_stat = window_slope(self._likelihood) if len(self._likelihood) == cfg.window else (math.nan, math.nan)
        grad_surge = surge_ratio(self._grad_norm, cfg.surge_window)
        entropy_surge = surge_ratio(self._entropy, cfg.surge_window)

        decaying = t_stat <= -cfg.decay_t
        self._decay_streak = self._decay_streak + 1 if decaying else 0
        self._calm_streak = 0 if decaying else self._calm_streak + 1
        surging = grad_surge >= cfg.surge_ratio or entropy_surge >= cfg.entropy_surge_ratio

        previous = self.phase
        if self.phase is Phase.ACCELERATION or surging:
            self.phase = Phase.ACCELERATION
        elif self._decay_streak >= cfg.patience:
            self.phase = Phase.STEADY_DECAY
        elif self.phase is Phase.STEADY_DECAY and self._calm_streak >= cfg.window:
            self.phase = Phase.STAGNATION

        action, message = Action.NONE, ""
        if self.phase is not previous:
            evidence = (f"likelihood slope {slope:+.2e}/step (t={t_stat:.1f}), "
                        f"grad-norm surge ×{grad_surge:.2f}, entropy surge ×{entropy_surge:.2f}")
            message = f"step {step}: phase {previous.name} → {self.phase.name}; {evidence}"
            if self.phase is Phase.STEADY_DECAY:
                action = Action(cfg.on_phase_two)
            elif self.phase is Phase.ACCELERATION:
                action = Action(cfg.on_phase_three)
            if action is Action.RAISE_LAMBDA:
                action, message = self._raise_lambda(message)
        return MonitorReport(step, self.phase, self.phase is not previous, action, self.llds_lambda,
                             slope, t_stat, grad_surge, entropy_surge, message)

    @property
    def reads(self) -> tuple[str, ...]:
        """The metric keys :meth:`update` and :meth:`warm_up` read (besides ``step``)."""
        cfg = self.config
        return cfg.likelihood_key, cfg.grad_norm_key, cfg.entropy_key, keys.LLDS_LAMBDA

    def warm_up(self, rows: Iterable[Mapping[str, float]]) -> None:
        """Replay a resumed run's recorded rows (each with ``step``) through :meth:`update`, acting on nothing.

        Windows, streaks and phase end as the uninterrupted run left them: each row's recorded
        ``llds/lambda`` is the λ its step ran with, so a ``raise_lambda`` in the history restarts
        the likelihood window where it did. The actions the replay returns are dropped (the run
        acted on them before it stopped), and λ ends as given to the constructor — the
        checkpoint's, which the trainer restores. Rows: ``MetricsWriter.rows_before(step)``.
        """
        in_force = self.llds_lambda
        for row in rows:
            recorded = row.get(keys.LLDS_LAMBDA)
            if recorded is not None and math.isfinite(float(recorded)):
                self.llds_lambda = float(recorded)
            self.update(int(row["step"]), row)
        self.llds_lambda = in_force

    def _raise_lambda(self, message: str) -> tuple[Action, str]:
        cfg = self.config
        old = self.llds_lambda
        raised = old * cfg.lambda_factor if old > 0 else cfg.lambda_when_zero
        self.llds_lambda = min(raised, cfg.lambda_max)
        if self.llds_lambda <= old:
            return Action.LOG, f"{message}; λ already at lambda_max={cfg.lambda_max}"
        # Judge the new λ on post-raise steps only.
        self._likelihood.clear()
        self._decay_streak = 0
        if self.phase is Phase.STEADY_DECAY:
            self.phase = Phase.STAGNATION
        return Action.RAISE_LAMBDA, f"{message}; λ {old:g} → {self.llds_lambda:g}"


def window_slope(points: Iterable[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares slope of ``(step, value)`` points and its t-statistic (slope / std. error)."""
    steps, values = np.array(list(points), dtype=np.float64).T
    x = steps - steps.mean()
    sxx = float(x @ x)
    if sxx == 0.0:
        return math.nan, math.nan
    slope = float(x @ (values - values.mean())) / sxx
    residual = values - values.mean() - slope * x
    dof = len(values) - 2
    stderr = math.sqrt(float(residual @ residual) / dof / sxx) if dof > 0 else math.nan
    if stderr == 0.0:
        return slope, math.copysign(math.inf, slope) if slope else 0.0
    return slope, slope / stderr


def surge_ratio(values: deque[float] | list[float], recent: int) -> float:
    """Median of the last ``recent`` values over the median of the ones before (nan if too few)."""
    values = list(values)
    if len(values) < 2 * recent:
        return math.nan
    baseline = float(np.median(values[:-recent]))
    return float(np.median(values[-recent:])) / baseline if baseline > 0 else math.nan


@dataclasses.dataclass(frozen=True)
class PhaseSpan:
    phase: Phase
    start_step: int
    end_step: int  # inclusive


def replay(rows: Iterable[Mapping[str, float]], config: MonitorConfig = MonitorConfig()) -> list[MonitorReport]:
    """Run a log-only monitor over recorded metric rows (each with a ``step``), e.g. for a report."""
    monitor = DeathSpiralMonitor(dataclasses.replace(config, on_phase_two="log", on_phase_three="log"))
    return [monitor.update(int(row["step"]), row) for row in rows]


def phase_spans(reports: Iterable[MonitorReport]) -> list[PhaseSpan]:
    """Consecutive steps of the same phase merged into spans."""
    spans: list[PhaseSpan] = []
    for report in reports:
        if spans and spans[-1].phase is report.phase:
            spans[-1] = dataclasses.replace(spans[-1], end_step=report.step)
        else:
            spans.append(PhaseSpan(report.phase, report.step, report.step))
    return spans


def _append_finite(buffer: deque, value, wrap=lambda v: v) -> None:
    if value is None:
        return
    value = float(value)
    if math.isfinite(value):
        buffer.append(wrap(value))
