"""The training config: one ``ml_collections.ConfigDict`` with a section per subsystem.

Sections: ``model``, ``mesh``, ``data``, ``retrieval``, ``rollout`` (``llds_jax.rollout``'s
defaults), ``rl`` (``llds_jax.rl``'s defaults), ``optim``, ``train``, ``sft``, ``eval``,
``monitor`` (death-spiral monitor), ``plan`` (``--mode=plan``).
``configs/*.py`` start from :func:`base_config` and override; ``--config.a.b=v`` overrides
from the command line. :func:`validate` runs before any weights are touched and fails naming
the field and its value; :func:`batch_arithmetic` is the table printed at start-up.

Batch vocabulary (all counted in *trajectories* except ``prompts_per_step``):
``prompts_per_step × rollout.n_samples`` trajectories per rollout step, split **in order** into
``mini_batch_size`` chunks (one optimizer update each — the reference's 2560 / 256 = 10, the
split that makes π_θ ≠ π_old so LLDS can act), each accumulated over ``micro_batch_size``
chunks; ``logprob_batch_size`` is the chunk for the no-grad π_old / π_ref forwards. Mini-batch 1
of a step runs at θ = θ_old and takes its own gradient-stopped forward as π_old, so its LLDS is
exactly 0 (``train/micro_loss.py``); only later mini-batches, which read the precomputed π_old after
θ moved, can have LLDS > 0. With one mini-batch per step (``mini_batch_size`` = all
trajectories) LLDS therefore never acts.

Validation (:func:`validate`) composes every section's own checks — ``model``, ``mesh``,
``data``, ``retrieval``, ``rollout``, ``rl``, ``optim``, ``train``, ``sft``, ``eval``,
``monitor``, ``plan``, ``resume`` — and the trainer's size relations against a device count.
Every mode calls it (or :func:`validate_sections`, its device-free part) first, before any
device, index or weight is touched.
"""

from __future__ import annotations

import dataclasses
import math

import ml_collections

from llds_jax.diagnostics.monitor import MonitorConfig
from llds_jax.errors import InputError
from llds_jax.parallel.mesh import MESH_AXES, MeshShapeError, resolve_mesh_shape
from llds_jax.parallel.rules import current_rules
from llds_jax.plan.config import default_plan_config
from llds_jax.plan.config import validate as plan_validate
from llds_jax.rl.config import validate as rl_validate


class TrainConfigError(InputError):
    """A config value the trainer cannot honour; the message names the field and value."""


