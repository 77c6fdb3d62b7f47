"""How long one training step takes on the target, phase by phase, before the hardware is booked.

Each phase's work is counted in closed form (``llds_jax.utils.flops``, the same counts the
trainer's ``throughput/*`` metrics divide) for the step the config describes, with trajectory
lengths drawn from a length distribution (``data.lengths``: Search-R1 3B's own by default, or a
run's ``samples.jsonl``), and turned into seconds at a stated fraction of the chip's peak:

* **rollout / decode** — decode steps of the rollout's schedule under each policy of the engine
  (``rollout.schedule_sim.simulate_engine``, the engine's own scheduler: the waves, every turn of a
  wave as long as its longest action; the continuous policy, its segments and retrieval waits), each
  reading the weights once and every row's live KV entries, at ``hbm`` × HBM bandwidth (or the
  matmul bound, if larger);
* **rollout / prefill** — prompts and appended feedback through the forward, at ``matmul`` × peak;
* **rollout / retrieval** — one batched retriever call per turn of a wave, each at the configured
  backend's cost (``plan.retrieval``: faiss Flat / IVF / BM25 on the host's CPUs, or the mesh index
  on the chips); the engine runs it on a host thread, so only its waits count there;
* **logprobs** (π_old, π_ref), **update** (forward + backward + remat), **delta** (the Δ forward,
  every ``train.delta_every`` steps; charged over every response, an upper bound: packed, it computes
  the responses with a nonzero advantage only, a share of the batch the plan cannot know ahead
  of the rewards) — over the batch as the trainer computes it, the update at
  ``matmul`` × peak, the no-grad passes at ``forward`` × peak (measured apart on the H100);
* **checkpoint** — the save is asynchronous, so the loop waits only for the devices' copy of the
  state to host memory, plus any part of the write (``plan.checkpoint_bytes_per_s`` per host) that
  outlasts the ``train.save_every`` steps it runs beside (amortised per step).

XLA's ``HloCostAnalysis`` costs a while loop's body once, and the update and decode are loops
(layers, micro-batches, tokens), so compiled costs under-count by the trip counts; the closed form
is what is used. Efficiencies are assumptions, named in the output with where they come from.
"""

from __future__ import annotations

import dataclasses
import math
import random

from llds_jax.data.lengths import TrajectoryLengths, load_lengths
from llds_jax.plan.collectives import collective_seconds
from llds_jax.utils import flops

# Fractions of peak the phases reach, per platform, and why (plan.efficiency_* override them).
# "forward": the no-grad log-prob passes (π_old, π_ref, Δ); "matmul": the update and the rollout's prefill.
EFFICIENCY = {
    "gpu": {"matmul": (0.42, "measured: launch/device_check.sh on one H100 ran the Qwen2.5-0.5B update over "
                              "320 x 4,096 tokens at 0.42 of peak (hardware FLOPs, remat included), 16 padded rows a "
                              "micro-batch; one shape (d=896, 16 rows a device) only, not yet checked against a second "
                              "(qwen3b on 8 H100s: d=2,048, 2 rows a device)"),
            "forward": (0.45, "measured: the same device check's log-prob forward over the same 320 x 4,096 tokens "
                              "ran at 0.45 of peak, 64 padded rows a batch; one shape (d=896) only, not yet checked "
                              "against a second"),
            "hbm": (0.60, "assumed (not yet measured after compile): batched decode at ~60 % of HBM bandwidth")},
    "tpu": {"matmul": (0.50, "assumed: MaxText's published dense-model MFU on v5e/v5p is ~50-60 %"),
            "forward": (0.50, "assumed: as the update (MaxText's published dense-model MFU on v5e/v5p ~50-60 %)"),
            "hbm": (0.70, "assumed: the Pallas decode kernel reads live KV blocks only")},
    "cpu": {"matmul": (0.50, "assumed: half the measured fp32 matmul peak"),
            "forward": (0.50, "assumed: half the measured fp32 matmul peak"),
            "hbm": (0.50, "assumed: half the measured copy bandwidth")},
}
# A checkpoint save blocks the loop only while each device copies its shard of the state to host memory:
# the trainer's Checkpointer saves asynchronously (train/checkpoint.py, Orbax's async CheckpointManager), the
# write runs beside the next steps and holds the loop up only if it is still running at the next save.
HOST_COPY_BYTES_PER_S = (10e9, "assumed, not measured: one device's copy of its state shard to pageable host "
                               "memory, all devices at once (~1/6 of PCIe Gen5 x16's 64 GB/s)")
