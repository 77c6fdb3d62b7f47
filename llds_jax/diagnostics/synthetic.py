"""Synthetic metric streams shaped like the paper's Fig. 2, with known phase boundaries.

Used to test the monitor and the report without a training run, and to demo
``--mode=report``. Shapes follow §5.1 and Fig. 2/4: in phase I the likelihood of correct
responses is flat while reward rises; in phase II it drifts down linearly, reward grows
slowly and the gradient norm is stable; in phase III the likelihood falls faster and
faster, gradient norm and entropy grow exponentially and reward falls. Every stream gets
i.i.d. noise at the scale of a per-step batch estimate.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from llds_jax.diagnostics import keys


@dataclasses.dataclass(frozen=True)
class SpiralShape:
    steps: int = 200
    phase_two_start: int = 60
    phase_three_start: int = 120
    likelihood_start: float = -0.25  # nats/token of correct responses in phase I
    decay_per_step: float = 8e-4  # phase II drift, nats/token per step
    likelihood_noise: float = 0.01
    acceleration: float = 4e-5  # phase III extra drop: acceleration · (t − t3)², nats/token
    grad_norm: float = 0.4
    grad_noise: float = 0.15  # log-normal σ
    grad_growth: float = 0.05  # phase III exponential rate per step
    entropy: float = 0.6


def death_spiral_run(seed: int, shape: SpiralShape = SpiralShape()) -> list[dict[str, float]]:
    """Metric rows (with ``step``) of a run that goes through phases I → II → III."""
    rng = np.random.default_rng(seed)
    t = np.arange(shape.steps, dtype=np.float64)
    t2, t3 = shape.phase_two_start, shape.phase_three_start
    in_two = np.clip(t - t2, 0, None)
    in_three = np.clip(t - t3, 0, None)
    likelihood = shape.likelihood_start - shape.decay_per_step * in_two - shape.acceleration * in_three**2
    grad_norm = shape.grad_norm * np.exp(shape.grad_growth * in_three)
    entropy = shape.entropy + 3e-4 * t + shape.entropy * (np.exp(0.02 * in_three) - 1)
    reward = np.where(t < t3, 0.1 + 0.25 * (1 - np.exp(-t / 40)), 0.0)
    reward = np.where(t >= t3, (0.1 + 0.25 * (1 - np.exp(-t3 / 40))) * np.exp(-0.04 * in_three), reward)
    lld_rate = 0.3 + 0.2 * np.minimum(in_two / max(t3 - t2, 1), 1) + 0.4 * (1 - np.exp(-in_three / 20))
    return _rows(rng, t, likelihood, grad_norm, entropy, reward, lld_rate, shape)


def stable_run(seed: int, steps: int = 1000, *, likelihood_rise_per_step: float = 0.0,
               shape: SpiralShape = SpiralShape()) -> list[dict[str, float]]:
    """A healthy run: flat or rising likelihood, stable gradient norm and entropy."""
    rng = np.random.default_rng(seed)
    t = np.arange(steps, dtype=np.float64)
    likelihood = shape.likelihood_start + likelihood_rise_per_step * t
    reward = 0.1 + 0.35 * (1 - np.exp(-t / 100))
    return _rows(rng, t, likelihood, np.full_like(t, shape.grad_norm), np.full_like(t, shape.entropy),
                 reward, np.full_like(t, 0.3), shape)


def _rows(rng, t, likelihood, grad_norm, entropy, reward, lld_rate, shape: SpiralShape) -> list[dict[str, float]]:
    n = len(t)
    ll_correct = likelihood + rng.normal(0, shape.likelihood_noise, n)
    ll_incorrect = likelihood - 0.3 + rng.normal(0, 2 * shape.likelihood_noise, n)
    # First action decays faster than the second in the spiral (paper Fig. 5).
    ll_first = likelihood + 0.05 + 1.5 * (likelihood - likelihood[0]) + rng.normal(0, shape.likelihood_noise, n)
    ll_second = likelihood - 0.05 + 0.5 * (likelihood - likelihood[0]) + rng.normal(0, shape.likelihood_noise, n)
    grad = grad_norm * np.exp(rng.normal(0, shape.grad_noise, n))
    columns = {
        keys.REWARD_MEAN: np.clip(reward + rng.normal(0, 0.03, n), 0, 1),
        keys.LL_CORRECT: ll_correct,
        keys.LL_INCORRECT: ll_incorrect,
        "diag/ll_correct/action0": ll_first,
        "diag/ll_correct/action1": ll_second,
        "diag/ll_incorrect/action0": ll_first - 0.3 + rng.normal(0, shape.likelihood_noise, n),
        "diag/ll_incorrect/action1": ll_second - 0.3 + rng.normal(0, shape.likelihood_noise, n),
        keys.LLD_RATE: np.clip(lld_rate + rng.normal(0, 0.05, n), 0, 1),
        keys.GRAD_NORM: grad,
        keys.POLICY_ENTROPY: entropy * np.exp(rng.normal(0, 0.03, n)),
        keys.SEARCHES: np.clip(1.0 + rng.normal(0, 0.05, n), 0, None),
        keys.VALID_ACTION_RATE: np.clip(0.97 + rng.normal(0, 0.01, n), 0, 1),
        "rollout/response_tokens": 400 + rng.normal(0, 10, n),
        keys.LLDS_VALUE: np.abs(rng.normal(0.002, 0.001, n)),
    }
    return [{"step": int(step), **{k: float(v[i]) for k, v in columns.items()}} for i, step in enumerate(t)]