def base_config() -> ml_collections.ConfigDict:
    from llds_jax.parallel.distributed import default_distributed_config
    from llds_jax.retrieval.config import default_retrieval_config
    from llds_jax.rl.config import default_config as rl_defaults
    from llds_jax.rollout.config import default_config as rollout_defaults

    c = ml_collections.ConfigDict()
    c.workdir = "runs/default"
    c.seed = 0
    c.model = ml_collections.ConfigDict(dict(
        source="smollm2",      # "smollm2" (bundled GGUF), "tiny:<family>", or an HF dir / .gguf file
        tokenizer="",          # "" = the source's own tokenizer
        dtype="float32",       # compute dtype of the policy
        param_dtype="float32",  # master weights (keep fp32: lr 1e-6 updates vanish in bf16)
        ref_dtype="float32",   # frozen reference copy; "bfloat16" halves its memory
        remat="minimal",       # per-layer checkpoint policy: none | minimal | minimal_no_gate | dots_saveable | full (models/decoder.py)
        remat_gpu="",          # the policy where the programs compile for a GPU; "" = model.remat (models/loading.py)
        scan_layers=True,      # one scanned block (compiles once per program) or the layers unrolled (models/config.py)
        attention="auto",      # auto (splash on TPU, cuDNN on GPU, blockwise XLA elsewhere) | xla_blockwise | splash | cudnn | naive
        logprob_chunk_size=128,  # positions per chunk of the vocab projection (never [B,T,V] fp32)
        # random:<name> only: the final norm scaled so the initial logits spread this many nats (std over the
        # vocabulary), a trained model's peaked rows; 0 = the init's own (≈ 0.6 at Qwen's widths: near-flat rows)
        random_logit_std=0.0,
    ))
    c.mesh = ml_collections.ConfigDict(dict(shape=(-1, 1, 1)))  # (data, fsdp, tensor)
    c.data = ml_collections.ConfigDict(dict(
        train=("bundled:nq_train", "bundled:hotpotqa_train"),
        shuffle=True,
        limit_per_source=0,  # 0 = all rows
    ))
    c.retrieval = default_retrieval_config()  # bundled corpus, in-process BM25, cached index
    c.rollout = rollout_defaults()
    c.rl = rl_defaults()
    c.optim = ml_collections.ConfigDict(dict(
        lr=1e-6, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01, clip_norm=1.0,
        warmup_ratio=0.285,        # reference: 286 of 1005 steps
        lr_first_step_zero=True,   # verl's warmup factor step/warmup: step 0 trains at lr 0
    ))
    c.train = ml_collections.ConfigDict(dict(
        total_steps=1005,
        prompts_per_step=512,      # × rollout.n_samples (the GRPO group size) = trajectories per step
        mini_batch_size=256,
        micro_batch_size=32,
        logprob_batch_size=64,
        # Positions per trajectory whose log-probs π_old, π_ref, the loss and the Δ pass compute: 0 =
        # the rollout's bound on action tokens, (rollout.max_turns + 1) × rollout.max_action_tokens.
        max_action_tokens_per_row=0,
        # Pack trajectories several to a row for π_old, π_ref, the update and the Δ pass (segment ids,
        # positions restarting per trajectory): the same numbers to fp32 rounding on far fewer tokens.
        packing=True,
        # Tokens per packed micro-batch (rows of rollout.max_context, at least one per data shard);
        # 0 = one row per data shard, the least padding.
        micro_batch_tokens=0,
        warmup_sft_steps=0,        # format warm-up steps run before RL (see the sft section)
        save_every=100,
        keep_checkpoints=3,        # newest checkpoints kept; the lab's probe reads one every few steps (issue 43)
        # Backends beside metrics.jsonl (always written): tensorboard | wandb | mlflow | jsonl (train/loggers.py);
        # the one TensorBoard switch: () or ("jsonl",) writes metrics.jsonl alone.
        loggers=("tensorboard",),
        wandb_project="llds_jax", wandb_mode="offline",  # offline: no account or network; `wandb sync` later
        mlflow_tracking_uri="", mlflow_experiment="llds_jax",  # "" = the file store <workdir>/mlruns
        # DAPO dynamic sampling (train/dynamic_sampling.py): train only on groups whose rewards differ,
        # drawing up to dynamic_sampling_max_draws prompt batches per step (the first included).
        dynamic_sampling=False,
        dynamic_sampling_max_draws=4,
        profile_steps=(),          # RL steps whose jax.profiler trace goes to <workdir>/profile (train/profiling.py)
        delta_diagnostics=True,    # one extra no-grad forward after the updates: Δ = logπ_new − logπ_old (LLD rate)
        delta_every=1,             # ... on every k-th RL step only (steps 0, k, 2k, ...): the forward costs ≈ 1/3 of an update
        samples_per_step=4,        # trajectories' text/answer/reward appended to <workdir>/samples.jsonl
        export_hf=True,            # write <workdir>/hf/step_<N> (transformers-loadable) at the end
        max_nonfinite_updates=5,   # stop (with a checkpoint) after this many skipped non-finite updates in a row; 0 = never
        # Per-device peaks the throughput/*_mfu and *_mbu metrics divide by; 0 = the datasheet row of
        # the device (llds_jax.utils.flops.PEAKS: H100, H200, v5e, v5p), measured once on a CPU.
        peak_flops=0.0,
        peak_bytes_per_s=0.0,
    ))
    # Every MonitorConfig field, so --config.monitor.on_phase_two=raise_lambda etc. work from the command line
    c.monitor = ml_collections.ConfigDict(dict(enabled=True, **dataclasses.asdict(MonitorConfig())))
    c.distributed = default_distributed_config()  # multi-host join (llds_jax.parallel.distributed); unset = env/auto
    c.plan = default_plan_config()  # --mode=plan (llds_jax.plan): AOT memory plan before booking a pod
    c.resume = "auto"  # "auto" | "never" | a step number (llds_jax.train.checkpoint)
    c.sft = ml_collections.ConfigDict(dict(
        steps=20, batch_size=4, lr=1e-4, warmup_steps=0, max_seq_len=512,
        max_action_tokens_per_row=0,  # positions per example the loss scores (its action targets); 0 = every one
        data=("bundled:nq_train", "bundled:hotpotqa_train"),
    ))
    c.eval = ml_collections.ConfigDict(dict(  # --mode=eval (llds_jax.eval.run); configs/eval.py overrides
        # Files (.jsonl FlashRAG / .parquet Search-R1), directories of them, or bundled:<name>;
        # a tuple or one comma-separated string.
        data="bundled:nq_dev",
        limit=40,             # questions per data source; 0 = all
        greedy=True,          # False: T = rollout.temperature, top-p = rollout.top_p
        batch_size=8,         # questions per rollout call
        out_dir="",           # "" = <workdir>/eval
        seed=0,               # the sampling key when not greedy
    ))
    return c


