"""``--mode=plan``: will this config fit the hardware? Answered before a pod is booked.

    python -m llds_jax.main --mode=plan --config=configs/qwen3b.py --config.plan.devices=64
    python -m llds_jax.main --mode=plan --config=configs/qwen3b.py --config.plan.topology=v5e:8x8
    python -m llds_jax.main --mode=plan --config=configs/qwen3b.py --config.plan.gpu=h100 --config.plan.devices=8

No weights are read or allocated. The model's shapes come from ``config.model.source`` (an
HF ``config.json``, or a known Qwen2.5 name such as ``.../Qwen2.5-3B``: ``models.loading``); every array is a
``jax.ShapeDtypeStruct`` carrying the sharding the run would use. Three programs are compiled
ahead of time (``jit(...).lower(...).compile()``) on a mesh of ``plan.devices`` devices:

* ``update``   — the trainer's real update step (``train.step.build_update_fns``): every
  mini-batch's AdamW update with gradient accumulation, remat and chunked log-probs;
* ``logprobs`` — the no-grad π_old / π_ref forward over the rollout batch;
* ``prefill`` / ``decode`` — the sampler's cache write of the prompts and one decode token
  (``Decoder.forward_cached``) with a KV cache for ``plan.rollout_batch`` rows.

Per device it prints what lives there: params, Adam moments, the reference copy, the batch,
the KV cache (exact, from the shardings) and XLA's own ``memory_analysis`` of each program
(arguments, outputs, donated aliases, temporaries = activations + gradient accumulator +
workspace), then the peak against H100 80 GB / H200 141 GB / TPU v5e 16 GB / v5p 95 GB.

Which compiler (``llds_jax.plan.targets``): ``plan.topology="v5e:8x8"`` compiles with
XLA:TPU for that slice and ``plan.gpu="h100"`` with XLA:GPU for ``plan.devices`` H100s — both
compile-only, on any host, once ``pip install '.[plan-tpu]'`` / ``'.[plan-gpu]'`` is done. XLA:TPU
refuses programs that overflow the chip's HBM; the plan then records the compiler's message and
recompiles with ``xla_tpu_no_crash_on_oom`` to get the numbers. With neither (or without the
package, which is said in the table) the programs are compiled by XLA:CPU's SPMD partitioner
for the same number of simulated devices: argument/KV/batch sizes are then exact for any
backend, while temporaries are XLA:CPU's buffer assignment of the same partitioned program.
The table names the compiler that produced the numbers.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pickle
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from llds_jax.config import mesh_shape, validate, validate_sections
from llds_jax.models.attention import CACHED_BLOCK, DEFAULT_BLOCK, QUERY_BLOCK, query_piece
from llds_jax.models.loading import decoder_config
from llds_jax.plan.aot import TooLargeToCompile, abstract_train_state, compile_ahead
from llds_jax.plan.config import CHECK_MODES, GB, HARDWARE, USABLE_FRACTION
from llds_jax.plan.retrieval import index_memory, refuse_index
from llds_jax.plan.step_time import StepTime, format_step_time, predict_step_time
from llds_jax.plan.targets import NeedsFreshProcess, PlanError, Target, resolve_target
from llds_jax.utils import flops


# ------------------------------------------------------------------ inputs
def plan_devices(section) -> Target:
    """The target to compile for: a TPU slice's or GPUs' compile-only devices, or this process's
    (CPU: simulated) devices.

    Raises ``NeedsFreshProcess`` when this process's JAX already started with another device
    count (anything that runs a JAX op fixes it: importing bm25s does) or without the CUDA plugin.
    """
    target = resolve_target(section)
    if target.devices is not None:
        return target
    wanted = target.count
    if wanted:
        try:  # only possible before the backend starts; afterwards the device count is fixed
            jax.config.update("jax_num_cpu_devices", wanted)
        except RuntimeError:
            pass
    devices = jax.devices()
    if wanted and len(devices) < wanted:
        if devices[0].platform != "cpu":
            raise PlanError(f"plan.devices={wanted}: this host has {len(devices)} {devices[0].platform} devices; "
                            f"plan on a CPU host (simulated devices) or set plan.topology / plan.gpu")
        raise NeedsFreshProcess(wanted)
    devices = devices[:wanted] if wanted else devices
    if target.note:
        return dataclasses.replace(target, devices=tuple(devices), count=len(devices))
    return Target(devices[0].platform, tuple(devices), len(devices),
                  f"XLA:{devices[0].platform.upper()} SPMD, {len(devices)} devices")


def _plan_in_child(config, devices: int) -> None:
    """Run the plan in ``python -m llds_jax.plan.run`` (JAX_PLATFORMS=cpu, ``devices`` CPU devices)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.pkl"
        path.write_bytes(pickle.dumps(config))
        env = dict(os.environ, JAX_PLATFORMS="cpu",
                   XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}")
        result = subprocess.run([sys.executable, "-m", "llds_jax.plan.run", str(path)], env=env, check=False)
    if result.returncode:
        raise PlanError(f"the plan for {devices} devices failed in its child process "
                        f"(exit {result.returncode}; its error is printed above)")