# The rollout's one decode step (the engine's, under either policy: the paged cache; models/attention/decode_gpu.py
# on GPU, decode_tpu.py on TPU) has no loop or conditional whose predicate the host reads (bench_rollout.py --decode-program: 0 and 0 on
# h100-0p5b-320, h100-qwen3b, v5e-qwen3b), so its fixed cost is its kernel launches: per layer and per step,
# read off that report's compiled steps (XLA:GPU with the top-p sampler kernel, sampling/filtering_gpu.sample_top_p,
# and the gate/up kernel, models/mlp_gpu.py: 269 launches a token at 24 layers, 395 at 36, 10.5 a layer + 17, the
# two shapes' kinds of kernel a layer now the same since the paged kernel stores a G = 7 group in place (before,
# 0.5B's extra output slice a layer fitted 8.5 + 89); XLA:TPU, v5e-qwen3b's step compiled at 36 and at 24 of its
# layers (the same rows and pool; aadaa2a): 1,551 and 1,059, 41 a layer + 75 exactly), each at LAUNCH_S.
ENGINE_LAUNCHES = {"gpu": (10.5, 17), "tpu": (41, 75), "cpu": (0, 0)}  # (per layer, per step)
LAUNCH_S = {
    "gpu": (3e-6, "assumed, not yet measured: one kernel launch and its gap on a Hopper GPU without CUDA graphs "
                  "(benchmarks/device_decode_step.py measures it on the next lent GPU)"),
    "tpu": (1e-6, "assumed: XLA:TPU runs a program's ops back to back, ~1 µs an op"),
    "cpu": (0.0, "assumed: none")}
# The sampler's traffic over each sampled row's [vocab] logits a decode step, in passes over that row in the dtype the
# model writes it (the compute dtype: Decoder.forward_cached), the LM head's write of it included, per platform.
# The cut-off search is a Pallas kernel on both accelerators (sampling/filtering_tpu.py, filtering_gpu.py).
# GPU (the paper's top-p mode): the LM head writes the row, the top-p sampler kernel (filtering_gpu.sample_top_p)
# searches and draws in 2 reads where the boundary's one-nat bin fits its scratch, and a row whose bin overflows reads
# 9 more (the full-row search and draw): 0.27 % of rows on real weights (SmolLM2-135M, docs/performance.md), so
# 1 + 2 + 0.0027 x 9 ≈ 3.02; its candidate scratch apart (filtering_gpu.sampler_scratch_bytes: at capacity). (The engine's frozen-row
# select, 3 more, went at 813c247; picking the sampled logit reads one a row.)
# TPU: counted in HBM bytes, not XLA's cost analysis, which charges XLA:TPU's prefetches into VMEM as if they
# were HBM reads (docs/performance.md).
SAMPLER_ROW_READS = {
    "gpu": (3.02, "the LM head's write of the [rows, V] logits, the Triton top-p sampler's 2 reads and the full-row "
                  "fallback's 9 on the 0.27 % of rows whose boundary bin overflows its scratch (SmolLM2-135M's real "
                  "weights, 6,400 draws at T 1, top-p 0.95; not yet measured on Qwen)"),
    "tpu": (3, "the v5e-qwen3b step of bench_rollout.py --decode-program at the commit whose decode logits are bf16 (40 "
               "rows; the Pallas cut-off kernel), its ops touching [40, 151,936] charged their HBM operands and results "
               "(tools/roofline/_tpu_hbm.Reader.charges), the LM head's weights apart: its write 1, the draw's prefetch "
               "into VMEM 1, the kernel's read 1 (fp32 logits at f0a532e: 4, a second prefetch)"),
    "cpu": (23, "not measured on XLA:CPU (its own bisection): the XLA search's count on an H100 (9a28e06) assumed"),
}
# The GPU top-p sampler's fallback rate is the model's: random weights at the init's spread (model.source "random:...",
# model.random_logit_std below TRAINED_LIKE_LOGIT_STD) give near-flat logits, the top-p 0.95 nucleus ≈ 129,600 of
# 151,936 tokens and the boundary's bin 41k–84k (measured on random:Qwen2.5-0.5B's logits, 32 rows), so every row
# takes the full-row search and draw.
RANDOM_WEIGHTS_GPU_SAMPLER_READS = (12.0, "random weights: every row's boundary bin overflows the top-p sampler's "
                                          "scratch (near-flat logits), so the LM head's write, 2 reads and the "
                                          "full-row search and draw's 9")