def _get(config, path: str):
    value = config
    for part in path.split("."):
        value = value[part]
    return value


def _positive(config, path: str) -> int:
    value = _get(config, path)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TrainConfigError(f"{path}={value!r} must be a positive integer")
    return value


def _non_negative(config, path: str) -> int:
    value = _get(config, path)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TrainConfigError(f"{path}={value!r} must be an integer ≥ 0")
    return value


def _number_in(config, path: str, low: float, high: float | None = None) -> float:
    value = _get(config, path)
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            low <= value and (high is None or value <= high)):
        raise TrainConfigError(f"{path}={value!r} must be a number in [{low}, {'inf' if high is None else high}]")
    return value


def mesh_shape(config, num_devices: int | None = None) -> tuple[int, int, int]:
    """``mesh.shape`` with its ``-1`` resolved against ``num_devices`` (default: this host's devices)."""
    if num_devices is None:
        import jax

        num_devices = jax.device_count()
    try:
        return resolve_mesh_shape(tuple(config.mesh.shape), num_devices)
    except MeshShapeError as err:
        raise TrainConfigError(str(err)) from err


def data_parallel_size(config, num_devices: int | None = None) -> int:
    """Devices the batch splits over on the configured mesh: the rules table's ``batch`` axes."""
    return current_rules().shards("batch", dict(zip(MESH_AXES, mesh_shape(config, num_devices), strict=True)))


# --------------------------------------------------------------- sections
def _check_model(config) -> None:
    from llds_jax.models.config import ATTENTION_BACKENDS, REMAT_POLICIES

    m = config.model
    if not isinstance(m.source, str) or not m.source:
        raise TrainConfigError(f"model.source={m.source!r} must name a model ('smollm2', 'tiny:<family>', a path)")
    for path in ("model.dtype", "model.param_dtype", "model.ref_dtype"):
        if _get(config, path) not in ("float32", "bfloat16", "float16"):
            raise TrainConfigError(f"{path}={_get(config, path)!r}: expected float32, bfloat16 or float16")
    if m.remat not in REMAT_POLICIES:
        raise TrainConfigError(f"model.remat={m.remat!r}: expected one of {REMAT_POLICIES}")
    if m.remat_gpu and m.remat_gpu not in REMAT_POLICIES:
        raise TrainConfigError(f"model.remat_gpu={m.remat_gpu!r}: expected '' (= model.remat) or one of "
                               f"{REMAT_POLICIES}")
    if m.attention not in ATTENTION_BACKENDS:
        raise TrainConfigError(f"model.attention={m.attention!r}: expected one of {ATTENTION_BACKENDS}")
    _positive(config, "model.logprob_chunk_size")
    std = m.random_logit_std
    if not isinstance(std, (int, float)) or isinstance(std, bool) or not 0 <= std < float("inf"):
        raise TrainConfigError(f"model.random_logit_std={std!r}: expected a finite number >= 0")
    if std and not m.source.startswith("random:"):
        raise TrainConfigError(f"model.random_logit_std={std!r} scales random weights only; model.source={m.source!r} "
                               "is not 'random:<name>' (set it to 0)")


