"""The RL objective: advantages, policy losses, KL, aggregation and the LLDS family.

Pure functions of arrays, chosen by the strings in `config.rl` (see `default_config`).
"""

from llds_jax.rl.action_runs import action_run_ids, action_run_starts, sum_over_runs
from llds_jax.rl.advantages import ADVANTAGE_ESTIMATORS, compute_advantages
from llds_jax.rl.aggregation import AGGREGATIONS, aggregate
from llds_jax.rl.config import default_config, validate
from llds_jax.rl.kl import KL_ESTIMATORS
from llds_jax.rl.llds import LLDS_GATES, answer_coefficient, llds_terms
from llds_jax.rl.objective import (
    BatchConstants,
    LossMasks,
    ObjectiveTerms,
    PolicyBatch,
    accumulate,
    all_reduce,
    batch_constants,
    finalize,
    micro_batch_loss,
    objective,
    objective_terms,
)
from llds_jax.rl.policy_losses import POLICY_LOSSES

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "LLDS_GATES",
    "POLICY_LOSSES",
    "BatchConstants",
    "LossMasks",
    "ObjectiveTerms",
    "PolicyBatch",
    "accumulate",
    "action_run_ids",
    "action_run_starts",
    "aggregate",
    "all_reduce",
    "answer_coefficient",
    "batch_constants",
    "compute_advantages",
    "default_config",
    "finalize",
    "llds_terms",
    "micro_batch_loss",
    "objective",
    "objective_terms",
    "sum_over_runs",
    "validate",
]
