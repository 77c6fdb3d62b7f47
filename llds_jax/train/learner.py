"""The learner: owns the train state on the mesh and turns one scored rollout batch into updates.

It only orchestrates — the advantages (``llds_jax.rl.compute_advantages``) and the loss
(``llds_jax.rl.objective``) are computed inside the jitted update (``llds_jax.train.step``) from
one :class:`~llds_jax.train.batch.TrainBatch` uploaded once per step — and reports what SPEC §8 asks:
the objective's metrics per mini-batch (LLDS must read exactly 0 in the first one), timings,
and the sampler-vs-trainer log-prob gap on action tokens (a large gap means the sampler and
the trainer disagree about π_old, e.g. a dtype or temperature mismatch).

Host ↔ device: the host record (``TrainBatch.from_rollout``) is padded to one fixed length
(``rollout.max_context`` rounded up to ``rollout.pad_to_multiple``) so every jitted function
compiles once per run, then uploaded once (:meth:`Learner.upload`) with the batch sharding.
With ``train.packing`` (default) the upload also packs the trajectories several to a row
(``llds_jax.train.packing``): the decoder passes read those rows, the objective the
per-trajectory view. One host packs on the host (``pack``); several hosts all-gather only the
lengths, every host computes the same plan (the one-host plan), and a jitted scatter writes
each host's trajectories into the packed rows, which span every host's devices (``pack_on_device``).

Several hosts (``jax.process_count() > 1``): every host passes only *its* rows — the block
``host_rows()`` (``distributed.host_batch_rows`` of the batch sharding; rows are
prompt-major, so host ``p`` holds whole GRPO groups when its share of the prompts is whole,
which ``rl_loop`` arranges) — and the global batch is assembled from the blocks
(``distributed.global_batch_from_host_rows``) without any host holding all of it. Group ids
must be global (unique across hosts). Advantages are computed inside the update over the
*global* batch (rewards and group ids are batch fields), so any estimator — per group or
batch-wide — gives the same numbers as on one host. Results come back as this host's rows
(``distributed.local_rows``: no communication) and the replicated per-mini-batch metrics and
global token counts (``distributed.fetch_to_host``).
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from llds_jax.diagnostics import keys
from llds_jax.diagnostics.from_rollout import action_sums
from llds_jax.models import params_in_compute_dtype
from llds_jax.parallel import distributed
from llds_jax.parallel.rules import ShardingRules, current_rules, use_rules
from llds_jax.rl.rollout_correction import correction_metrics
from llds_jax.sampling import placement
from llds_jax.train.batch import TrainBatch, check_action_tokens, padded_length
from llds_jax.train.checkpoint import Checkpointer, Restored, resume
from llds_jax.train.packing import (
    PackingSizes,
    action_targets,
    one_group,
    pack_both,
    pack_on_device,
    place,
    plan_rows,
)
from llds_jax.train.packing import trajectory_lengths as packed_lengths
from llds_jax.train.signatures import SignatureLog
from llds_jax.train.state import TrainState
from llds_jax.train.state_layout import train_state_layout
from llds_jax.train.step import build_update_fns
from llds_jax.train.step_settings import StepSizes, packing_for_run

_REDUCE_MINI_BATCHES = {"mean": np.mean, "max": np.max, "min": np.min, "sum": np.sum,
                        "first": lambda a: a[0], "last": lambda a: a[-1], "count": len}


def summarize_update(per_mini: dict[str, np.ndarray]) -> dict[str, float]:
    """Per-mini-batch arrays → the step's update metrics, as ``diagnostics.keys.UPDATE_METRICS`` says."""
    out = {}
    for metric in keys.UPDATE_METRICS:
        values = np.asarray(per_mini[metric.from_update or metric.name])
        out[metric.name] = float(_REDUCE_MINI_BATCHES[metric.mini_batches](values))
    return out