def _check_mesh(config) -> None:
    shape = tuple(config.mesh.shape)
    mesh_shape(config, max(1, math.prod(s for s in shape if isinstance(s, int) and s > 0)))  # its form only


def _check_data(config) -> None:
    if not config.data.train:
        raise TrainConfigError("data.train is empty: name at least one question source")
    _non_negative(config, "data.limit_per_source")


def _check_retrieval(config) -> None:
    from llds_jax.retrieval.config import validate as retrieval_validate

    retrieval_validate(config.retrieval)
    r = config.retrieval
    named = [a for a in str(r.mesh_axis).split(",") if a]
    if r.method == "mesh" and not r.url and (unknown := [a for a in named if a not in MESH_AXES]):
        # the trainer's mesh is the index's (app.run → open_mesh): a name outside it fails here, before any weight
        raise InputError(f"retrieval.mesh_axis={r.mesh_axis!r} names {unknown}, not axes of the trainer's mesh "
                         f"{MESH_AXES} ('' = every device)")


def _check_rollout(config) -> None:
    for path in ("rollout.max_turns", "rollout.max_action_tokens", "rollout.max_obs_tokens",
                 "rollout.max_prompt_tokens", "rollout.max_context", "rollout.topk", "rollout.n_samples",
                 "rollout.pad_to_multiple"):
        _positive(config, path)
    for path in ("rollout.top_k", "rollout.max_concurrent_rows", "rollout.cpu_memory_bytes",
                 "rollout.prefill_chunk", "rollout.kv_blocks"):
        _non_negative(config, path)
    for path in ("rollout.segment_tokens", "rollout.kv_block_tokens", "rollout.slot_tokens", "rollout.prefill_rows"):
        _positive(config, path)
    from llds_jax.rollout.config import ENGINES  # noqa: PLC0415  (as base_config imports the section)

    devices = config.rollout.sampler_devices
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < -1:
        raise TrainConfigError(f"rollout.sampler_devices={devices!r}: expected 0 (one device), -1 (every local "
                               f"device) or a device count")
    engine = config.rollout.engine
    if engine not in ENGINES:
        raise TrainConfigError(f"rollout.engine={engine!r}: expected one of {ENGINES}")
    _number_in(config, "rollout.temperature", 0.0)
    _number_in(config, "rollout.top_p", 0.0, 1.0)
    if _number_in(config, "rollout.memory_fraction", 0.0, 1.0) == 0.0:
        raise TrainConfigError("rollout.memory_fraction=0.0 leaves the rollout no memory: use (0, 1]")


def _check_rl(config) -> None:
    rl_validate(config.rl)  # the objective's fields fail here, not when the update is first traced


def _check_optim(config) -> None:
    o = config.optim
    if not 0.0 <= o.warmup_ratio <= 1.0:
        raise TrainConfigError(f"optim.warmup_ratio={o.warmup_ratio} must be in [0, 1]")
    if o.lr < 0:
        raise TrainConfigError(f"optim.lr={o.lr} must be ≥ 0")
    if o.clip_norm <= 0:
        raise TrainConfigError(f"optim.clip_norm={o.clip_norm} must be > 0")
    for path in ("optim.b1", "optim.b2"):
        beta = _number_in(config, path, 0.0, 1.0)
        if beta == 1.0:
            raise TrainConfigError(f"{path}=1.0: Adam's moment decay must be < 1")
    _number_in(config, "optim.eps", 0.0)
    _number_in(config, "optim.weight_decay", 0.0)


