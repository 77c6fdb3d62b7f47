"""The learner: owns the train state on the mesh and turns one scored rollout batch into updates.

It only orchestrates — advantages come from ``llds_jax.rl.compute_advantages``, the loss from
``llds_jax.rl.objective`` (through ``llds_jax.train.step``) — and reports what SPEC §8 asks:
the objective's metrics per mini-batch (LLDS must read exactly 0 in the first one), timings,
and the sampler-vs-trainer log-prob gap on action tokens (a large gap means the sampler and
the trainer disagree about π_old, e.g. a dtype or temperature mismatch).

Host ↔ device: rollout arrays arrive as numpy [N, L] (L varies per batch); they are padded
to one fixed length (``rollout.max_context`` rounded up to ``rollout.pad_to_multiple``) so
every jitted function compiles once per run, then placed with the batch sharding.

Several hosts (``jax.process_count() > 1``): every host passes only *its* rows — the block
``host_rows()`` (``distributed.host_batch_rows`` of the batch sharding; rows are
prompt-major, so host ``p`` holds whole GRPO groups when its share of the prompts is whole,
which ``rl_loop`` arranges) — and the global batch is assembled from the blocks
(``distributed.global_batch_from_host_rows``) without any host holding all of it. Group ids
must be global (unique across hosts). Advantages are computed over the *global* batch from
all-gathered rewards and group ids (N scalars), so any estimator — per group or batch-wide —
gives the same numbers as on one host. Results come back as this host's rows
(``distributed.local_rows``: no communication) and the replicated per-mini-batch metrics
(``distributed.fetch_to_host``); token counts for throughput are summed over hosts.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from llds_jax.diagnostics import keys
from llds_jax.models import params_in_compute_dtype
from llds_jax.parallel import distributed
from llds_jax.parallel.rules import DEFAULT as DEFAULT_RULES
from llds_jax.parallel.rules import ShardingRules
from llds_jax.rl.advantages import compute_advantages
from llds_jax.train.state import TrainState, init_train_state, train_state_shardings
from llds_jax.train.step import StepSizes, TrainBatch, build_update_fns, train_batch_shardings


def padded_length(config) -> int:
    multiple = max(1, int(config.rollout.pad_to_multiple))
    return -(-int(config.rollout.max_context) // multiple) * multiple


def pad_columns(array: np.ndarray, length: int, value) -> np.ndarray:
    if array.shape[1] > length:
        raise ValueError(f"rollout arrays are {array.shape[1]} tokens long, more than the trainer's fixed "
                         f"length {length} (rollout.max_context rounded to rollout.pad_to_multiple)")
    return np.pad(array, ((0, 0), (0, length - array.shape[1])), constant_values=value)


_REDUCE_MINI_BATCHES = {"mean": np.mean, "max": np.max, "min": np.min, "sum": np.sum,
                        "first": lambda a: a[0], "last": lambda a: a[-1], "count": len}


def summarize_update(per_mini: dict[str, np.ndarray], with_entropy: bool = True) -> dict[str, float]:
    """Per-mini-batch arrays → the step's update metrics, as ``diagnostics.keys.UPDATE_METRICS`` says.

    ``with_entropy=False`` (no entropy term: the update fills ``policy/entropy`` with zeros)
    leaves the entropy out rather than logging a constant 0.
    """
    out = {}
    for metric in keys.UPDATE_METRICS:
        if metric.name == keys.POLICY_ENTROPY and not with_entropy:
            continue
        values = np.asarray(per_mini[metric.from_update or metric.name])
        out[metric.name] = float(_REDUCE_MINI_BATCHES[metric.mini_batches](values))
    return out


def logprob_gap(sampler_logp: np.ndarray, trainer_logp: np.ndarray, action_mask: np.ndarray) -> dict[str, float]:
    """Mean |Δ| and Pearson correlation of sampler vs trainer log-probs on action tokens.

    ``sampler_logp`` is aligned with the ids (entry t = log p of token t), ``trainer_logp`` is
    shifted (entry t scores token t+1), hence the ``[:, 1:]``.
    """
    mask = action_mask[:, 1:] > 0
    a, b = sampler_logp[:, 1:][mask], trainer_logp[:, : mask.shape[1]][mask]
    if a.size < 2:
        return {"logprob_gap/abs_mean": float("nan"), "logprob_gap/abs_max": float("nan"),
                "logprob_gap/corr": float("nan")}
    corr = float(np.corrcoef(a, b)[0, 1]) if a.std() > 0 and b.std() > 0 else float("nan")
    return {"logprob_gap/abs_mean": float(np.abs(a - b).mean()), "logprob_gap/abs_max": float(np.abs(a - b).max()),
            "logprob_gap/corr": corr}


@dataclasses.dataclass
class Learner:
    """Train state + jitted step functions on one mesh. Build with :meth:`create`."""

    config: Any
    mesh: jax.sharding.Mesh
    rules: ShardingRules
    graphdef: Any
    state: TrainState
    state_shardings: TrainState
    batch_shardings: TrainBatch
    fns: Any
    seq_len: int

    @classmethod
    def create(cls, model: nnx.Module, config, mesh, rules: ShardingRules | None = None,
               ref_model: nnx.Module | None = None) -> Learner:
        """Split ``model`` (already placed on ``mesh``) into graphdef + fp32 params and jit the step.

        π_ref is a copy of the current params (``ref_model``'s if given) cast to
        ``model.ref_dtype``; it is skipped entirely when ``rl.kl_coef == 0``.
        """
        rules = rules or DEFAULT_RULES
        graphdef, params = nnx.split(model, nnx.Param)
        with jax.set_mesh(mesh):
            param_shardings = jax.tree.map(lambda x: x.sharding, params)
            ref = None
            if config.rl.kl_coef > 0:
                ref = params if ref_model is None else nnx.state(ref_model, nnx.Param)
            ref_dtype = None if config.model.ref_dtype == config.model.param_dtype else config.model.ref_dtype

            def fresh(p, r):
                return init_train_state(p, config.optim, config.seed, r, ref_dtype, config.rl.llds_coef)

            abstract = jax.eval_shape(fresh, params, ref)
            state_shardings = train_state_shardings(abstract, param_shardings, mesh, config.optim)
            state = jax.jit(fresh, out_shardings=state_shardings)(params, ref)
        seq_len = padded_length(config)
        example = cls._host_batch_shapes(StepSizes.from_config(config).trajectories, seq_len, with_ref=ref is not None)
        batch_shardings = train_batch_shardings(example, mesh, rules)
        fns = build_update_fns(graphdef, state_shardings, batch_shardings, mesh, config, rules)
        return cls(config, mesh, rules, graphdef, state, state_shardings, batch_shardings, fns, seq_len)

    @staticmethod
    def _host_batch_shapes(n: int, length: int, with_ref: bool) -> TrainBatch:
        tok = jax.ShapeDtypeStruct((n, length), jnp.float32)
        row = jax.ShapeDtypeStruct((n,), jnp.float32)
        logp = jax.ShapeDtypeStruct((n, length - 1), jnp.float32)
        return TrainBatch(jax.ShapeDtypeStruct((n, length), jnp.int32), jax.ShapeDtypeStruct((n, length), jnp.bool_),
                          tok, tok, jax.ShapeDtypeStruct((n, length), jnp.int32), row, row, row, logp,
                          logp if with_ref else None)

    # -- what the sampler reads -------------------------------------------------------------
    def set_llds_coef(self, value: float) -> None:
        """Change λ from the next update on (the monitor's ``raise_lambda``); no recompilation.

        λ lives in the train state, so checkpoints carry it and a resumed run keeps it.
        """
        if not np.isfinite(value) or value < 0:
            raise ValueError(f"LLDS λ={value!r}: must be a finite number ≥ 0")
        sharding = self.state_shardings.llds_coef
        coef = jax.make_array_from_callback((), sharding, lambda _: np.asarray(value, np.float32))
        self.state = self.state.replace(llds_coef=coef)

    @property
    def llds_coef(self) -> float:
        return float(distributed.fetch_to_host(self.state.llds_coef))

    def policy(self) -> tuple[Any, Any]:
        """``(graphdef, params)`` of the current policy — the same arrays the update reads."""
        return self.graphdef, self.state.params

    def sampler_policy(self) -> tuple[Any, Any]:
        """The policy this host samples with: :meth:`policy` on one host.

        On several hosts the params span other hosts' devices, and a jitted sampler fed
        host-specific prompts cannot read them (that would be one SPMD program with different
        inputs per host). So every host all-gathers the current params (a collective: call on
        every host together) and samples from a copy on its first local device — one extra
        params-sized transfer and copy per step, fine up to a few B params per host.

        The params come in the compute dtype (bf16 on accelerators): cast once per step, not
        per token inside the decode loop (``models.params_in_compute_dtype``).
        """
        graphdef, params = self.policy()
        if jax.process_count() > 1:
            params = jax.device_put(distributed.fetch_to_host(params), jax.local_devices()[0])
        compute = jnp.dtype(nnx.merge(graphdef, params).config.compute_dtype)
        if all(x.dtype == compute for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating)):
            return graphdef, params
        return graphdef, params_in_compute_dtype(params, compute.name)

    # -- one training step's update phase ---------------------------------------------------
    def host_rows(self) -> slice:
        """The rows of the step's global batch this host feeds (all of them on one host)."""
        return distributed.host_batch_rows(self.batch_shardings.input_ids,
                                           StepSizes.from_config(self.config).trajectories)

    def device_batch(self, arrays: dict[str, np.ndarray], advantages: np.ndarray) -> TrainBatch:
        """This host's rows (``host_rows()``) of the rollout batch → the global, sharded TrainBatch."""
        n, length = StepSizes.from_config(self.config).trajectories, self.seq_len
        rows = self.host_rows()
        local = rows.stop - rows.start
        if arrays["input_ids"].shape[0] != local:
            raise ValueError(f"rollout has {arrays['input_ids'].shape[0]} trajectories, the step expects "
                             f"train.prompts_per_step×rollout.n_samples = {n}"
                             + (f", of which this host (process {jax.process_index()}) feeds rows "
                                f"{rows.start}:{rows.stop}" if jax.process_count() > 1 else ""))
        host = TrainBatch(
            input_ids=pad_columns(arrays["input_ids"].astype(np.int32), length, 0),
            attention_mask=pad_columns(arrays["attention_mask"].astype(bool), length, False),
            action_mask=pad_columns(arrays["action_mask"].astype(np.float32), length, 0.0),
            answer_mask=pad_columns(arrays["answer_mask"].astype(np.float32), length, 0.0),
            action_index=pad_columns(arrays["action_index"].astype(np.int32), length, -1),
            num_searches=np.asarray(arrays["num_searches"], np.float32),
            row_weight=np.asarray(arrays.get("row_weight", np.ones(local)), np.float32),
            advantages=np.asarray(advantages, np.float32),
        )
        shardings = self.batch_shardings._replace(old_logp=None, ref_logp=None)
        if jax.process_count() == 1:
            return jax.device_put(host, shardings)
        return distributed.global_batch_from_host_rows(host, shardings, n)

    def advantages(self, rewards: np.ndarray, group_ids: np.ndarray, valid: np.ndarray | None = None) -> np.ndarray:
        """Advantages of this host's rows, from the statistics of the global batch (see module docstring)."""
        rl = self.config.rl
        valid = np.ones(len(rewards), bool) if valid is None else np.asarray(valid, bool)
        rows = slice(0, len(rewards))
        if jax.process_count() > 1:
            rows, n = self.host_rows(), StepSizes.from_config(self.config).trajectories
            rewards, group_ids, valid = (distributed.gather_host_rows(np.asarray(x), rows, n)
                                         for x in (rewards, group_ids, valid))
        out = np.asarray(compute_advantages(jnp.asarray(rewards, jnp.float32), jnp.asarray(group_ids, jnp.int32),
                                            jnp.asarray(valid), estimator=rl.advantage_estimator,
                                            eps=rl.advantage_eps, unbiased_std=rl.unbiased_std))
        return out[rows]

    def update(self, arrays: dict[str, np.ndarray], rewards: np.ndarray, group_ids: np.ndarray,
               ) -> tuple[dict[str, float], dict[str, np.ndarray]]:
        """π_old, π_ref, then the sequential mini-batch updates. Returns (step metrics, host arrays).

        ``arrays``/``rewards``/``group_ids`` are this host's rows (``host_rows()``; all rows on
        one host). The host arrays (advantages, old_logp of this host's rows, per-mini-batch
        metrics of the whole step) feed the diagnostics. Every host must call this together.
        """
        advantages = self.advantages(rewards, group_ids)
        rows = self.host_rows()
        with jax.set_mesh(self.mesh):
            batch = self.device_batch(arrays, advantages)
            clock = time.perf_counter()
            old_logp = self.fns.policy_logprobs(self.state.params, batch.input_ids, batch.attention_mask)
            ref_logp = None
            if self.fns.reference_logprobs is not None:
                ref_logp = self.fns.reference_logprobs(self.state.ref_params, batch.input_ids, batch.attention_mask)
            jax.block_until_ready((old_logp, ref_logp))
            logprob_s = time.perf_counter() - clock
            batch = batch._replace(old_logp=old_logp, ref_logp=ref_logp)
            clock = time.perf_counter()
            self.state, per_mini = self.fns.update(self.state, batch)
            per_mini = distributed.fetch_to_host(per_mini)  # replicated: read from a local shard
            update_s = time.perf_counter() - clock
        old_host = distributed.local_rows(old_logp, rows)
        metrics = summarize_update(per_mini, with_entropy=self.config.rl.entropy_coef > 0)
        tokens = distributed.sum_over_hosts({"action": float(np.sum(arrays["action_mask"])),
                                             "all": float(np.sum(arrays["attention_mask"]))})
        metrics.update({
            "time/logprobs_s": logprob_s, "time/update_s": update_s,
            "throughput/update_tokens_per_s": tokens["all"] / max(update_s, 1e-9),
            "throughput/action_tokens_per_s": tokens["action"] / max(update_s, 1e-9),
            "advantage/abs_mean": float(np.abs(advantages).mean()),
            "advantage/nonzero_frac": float(np.mean(advantages != 0)),
        })
        if "sampler_logprobs" in arrays:
            metrics.update(logprob_gap(arrays["sampler_logprobs"], old_host, arrays["action_mask"]))
        return metrics, {"advantages": advantages, "old_logp": old_host, "per_mini_batch": per_mini}

    def logprobs_now(self, arrays: dict[str, np.ndarray]) -> np.ndarray:
        """log π_θ of this host's rows under the *current* params (for Δ after the step's updates)."""
        n = arrays["input_ids"].shape[0]
        with jax.set_mesh(self.mesh):
            batch = self.device_batch(arrays, np.zeros(n, np.float32))
            logp = self.fns.policy_logprobs(self.state.params, batch.input_ids, batch.attention_mask)
        return distributed.local_rows(logp, self.host_rows())

    def compile_counts(self) -> dict[str, int]:
        """Jit cache sizes (one entry per compiled signature): must stay 1 for a whole run."""
        fns = {"policy_logprobs": self.fns.policy_logprobs, "update": self.fns.update}
        if self.fns.reference_logprobs is not None:
            fns["reference_logprobs"] = self.fns.reference_logprobs
        return {name: fn._cache_size() for name, fn in fns.items()}