def grad_norm_per_active_row(grad_norm: float, advantages: np.ndarray) -> float:
    """The pre-clip grad norm over the share of rows with A ≠ 0 (nan when there are none).

    Why: the token-mean loss divides by every row's tokens, so the norm scales with the share
    of rows that carry an advantage; when groups go uniform the raw norm falls even if each
    active row's gradient surges (issue 43's "dilution"). This is the norm those rows would give alone.
    """
    share = float(np.mean(np.asarray(advantages) != 0)) if np.size(advantages) else 0.0
    return float(grad_norm) / share if share > 0 else float("nan")


def logprob_gap(sampler_logp: np.ndarray, trainer_logp: np.ndarray, action_mask: np.ndarray) -> dict[str, float]:
    """Mean |Δ| and Pearson correlation of sampler vs trainer log-probs on action tokens.

    All token-aligned (``llds_jax.train.batch``); ``trainer_logp`` may be wider than the
    rollout (the trainer's fixed length): its extra columns are padding.
    """
    mask = np.asarray(action_mask) > 0
    a, b = np.asarray(sampler_logp)[mask], np.asarray(trainer_logp)[:, : mask.shape[1]][mask]
    if a.size < 2:
        return {"logprob_gap/abs_mean": float("nan"), "logprob_gap/abs_max": float("nan"),
                "logprob_gap/corr": float("nan")}
    corr = float(np.corrcoef(a, b)[0, 1]) if a.std() > 0 and b.std() > 0 else float("nan")
    return {"logprob_gap/abs_mean": float(np.abs(a - b).mean()), "logprob_gap/abs_max": float(np.abs(a - b).max()),
            "logprob_gap/corr": corr}


def sampler_gap(sampler_logp: jax.Array, trainer_logp: jax.Array, action_mask: jax.Array) -> dict[str, jax.Array]:
    """:func:`logprob_gap` traced (fp32, the correlation from centred sums): the learner reduces it on device."""
    mask = action_mask > 0
    count = mask.sum().astype(jnp.float32)
    a = jnp.where(mask, sampler_logp.astype(jnp.float32), 0.0)
    b = jnp.where(mask, trainer_logp.astype(jnp.float32), 0.0)
    gap = jnp.abs(a - b)
    centred_a = jnp.where(mask, a - a.sum() / count, 0.0)
    centred_b = jnp.where(mask, b - b.sum() / count, 0.0)
    var_a, var_b = (centred_a**2).sum(), (centred_b**2).sum()
    corr = jnp.where((var_a > 0) & (var_b > 0), (centred_a * centred_b).sum() / jnp.sqrt(var_a * var_b), jnp.nan)
    enough = count >= 2
    return {"logprob_gap/abs_mean": jnp.where(enough, gap.sum() / count, jnp.nan),
            "logprob_gap/abs_max": jnp.where(enough, gap.max(), jnp.nan),
            "logprob_gap/corr": jnp.where(enough, corr, jnp.nan)}