def bytes_per_device(tree: Any) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (replicas counted in full)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        if leaf is None:
            continue
        shard = leaf.sharding.shard_shape(leaf.shape)
        total += math.prod(shard) * jnp.dtype(leaf.dtype).itemsize
    return total


# --------------------------------------------------------------- programs
@dataclasses.dataclass
class CompiledProgram:
    name: str
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    code_bytes: int
    compile_seconds: float
    refused: str = ""   # XLA:TPU's out-of-memory error, when it refused the program for this chip
    lower_bound: bool = False  # not compilable even without the HBM check: temps are the error's lower bound

    @property
    def peak_bytes(self) -> int:
        """Live at once: inputs, outputs not written into donated inputs, temporaries."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes + self.code_bytes


def compile_program(name: str, jitted, *abstract_args, platform: str = "cpu") -> CompiledProgram:
    """AOT-compile (``aot.compile_ahead``) and keep XLA's memory analysis; XLA:TPU's refusal for lack of HBM
    is kept and the numbers compiled anyway."""
    start = time.perf_counter()
    try:
        compiled, refused = compile_ahead(jitted, *abstract_args, platform=platform)
    except TooLargeToCompile as too_large:  # one buffer alone is larger than the HBM
        return CompiledProgram(name, bytes_per_device(abstract_args), 0, 0, _bytes_named(" ".join(too_large.messages)),
                               0, time.perf_counter() - start, str(too_large), lower_bound=True)
    seconds = time.perf_counter() - start
    stats = compiled.memory_analysis()
    if stats is None:
        raise PlanError(f"{name}: this backend reports no memory analysis")
    return CompiledProgram(name, stats.argument_size_in_bytes, stats.output_size_in_bytes,
                           stats.alias_size_in_bytes, stats.temp_size_in_bytes,
                           stats.generated_code_size_in_bytes, seconds, refused)


def _bytes_named(message: str) -> int:
    """The largest size an XLA:TPU out-of-memory message names ("(31.93G)" in GiB, "size=N" in bytes)."""
    sizes = [float(g) * 2**30 for g in re.findall(r"required for HLO temporaries \(([\d.]+)G\)", message)]
    sizes += [int(n) for n in re.findall(r"Allocation \(size=(\d+)\)", message)]
    return int(max(sizes, default=0))


@dataclasses.dataclass
class Plan:
    model: str
    parameters: int
    mesh_shape: tuple[int, ...]
    compiler: str
    resident: dict[str, int]            # per device, alive for the whole run
    phase_extra: dict[str, dict[str, int]]  # per device, alive during one phase only
    programs: dict[str, CompiledProgram]
    notes: list[str]
    attention_scores: dict[str, int] = dataclasses.field(default_factory=dict)  # one layer, per device
    target: str = ""                    # the HARDWARE row the compiler targeted ("" = none: a proxy)
    attention_kernels: dict[str, str] = dataclasses.field(default_factory=dict)  # phase -> kernel compiled
    step_time: StepTime | None = None   # predicted seconds per phase of one step (plan.step_time)

    def phase_peak(self, phase: str) -> int:
        """Peak bytes per device of a phase: XLA's live set of the program plus what it does not see."""
        program = self.programs[phase]
        outside = sum(v for k, v in self.resident.items() if k not in _ARGUMENTS_OF[phase])
        return program.peak_bytes + outside

    @property
    def peak_bytes(self) -> int:
        return max(self.phase_peak(p) for p in self.programs)


