"""Death-spiral diagnostics (paper §5, SPEC §8): per-step metrics, an online monitor, run reports.

The metrics contract
--------------------
The trainer appends one flat JSON object per step to ``<workdir>/metrics.jsonl``. Every key,
its unit, its meaning and how it is combined over hosts and mini-batches is in one table,
:data:`keys.TABLE` (``llds_jax/diagnostics/keys.py``); code refers to keys through it.
Values are floats; ``null`` marks "no samples this step". The monitor reads
``diag/ll_correct/all``, ``grad/norm_preclip`` and ``policy/entropy``; the report those plus
reward, LLD rate, searches and valid-action rate.

What the trainer calls each step
--------------------------------
1. ``step_diagnostics(response_batch_from_rollout(rollout, advantage=, reward=,
   old_logprobs=, num_action_slots=max_turns + 1, new_logprobs=None))``
   → dict (``diag/*``); :mod:`from_rollout` turns the ``RolloutBatch`` and ``[N, L]``
   token arrays into the per-response :class:`ResponseBatch` (``new_logprobs`` is the
   switchable extra forward pass after the step's updates that gives Δ and the LLD rate);
2. ``report = monitor.update(step, metrics)`` → log ``report.as_metrics()``; act on
   ``report.action`` (``STOP``: save a checkpoint and stop; ``RAISE_LAMBDA``: use
   ``report.llds_lambda`` from the next step on). Build the monitor once with
   ``DeathSpiralMonitor(MonitorConfig.from_mapping(config.get("monitor")), llds_lambda=λ)``;
   on resume replay the recorded steps: ``monitor.warm_up(writer.rows_before(start_step))``
   (``train.loop.make_monitor`` does both).
"""

from llds_jax.diagnostics import keys
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

__all__ = [
    "Action", "DeathSpiralMonitor", "MonitorConfig", "MonitorReport", "Phase", "ResponseBatch",
    "keys", "replay", "response_batch_from_rollout", "step_diagnostics",
]