class StepExtras(dict):
    """:meth:`Learner.update`'s extras. ``old_logp`` (π_old of this host's rows, ``[N, T]``) is
    downloaded only when read: the training loop reduces it on device (:meth:`Learner.step_reductions`)."""

    def __init__(self, rows: slice, **items):
        super().__init__(**items)
        self._rows = rows

    def __missing__(self, key):
        if key != "old_logp":
            raise KeyError(key)
        self[key] = distributed.local_rows(self["batch"].old_logp, self._rows)
        return self[key]


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
    # Packed shapes when the decoder passes read packed rows (``train.packing``), else None.
    packing: PackingSizes | None = None
    # A weak reference to the fresh state, whose π_ref is a same-dtype copy of its params: while
    # ``state`` is still that object (no update, restore or λ change since), π_ref's log-probs are
    # π_old's, bit for bit. Weak, so a restored state does not keep the fresh one's buffers alive.
    reference_is_policy_in: weakref.ref | None = None
    # The jitted step reductions, by (action slots, with Δ): built on first use (step_reductions).
    reductions: dict = dataclasses.field(default_factory=dict)
    reduction_signatures: SignatureLog = dataclasses.field(default_factory=SignatureLog)
    # Several hosts: the jitted packing scatters, one per grouping (``pack_across_hosts``), built on first use.
    packers: Any = None
    # Packed: the jitted count and scatter of the Δ pass's rows (``delta_inputs``), built on first use.
    delta_packer: Any = None

    @classmethod
    def create(cls, model: nnx.Module, config, mesh, ref_model: nnx.Module | None = None,
               state: TrainState | None = None) -> Learner:
        """Lay out ``model``'s train state on ``mesh`` (``train.state_layout``) and jit the step.

        Without ``state`` the state is step 0's: the fp32 params of ``model`` (already placed on
        ``mesh``) and π_ref, a copy of them (``ref_model``'s if given) cast to ``model.ref_dtype``
        — skipped entirely when the objective reads no π_ref; its pass is skipped in the first step
        when it is a same-dtype copy of the policy (its log-probs are π_old's). With ``state`` (a
        restored one, laid out as :func:`restore_target` says) no fresh state is built. The sharding
        table is the ambient one (``parallel.rules.use_rules``), the one the model's own constraints
        read; the learner keeps it and traces every jitted call under it.
        """
        rules = current_rules()
        with jax.set_mesh(mesh), use_rules(rules):
            layout = train_state_layout(model, config, mesh)
            same = False
            if state is None:
                params = nnx.state(model, nnx.Param)
                ref = None
                if layout.with_reference:
                    ref = params if ref_model is None else nnx.state(ref_model, nnx.Param)
                state = layout.fresh(params, ref)
                same = layout.with_reference and ref_model is None and config.model.ref_dtype == config.model.param_dtype
        seq_len = padded_length(config)
        sizes = StepSizes.from_config(config)
        packing = packing_for_run(config, mesh, rules)
        example = TrainBatch.abstract(sizes.trajectories, seq_len, with_ref=layout.with_reference, packing=packing,
                                      with_sampler=config.rl.rollout_correction != "none")
        batch_shardings = example.shardings(mesh, rules)
        fns = build_update_fns(layout.graphdef, layout.shardings, batch_shardings, mesh, config, rules, packing=packing)
        return cls(config, mesh, rules, layout.graphdef, state, layout.shardings, batch_shardings, fns, seq_len,
                   packing, reference_is_policy_in=weakref.ref(state) if same else None)

    @classmethod
    def restore_target(cls, model: nnx.Module, config, mesh) -> TrainState:
        """The abstract train state (``ShapeDtypeStruct`` leaves with shardings) a checkpoint restores into.

        Built from shapes alone: resume holds one model and the restored state, never a fresh state beside them.
        """
        with jax.set_mesh(mesh):
            return train_state_layout(model, config, mesh).abstract

    @classmethod
    def resume(cls, model: nnx.Module, config, mesh, ckpt: Checkpointer) -> tuple[Learner, Restored] | None:
        """The learner at the checkpoint ``config.resume`` names (``train.checkpoint.resume``); None for a fresh start.

        The checkpoint is read into :meth:`restore_target`, so at no point does more than ``model``
        and one train state live on the devices (``tests/train/test_state_layout.py`` counts them).
        """
        restored = resume(ckpt, config.resume, cls.restore_target(model, config, mesh))
        if restored is None:
            return None
        return cls.create(model, config, mesh, state=restored.state), restored

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

    @property
    def model_config(self):
        """The policy's ``DecoderConfig`` (shapes, dtypes, remat: what ``utils.flops`` counts)."""
        return nnx.merge(self.graphdef, self.state.params).config

    def policy(self) -> tuple[Any, Any]:
        """``(graphdef, params)`` of the current policy — the same arrays the update reads."""
        return self.graphdef, self.state.params

    def sampler_policy(self) -> tuple[Any, Any]:
        """The policy this host samples with: :meth:`policy` on one host.

        On several hosts the params span other hosts' devices, and a jitted sampler fed
        host-specific prompts cannot read them (that would be one SPMD program with different
        inputs per host). With the continuous engine (``rollout.engine``) every host gets a
        replica on each of its sampler devices (``rollout.sampler_devices``, every local one by
        default) device to device: cast on the sharded params, all-gathered over the
        interconnect, wrapped as host-local arrays (``sampling.placement.replicate_params``;
        nothing passes through host memory). The turn loop keeps the old path: the params
        all-gathered into host memory and copied to the first local device.

        The params come in the compute dtype (bf16 on accelerators): cast once per step, not
        per token inside the decode loop (``models.params_in_compute_dtype``). All hosts call
        this together (collectives).
        """
        graphdef, params = self.policy()
        compute = jnp.dtype(nnx.merge(graphdef, params).config.compute_dtype)
        cast = any(x.dtype != compute for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating))
        rollout = self.config.rollout
        if jax.process_count() > 1 and rollout.engine == "continuous":
            if cast:
                params = params_in_compute_dtype(params, compute.name)
            mesh = placement.sampler_mesh(placement.sampler_devices(int(rollout.sampler_devices)))
            return graphdef, placement.replicate_params(params, mesh)
        if jax.process_count() > 1:
            params = jax.device_put(distributed.fetch_to_host(params), jax.local_devices()[0])
        return (graphdef, params_in_compute_dtype(params, compute.name)) if cast else (graphdef, params)

    # -- one training step's update phase ---------------------------------------------------
    def host_rows(self) -> slice:
        """The rows of the step's global batch this host feeds (all of them on one host)."""
        return distributed.host_batch_rows(self.batch_shardings.input_ids,
                                           StepSizes.from_config(self.config).trajectories)

    def upload(self, host: TrainBatch) -> TrainBatch:
        """This host's rows (``host_rows()``) of the step's batch → the global, row-sharded device batch.

        Once per step: π_old, π_ref, the update and the Δ-log-prob pass all read the result.
        ``host`` comes from :meth:`TrainBatch.from_rollout` padded to :attr:`seq_len`.
        """
        n = StepSizes.from_config(self.config).trajectories
        rows = self.host_rows()
        if host.rows != rows.stop - rows.start:
            raise ValueError(f"rollout has {host.rows} trajectories, the step expects "
                             f"train.prompts_per_step×rollout.n_samples = {n}"
                             + (f", of which this host (process {jax.process_index()}) feeds rows "
                                f"{rows.start}:{rows.stop}" if jax.process_count() > 1 else ""))
        if host.input_ids.shape[1] != self.seq_len:
            raise ValueError(f"batch is {host.input_ids.shape[1]} tokens wide, the trainer's fixed length is "
                             f"{self.seq_len}: build it with TrainBatch.from_rollout(..., length=learner.seq_len)")
        check_action_tokens(host.action_mask, StepSizes.from_config(self.config).scored_positions,
                            "train.max_action_tokens_per_row")
        if (host.sampler_logp is None) != (self.batch_shardings.sampler_logp is None):
            raise ValueError(f"rl.rollout_correction = {self.config.rl.rollout_correction!r}: the batch must "
                             f"{'' if host.sampler_logp is None else 'not '}carry the sampler's log-probs "
                             "(TrainBatch.from_rollout(..., with_sampler_logp=...))")
        host = host._replace(old_logp=None, ref_logp=None)
        if self.packing is not None and jax.process_count() == 1:
            packed, packed_passes = pack_both(host.input_ids, host.attention_mask, host.action_mask, self.packing)
            host = host._replace(packed=packed, packed_passes=packed_passes)
        shardings = self.batch_shardings._replace(old_logp=None, ref_logp=None)
        with jax.set_mesh(self.mesh), use_rules(self.rules):  # the table the step was built with
            if jax.process_count() == 1:
                batch = jax.device_put(host, shardings)
            else:
                batch = distributed.global_batch_from_host_rows(host, shardings.unpacked(), n)
                if self.packing is not None:  # every host's lengths and action targets: a collective
                    counts = np.stack([packed_lengths(host.attention_mask),
                                       action_targets(host.action_mask).sum(axis=1)], axis=1).astype(np.int32)
                    batch = self.pack_across_hosts(batch, distributed.gather_host_rows(counts, rows, n))
        return batch

    def _replicated(self, x: np.ndarray) -> jax.Array:
        """A small host array every host holds whole, as a replicated global array."""
        replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        return jax.make_array_from_callback(x.shape, replicated, lambda index: x[index])

    def pack_across_hosts(self, batch: TrainBatch, every: np.ndarray) -> TrainBatch:
        """Several hosts: ``batch`` with its packed rows (both groupings), from ``every`` trajectory's
        (length, action targets), gathered by :meth:`upload`.

        Only the lengths and action-target counts travel between hosts (``gather_host_rows``: 2 int32
        per trajectory); every host then plans and places the whole batch identically — first-fit
        decreasing within each mini-batch, the one-host plan, and its rows as one group for the no-grad
        passes — and ``pack_on_device`` scatters each trajectory's tokens, already on its host's devices,
        into rows that span every host's devices.
        """
        put = self._replicated
        if self.packers is None:  # one program per grouping (their slot counts may differ)
            def packer(name: str, sizes: PackingSizes, out_shardings):
                fn = lambda ids, actions, lengths, placed: pack_on_device(ids, actions, lengths, placed, sizes)
                return sizes, jax.jit(self.reduction_signatures.counted(name, fn), out_shardings=out_shardings)

            self.packers = {"packed": packer("pack_rows", self.packing, self.batch_shardings.packed),
                            "packed_passes": packer("pack_pass_rows", self.packing.whole_batch(),
                                                    self.batch_shardings.packed_passes)}
        plan = plan_rows(every[:, 0], every[:, 1], self.packing)
        plans = {"packed": plan, "packed_passes": one_group(plan, self.packing)}
        out = {}
        for field, (sizes, fn) in self.packers.items():
            where = place(plans[field], sizes)
            out[field] = fn(batch.input_ids, batch.action_mask, put(every[:, 0]), jax.tree.map(put, where))
        return batch._replace(**out)

    def update(self, batch: TrainBatch) -> tuple[dict[str, float], dict[str, Any]]:
        """π_old, π_ref, then the sequential mini-batch updates. Returns (step metrics, extras).

        ``batch`` is this host's host record (uploaded here) or the device batch of
        :meth:`upload`. Extras (:class:`StepExtras`): ``batch`` (the device batch with π_old/π_ref, for
        the Δ pass), ``advantages`` and token-aligned ``old_logp`` (downloaded when read) of this host's rows, the whole step's
        per-mini-batch metrics (``per_mini_batch``) and ``logprob_passes`` (π_old, plus π_ref when it ran). Every host must call this together.
        """
        if not isinstance(batch.input_ids, jax.Array):
            batch = self.upload(batch)
        rows = self.host_rows()
        with jax.set_mesh(self.mesh), use_rules(self.rules):  # the table the step was built with
            clock = time.perf_counter()
            old_logp = self.fns.policy_logprobs(self.state.params, *batch.logprob_inputs)
            ref_logp = None
            if self._reference_is_policy():  # step 0: π_ref = π_θ, one program on equal inputs
                ref_logp = old_logp
            elif self.fns.reference_logprobs is not None:
                ref_logp = self.fns.reference_logprobs(self.state.ref_params, *batch.logprob_inputs)
            jax.block_until_ready((old_logp, ref_logp))
            logprob_s = time.perf_counter() - clock
            batch = batch._replace(old_logp=old_logp, ref_logp=ref_logp)
            clock = time.perf_counter()
            self.state, per_mini, outputs = self.fns.update(self.state, batch)
            per_mini = distributed.fetch_to_host(per_mini)  # replicated: read from a local shard
            update_s = time.perf_counter() - clock
            action_tokens, tokens = (float(x) for x in distributed.fetch_to_host((outputs.action_tokens,
                                                                                  outputs.tokens)))
        advantages = distributed.local_rows(outputs.advantages, rows)
        metrics = summarize_update(per_mini)
        metrics.update({
            "time/logprobs_s": logprob_s, "time/update_s": update_s,
            "throughput/update_tokens_per_s": tokens / max(update_s, 1e-9),
            "throughput/action_tokens_per_s": action_tokens / max(update_s, 1e-9),
            "advantage/abs_mean": float(np.abs(advantages).mean()),
            "advantage/nonzero_frac": float(np.mean(advantages != 0)),
        })
        metrics[keys.GRAD_NORM_PER_ACTIVE_ROW] = grad_norm_per_active_row(metrics[keys.GRAD_NORM], advantages)
        passes = 1 + int(ref_logp is not None and ref_logp is not old_logp)  # π_old, and π_ref when it ran
        return metrics, StepExtras(rows, batch=batch, advantages=advantages, per_mini_batch=per_mini,
                                   logprob_passes=passes)

    def logprobs_now(self, batch: TrainBatch) -> np.ndarray:
        """Token-aligned log π_θ of this host's rows under the *current* params (Δ after the step's updates).

        Pass the device batch the update read (``extras["batch"]``): nothing is uploaded again.
        """
        if not isinstance(batch.input_ids, jax.Array):
            batch = self.upload(batch)
        with jax.set_mesh(self.mesh), use_rules(self.rules):  # the table the step was built with
            logp = self.fns.policy_logprobs(self.state.params, *batch.logprob_inputs)
        return distributed.local_rows(logp, self.host_rows())

    def delta_inputs(self, batch: TrainBatch, advantages: np.ndarray) -> tuple[tuple, np.ndarray]:
        """The Δ pass's arguments after the params — the responses with a nonzero advantage, packed — and
        which trajectories those are (bool [N], every host's).

        Why: Δ is read for correct (A > 0) and incorrect (A < 0) responses only (``diagnostics.step_metrics``:
        the LLD rate, Δ by action); a response of a group whose rewards are all equal has A = 0, and its Δ
        would go unread. So the pass computes the others' rows only: the update's row plan of the kept
        trajectories (the rest empty, no tokens and no targets), regrouped as one (``packing.one_group``), in
        the no-grad passes' static shapes — ``policy_logprobs`` runs its one program over fewer micro-batches.
        ``advantages``: this host's rows (``update``'s extras). Packed runs only (``train.packing``).
        """
        n = batch.input_ids.shape[0]
        keep = distributed.gather_host_rows((np.asarray(advantages) != 0).astype(np.int32), self.host_rows(), n) > 0
        sizes = self.packing.whole_batch()
        if self.delta_packer is None:
            replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())

            def count(attention, actions):  # every trajectory's (real tokens, action targets), on every host
                return jnp.stack([attention.sum(axis=1), (actions[:, 1:] > 0).sum(axis=1)], axis=1).astype(jnp.int32)

            def scatter(ids, actions, kept, lengths, placed):
                actions = actions * kept[:, None].astype(actions.dtype)  # nothing scored off the kept rows
                return pack_on_device(ids, actions, lengths, placed, sizes), actions

            self.delta_packer = (
                jax.jit(self.reduction_signatures.counted("delta_row_counts", count), out_shardings=replicated),
                jax.jit(self.reduction_signatures.counted("pack_delta_rows", scatter),
                        out_shardings=(self.batch_shardings.packed_passes, self.batch_shardings.action_mask)))
        count, scatter = self.delta_packer
        counts = distributed.fetch_to_host(count(batch.attention_mask, batch.action_mask)) * keep[:, None]
        where = place(one_group(plan_rows(counts[:, 0], counts[:, 1], self.packing), self.packing), sizes)
        put = self._replicated
        return scatter(batch.input_ids, batch.action_mask, put(keep), put(counts[:, 0]), jax.tree.map(put, where)), keep

    def step_reductions(self, batch: TrainBatch, sampler_logp: np.ndarray, num_actions: int, *,
                        with_delta: bool, advantages: np.ndarray | None = None
                        ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """The step's diagnostics inputs, reduced on device: no ``[N, T]`` array comes back to the host.

        Returns this host's rows' per-action sums (``diagnostics.from_rollout.action_sums``: π_old,
        log-odds, tokens and, ``with_delta``, Δ log π after the updates from one more π_θ pass) and the
        sampler-vs-trainer metrics (``logprob_gap/*``, ``rollout_corr/*``; ``time/delta_logprobs_s``).
        ``batch``: the device batch :meth:`update` returned; ``sampler_logp``: this host's rows of the
        rollout's token-aligned sampler log-probs (uploaded here, padded to :attr:`seq_len`);
        ``advantages``: this host's rows' (``update``'s extras): with packed rows, the Δ pass then computes
        the responses with A ≠ 0 only (:meth:`delta_inputs`), the others' Δ reported 0 (no diagnostic reads it).
        """
        metrics = {}
        with jax.set_mesh(self.mesh), use_rules(self.rules):  # the table the step was built with
            new_logp = keep = None
            if with_delta:
                clock = time.perf_counter()
                inputs, keep = batch.logprob_inputs, np.ones(batch.action_mask.shape[0], bool)
                if advantages is not None and self.packing is not None:
                    inputs, keep = self.delta_inputs(batch, advantages)
                new_logp = batch.old_logp  # every A = 0: nothing to compute, every Δ 0
                if keep.any():
                    new_logp = jax.block_until_ready(self.fns.policy_logprobs(self.state.params, *inputs))
                metrics["time/delta_logprobs_s"] = time.perf_counter() - clock
                metrics["throughput/delta_responses_frac"] = float(keep.mean())
                keep = self._replicated(keep)
            sampler = np.zeros((len(sampler_logp), self.seq_len), np.float32)
            sampler[:, :np.shape(sampler_logp)[1]] = sampler_logp
            sharding = self.batch_shardings.action_mask
            sampler = (jax.device_put(sampler, sharding) if jax.process_count() == 1 else
                       distributed.global_batch_from_host_rows(sampler, sharding, batch.action_mask.shape[0]))
            reduce = self._reduction_fn(num_actions, with_delta)
            sums, gap = reduce(batch.old_logp, new_logp, keep, sampler, batch.action_index, batch.action_mask)
        rows = self.host_rows()
        metrics.update({k: float(v) for k, v in distributed.fetch_to_host(gap).items()})
        return {k: distributed.local_rows(v, rows) for k, v in sums.items()}, metrics

    def _reduction_fn(self, num_actions: int, with_delta: bool):
        if (num_actions, with_delta) not in self.reductions:
            rl = self.config.rl

            def reduce(old_logp, new_logp, keep, sampler_logp, action_index, action_mask):
                if new_logp is not None:  # Δ = 0 where the pass did not compute (A = 0: unread)
                    new_logp = jnp.where(keep[:, None], new_logp, old_logp)
                sums = action_sums(old_logp, action_index, action_mask, num_actions, new_logp)
                return sums, {**sampler_gap(sampler_logp, old_logp, action_mask),
                              **correction_metrics(old_logp - sampler_logp, action_mask, rl)}

            name = "step_reductions_delta" if with_delta else "step_reductions"
            self.reductions[num_actions, with_delta] = jax.jit(self.reduction_signatures.counted(name, reduce))
        return self.reductions[num_actions, with_delta]

    def _reference_is_policy(self) -> bool:
        return self.reference_is_policy_in is not None and self.reference_is_policy_in() is self.state

    def compile_counts(self) -> dict[str, int]:
        """Input signatures each jitted function was traced for (``train.signatures``: jit's own cache size
        is evicted in long-lived processes): at most 1 for a whole run (π_ref: 0 until step 1)."""
        return {**self.fns.signatures.counts(), **self.reduction_signatures.counts()}