# model.random_logit_std at or above which random weights sample like a trained model: at 5 nats a top-p 0.95 row of
# random:Qwen2.5-0.5B holds a median 174 tokens, its boundary bin a median 108 (p90 294, max 482 of 64 rows; at 4 nats
# 1,091, max 2,288: 1.6 % overflow), so the sampler takes its fast path as on SmolLM2's real weights.
TRAINED_LIKE_LOGIT_STD = 5.0
# Published step times of the paper's job elsewhere (seconds per step), for the table.
ANCHORS = (
    ("Search-R1 Qwen2.5-3B, 8xH100 (maintainers: 200 steps in 2-3 h)", "36-54 s"),
    ("Search-R1 Qwen2.5-3B, 8xH100 (users, Search-R1 issue #1)", "108-126 s"),
    ("verl Search-R1-like Qwen2.5-3B recipe, 8xH20", "165-185 s"),
    ("any Search-R1 job on TPU", "none published"),
)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A rollout schedule's work: decode steps and what they read, prefill tokens, retriever calls."""

    name: str
    decode_steps: int
    lower_bound_steps: int       # max(longest trajectory's decode tokens, all decode tokens / slots)
    decode_tokens: int
    key_reads: float             # Σ over sampled tokens of the live KV entries they attend to
    prefill_tokens: int
    prefill_pairs: float         # attention (query, key) pairs of the prefill and appends
    retrieval_calls: int
    slots: int

    @property
    def efficiency(self) -> float:
        return self.lower_bound_steps / max(self.decode_steps, 1)


def step_lengths(config, lengths: list[TrajectoryLengths], count: int, seed: int = 0) -> list[TrajectoryLengths]:
    """``count`` trajectories drawn from ``lengths`` (seeded, without replacement while it lasts), cut by
    the config's caps: ``max_turns + 1`` actions, ``max_action_tokens``, ``max_obs_tokens``, ``max_context``."""
    rollout = config.rollout
    pool, rng, drawn = list(lengths), random.Random(seed), []
    while len(drawn) < count:
        rng.shuffle(pool)
        drawn.extend(pool[: count - len(drawn)])
    out = []
    for trajectory in drawn:
        t = trajectory.capped(int(rollout.max_turns) + 1, int(rollout.max_action_tokens), int(rollout.max_obs_tokens))
        room, actions, feedback = int(rollout.max_context) - min(t.prompt, int(rollout.max_prompt_tokens)), [], []
        searched = []
        for k, a in enumerate(t.actions):
            actions.append(min(a, room))
            room -= actions[-1]
            if k < len(t.feedback) and room > 0:
                feedback.append(min(t.feedback[k], room))
                searched.append(t.is_search(k))
                room -= feedback[-1]
            if room <= 0:
                break
        keep = max(0, len(actions) - 1)  # feedback only between actions: a context that ran out ends the trajectory
        out.append(TrajectoryLengths(min(t.prompt, int(rollout.max_prompt_tokens)), tuple(actions), tuple(feedback[:keep]),
                                     tuple(searched[:keep])))
    return out


def waves_schedule(trajectories: list[TrajectoryLengths], rows_per_wave: int, *, max_tokens: int,
                   action_tokens: int) -> Schedule:
    """The engine's waves policy (``rollout.schedule_sim.simulate_engine(waves=True)``): rows in waves of
    ``rows_per_wave`` whole-context slots of ``max_tokens``; every turn of a wave is one decode call of the
    ``action_tokens`` buffer that lasts until its longest action ends, then one retriever call serves the
    wave's searches."""
    from llds_jax.rollout.schedule_sim import simulate_engine  # noqa: PLC0415

    run = simulate_engine(trajectories, rows_per_wave, segment=action_tokens, prefill_chunk=512, retrieval_steps=0,
                          max_tokens=max_tokens, waves=True)
    return _schedule("waves", run, min(rows_per_wave, len(trajectories)))


def _schedule(name: str, run: dict, slots: int, extra_steps: int = 0) -> Schedule:
    return Schedule(name, int(run["decode_steps"]) + extra_steps, int(run["lower_bound_steps"]),
                    run["decode_tokens"], run["key_reads"], run["prefill_tokens"], run["prefill_pairs"],
                    int(run["retrieval_batches"]), slots)


