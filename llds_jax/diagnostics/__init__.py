"""Death-spiral diagnostics (paper §5, SPEC §8): per-step metrics, an online monitor, run reports.

The metrics contract
--------------------
The trainer appends one flat JSON object per step to ``<workdir>/metrics.jsonl``. The
report and the monitor read the keys below; any other keys are carried along untouched.
Values are floats; ``NaN`` (Python's ``json`` writes it) marks "no samples this step".

===============================  ========================================================
key                              meaning (unit)
===============================  ========================================================
``step``                         optimizer-step counter of the rollout batch (int)
``reward/mean``                  mean EM reward of the step's rollouts
``grad/norm_preclip``            global gradient norm before clipping (mean over the
                                 step's mini-batch updates)
``kl/mean``                      k3 KL to the reference, token mean
``ratio/max``, ``ratio/clip_frac``  from :func:`per_action.ratio_statistics`
``llds/value``                   LLDS penalty before λ, token mean
``llds/lambda``                  λ in use this step (the monitor may raise it)
``llds/gate_frac_actions``       share of preserved actions whose gate was on
``llds/gate_frac_responses``     share of preserved responses with any active action
``time/step_s``                  wall time of the whole step (s); other ``time/*`` free
``diag/...``                     :func:`step_metrics.step_diagnostics` output:
``diag/ll_correct/action{k}``    mean token log-lik. under π_old of correct (A > 0)
                                 responses' action k (nats/token); also ``/later`` (k ≥ 1)
                                 and ``/all``; same for ``diag/ll_incorrect/...``
``diag/lld_rate``                share of correct responses with Δ = Σ(logπ_new − logπ_old)
                                 ≤ 0 after the step's updates; ``/action{k}`` per action
``diag/delta_correct/all``       mean Δ of correct responses (nats/response)
``diag/entropy``                 token-mean entropy over action tokens (nats)
``diag/response_length/mean``    response tokens incl. feedback; ``diag/action_tokens/mean``
``diag/searches/mean``           valid searches per trajectory
``diag/valid_action_rate``       valid actions / actions taken
``diag/finished_rate``           share of trajectories that gave an ``<answer>``
``diag/first_action_correct_rate``  paper §5.3 (see :mod:`step_metrics`)
``monitor/phase``                1, 2, 3 from :class:`monitor.DeathSpiralMonitor`; also
                                 ``monitor/ll_slope``, ``monitor/ll_t_stat``, ``monitor/*_surge_ratio``
===============================  ========================================================

What the trainer calls each step
--------------------------------
1. ``step_diagnostics(response_batch_from_rollout(rollout, advantage=, reward=,
   old_logprobs=, num_action_slots=max_turns + 1, new_logprobs=None, token_entropy=None))``
   → dict (``diag/*``); :mod:`from_rollout` turns the ``RolloutBatch`` and ``[N, L]``
   token arrays into the per-response :class:`ResponseBatch` (``new_logprobs`` is the
   switchable extra forward pass after the step's updates that gives Δ and the LLD rate);
2. ``report = monitor.update(step, metrics)`` → log ``report.as_metrics()``; act on
   ``report.action`` (``STOP``: save a checkpoint and stop; ``RAISE_LAMBDA``: use
   ``report.llds_lambda`` from the next step on). Build the monitor once with
   ``DeathSpiralMonitor(MonitorConfig.from_mapping(config.get("monitor")), llds_lambda=λ)``;
   on resume call ``monitor.warm_up(report.load_metrics(workdir / "metrics.jsonl"))``.
"""

from llds_jax.diagnostics.from_rollout import response_batch_from_rollout
from llds_jax.diagnostics.monitor import (
    Action,
    DeathSpiralMonitor,
    MonitorConfig,
    MonitorReport,
    Phase,
    replay,
)
from llds_jax.diagnostics.step_metrics import ResponseBatch, step_diagnostics

LIKELIHOOD_KEY = "diag/ll_correct/all"
REPORTED_KEYS = (
    "reward/mean", "grad/norm_preclip", "kl/mean", "ratio/max", "ratio/clip_frac", "llds/value", "llds/lambda",
    "diag/ll_correct/all", "diag/ll_incorrect/all", "diag/lld_rate", "diag/entropy", "diag/searches/mean",
    "diag/valid_action_rate", "diag/response_length/mean", "diag/first_action_correct_rate",
)

__all__ = [
    "Action", "DeathSpiralMonitor", "MonitorConfig", "MonitorReport", "Phase", "ResponseBatch",
    "replay", "response_batch_from_rollout", "step_diagnostics", "LIKELIHOOD_KEY", "REPORTED_KEYS",
]