# Which resident buffers each program receives as arguments (XLA counts those itself).
_ARGUMENTS_OF = {
    "update": {"params", "optimizer", "reference", "counters"},
    "logprobs": {"params"},
    "prefill": {"params"},
    "decode": {"params"},
}


def make_plan(config, target: Target | None = None) -> Plan:
    """Compile the configured phases for the planned mesh and account per-device memory.

    ``target`` defaults to ``plan_devices(config.plan)``; a list of devices is also accepted.
    """
    from llds_jax.parallel.mesh import make_mesh  # noqa: PLC0415
    from llds_jax.parallel.rules import DEFAULT  # noqa: PLC0415
    from llds_jax.train.batch import TrainBatch, padded_length  # noqa: PLC0415
    from llds_jax.train.step import build_update_fns  # noqa: PLC0415
    from llds_jax.train.step_settings import packing_for_run  # noqa: PLC0415

    section = config.plan
    if target is None:
        target = plan_devices(section)
    elif not isinstance(target, Target):
        devices = tuple(target)
        target = Target(devices[0].platform, devices, len(devices),
                        f"XLA:{devices[0].platform.upper()} SPMD, {len(devices)} devices")
    devices = list(target.devices)
    validate(config, len(devices))
    shape = mesh_shape(config, len(devices))
    mesh = make_mesh(shape, devices)
    rules = DEFAULT
    decoder_cfg = decoder_config(config.model, target.platform)  # the target's remat policy (model.remat_gpu)

    trajectories = config.train.prompts_per_step * config.rollout.n_samples
    length = padded_length(config)
    dp_rows = rules.shards("batch", mesh)
    rollout_rows, wave_note = _rollout_rows(config, section, decoder_cfg, target, devices, trajectories, dp_rows)

    graphdef, state, state_shardings = abstract_train_state(config, decoder_cfg, mesh, rules)
    # Packed micro-batches: what the run trains on, on one host or several (Learner.pack_across_hosts).
    packing = packing_for_run(config, mesh, rules)
    batch = TrainBatch.abstract(trajectories, length, with_ref=state.ref_params is not None, mesh=mesh, rules=rules,
                                packing=packing, with_sampler=config.rl.rollout_correction != "none")
    # the rollout compiles on the engine's paged cache (either policy): its slots, its pool
    engine = _engine_layout(config, section, decoder_cfg, target, devices, trajectories, dp_rows, rollout_rows)
    if config.rollout.engine == "continuous":  # the note says what the engine runs, not a wave
        wave_note = _engine_note(engine, trajectories)
    cache = _abstract_paged_cache(decoder_cfg, config.rollout, engine, dp_rows, mesh, rules)
    sampler_rows = {"prefill": min(int(config.rollout.prefill_rows), engine.slots_per_device) * dp_rows,
                    "decode": engine.slots_per_device * dp_rows}
    # an append runs over the rows that have ids, gathered with their tables (SlotSession._extend):
    # the same pools, a table and an end per appended row
    caches = {"decode": cache, "prefill": dataclasses.replace(
        cache, table=_row_array((sampler_rows["prefill"], cache.table.shape[1]), jnp.int32, mesh, rules),
        end=_row_array((sampler_rows["prefill"],), jnp.int32, mesh, rules))}
    parameters = sum(math.prod(x.shape) for x in jax.tree.leaves(state.params))
    resident = {
        "params": bytes_per_device(state.params),
        "optimizer": bytes_per_device(state.opt_state),
        "reference": bytes_per_device(state.ref_params),
        "counters": bytes_per_device((state.step, state.rng, state.updates, state.skipped_updates)),
    }
    index_held, index_note = index_memory(config, len(devices), hosts_of(devices))
    resident.update(index_held)  # the mesh index: resident beside the model, outside every program's arguments
    phase_extra = {
        "update": {"batch": bytes_per_device(batch)},
        "logprobs": {"batch": bytes_per_device(batch.logprob_inputs)},
        "prefill": {"kv_cache": bytes_per_device(cache)},
        "decode": {"kv_cache": bytes_per_device(cache)},
    }
    programs: dict[str, CompiledProgram] = {}
    phases = tuple(section.phases)
    with jax.set_mesh(mesh):
        if "update" in phases or "logprobs" in phases:
            fns = build_update_fns(graphdef, state_shardings, batch.shardings(mesh, rules), mesh,
                                   config, rules, packing=packing)
            if "update" in phases:
                programs["update"] = compile_program("update", fns.update, state, batch,
                                                     platform=target.platform)
            if "logprobs" in phases:
                programs["logprobs"] = compile_program("logprobs", fns.policy_logprobs, state.params,
                                                       *batch.logprob_inputs, platform=target.platform)
        prompt_tokens = int(config.rollout.max_prompt_tokens)
        chunk = int(config.rollout.prefill_chunk)
        sampler_tokens = {"prefill": min(chunk, prompt_tokens) if chunk else prompt_tokens, "decode": 1}
        for phase in ("prefill", "decode"):
            if phase in phases:
                programs[phase] = compile_program(
                    phase, _cached_forward(graphdef, mesh, rules), state.params,
                    _row_array((sampler_rows[phase], sampler_tokens[phase]), jnp.int32, mesh, rules),
                    caches[phase], _row_array((sampler_rows[phase], sampler_tokens[phase]), jnp.bool_, mesh, rules),
                    platform=target.platform)
    dp = dp_rows
    heads = decoder_cfg.num_heads // rules.shards("act_heads", mesh, decoder_cfg.num_heads)
    context, prompt = int(config.rollout.max_context), int(config.rollout.max_prompt_tokens)
    requested = config.model.attention
    kernels = {phase: _attention_kernel(requested, target.platform, full_sequence=phase in ("update", "logprobs"))
               for phase in programs}
    if "decode" in kernels:  # the engine's one-token step: the paged decode kernel
        from llds_jax.models.attention import resolve_paged_backend  # noqa: PLC0415

        paged = resolve_paged_backend(requested, target.platform)
        kernels["decode"] = {"triton": "pallas paged decode (triton)", "splash": "pallas paged decode (tpu)"}.get(
            paged, kernels["decode"])
    def scores_read(phase, queries, keys):  # the [queries, keys] tile one kernel step holds
        full_sequence = phase in ("update", "logprobs")
        if kernels[phase] == "naive":
            return queries, keys
        if kernels[phase] == "xla_blockwise" and full_sequence:  # a query piece x QUERY_BLOCK keys
            return min(queries, query_piece(queries)), min(keys, QUERY_BLOCK)
        return queries, min(keys, DEFAULT_BLOCK if full_sequence else CACHED_BLOCK)

    rows = {"update": config.train.micro_batch_size, "logprobs": config.train.logprob_batch_size,
            **sampler_rows}
    if packing is not None:  # both passes run micro-batches of packed rows
        rows["update"] = rows["logprobs"] = packing.rows
    queries = {"update": length, "logprobs": length, "prefill": prompt, "decode": 1}
    keys = {"update": length, "logprobs": length, "prefill": context, "decode": context}
    attention = {  # one layer's fp32 scores per device: rows x heads x (a tile of) queries x keys x 4 B
        phase: -(-rows[phase] // dp) * heads * math.prod(scores_read(phase, queries[phase], keys[phase])) * 4
        for phase in programs}
    notes = [target.note] if target.note else []
    notes += [wave_note, index_note]
    if packing is not None:
        notes.append(f"packed rows: {packing.rows} × {packing.width} tokens per micro-batch "
                     f"(train.micro_batch_tokens), {packing.slots} micro-batch slots")
    step = None
    if section.step_time:
        step = _step_time(config, section, decoder_cfg, target, devices, rollout_rows, trajectories, length, state,
                          packing)
    return Plan(f"{Path(str(config.model.source)).name} ({decoder_cfg.num_layers} layers, d={decoder_cfg.hidden_size})",
                parameters, shape, target.compiler, resident, phase_extra, programs, notes,
                attention, target.hardware, kernels, step)


def hosts_of(devices) -> int:
    """Hosts the devices of a target belong to (compile-only topologies carry their process index)."""
    return max(1, len({getattr(d, "process_index", 0) for d in devices}))


def _step_time(config, section, decoder_cfg, target, devices, rollout_rows: int, trajectories: int, length: int,
               state, packing) -> StepTime:
    """The step-time prediction for this plan's target (``plan.step_time``); ``packing``: the packed
    shapes the training passes run (None: padded rows, ``train.packing`` off)."""
    from llds_jax.rollout.kv_plan import rollout_rows_per_wave  # noqa: PLC0415
    from llds_jax.train.step_settings import StepSizes  # noqa: PLC0415

    hosts = hosts_of(devices)
    platform = "gpu" if target.platform in ("gpu", "cuda") else target.platform
    peak = (flops.Peak(*flops.PEAKS[target.hardware][1:], flops.PEAKS[target.hardware][0]) if target.hardware
            else flops.device_peak(devices[0]))
    rows_per_wave = rollout_rows
    if hosts > 1:  # today each host samples on one of its devices (Learner.sampler_policy)
        capacity = HARDWARE[target.hardware][1] if target.hardware else device_memory_limit(section, devices) or 0
        rows_per_wave = (rollout_rows_per_wave(decoder_cfg, config.rollout, capacity, 1) if capacity
                         else -(-trajectories // hosts))
    state_bytes = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(state))
    return predict_step_time(config, decoder_cfg, platform=platform, peak=peak, devices=len(devices), hosts=hosts,
                             rows_per_wave=rows_per_wave, train_rows=trajectories, train_length=length,
                             scored_per_row=StepSizes.from_config(config).scored_positions, state_bytes=state_bytes,
                             packing=packing, device_bytes=HARDWARE[target.hardware][1] if target.hardware
                             else device_memory_limit(section, devices),
                             hardware=target.hardware or "")


def _rollout_rows(config, section, decoder_cfg, target, devices, trajectories: int, dp: int) -> tuple[int, str]:
    """Rows of one rollout wave as the trainer will decode them, and a note saying where that came from.

    ``plan.rollout_batch`` overrides; otherwise ``rollout.max_concurrent_rows``, or the trainer's
    derivation (``rollout.kv_plan.rollout_rows_per_wave``) for the target chip's memory.
    """
    from llds_jax.rollout.kv_plan import rollout_rows_per_wave  # noqa: PLC0415

    context = config.rollout.max_context
    if int(section.rollout_batch):
        rows, source = int(section.rollout_batch), "plan.rollout_batch"
    else:
        device_bytes = HARDWARE[target.hardware][1] if target.hardware else device_memory_limit(section, devices)
        if device_bytes is None and not int(config.rollout.max_concurrent_rows):
            return trajectories, (f"the rollout decodes all {trajectories} trajectories of a step together (KV cache "
                                  f"{trajectories} rows x {context} slots): no target memory to size waves by; "
                                  f"set plan.topology / plan.gpu or rollout.max_concurrent_rows")
        rows = rollout_rows_per_wave(decoder_cfg, config.rollout, device_bytes or 0, dp)
        source = ("rollout.max_concurrent_rows" if int(config.rollout.max_concurrent_rows) else
                  f"derived: rollout.memory_fraction={config.rollout.memory_fraction} of {device_bytes / GB:.0f} GB")
    rows = max(dp, min(rows, trajectories) // dp * dp)
    waves = -(-trajectories // rows)
    note = (f"the rollout (rollout.engine=waves) decodes {trajectories} trajectories in {waves} wave(s) of "
            f"{rows} rows ({source}); paged KV: each row the blocks of {context} tokens")
    return rows, note


def _engine_note(engine, trajectories: int) -> str:
    return (f"the rollout engine (rollout.engine=continuous, paged KV) runs {engine.slots_per_device} slots "
            f"and a pool of {engine.kv_blocks_per_device} KV blocks of {engine.block_tokens} tokens "
            f"({engine.kv_tokens_per_device} tokens) per device for {trajectories} trajectories; prefill "
            f"and decode below compile on that paged cache")


def _engine_layout(config, section, decoder_cfg, target, devices, trajectories: int, dp: int, wave_rows: int):
    """The engine's per-device slots and KV pool on the target, as the engine sizes itself: under the
    waves a wave's rows (``wave_rows`` over the ``dp`` devices), each with the blocks of a whole
    ``max_context``; under the continuous policy ``rollout/kv_plan.py``'s slots and pool (the same
    whole-context rows when ``rollout.max_concurrent_rows`` is set or no target memory is known)."""
    from llds_jax.rollout.kv_plan import EngineMemory, engine_memory  # noqa: PLC0415
    from llds_jax.sampling.slots import cache_slot_limit  # noqa: PLC0415

    block = int(config.rollout.kv_block_tokens)
    whole = -(-cache_slot_limit(int(config.rollout.max_context)) // block)
    device_bytes = HARDWARE[target.hardware][1] if target.hardware else device_memory_limit(section, devices)
    explicit = int(config.rollout.max_concurrent_rows)
    if config.rollout.engine != "continuous" or explicit or not device_bytes:
        slots = -(-(min(explicit, trajectories) if config.rollout.engine == "continuous" and explicit
                    else wave_rows) // dp)
        blocks = int(config.rollout.kv_blocks) if config.rollout.engine == "continuous" else 0
        return EngineMemory(slots, blocks or slots * whole, block, 0, 0, 0)
    memory = engine_memory(decoder_cfg, config.rollout, int(device_bytes), -(-trajectories // dp))
    configured = int(config.rollout.kv_blocks)
    return dataclasses.replace(memory, kv_blocks_per_device=configured) if configured else memory


def _abstract_paged_cache(decoder_cfg, rollout_config, engine, dp: int, mesh, rules):
    """The engine's paged cache (``models.PagedKVCache``) as sharded shapes: each data device its pool."""
    from llds_jax.models import PagedKVCache  # noqa: PLC0415
    from llds_jax.sampling.slots import cache_slot_limit  # noqa: PLC0415

    block = engine.block_tokens
    pool = (dp, engine.kv_blocks_per_device, decoder_cfg.num_kv_heads, block, decoder_cfg.head_dim)
    pool = jax.ShapeDtypeStruct(pool, jnp.dtype(decoder_cfg.dtype),
                                sharding=rules.sharding(("batch", None, None, None, None), mesh, pool))
    rows = engine.slots_per_device * dp
    columns = -(-cache_slot_limit(int(rollout_config.max_context)) // block)
    return PagedKVCache(k=(pool,) * decoder_cfg.num_layers, v=(pool,) * decoder_cfg.num_layers,
                        table=_row_array((rows, columns), jnp.int32, mesh, rules),
                        end=_row_array((rows,), jnp.int32, mesh, rules))


def _attention_kernel(requested: str, platform: str, *, full_sequence: bool) -> str:
    """The kernel a phase compiles (``models.attention``: splash/cuDNN serve full sequences only)."""
    from llds_jax.models.attention import resolve_backend  # noqa: PLC0415

    kernel = resolve_backend(requested, platform)
    return kernel if full_sequence or kernel == "naive" else "xla_blockwise"


def _row_array(shape, dtype, mesh, rules):
    logical = ("batch",) + (None,) * (len(shape) - 1)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=rules.sharding(logical, mesh, shape))


def _cached_forward(graphdef, mesh, rules):
    """The sampler's per-call program: write ``tokens`` into the cache, logits of the last one."""
    def forward(params, tokens, cache, token_mask):
        return nnx.merge(graphdef, params).forward_cached(tokens, cache, token_mask)

    return jax.jit(forward, donate_argnums=(2,))


# ----------------------------------------------------------- before a run
# What to change when a phase does not fit, named in the refusal.
PHASE_KNOBS = {
    "update": "train.micro_batch_tokens (packed) or train.micro_batch_size (rows per gradient micro-batch), "
              "model.remat (model.remat_gpu on a GPU) or mesh.shape",
    "logprobs": "train.micro_batch_tokens (packed) or train.logprob_batch_size",
    "prefill": "rollout.max_concurrent_rows (rows per rollout wave) or rollout.prefill_chunk",
    "decode": "rollout.max_concurrent_rows (rows per rollout wave) or rollout.memory_fraction",
}


def device_memory_limit(section, devices) -> int | None:
    """Bytes one device may use: ``plan.device_memory_bytes``, else what the device reports (None on CPU)."""
    if int(section.device_memory_bytes):
        return int(section.device_memory_bytes)
    from llds_jax.rollout.memory import reported_bytes_limit  # noqa: PLC0415

    return reported_bytes_limit(devices)


def check_fits_before_training(config, devices) -> Plan | None:
    """Compile the run's own programs for ``devices`` (no weights) and refuse a run that will not fit.

    Costs one AOT compile of each phase before the weights load: minutes on a pod, against an
    out-of-memory error an hour later, after the weights and the first rollout.
    """
    section = config.plan
    mode = section.check_before_train
    if mode not in CHECK_MODES:
        raise PlanError(f"plan.check_before_train={mode!r} is not one of {CHECK_MODES}")
    if mode == "never":
        return None
    devices = list(devices)
    limit = device_memory_limit(section, devices)
    if limit is None:
        if mode == "always":
            raise PlanError(f"plan.check_before_train='always', but {devices[0].platform} devices report no memory "
                            "limit: set plan.device_memory_bytes")
        return None
    if index_alone := refuse_index(config, len(devices), hosts_of(devices), limit):  # before any compile
        raise PlanError(f"this run will not fit its devices:\n{index_alone}\n(plan.check_before_train='never' skips "
                        "this check)")
    plan = make_plan(config, target=devices)
    over = {phase: plan.phase_peak(phase) for phase in plan.programs if plan.phase_peak(phase) > limit}
    if over:
        size = lambda n: f"{n / GB:.2f} GB" if n >= GB / 10 else f"{n / 1e6:.2f} MB"
        lines = [f"  {phase}: {size(peak)} per device > {size(limit)}; change {PHASE_KNOBS[phase]}"
                 for phase, peak in over.items()]
        if index := plan.resident.get("retrieval_index", 0):  # only the mesh index puts it there
            lines.append(f"  each phase includes the retrieval index, {size(index)} per device (retrieval.method='mesh',"
                         f" retrieval.mesh_dtype={config.retrieval.mesh_dtype!r})")
        raise PlanError("this run will not fit its devices (its own plan; --mode=plan prints the table):\n"
                        + "\n".join(lines) + "\n(plan.check_before_train='never' skips this check)")
    return plan


# ------------------------------------------------------------------ report
def _gb(n: int) -> str:
    return f"{n / GB:8.2f}"


def format_plan(plan: Plan, hardware=tuple(HARDWARE)) -> str:
    lines = [
        f"model      : {plan.model}, {plan.parameters / 1e9:.3f} B parameters",
        f"mesh       : (data, fsdp, tensor) = {plan.mesh_shape}  -> {math.prod(plan.mesh_shape)} devices",
        f"compiler   : {plan.compiler}",
        "",
        "resident per device (whole run), GB",
        *(f"  {k.replace('_', ' '):<24}{_gb(v)}" for k, v in plan.resident.items()),
        f"  {'total':<24}{_gb(sum(plan.resident.values()))}",
        "",
        "per phase, per device, GB: XLA memory_analysis of the compiled program",
        f"  {'phase':<10}{'args':>9}{'outputs':>9}{'donated':>9}{'temps':>9}{'+other':>9}{'peak':>9}"
        f"{'attn/layer':>11}{'compile s':>11}   attention kernel, phase-only inputs",
    ]
    for name, p in plan.programs.items():
        outside = plan.phase_peak(name) - p.peak_bytes
        extra = ", ".join(f"{k} {v / GB:.2f}" for k, v in plan.phase_extra.get(name, {}).items())
        lines.append(f"  {name:<10}{_gb(p.argument_bytes)}{_gb(p.output_bytes)}{_gb(p.alias_bytes)}"
                     f"{_gb(p.temp_bytes)}{_gb(outside)}{_gb(plan.phase_peak(name))}"
                     f"{plan.attention_scores.get(name, 0) / GB:>11.2f}{p.compile_seconds:>11.1f}   "
                     f"{plan.attention_kernels.get(name, '?')}; {extra}"
                     + ("   LOWER BOUND: not compilable for this chip" if p.lower_bound else ""))
    if not plan.programs:  # plan.phases=(): the step time alone, nothing compiled
        lines += ["  (none compiled: plan.phases is empty)"]
        lines += [f"note: {n}" for n in plan.notes]
        return "\n".join(lines + ([format_step_time(plan.step_time)] if plan.step_time is not None else []))
    refused = {name: p.refused for name, p in plan.programs.items() if p.refused}
    lines += [f"  ! {plan.compiler.split(' ')[0]} refused {name} for this chip: {msg}" for name, msg in refused.items()]
    unknown = [name for name, p in plan.programs.items() if p.lower_bound]
    at_least = "at least " if unknown else ""
    lines += ["", f"fits? peak {at_least}{plan.peak_bytes / GB:.2f} GB per device vs {USABLE_FRACTION:.0%} of HBM"]
    for key in hardware:
        label, capacity = HARDWARE[key]
        usable = capacity * USABLE_FRACTION
        verdict = "fits" if plan.peak_bytes <= usable else f"DOES NOT FIT (needs {at_least}{plan.peak_bytes / usable:.1f}x)"
        if unknown and plan.peak_bytes <= usable:
            verdict = f"unknown ({', '.join(unknown)} could not be compiled for the target chip)"
        if key == plan.target:
            verdict = (f"DOES NOT FIT (the compiler refused {', '.join(refused)})" if refused else verdict)
            verdict += "   <- compiled for this chip"
        lines.append(f"  {label:<28}{verdict}")
    lines.append("  (rows other than the compiled chip reuse these numbers: a proxy)" if plan.target else
                 "  (no row's own compiler ran: the temporaries are a proxy for every row)")
    lines += ["", "temps = activations (remat), gradient accumulator, log-prob chunks, attention scores;",
              "+other = resident buffers the program does not take as arguments (e.g. Adam state while decoding);",
              "attn/layer = one layer's fp32 attention scores live at once per device (rows x heads x queries x",
              "keys x 4 B): keys = one block of the blockwise/splash/cuDNN kernels, all keys for naive (T^2)."]
    lines += [f"note: {n}" for n in plan.notes]
    if plan.step_time is not None:
        lines.append(format_step_time(plan.step_time))
    return "\n".join(lines)


def plan_as_json(plan: Plan) -> dict:
    """The whole plan as JSON (``plan.json_out``): memory per phase, and ``step_time_s`` / ``assumptions``."""
    out = {"model": plan.model, "parameters": plan.parameters, "mesh_shape": list(plan.mesh_shape),
           "compiler": plan.compiler, "target": plan.target, "resident_bytes": dict(plan.resident),
           "phases": {name: dataclasses.asdict(p) | {"peak_bytes": plan.phase_peak(name),
                                                     "attention_kernel": plan.attention_kernels.get(name, "")}
                      for name, p in plan.programs.items()},
           "peak_bytes": plan.peak_bytes if plan.programs else 0, "notes": list(plan.notes)}
    if plan.step_time is not None:
        out.update(plan.step_time.as_json())
    return out


def plan_main(config) -> None:
    """Entry point of ``--mode=plan``: print the per-device memory table (``make_plan`` returns it).

    When this process's JAX cannot build the target (CPU device count already fixed, or the
    CUDA plugin skipped at start-up), the plan is made and printed by a child process.
    """
    validate_sections(config)  # every section, before a compiler or device is touched
    section = config.plan
    try:
        plan = make_plan(config)  # validates again with the target's device count
    except NeedsFreshProcess as need:
        _plan_in_child(config, need.args[0])
        return
    print(format_plan(plan, tuple(section.hardware)), flush=True)
    if section.json_out:
        path = Path(str(section.json_out))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(plan_as_json(plan), indent=1) + "\n")
        print(f"plan written to {path}", flush=True)


if __name__ == "__main__":  # the child process of _plan_in_child
    plan_main(pickle.loads(Path(sys.argv[1]).read_bytes()))