def _check_train(config) -> None:
    t = config.train
    if "max_doc_tokens" in t:  # a config file may still set the old name, which would silently do nothing
        raise TrainConfigError(f"train.max_doc_tokens={t.max_doc_tokens!r} moved to retrieval.max_doc_tokens "
                               "(the retriever factory applies the cut for training and eval alike)")
    if "tensorboard" in t:  # the removed second switch: train.loggers alone says which backends run
        raise TrainConfigError(f"train.tensorboard={t.tensorboard!r} was removed: train.loggers is the one switch "
                               "(drop 'tensorboard' from it, e.g. train.loggers=(), to write metrics.jsonl alone)")
    for path in ("train.total_steps", "train.prompts_per_step", "rollout.n_samples", "train.mini_batch_size",
                 "train.micro_batch_size", "train.logprob_batch_size", "rollout.max_context"):
        _positive(config, path)
    trajectories = t.prompts_per_step * config.rollout.n_samples
    if trajectories % t.mini_batch_size:
        raise TrainConfigError(
            f"train.mini_batch_size={t.mini_batch_size} does not divide train.prompts_per_step×rollout.n_samples"
            f"={t.prompts_per_step}×{config.rollout.n_samples}={trajectories} trajectories")
    if t.mini_batch_size % t.micro_batch_size:
        raise TrainConfigError(
            f"train.micro_batch_size={t.micro_batch_size} does not divide train.mini_batch_size={t.mini_batch_size}")
    if trajectories % t.logprob_batch_size:
        raise TrainConfigError(
            f"train.logprob_batch_size={t.logprob_batch_size} does not divide the {trajectories} trajectories "
            "of a step")
    if t.warmup_sft_steps < 0:
        raise TrainConfigError(f"train.warmup_sft_steps={t.warmup_sft_steps} must be ≥ 0")
    limit = t.max_nonfinite_updates
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise TrainConfigError(f"train.max_nonfinite_updates={limit!r} must be an integer ≥ 0 (0 = never stop)")
    _positive(config, "train.keep_checkpoints")
    for path in ("train.save_every", "train.samples_per_step", "train.max_action_tokens_per_row",
                 "train.micro_batch_tokens"):
        _non_negative(config, path)
    _positive(config, "train.delta_every")
    _positive(config, "train.dynamic_sampling_max_draws")
    if not isinstance(t.dynamic_sampling, bool):
        raise TrainConfigError(f"train.dynamic_sampling={t.dynamic_sampling!r} must be True or False")
    for path in ("train.peak_flops", "train.peak_bytes_per_s"):
        value = _get(config, path)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise TrainConfigError(f"{path}={value!r} must be a number ≥ 0 (0 = the device's datasheet peak)")


def _check_sft(config) -> None:
    if config.train.warmup_sft_steps:
        for path in ("sft.batch_size", "sft.max_seq_len"):
            _positive(config, path)
        _non_negative(config, "sft.max_action_tokens_per_row")
        _number_in(config, "sft.lr", 0.0)
        if not config.sft.data:
            raise TrainConfigError("sft.data is empty while train.warmup_sft_steps > 0")


def _check_eval(config) -> None:
    if "eval" not in config:
        return
    _positive(config, "eval.batch_size")
    _non_negative(config, "eval.limit")


def _check_monitor(config) -> None:
    try:
        MonitorConfig.from_mapping(config.monitor)
    except (TypeError, ValueError) as err:
        raise TrainConfigError(f"monitor: {err}") from err


def _check_plan(config) -> None:
    plan_validate(config.plan)


def _check_resume(config) -> None:
    value = config.resume
    if isinstance(value, bool) or not (value in ("auto", "never") or (isinstance(value, int) and value >= 0)
                                       or (isinstance(value, str) and value.isdigit())):
        raise TrainConfigError(f"resume={value!r}: expected 'auto', 'never' or a step number ≥ 0")


SECTION_CHECKS = {
    "model": _check_model, "mesh": _check_mesh, "data": _check_data, "retrieval": _check_retrieval,
    "rollout": _check_rollout, "rl": _check_rl, "optim": _check_optim, "train": _check_train, "sft": _check_sft,
    "eval": _check_eval, "monitor": _check_monitor, "plan": _check_plan, "resume": _check_resume,
}


