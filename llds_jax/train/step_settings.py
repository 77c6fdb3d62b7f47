"""The static settings of the jitted step: its sizes, and the config read (and validated) once, before any trace.

Why a module of its own: every traced piece of the step — the forward and the padded π_old/π_ref pass
(``train.forward``), the micro-batch loss (``train.micro_loss``), the packed path (``train.packed_step``)
and the update (``train.step``) — is a top-level function that takes a ``StepSettings`` as an explicit
argument, bound with ``functools.partial`` where ``build_update_fns`` jits it (MaxText's ``train_step``
style). This is that argument, and the one place the step reads its config: ``rl.validate`` runs here, at
build time, so no trace validates anything.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from llds_jax.parallel.rules import ShardingRules
from llds_jax.rl.config import validate as rl_validate
from llds_jax.train.batch import padded_length, scored_positions_per_row
from llds_jax.train.packing import PackingSizes, data_parallel_size, packing_sizes
from llds_jax.train.state import make_optimizer


@dataclasses.dataclass(frozen=True)
class StepSizes:
    """Static sizes of the update (one compiled shape per run)."""

    trajectories: int
    mini_batch_size: int
    micro_batch_size: int
    logprob_batch_size: int
    total_steps: int
    # Next-token positions per row that π_old, π_ref, the loss and the Δ pass compute: the bound
    # on a row's action tokens (``batch.scored_positions_per_row``), or length - 1 (all of them).
    scored_positions: int

    @property
    def num_mini_batches(self) -> int:
        return self.trajectories // self.mini_batch_size

    @property
    def num_micro_batches(self) -> int:
        return self.mini_batch_size // self.micro_batch_size

    @classmethod
    def from_config(cls, config) -> StepSizes:
        t = config.train
        return cls(t.prompts_per_step * config.rollout.n_samples, t.mini_batch_size, t.micro_batch_size,
                   t.logprob_batch_size, t.total_steps, scored_positions_per_row(config, padded_length(config)))


def packing_for_run(config, mesh, rules: ShardingRules | None = None) -> PackingSizes | None:
    """The packed shapes of a run on ``mesh``, or None for padded rows (``train.packing`` off).

    One host or several: several pack the same rows (``Learner.pack_across_hosts``).
    """
    if not config.train.packing:
        return None
    sizes = StepSizes.from_config(config)
    return packing_sizes(config, padded_length(config), sizes.scored_positions, data_parallel_size(mesh, rules))


def needs_reinforce_pp_reference(rl_cfg) -> bool:
    """REINFORCE++ with β > 0 reads π_ref in its advantages even when the loss has no KL term."""
    return rl_cfg.advantage_estimator == "reinforce_pp" and rl_cfg.reinforce_pp_kl_coef > 0


@dataclasses.dataclass(frozen=True, eq=False)
class StepSettings:
    """Everything static the traced step reads; built once per run by ``from_config``."""

    sizes: StepSizes
    rl: Any  # config.rl, validated; Dr. GRPO's token_sum_norm_length pinned (see from_config)
    optim: Any  # config.optim
    tx: optax.GradientTransformation  # the AdamW direction (train.state.make_optimizer)
    temperature: float
    chunk_size: int  # model.logprob_chunk_size: rows of the LM head per chunk (no [B, T, V] array)
    compute_dtype: str
    mesh: jax.sharding.Mesh
    rules: ShardingRules
    packing: PackingSizes | None = None  # train.packing: the packed rows' shapes; None for padded rows
    # The entropy is a diagnostic the death-spiral monitor reads whatever its coefficient: computed in
    # every update forward, and held out of the gradient when the coefficient is 0 (``micro_loss.entropy_term``).
    with_entropy: bool = True

    def scored(self, input_ids) -> int | None:
        """Positions per row a padded pass computes, or None for all of them (the bound is no smaller)."""
        targets = input_ids.shape[1] - 1
        return self.sizes.scored_positions if self.sizes.scored_positions < targets else None

    @classmethod
    def from_config(cls, config, mesh: jax.sharding.Mesh, rules: ShardingRules,
                    packing: PackingSizes | None = None) -> StepSettings:
        rl_cfg = config.rl
        if rl_cfg.aggregation == "token-sum-norm" and not rl_cfg.token_sum_norm_length:
            # Dr. GRPO's constant L defaults to the width of the arrays it sums, which compaction
            # narrows: pin it to the trainer's target count (what the full view would use).
            rl_cfg = rl_cfg.copy_and_resolve_references()
            rl_cfg.token_sum_norm_length = padded_length(config) - 1
        rl_validate(rl_cfg)  # here, at build time: the traced objective reads a validated config
        return cls(sizes=StepSizes.from_config(config), rl=rl_cfg, optim=config.optim,
                   tx=make_optimizer(config.optim), temperature=float(config.rollout.temperature),
                   chunk_size=int(config.model.logprob_chunk_size),
                   compute_dtype=jnp.dtype(config.model.dtype).name, mesh=mesh, rules=rules, packing=packing)