def engine_schedule(config, model_cfg, trajectories: list[TrajectoryLengths], *, device_bytes: float,
                    sampler_devices: int, paged: bool, retrieval_steps, waves_rows: int) -> Schedule:
    """The continuous engine's schedule (``rollout.schedule_sim.simulate_engine``: the engine's own
    ``Scheduler``) of one host's trajectories over its ``sampler_devices``: slots of dense
    ``max_context`` rows as the engine runs today (each device holds a wave's rows per device,
    ``waves_rows``), or the paged-KV plan's (``rollout.kv_plan.engine_memory``) with its block pool."""
    from llds_jax.rollout.kv_plan import engine_memory  # noqa: PLC0415
    from llds_jax.rollout.schedule_sim import simulate_engine  # noqa: PLC0415

    rollout = config.rollout
    kv_blocks, block, devices = None, int(rollout.kv_block_tokens), 1
    if paged:  # each sampler device its own pool, as the engine's paged cache
        memory = engine_memory(model_cfg, rollout, int(device_bytes), -(-len(trajectories) // sampler_devices))
        slots, kv_blocks, block = memory.slots_per_device * sampler_devices, memory.kv_blocks_per_device, memory.block_tokens
        devices = sampler_devices
    else:
        slots = min(len(trajectories), waves_rows * sampler_devices)
    run = simulate_engine(trajectories, slots,
                          segment=int(rollout.segment_tokens), prefill_chunk=int(rollout.prefill_chunk) or 512,
                          retrieval_steps=retrieval_steps, max_tokens=int(rollout.max_context), kv_blocks=kv_blocks,
                          block_size=block, devices=devices)
    return _schedule("engine, paged plan" if paged else "engine, dense rows", run, slots,
                     extra_steps=int(run["retrieval_wait_steps"]))


@dataclasses.dataclass
class StepTime:
    """Predicted seconds per phase (``seconds``; ``total`` included), the assumptions, the inputs."""

    seconds: dict[str, float]
    assumptions: dict[str, str]
    schedule: Schedule
    details: dict[str, float]
    # Every rollout schedule predicted (waves; the continuous engine on dense rows and on the paged
    # plan): its schedule and the step's seconds with it. ``seconds`` is the configured engine's.
    by_schedule: dict[str, tuple[Schedule, dict[str, float]]] = dataclasses.field(default_factory=dict)
    # One paper turn's search (a query per trajectory of the step): "configured" and faiss Flat on a host
    # vs the mesh index ("mesh_bfloat16" / "mesh_float32"), seconds; "queries".
    retrieval_turn: dict[str, float] = dataclasses.field(default_factory=dict)

    def as_json(self) -> dict:
        return {"step_time_s": dict(self.seconds), "assumptions": dict(self.assumptions),
                "schedule": dataclasses.asdict(self.schedule) | {"efficiency": self.schedule.efficiency},
                "step_time_s_by_schedule": {name: dict(sec) for name, (_, sec) in self.by_schedule.items()},
                "schedules": {name: dataclasses.asdict(sch) | {"efficiency": sch.efficiency}
                              for name, (sch, _) in self.by_schedule.items()},
                "details": dict(self.details), "anchors": {name: value for name, value in ANCHORS},
                "retrieval_turn_s": dict(self.retrieval_turn)}


# What each remat policy (models.decoder._remat) reruns in the update's backward, for the assumption's text.
REMAT_RERUN = {"full": "full remat rerunning the forward", "nothing_saveable": "remat rerunning the forward",
               "minimal": "remat 'minimal' keeping every matmul output (rerun: norms, RoPE, SiLU; no matmul)",
               "dots_saveable": "remat keeping every dot product's output (rerun: elementwise work)",
               "minimal_no_gate": "remat 'minimal_no_gate' keeping every matmul output but the MLP gate's "
                                  "(rerun: the gate projection, norms, RoPE, SiLU)",
               "none": "no remat"}


def attention_is_opaque(requested: str, platform: str) -> bool:
    """Whether the training passes' attention on ``platform`` is a kernel that keeps its residuals inside its
    custom VJP (so a remat policy reruns its forward): cuDNN on a GPU, splash on a TPU, where ``model.attention``
    asks for them or for ``auto`` (``models.attention.resolve_backend``; the job's GPU has cuDNN)."""
    return ((platform == "gpu" and requested in ("auto", "cudnn"))
            or (platform == "tpu" and requested in ("auto", "splash")))


def training_rows(trajectories: list[TrajectoryLengths], packing, length: int) -> tuple[int, int, int, float]:
    """(update rows, no-grad pass rows, row length, attention pairs of the whole batch) the training passes
    compute for ``trajectories``: packed rows (``train.packing.plan_rows``, within each mini-batch; the
    no-grad passes' the same rows as one group, ``packing.one_group``) when ``packing`` is given, else one
    padded row of ``length`` each."""
    if packing is None:
        return len(trajectories), len(trajectories), length, len(trajectories) * float(flops.causal_pairs(length))
    from llds_jax.train.packing import computed_tokens, one_group, plan_rows  # noqa: PLC0415

    plan = plan_rows([t.total for t in trajectories], [sum(t.actions) for t in trajectories], packing)
    rows = (computed_tokens(plan, packing) // packing.width,
            computed_tokens(one_group(plan, packing), packing.whole_batch()) // packing.width)
    return *rows, packing.width, float(sum(flops.causal_pairs(t.total) for t in trajectories))


def predict_step_time(config, model_cfg, *, platform: str, peak: flops.Peak, devices: int, hosts: int,
                      rows_per_wave: int, train_rows: int, train_length: int, scored_per_row: int,
                      state_bytes: float, lengths: list[TrajectoryLengths] | None = None,
                      length_label: str = "", packing=None, device_bytes: float | None = None,
                      hardware: str = "") -> StepTime:
    """Seconds of one step of ``config`` on ``devices`` chips of ``peak`` over ``hosts`` hosts.

    ``rows_per_wave``: the rollout's wave size per host (all of a host's trajectories decode on
    its sampling devices: all the mesh's devices on one host, one per host on several, as
    ``Learner.sampler_policy`` does today); ``train_rows`` × ``train_length``: the batch the
    trainer's programs compute padded; ``packing`` (``train.packing.PackingSizes``): the passes run
    packed rows instead, sized on the step's own trajectories; ``state_bytes``: the train state a
    checkpoint writes; ``lengths`` (named ``length_label``) replace ``plan.length_source``;
    ``device_bytes``: one chip's memory, for the continuous engine's paged-KV plan (None: no such column);
    ``hardware``: the target's ``plan.config.HARDWARE`` key ("" = none), for the retrieval host's CPUs and
    the chips' interconnect.
    """
    section = config.plan
    efficiency = {kind: EFFICIENCY.get(platform, EFFICIENCY["cpu"])[kind] for kind in ("matmul", "forward", "hbm")}
    matmul = float(section.efficiency_matmul) or efficiency["matmul"][0]
    forward_rate = float(section.efficiency_matmul) or efficiency["forward"][0]  # the override sets both
    hbm = float(section.efficiency_hbm) or efficiency["hbm"][0]
    trajectories = int(config.train.prompts_per_step) * int(config.rollout.n_samples)
    per_host = -(-trajectories // hosts)
    sampler_devices = devices if hosts == 1 else 1
    drawn = step_lengths(config, lengths if lengths is not None else load_lengths(str(section.length_source)),
                         per_host, seed=int(config.seed))
    schedule = waves_schedule(drawn, max(1, min(rows_per_wave, per_host)), max_tokens=int(config.rollout.max_context),
                              action_tokens=int(config.rollout.max_action_tokens))
    search = _retrieval(config, drawn, platform=platform, hardware=hardware, peak=peak, devices=devices,
                        hosts=hosts, matmul=matmul, hbm=hbm, trajectories=trajectories)

    compute_bytes = 2 if model_cfg.dtype in ("bfloat16", "float16") else 4
    launches_per_layer, launches_per_step = ENGINE_LAUNCHES.get(platform, ENGINE_LAUNCHES["cpu"])
    sampler_reads, sampler_why = SAMPLER_ROW_READS.get(platform, SAMPLER_ROW_READS["cpu"])
    if (platform == "gpu" and str(config.model.source).startswith("random:")
            and config.model.random_logit_std < TRAINED_LIKE_LOGIT_STD):
        sampler_reads, sampler_why = RANDOM_WEIGHTS_GPU_SAMPLER_READS
    scratch = 0
    if platform == "gpu":  # the top-p sampler's candidate scratch, a sampled row's at capacity
        from llds_jax.sampling.filtering_gpu import sampler_scratch_bytes  # noqa: PLC0415  (Pallas Triton)

        scratch = sampler_scratch_bytes(model_cfg.vocab_size)
    sampler_row_bytes = sampler_reads * model_cfg.vocab_size * compute_bytes + scratch
    launch_s, launch_why = LAUNCH_S.get(platform, LAUNCH_S["cpu"])
    overhead = (launches_per_layer * model_cfg.num_layers + launches_per_step) * launch_s
    overhead_why = (f"the engine's step (either policy): {launches_per_layer} x {model_cfg.num_layers} layers + "
                    f"{launches_per_step} kernel launches (bench_rollout.py --decode-program) x "
                    f"{launch_s * 1e6:g} µs ({launch_why})")
    if float(section.decode_step_overhead_s) >= 0:  # one fixed cost for every schedule
        overhead, overhead_why = float(section.decode_step_overhead_s), "plan.decode_step_overhead_s"

    def rollout_seconds(sch: Schedule, samplers: int, retrieval_on_path: bool) -> dict[str, float]:
        """Decode at the bytes (or FLOPs) bound of its steps — weights once a step, live KV, and the
        sampler's reads of every row the step samples — plus its fixed cost a step (the engine's kernel
        launches: both policies run its one step program); prefill at the matmul rate;
        retrieval on the critical path for the waves (the engine waits only where its steps say so)."""
        read = flops.decode_bytes(model_cfg, sch.decode_steps, sch.key_reads / samplers, compute_bytes, compute_bytes)
        read += sampler_row_bytes * sch.decode_steps * sch.slots / samplers
        work = flops.decode_flops(model_cfg, sch.decode_tokens, sch.key_reads) / samplers
        decode = max(read / (peak.bytes_per_s * hbm), work / (peak.flops * matmul)) + overhead * sch.decode_steps
        prefill = (2.0 * model_cfg.num_layers * flops.layer_weights(model_cfg) * sch.prefill_tokens
                   + flops.attention_flops(model_cfg, sch.prefill_pairs)) / (peak.flops * matmul * samplers)
        retrieval = search["cost"].total(sch.retrieval_calls, search["call_queries"]) if retrieval_on_path else 0.0
        return {"rollout_decode": decode, "rollout_prefill": prefill, "rollout_retrieval": retrieval,
                "decode_bytes": read, "decode_flops": work}

    rollouts = {"waves": (schedule, rollout_seconds(schedule, sampler_devices, True))}
    per_step = rollouts["waves"][1]["rollout_decode"] / max(schedule.decode_steps, 1)
    mean_call = search["call_queries"] / max(schedule.retrieval_calls, 1)  # the waves' mean batch
    retrieval_steps = math.ceil(search["cost"].seconds(mean_call) / max(per_step, 1e-9))

    def batch_steps(queries: int) -> int:  # the engine's batches cost their own queries (exact search: per query)
        return math.ceil(search["cost"].seconds(queries) / max(per_step, 1e-9))

    local = max(1, devices // hosts)
    engine_devices = {-1: local, 0: 1}.get(int(config.rollout.sampler_devices),
                                           int(config.rollout.sampler_devices))
    waves_rows_per_device = max(1, min(rows_per_wave, per_host) // sampler_devices)
    for paged in (False, True):
        if paged and not device_bytes:
            continue
        try:
            sch = engine_schedule(config, model_cfg, drawn, device_bytes=device_bytes or 0,
                                  sampler_devices=min(engine_devices, local), paged=paged,
                                  retrieval_steps=batch_steps, waves_rows=waves_rows_per_device)
        except (ValueError, RuntimeError):  # not one trajectory fits the paged pool: no such column
            continue
        rollouts[sch.name] = (sch, rollout_seconds(sch, min(engine_devices, local), False))
    # the engine pages its cache (rollout/kv_plan.engine_sizing): its column is the paged plan's wherever
    # one chip's memory is known; "dense rows" (a max_context row a slot) only without it
    configured = ("waves" if config.rollout.engine == "waves" else
                  "engine, paged plan" if "engine, paged plan" in rollouts else "engine, dense rows")
    schedule, rollout_part = rollouts[configured]
    decode_s, prefill_s, retrieval_s = (rollout_part[k] for k in ("rollout_decode", "rollout_prefill",
                                                                  "rollout_retrieval"))
    decode_bytes, decode_flops = rollout_part["decode_bytes"], rollout_part["decode_flops"]

    if packing is not None:  # the whole step's trajectories, every host's (one plan over all of them)
        step_trajectories = step_lengths(config, lengths if lengths is not None else
                                         load_lengths(str(section.length_source)), trajectories,
                                         seed=int(config.seed))
        train_rows, pass_rows, train_length, pairs = training_rows(step_trajectories, packing, train_length)
        scored_per_row = packing.scored
        useful_tokens = sum(t.total for t in step_trajectories)
    else:
        pass_rows, pairs, useful_tokens = train_rows, train_rows * float(flops.causal_pairs(train_length)), 0
    # A no-grad pass (π_old, π_ref, Δ) over its rows; the update's own forward over the update's rows.
    forward = flops.forward_flops(model_cfg, pass_rows, train_length, scored_per_row, pairs_per_row=pairs / pass_rows)
    update_forward = flops.forward_flops(model_cfg, train_rows, train_length, scored_per_row,
                                         pairs_per_row=pairs / train_rows)
    opaque = attention_is_opaque(str(config.model.attention), platform)
    head_chunked = scored_per_row > int(config.model.logprob_chunk_size)
    update_flops = flops.update_hardware_flops(model_cfg, train_rows, train_length, scored_per_row, model_cfg.remat,
                                               pairs_per_row=pairs / train_rows, opaque_attention=opaque,
                                               head_chunked=head_chunked)
    mesh_rate, forward_mesh_rate = peak.flops * matmul * devices, peak.flops * forward_rate * devices
    passes = 1 + int(float(config.rl.kl_coef) > 0)
    delta_every = int(config.train.delta_every) if config.train.delta_diagnostics else 0
    save_every = int(config.train.save_every)
    copy_rate, copy_why = HOST_COPY_BYTES_PER_S
    save_copy = state_bytes / (copy_rate * devices)  # every device its shard, at once
    save_write = state_bytes / (float(section.checkpoint_bytes_per_s) * hosts)  # in the background
    collectives, collectives_why = collective_seconds(
        config, model_cfg, platform=platform, hardware=hardware, devices=devices, hosts=hosts,
        compute_bytes=compute_bytes, train_rows=train_rows, pass_rows=pass_rows, packing=packing, passes=passes,
        delta_every=delta_every,
        compute_seconds={"forward": forward / forward_mesh_rate, "update_forward": update_forward / mesh_rate,
                         "update_backward": (update_flops - update_forward) / mesh_rate})
    seconds = {
        "rollout_decode": decode_s, "rollout_prefill": prefill_s, "rollout_retrieval": retrieval_s,
        "logprobs": passes * forward / forward_mesh_rate + collectives["logprobs"],
        "update": update_flops / mesh_rate + collectives["update"],
        "delta": (forward / forward_mesh_rate / delta_every if delta_every else 0.0) + collectives["delta"],
    }

    def totals(part: dict[str, float]) -> dict[str, float]:
        out = {**seconds, **{k: v for k, v in part.items() if k.startswith("rollout_")}}
        out["rollout"] = out["rollout_decode"] + out["rollout_prefill"] + out["rollout_retrieval"]
        between = sum(v for k, v in out.items() if k != "rollout") * save_every  # the steps a write runs beside
        out["checkpoint"] = (save_copy + max(0.0, save_write - between)) / save_every if save_every else 0.0
        out["total"] = sum(v for k, v in out.items() if k not in ("rollout", "total"))
        return out

    by_schedule = {name: (sch, totals(part)) for name, (sch, part) in rollouts.items()}
    seconds = by_schedule[configured][1]
    assumptions = {
        "peak": peak.source,
        "matmul_efficiency": f"{matmul:.2f} of peak FLOP/s (update, prefill): "
                             + ("plan.efficiency_matmul" if section.efficiency_matmul else efficiency["matmul"][1]),
        "forward_efficiency": f"{forward_rate:.2f} of peak FLOP/s (the log-prob passes: π_old, π_ref, Δ): "
                              + ("plan.efficiency_matmul" if section.efficiency_matmul else efficiency["forward"][1]),
        "hbm_efficiency": f"{hbm:.2f} of HBM bandwidth (decode): "
                          + ("plan.efficiency_hbm" if section.efficiency_hbm else efficiency["hbm"][1]),
        "decode_step_overhead": f"{overhead * 1e3:.2f} ms per decode step: {overhead_why}",
        "sampler": f"{sampler_reads} passes over each sampled row's {model_cfg.dtype} logits a decode step on {platform}: "
                   f"{sampler_why}" + (f"; + {scratch:,} B a row: the top-p sampler's candidate scratch at capacity "
                                      "(sampling/filtering_gpu.sampler_scratch_bytes)" if scratch else ""),
        "retrieval": f"{search['cost'].backend}: {search['cost'].why}; index {search['index'].passages:,} x "
                     f"{search['index'].dim} ({search['index'].source})",
        "checkpoint": f"every train.save_every={save_every} steps the loop waits while the devices copy the "
                      f"{state_bytes / 1e9:.1f} GB state to host memory ({save_copy:.2f} s at {copy_rate / 1e9:g} GB/s "
                      f"a device: {copy_why}); Orbax writes it asynchronously at "
                      f"{float(section.checkpoint_bytes_per_s) / 1e9:g} GB/s a host (plan.checkpoint_bytes_per_s: "
                      f"{save_write:.1f} s), beside the next steps, and only a write outlasting them would wait",
        "lengths": f"{len(drawn)} trajectories per host drawn from "
                   f"{length_label or section.length_source or 'Search-R1 3B reference lengths (bundled)'}"
                   ", cut by the rollout caps",
        "sampling_devices": f"waves: {sampler_devices} sampling device(s) per host x {hosts} host(s), waves of "
                   f"{rollouts['waves'][0].slots} rows; engine: {min(engine_devices, local)} device(s) per host "
                   f"(rollout.sampler_devices), retrieval on a host thread, a batch in decode steps at the waves' "
                   f"{per_step * 1e3:.2f} ms a step ({retrieval_steps} for the waves' mean batch of {mean_call:.0f}); "
                   f"configured: rollout.engine={config.rollout.engine!r}",
        "training_batch": (f"{train_rows} packed rows x {train_length} tokens computed by the update (each "
                           f"mini-batch's rows in whole micro-batches) and {pass_rows} by each no-grad pass (the "
                           f"same rows as one group, packing.one_group): packing.plan_rows on the drawn "
                           f"lengths' {useful_tokens:,} real tokens, computed / real "
                           f"{train_rows * train_length / useful_tokens:.3f} and "
                           f"{pass_rows * train_length / useful_tokens:.3f}" if packing is not None else
                           f"{train_rows} padded rows x {train_length} tokens computed per pass"),
        "update_flops": f"remat={model_cfg.remat!r} (model.remat; model.remat_gpu on a GPU): the update runs the forward once and the backward "
                        f"(2 forwards), {REMAT_RERUN[model_cfg.remat]}"
                        + ("" if not opaque or model_cfg.remat not in (*flops.REMAT_KEEPS_MATMULS,
                                                                       *flops.REMAT_RERUNS_GATE) else
                           f" plus the opaque attention kernel's forward ({'cuDNN' if platform == 'gpu' else 'splash'}"
                           ": its residuals live in its custom VJP)")
                        + (f"; the LM head's {scored_per_row} scored positions a row in chunks of "
                           f"{int(config.model.logprob_chunk_size)}, each checkpointed: their projection rerun"
                           if head_chunked else "")
                        + f" = {update_flops / update_forward:.2f} forwards (utils.flops.update_hardware_flops); the "
                        "matmul efficiency above is per hardware FLOP, measured under full remat and assumed "
                        "for every policy",
        "delta": (f"the Δ forward every {delta_every} step(s), charged over every response: an upper bound, "
                  "since with packed rows the trainer computes only the responses with a nonzero advantage (all "
                  "a Δ diagnostic reads; their share is the run's, throughput/delta_responses_frac)"
                  if delta_every else "off (train.delta_diagnostics)"),
        "collectives": collectives_why,
        "overlap": "none: phases run one after another, as the trainer runs them",
    }
    details = {"decode_bytes": decode_bytes, "decode_flops": decode_flops,
               "update_flops": update_flops, "forward_flops": forward, "update_forward_flops": update_forward,
               "logprob_passes": passes, "train_rows": train_rows, "pass_rows": pass_rows,
               "collective_seconds": collectives,
               "trajectories_per_host": per_host, "mean_trajectory_tokens": sum(t.total for t in drawn) / len(drawn),
               "retrieval_queries_per_host": search["queries"]}
    return StepTime(seconds, assumptions, schedule, details, by_schedule, search["turn"])


def _retrieval(config, drawn, *, platform, hardware, peak, devices, hosts, matmul, hbm, trajectories) -> dict:
    """The configured retriever's cost a call (``plan.retrieval.search_cost``), the searches the host's
    calls carry (a ``retrieval.url`` server answers every host's), and a paper turn's seconds — one query
    per trajectory of the step — by faiss Flat on one host vs the mesh index (bf16, fp32) on each host's chips."""
    from llds_jax.plan.retrieval import backend_of, index_shape, index_shards, search_cost  # noqa: PLC0415

    shape, local = index_shape(config), index_shards(config, devices, hosts)
    kw = dict(hardware=hardware, platform=platform, peak=peak, shards=local, matmul=matmul, hbm=hbm)
    cost = search_cost(config, backend_of(config.retrieval), shape, **kw)
    searches = sum(t.is_search(k) for t in drawn for k in range(len(t.feedback)))
    served = hosts if config.retrieval.url else 1
    per_host = -(-trajectories // hosts)
    turn = {"queries": trajectories, "configured": cost.seconds(per_host * served),
            "faiss_flat_host": search_cost(config, "flat", shape, **kw).seconds(trajectories)}
    turn |= {f"mesh_{dtype}": search_cost(config, "mesh", shape, dtype=dtype, **kw).seconds(per_host)
             for dtype in ("bfloat16", "float32")}
    return {"cost": cost, "index": shape, "queries": searches, "call_queries": searches * served, "turn": turn}


PHASE_ORDER = ("rollout_decode", "rollout_prefill", "rollout_retrieval", "rollout", "logprobs", "update", "delta",
               "checkpoint", "total")


def format_step_time(step: StepTime) -> str:
    """The plan's step-time section: seconds per phase under each rollout schedule, the schedules,
    the assumptions, the anchors."""
    names = list(step.by_schedule) or [step.schedule.name]
    columns = {name: step.by_schedule[name][1] for name in names} if step.by_schedule else {names[0]: step.seconds}
    lines = ["", f"step time, predicted (seconds per RL step; the run uses {step.schedule.name!r})",
             f"  {'phase':<20}" + "".join(f"{name:>22}" for name in names)]
    lines += [f"  {phase:<20}" + "".join(f"{columns[name][phase]:22.2f}" for name in names) for phase in PHASE_ORDER]
    for name in names:
        s = step.by_schedule[name][0] if step.by_schedule else step.schedule
        lines.append(f"  {name + ':':<22}{s.slots} slots, {s.decode_steps} decode steps vs a lower bound of "
                     f"{s.lower_bound_steps} (efficiency {s.efficiency:.2f}); {s.retrieval_calls} retriever calls")
    if step.retrieval_turn:
        turn = step.retrieval_turn
        lines.append(f"  retrieval, one turn of {int(turn['queries']):,} queries: configured {turn['configured']:.3f} s; "
                     f"faiss Flat on one host {turn['faiss_flat_host']:.2f} s; mesh index bf16 "
                     f"{turn['mesh_bfloat16']:.4f} s, fp32 {turn['mesh_float32']:.4f} s")
    lines += ["  assumptions:"]
    lines += [f"    {name:<18}: {text}" for name, text in step.assumptions.items()]
    lines += ["  published step times of the paper's job elsewhere:"]
    lines += [f"    {name:<66}: {value}" for name, value in ANCHORS]
    return "\n".join(lines)