def validate_sections(config) -> ml_collections.ConfigDict:
    """Every section's own values (no device count needed); returns the config for chaining.

    Safe before ``jax.distributed.initialize``: it asks JAX for nothing.
    """
    for check in SECTION_CHECKS.values():
        check(config)
    return config


def validate(config, num_devices: int | None = None) -> ml_collections.ConfigDict:
    """:func:`validate_sections`, then the size relations the update step needs on ``num_devices``.

    ``num_devices`` plans for another topology (e.g. 64 for a v5e-64) from any machine; by
    default this process's ``jax.device_count()``.
    """
    validate_sections(config)
    t = config.train
    dp = data_parallel_size(config, num_devices)
    for path, value in (("train.micro_batch_size", t.micro_batch_size),
                        ("train.logprob_batch_size", t.logprob_batch_size)):
        if value % dp:
            raise TrainConfigError(
                f"{path}={value} is not a multiple of the data-parallel size {dp} "
                f"(mesh.shape={tuple(config.mesh.shape)}: data×fsdp)")
    if t.warmup_sft_steps and config.sft.batch_size % dp:
        raise TrainConfigError(f"sft.batch_size={config.sft.batch_size} is not a multiple of the "
                               f"data-parallel size {dp}")
    return config


def _scored_text(config) -> str:
    from llds_jax.train.batch import padded_length, scored_positions_per_row  # noqa: PLC0415

    length = padded_length(config)
    scored = scored_positions_per_row(config, length)
    return (f"every one of the {length - 1} targets per row" if scored == length - 1 else
            f"≤ {scored} action targets per row of {length - 1} (train.max_action_tokens_per_row)")


def _packing_text(config, shards: int) -> str:
    from llds_jax.train.batch import padded_length, scored_positions_per_row  # noqa: PLC0415
    from llds_jax.train.packing import packing_sizes  # noqa: PLC0415

    width = padded_length(config)
    sizes = packing_sizes(config, width, scored_positions_per_row(config, width), shards)
    return (f"packing       : train.packing on: the decoder passes read trajectories packed into rows of "
            f"{width} tokens, {sizes.rows} rows per micro-batch (train.micro_batch_tokens), as many micro-batches "
            f"as each mini-batch fills; the two sizes above then only bound the padded fallback")


def batch_arithmetic(config, num_devices: int | None = None) -> str:
    """The human-readable batch / mini-batch / micro-batch table printed at start-up."""
    t = config.train
    trajectories = t.prompts_per_step * config.rollout.n_samples
    minis = trajectories // t.mini_batch_size
    micros = t.mini_batch_size // t.micro_batch_size
    dp = data_parallel_size(config, num_devices)
    warmup = int(config.optim.warmup_ratio * t.total_steps)
    return "\n".join([
        f"rollout batch : {t.prompts_per_step} prompts × {config.rollout.n_samples} samples = {trajectories} "
        f"trajectories, each padded to rollout.max_context = {config.rollout.max_context} tokens",
        f"mini-batches  : {trajectories} / {t.mini_batch_size} = {minis} sequential optimizer updates per step",
        f"micro-batches : {t.mini_batch_size} / {t.micro_batch_size} = {micros} accumulated per update; "
        f"{t.micro_batch_size // dp} per data-parallel shard (data×fsdp = {dp})",
        f"log-probs     : π_old and π_ref in chunks of {t.logprob_batch_size} "
        f"({trajectories // t.logprob_batch_size} chunks); LM head on {_scored_text(config)}",
        *([_packing_text(config, dp)] if t.packing else []),
        f"schedule      : {t.total_steps} steps, lr {config.optim.lr:g}, warmup {warmup} steps "
        f"({config.optim.warmup_ratio:.1%}), first step lr 0: {config.optim.lr_first_step_zero}; "
        f"{t.total_steps * minis} optimizer updates in total",
        f"SFT warm-up   : {t.warmup_sft_steps} steps of {config.sft.batch_size} trajectories",
    ])
