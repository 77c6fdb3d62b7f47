"""One token step of the rollout engine's decode, compiled by the real XLA:GPU / XLA:TPU compilers
(compile-only, as ``--mode=plan``), and what it costs: ``bench_rollout.py --decode-program``.

Why: issue 57 asks whether a decode step is one straight-line program (no loop whose trip count
the host must learn, no run-time branch) and how far its bytes are from the ideal. The step is
``sampling/slots.py::decode_segment``'s loop body (sampler + ``forward_cached`` over the paged
cache), at the shapes the engine runs on one device of each target.

The per-token step, isolated: ``decode_segment`` is compiled whole, exactly as the engine calls
it (traced sampling knobs, ``rollout.segment_tokens`` steps, the engine's block table and pool),
and the body of the ``while`` in its ENTRY computation is taken out of the optimised HLO: that
body is what runs once per token, as the compiler optimised it inside the loop. Compiling a
straight-line one-step function instead would let the compiler fold work the real loop cannot.
The segment loop itself is reported apart (``segment_loop``): its condition is read once per
token (a host round trip on XLA:GPU), and it is not counted in ``dynamic_loops``.

Counted over the computations the body reaches (while bodies and conditions, conditional
branches, calls; not the insides of fusions or reductions):

* ``dynamic_loops`` — ``while`` ops whose trip count is not a compile-time constant: XLA:GPU
  prints ``known_trip_count`` in the while's backend_config; XLA:TPU prints none, so a loop
  counts as known when its counter runs from a constant to a constant by a constant
  (``_tpu_hbm.Reader.trip_count``, the same reading on both targets);
* ``conditionals`` — ``conditional`` ops;
* ``kernels`` — fusions, custom calls (XLA:TPU's bookkeeping calls left out) and unfused ops
  that launch work (anything but parameters, constants, tuples, bitcasts, loop and branch ops),
  each op once; ``launches`` counts them per token at the stated lengths (loops times their trips,
  a conditional its branch with the most).

``bytes`` at the stated live lengths (:func:`mid_decode_lengths`): XLA's ``HloCostAnalysis``
(run by the CPU client over the optimised module, as ``tools/roofline`` does) of the body as a
program of its own; that analysis counts a loop body once, so each loop gets its other trips
added (``trips - 1`` times its body's cost, times the loops around it). Known trip counts are
XLA's; a dynamic loop is today's paged-attention key-block loop (``attention/paged.py``:
``fori_loop(1, ceil(live / block))``, block 0 peeled, ``live`` the furthest row's slot + 1), so
it is charged ``ceil((max length + 1) / block) - 1`` trips, what it runs for these rows. A
conditional is charged as XLA charges it (its costliest branch). Custom calls XLA cannot see
are added at their declared cost: cuBLAS GEMMs their operands and result
(``_xla_charges.gemm_call_bytes``' rule), a Pallas paged-decode kernel its module's
``decode_read_bytes`` at the stated lengths, any other Pallas TPU kernel the bytes of the
``pl.CostEstimate`` it declares (the sampler's cut-off search, ``sampling/filtering_tpu.py``:
one read of the rows), a GPU sampler kernel (``sampling/filtering_gpu.py``) the reads of the
logits its name states (the top-p sampler: its fast path's two, and its candidate scratch at
capacity; the rows whose boundary bin overflows it read 9 more, a rate of the model's distributions
that no compile can see: docs/performance.md); any other is listed in ``uncosted_calls``.

What XLA's analysis charges but the step does not move is taken back, each rule measured on the
target's compiler with a program of the step's own shapes (``charged_not_run``): a scatter of one
token per row into a donated pool (charged the whole pool in and out), a gather of one block per
row from a pool (the whole pool), the lookup of the rows' tokens in the embedding table (the
whole table, ``_xla_charges.gather_excess``, as ``tools/roofline`` takes it back), and the pick of
each row's sampled logit for its log-prob (the whole ``[rows, vocab]`` logits on XLA:GPU,
``_xla_charges.row_pick_excess``; XLA:TPU charges its bare gather what it reads).

On XLA:TPU ``bytes`` is HBM traffic instead (``_tpu_hbm``'s model of the same token body, the
kernels at their declared cost; ``xla_cost_analysis_bytes`` keeps the figure above): XLA:TPU's
analysis does not tell memory spaces apart, so each prefetch of a weight slice or a KV pool layer
into VMEM by memory-space assignment is charged at both ends (``copy-start``/``copy-done``,
``slice-start``) and again where a fusion reads the VMEM copy — at v5e qwen3b 22.8 GB against the
8.9 GB its HBM-resident operands and results account for. The ideal is an HBM figure, so the ratio
compares like with like; ``hbm_model.by_opcode`` says where the bytes go.

``kernel_groups``: where a token's bytes go, the kernels grouped by what they run, each group's
operand and result bytes (a custom call's declared bytes), largest first.

``ideal_bytes`` (issue 57's): the weights in the compute dtype once (a tied table once; an untied
input table only its looked-up rows), each row's live k and v over every layer read once and the
new token's k and v written. ``logits_bytes`` beside it: the ``[rows, vocab]`` logits in the dtype
the step writes them (the compute dtype: ``Decoder.forward_cached``) written once and read once,
what a sampler that needs the whole row cannot avoid unless the LM head is fused into it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "tools" / "roofline") not in sys.path:
    sys.path.insert(0, str(ROOT / "tools" / "roofline"))

from _hlo_reading import BOOKKEEPING_CALLS, as_entry, computation_blocks  # noqa: E402
from _tpu_hbm import Reader, token_body  # noqa: E402
from _xla_charges import gather_excess, optimised_hlo, row_pick_excess  # noqa: E402

# Ops that launch no work of their own.
_NO_KERNEL = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
              "after-all", "add-dependency", "opt-barrier", "domain", "copy-done", "slice-done", "async-done"}
LENGTHS_POINT = ("each row b holds reference trajectory b (file order, wrapping), at the token halfway through its own "
                 "decoding (its ceil(D/2)-th sampled token, D its sampled tokens under the paper's caps): its live "
                 "length is the prompt + every action and feedback before that token + the action's tokens before it")


@dataclasses.dataclass(frozen=True)
class StepTarget:
    """One device's decode step: the model, the target compiler and the engine's shapes there."""
    model: str           # KNOWN_MODELS name, or "tiny"
    platform: str        # "gpu" (one H100) or "tpu" (one v5e chip)
    rows: int            # decode slots on the device
    kv_blocks: int       # blocks in the device's pool
    columns: int         # block-table width (row cache slots / block)
    block: int = 128
    width: int = 512     # action buffer columns (bucket of rollout.max_action_tokens)
    segment: int = 8     # rollout.segment_tokens
    max_context: int = 4096
    source: str = ""


def _paper_rollout():
    spec = importlib.util.spec_from_file_location("qwen3b", ROOT / "configs" / "qwen3b.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def paper_targets() -> dict[str, StepTarget]:
    """The three targets of issue 57: Qwen2.5-0.5B at 320 rows of 4,096 slots on one H100, and
    Qwen2.5-3B on one GPU of 8xH100 and one chip of v5e:8x8 at the slots and pool the engine sizes
    itself to there (``kv_plan.engine_memory`` for ``configs/qwen3b.py``; its pool capped at what
    the slots could ever hold, as ``kv_plan.engine_sizing``)."""
    from llds_jax.models.loading import decoder_config
    from llds_jax.parallel.mesh import resolve_mesh_shape
    from llds_jax.plan.config import HARDWARE
    from llds_jax.rollout.kv_plan import engine_memory
    from llds_jax.rollout.scheduler import blocks_for
    from llds_jax.sampling.slots import MIN_LENGTH_BUCKET, bucket, cache_slot_limit

    config = _paper_rollout()
    rollout = config.rollout
    config.model.source = "random:Qwen2.5-3B"
    model = decoder_config(config.model)
    block, context = int(rollout.kv_block_tokens), int(rollout.max_context)
    columns = blocks_for(cache_slot_limit(context), block)
    shared = dict(block=block, columns=columns, width=bucket(int(rollout.max_action_tokens), MIN_LENGTH_BUCKET),
                  segment=int(rollout.segment_tokens), max_context=context)
    trajectories = config.train.prompts_per_step * rollout.n_samples
    out = {"h100-0p5b-320": StepTarget("Qwen2.5-0.5B", "gpu", 320, 320 * columns, source="issue 57: 320 rows x 4,096 "
                                       "slots (every row can hold max_context)", **shared)}
    for name, platform, hardware, devices in (("h100-qwen3b", "gpu", "H100", 8), ("v5e-qwen3b", "tpu", "v5e", 64)):
        shape = resolve_mesh_shape(config.mesh.shape, devices)
        data = shape[0] * shape[1]
        memory = engine_memory(model, rollout, int(HARDWARE[hardware][1]), -(-trajectories // data))
        blocks = min(memory.kv_blocks_per_device, memory.slots_per_device * columns)
        out[name] = StepTarget("Qwen2.5-3B", platform, memory.slots_per_device, blocks, source=(
            f"configs/qwen3b.py on {devices} x {hardware}: {trajectories // data} trajectories per device; "
            f"kv_plan.engine_memory: {memory.slots_per_device} slots, {memory.kv_blocks_per_device} blocks "
            f"(pool {blocks} blocks)"), **shared)
    return out


def tiny_targets() -> dict[str, StepTarget]:
    """The same report on the tiny test model (tests): 4 rows of 512 slots, each target compiler."""
    shared = dict(rows=4, kv_blocks=16, columns=4, width=16, segment=2, max_context=512, source="tiny (tests)")
    return {"h100-tiny": StepTarget("tiny", "gpu", **shared), "v5e-tiny": StepTarget("tiny", "tpu", **shared)}


def mid_decode_lengths(rows: int, *, max_turns: int = 3, max_action: int = 500, max_obs: int = 500,
                       max_prompt: int = 2048, max_context: int = 4096) -> list[int]:
    """Each row's live slots at the stated point (``LENGTHS_POINT``) of Search-R1 3B's reference
    trajectories (``llds_jax/data/bundled/searchr1_3b_lengths.jsonl``), under the paper's caps."""
    from llds_jax.data.lengths import reference_lengths

    reference = reference_lengths()
    out = []
    for b in range(rows):
        t = reference[b % len(reference)].capped(max_turns + 1, max_action, max_obs)
        half = -(-t.decode_tokens // 2)
        context, drawn, live = min(t.prompt, max_prompt), 0, None
        for k, action in enumerate(t.actions):
            if drawn + action >= half:
                live = context + half - 1 - drawn
                break
            context, drawn = context + action, drawn + action
            context += t.feedback[k] if k < len(t.feedback) else 0
        out.append(min(live if live is not None else context, max_context - 1))
    return out


def _decoder_config(model: str):
    from llds_jax.models.loading import known_config
    from llds_jax.models.testing import tiny_config

    if model == "tiny":
        return tiny_config("qwen2", dtype="bfloat16", scan_layers=False)
    return known_config(model, dtype="bfloat16", param_dtype="bfloat16", scan_layers=False)


def _device(platform: str):
    """One compile-only device of the target (the planner's plumbing); one v5e chip or one H100."""
    from llds_jax.plan.targets import gpu_target, target_installed, tpu_target

    if missing := target_installed(platform):
        raise SystemExit(f"--decode-program: {missing}")
    chosen = tpu_target("v5e:2x2") if platform == "tpu" else gpu_target("h100", 1, 1)
    if chosen.platform != platform:
        raise SystemExit(f"--decode-program: {chosen.note}")
    return chosen.devices[0], chosen.compiler


def segment_arguments(target: StepTarget, decoder_cfg, mesh) -> tuple[tuple, dict]:
    """Abstract arguments of ``slots.decode_segment`` as the engine calls it on one device:
    weights in the compute dtype (the sampler's copy), per-layer weights hoisted, the paged pool,
    traced sampling knobs. Returns (positional arguments, static keyword arguments)."""
    from flax import nnx

    from llds_jax.models import Decoder, PagedKVCache
    from llds_jax.sampling.decode_loop import MAX_STOP_IDS, DecodeState, SamplingParams
    from llds_jax.sampling.filtering import SamplingMode
    from llds_jax.sampling.slots import _layer_weights

    here = jax.NamedSharding(mesh, jax.P())

    def arr(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=here)

    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(decoder_cfg, rngs=nnx.Rngs(0))))
    compute = jnp.dtype(decoder_cfg.dtype)
    params = jax.tree.map(lambda x: arr(x.shape, compute if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype), state)
    layers = jax.tree.map(lambda x: arr(x.shape, x.dtype), jax.eval_shape(functools.partial(_layer_weights, graphdef),
                                                                           params))
    b, c = target.rows, decoder_cfg
    pool = arr((1, target.kv_blocks, c.num_kv_heads, target.block, c.head_dim), compute)
    cache = PagedKVCache(k=(pool,) * c.num_layers, v=(pool,) * c.num_layers, table=arr((b, target.columns), jnp.int32),
                         end=arr((b,), jnp.int32))
    keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), b))
    stop_strings = 2  # "</search>", "</answer>": the stop table's strings (stop_strings._STATE_BUCKET states)
    decode = DecodeState(tokens=arr((b, target.width), jnp.int32), logprobs=arr((b, target.width), jnp.float32),
                         lengths=arr((b,), jnp.int32), done=arr((b,), jnp.bool_), finish=arr((b,), jnp.int32),
                         stop_state=arr((b, stop_strings), jnp.int8), logits=arr((b, c.vocab_size), compute),
                         cache=cache, step=arr((), jnp.int32), keys=arr(keys.shape, keys.dtype),
                         drawn=arr((b,), jnp.int32))
    # the rollout's knobs (T 1, top-p 0.95, no top-k): SamplingParams.create gives the engine this static mode
    sampling = SamplingParams(arr((), jnp.float32), arr((), jnp.int32), arr((), jnp.float32),
                              arr((MAX_STOP_IDS,), jnp.int32), arr((stop_strings, 16, c.vocab_size), jnp.int8),
                              mode=SamplingMode.of(1.0, 0, 0.95))
    rows = lambda dtype: arr((b,), dtype)  # noqa: E731
    return ((graphdef, params, layers, decode, rows(jnp.bool_), rows(jnp.bool_), rows(jnp.int32), sampling),
            dict(steps=target.segment, pad_id=0))


def compile_segment(target: StepTarget, decoder_cfg, device):
    """``decode_segment`` compiled for ``device`` through the planner's compile step."""
    from llds_jax.parallel.mesh import make_mesh
    from llds_jax.plan.aot import compile_ahead
    from llds_jax.sampling.slots import decode_segment

    mesh = make_mesh((1, 1, 1), [device])
    args, static = segment_arguments(target, decoder_cfg, mesh)
    with jax.set_mesh(mesh):
        compiled, refused = compile_ahead(decode_segment, *args, platform=device.platform, **static)
    return compiled, refused


# ------------------------------------------------------------------ reading the step
@dataclasses.dataclass
class _Walk:
    """What the walk over the step's computations found (see the module docstring)."""
    loops: list[dict] = dataclasses.field(default_factory=list)     # every while: body, trips, dynamic
    conditionals: int = 0
    kernels: dict = dataclasses.field(default_factory=dict)         # (computation, op) -> times run per token
    launches: float = 0.0
    calls: list[tuple[str, str, float]] = dataclasses.field(default_factory=list)  # (computation, op, times run)


def _walk(reader: Reader, computation: str, times: float, dynamic_trips: int, found: _Walk, seen: set) -> float:
    """Walk ``computation`` run ``times`` per token; returns the kernel launches it makes per token."""
    launches = 0.0
    for op in reader.computations[computation].values():
        code = op.opcode
        if code == "while":
            trips = reader.trip_count(computation, op)
            runs = dynamic_trips if trips is None else trips
            body, condition = op.called("body")[0], op.called("condition")[0]
            if (computation, op.name) not in seen:
                found.loops.append(dict(name=op.name, body=body, trips=runs, dynamic=trips is None, times=times))
            seen.add((computation, op.name))
            launches += _walk(reader, condition, times * (runs + 1), dynamic_trips, found, seen)
            launches += _walk(reader, body, times * runs, dynamic_trips, found, seen)
        elif code == "conditional":
            if (computation, op.name) not in seen:
                found.conditionals += 1
            seen.add((computation, op.name))
            branches = op.called("branch_computations") or op.called("true_computation") + op.called(
                "false_computation")
            launches += max((_walk(reader, branch, times, dynamic_trips, found, seen) for branch in branches), default=0.0)
        elif code == "call":
            launches += _walk(reader, op.called("to_apply")[0], times, dynamic_trips, found, seen)
        elif code in _NO_KERNEL or code.endswith("-done"):
            continue
        else:
            if code == "custom-call":
                target = re.search(r'custom_call_target="([^"]+)"', op.attrs)[1]
                if target in BOOKKEEPING_CALLS:
                    continue
                found.calls.append((computation, op.name, times))
            found.kernels[(computation, op.name)] = found.kernels.get((computation, op.name), 0.0) + times
            launches += times
    return launches


def _hlo_cost(module_text: str) -> float:
    """Bytes XLA's HloCostAnalysis charges a module (the CPU client's analysis: compile-only
    executables report none)."""
    from jax._src.lib import _jax
    from jaxlib import _hlo

    cost = _jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, _hlo.hlo_module_from_text(module_text))
    return float(cost.get("bytes accessed", 0.0))


def _declared_kernel_cost(platform: str, name: str, attrs: str):
    """The ``decode_read_bytes`` of the Pallas paged-decode kernel a custom call runs, or None."""
    if platform == "tpu" and "paged_decode_attention" in name:
        from llds_jax.models.attention import decode_tpu

        return decode_tpu.decode_read_bytes
    if platform == "gpu" and "decode" in name + attrs and importlib.util.find_spec("llds_jax.models.attention.decode_gpu"):
        from llds_jax.models.attention import decode_gpu  # noqa: PLC0415  (another branch's kernel, when merged)

        return getattr(decode_gpu, "decode_read_bytes", None)
    return None


# the bytes a Pallas TPU kernel declares (pl.CostEstimate), as they appear in its backend_config
_COST_ESTIMATE = re.compile(r'cost_estimate\\?"\s*:\s*\{[^}]*?bytes_accessed\\?"\s*:\s*\\?"?(\d+)')

# the GPU sampler kernels (sampling/filtering_gpu.py) name the reads of their logits operand they make
# (Pallas Triton drops the CostEstimate), the top-p sampler also its candidate scratch; knobs and
# results: a few [rows] columns (six fp32 for the cut-off search, SAMPLER_COLUMNS 4-byte ones for the sampler)
_GPU_SAMPLER = re.compile(r'name = \\?"sampler_(?:cut_off|top_p)_gpu_(\d+)_reads(?:_(\d+)_candidates)?')


def _call_bytes(reader: Reader, computation: str, name: str, platform: str, decoder_cfg, lengths) -> tuple[float, str]:
    """(bytes, what) of one custom call XLA's analysis does not see; (0, '') when it has no declared cost."""
    from llds_jax.models import mlp_gpu  # noqa: PLC0415

    op = reader.computations[computation][name]
    target = re.search(r'custom_call_target="([^"]+)"', op.attrs)[1]
    if target.startswith("__cublas"):  # a GEMM moves its operands and result (_xla_charges.gemm_call_bytes)
        operands = sum(leaf.bytes for o in op.operands for leaf in reader.leaves_of(computation, o))
        return float(operands + op.leaves[0].bytes), "cublas"
    if target == "tpu_custom_call" and (estimate := _COST_ESTIMATE.search(op.attrs)) and "decode" not in op.name:
        return float(estimate[1]), "pallas cost_estimate"  # a kernel whose bytes do not depend on the lengths
    if target == "__gpu$xla.gpu.triton" and (named := _GPU_SAMPLER.search(op.attrs)):
        logits = max((leaf for o in op.operands for leaf in reader.leaves_of(computation, o)), key=lambda x: x.bytes)
        rows = logits.dims[0]
        if named[2] is None:
            return float(int(named[1]) * logits.bytes + 6 * rows * 4), "pallas sampler reads"
        from llds_jax.sampling import filtering_gpu  # noqa: PLC0415

        assert int(named[2]) == filtering_gpu.CANDIDATES, named[0]  # the scratch this checkout's kernel declares
        return (float(int(named[1]) * logits.bytes + filtering_gpu.SAMPLER_COLUMNS * rows * 4
                       + rows * filtering_gpu.sampler_scratch_bytes(logits.dims[1])),
                "pallas sampler reads")
    if target == "__gpu$xla.gpu.triton" and mlp_gpu.NAME in op.attrs:  # a GEMM: its operands and result once
        operands = sum(leaf.bytes for o in op.operands for leaf in reader.leaves_of(computation, o))
        return float(operands + op.leaves[0].bytes), "pallas gate/up GEMM"
    if (declared := _declared_kernel_cost(platform, op.name, op.attrs)) is not None:
        c = decoder_cfg
        return float(declared(lengths, c.num_kv_heads, c.head_dim, _pool_block(op, reader, computation),
                              jnp.dtype(c.dtype).itemsize, c.num_heads)), "pallas decode_read_bytes"
    return 0.0, ""


def _pool_block(op, reader: Reader, computation: str) -> int:
    """The key block of a paged-decode call: the pool operand ``[NB, KVH, block, Dh]`` (or with
    the device axis in front): the largest operand's second-to-last dimension."""
    leaves = [leaf for o in op.operands for leaf in reader.leaves_of(computation, o)]
    return max(leaves, key=lambda leaf: leaf.bytes).dims[-2]


def _pool_ops(reader: Reader, found: _Walk, opcode: str, elements: int) -> float:
    """``opcode`` ops (bare, or inside a fusion) on a pool of ``elements`` elements that the step
    runs per token: a scatter whose result is the pool, a gather whose operand is."""
    count = 0.0
    for (computation, name), times in found.kernels.items():
        op = reader.computations[computation][name]
        where = op.called("calls")[0] if op.opcode == "fusion" else computation
        inner = reader.computations[where].values() if op.opcode == "fusion" else [op]
        for o in inner:
            leaves = o.leaves if opcode == "scatter" else reader.leaves_of(where, o.operands[0]) if o.operands else []
            if o.opcode == opcode and leaves and math.prod(leaves[0].dims) == elements:
                count += times
    return count


def pool_excess(device, pool, rows: int, columns: int) -> tuple[float, float]:
    """Bytes XLA's analysis charges (one ``paged_write``: one token per row into a donated pool,
    one ``gather_column``: one block per row) beyond what they move: it charges a scatter its
    whole operand and result, though the write runs in place, and a gather from the pool the
    whole pool, though it reads one block a row (``_xla_charges``' rules, measured here on the
    target's compiler with programs of the step's own shapes)."""
    from llds_jax.models.attention.paged import gather_column, paged_write

    here = jax.sharding.SingleDeviceSharding(device)
    _, _, kv_heads, _, head_dim = pool.shape
    shapes = [jax.ShapeDtypeStruct(shape, dtype, sharding=here) for shape, dtype in (
        (pool.shape, pool.dtype), ((rows, 1, kv_heads, head_dim), pool.dtype), ((rows, 1), jnp.int32),
        ((rows, 1), jnp.int32), ((rows, 1), jnp.bool_))]
    table = jax.ShapeDtypeStruct((rows, 1), jnp.int32, sharding=here)
    compiled = jax.jit(paged_write, donate_argnums=(0,)).lower(shapes[0], shapes[1], table, shapes[3],
                                                                 shapes[4]).compile()
    update = rows * kv_heads * head_dim * jnp.dtype(pool.dtype).itemsize
    written = max(_hlo_cost(optimised_hlo(compiled)) - 2 * update, 0.0)
    wide = jax.ShapeDtypeStruct((rows, columns), jnp.int32, sharding=here)
    column = jax.ShapeDtypeStruct((), jnp.int32, sharding=here)
    compiled = jax.jit(gather_column).lower(shapes[0], wide, column).compile()
    read = max(_hlo_cost(optimised_hlo(compiled)) - 2 * update * pool.shape[3] - rows * 4, 0.0)
    return written, read


def read_step(hlo: str, platform: str, decoder_cfg, lengths: list[int], block: int,
              pool_charge=None, table_charge=None, pick_charge=None) -> dict:
    """The report's numbers for one compiled ``decode_segment`` (``hlo``: its optimised module
    without metadata) at live ``lengths`` per row (see the module docstring). ``pool_charge``:
    pool dims -> the excess XLA charges one pool scatter and one pool gather (:func:`pool_excess`);
    ``table_charge``: the excess it charges one lookup of the rows' tokens in the embedding table
    (``_xla_charges.gather_excess``: the whole table, though the gather reads one row a token);
    ``pick_charge``: the excess it charges picking each row's sampled logit from the ``[rows, vocab]``
    logits (``_xla_charges.row_pick_excess``: the whole array, though the gather reads one a row)."""
    reader = Reader(hlo)
    loops = [op for op in reader.computations[reader.entry].values() if op.opcode == "while"]
    # decode_loop.run_steps: the segment loop (its predicate is data-dependent: every row done?), and a
    # static loop for the tokens a segment has past whole chunks, if any
    segment = [op for op in loops if reader.trip_count(reader.entry, op) is None] or loops
    if len(segment) != 1:
        raise ValueError(f"expected decode_segment's one segment loop in ENTRY, found {len(loops)} while loops")
    body = segment[0].called("body")[0]
    # the segment loop checks for finished rows once a chunk of STOP_CHECK_EVERY tokens (a static loop):
    # the token is that chunk loop's body (tools/roofline/_tpu_hbm.token_body)
    token = token_body(reader, body)
    tokens_per_check = 1 if token == body else next(
        reader.trip_count(body, op) for op in reader.computations[body].values() if op.opcode == "while")
    body = token
    dynamic_trips = max(-(-(max(lengths) + 1) // block) - 1, 0)  # paged_attention: fori_loop(1, ceil(live / block))
    found = _Walk()
    launches = _walk(reader, body, 1.0, dynamic_trips, found, set())
    blocks = computation_blocks(hlo)
    xla = _hlo_cost(as_entry(blocks, body))
    loop_extra = sum(loop["times"] * (loop["trips"] - 1) * _hlo_cost(as_entry(blocks, loop["body"]))
                     for loop in found.loops)
    declared, uncosted, kinds, per_call = 0.0, [], {}, {}
    for computation, name, times in found.calls:
        nbytes, kind = _call_bytes(reader, computation, name, platform, decoder_cfg, lengths)
        if kind:
            declared += times * nbytes
            kinds[kind] = kinds.get(kind, 0.0) + times * nbytes
            per_call[name] = nbytes
        else:
            uncosted.append(name)
    pool = (1, None, decoder_cfg.num_kv_heads, block, decoder_cfg.head_dim)
    pools = {leaf.dims for ops in reader.computations.values() for op in ops.values() for leaf in op.leaves
             if len(leaf.dims) == 5 and all(a in (None, b) for a, b in zip(pool, leaf.dims, strict=True))}
    scatters = {dims: _pool_ops(reader, found, "scatter", math.prod(dims)) for dims in pools}
    gathers = {dims: _pool_ops(reader, found, "gather", math.prod(dims)) for dims in pools}
    in_place = sum(scatters[d] * pool_charge(d)[0] + gathers[d] * pool_charge(d)[1] for d in pools
                   if pool_charge and scatters[d] + gathers[d])
    # the lookup and pick rules as measured on XLA:GPU (on XLA:TPU the HBM model below charges what a gather reads)
    lookups = _pool_ops(reader, found, "gather", decoder_cfg.vocab_size * decoder_cfg.hidden_size)
    in_place += lookups * table_charge() if table_charge and lookups and platform == "gpu" else 0.0
    picks = _pool_ops(reader, found, "gather", len(lengths) * decoder_cfg.vocab_size)
    in_place += picks * pick_charge() if pick_charge and picks and platform == "gpu" else 0.0
    analysed = xla + loop_extra + declared - in_place
    hbm = _hbm_charges(hlo, body, {name for _, name, _ in found.calls}) if platform == "tpu" else None
    return dict(dynamic_loops=sum(loop["dynamic"] for loop in found.loops), conditionals=found.conditionals,
                kernels=len(found.kernels), bytes=int(analysed if hbm is None else hbm["xla_ops"] + declared),
                xla_cost_analysis_bytes=int(analysed), hbm_model=hbm,
                launches=int(launches), bytes_detail=dict(xla_body_once=int(xla), loop_trips_added=int(loop_extra),
                                                          custom_calls={k: int(v) for k, v in kinds.items()},
                                                          pool_scatters=sum(scatters.values()),
                                                          pool_gathers=sum(gathers.values()),
                                                          table_lookups=lookups, logit_picks=picks,
                                                          charged_not_run=-int(in_place)),
                uncosted_calls=sorted(uncosted), kernel_groups=kernel_groups(reader, found, per_call),
                loops=[dict(body=loop["body"], trips=loop["trips"], dynamic=loop["dynamic"]) for loop in found.loops],
                segment_loop=dict(known_trip_count=reader.trip_count(reader.entry, segment[0]) is not None,
                                  body=body, tokens_per_check=tokens_per_check), dynamic_trips_charged=dynamic_trips)


# ops inside a fusion that say nothing about what it computes (a kernel group's name leaves them out)
_FUSED_PLUMBING = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "broadcast", "convert", "reshape",
                   "copy", "transpose"}


def kernel_groups(reader: Reader, found: _Walk, declared: dict[str, float]) -> list[dict]:
    """Where a token's bytes go: the step's kernels grouped by what they run (a fusion by the ops
    inside it, a custom call by its kernel's name), each group's operand + result bytes a token
    (``declared``: a custom call's declared bytes instead), largest first. Evidence, not the total:
    a kernel that reads part of an operand (a gather, an in-place scatter) is charged all of it."""
    groups: dict[str, dict] = {}
    for (computation, name), times in found.kernels.items():
        op = reader.computations[computation][name]
        moved = declared.get(name)
        if moved is None:
            moved = op.bytes + sum(leaf.bytes for o in op.operands for leaf in reader.leaves_of(computation, o))
        if op.opcode == "fusion":
            inner = {o.opcode for o in reader.computations[op.called("calls")[0]].values()} - _FUSED_PLUMBING
            kind = f"fusion({','.join(sorted(inner))})"
        elif op.opcode == "custom-call":
            named = re.search(r'name = \\?"([A-Za-z_]+?)(?:_\d+_reads)?\\?"', op.attrs)
            kind = named[1] if named else re.search(r'custom_call_target="([^"]+)"', op.attrs)[1]
        else:
            kind = op.opcode
        group = groups.setdefault(kind, dict(kind=kind, kernels=0, bytes=0.0))
        group["kernels"] += times
        group["bytes"] += times * moved
    return sorted(({**g, "bytes": int(g["bytes"]), "kernels": int(g["kernels"])} for g in groups.values()),
                  key=lambda g: -g["bytes"])


class _KernelsApart(Reader):
    """``_tpu_hbm.Reader`` leaving out the custom calls the report charges at their declared cost."""

    def __init__(self, hlo: str, declared: set[str]):
        super().__init__(hlo)
        self.declared = declared

    def _charge(self, comp, op, skip_while, times):
        if op.opcode == "custom-call" and op.name in self.declared:
            return []
        return super()._charge(comp, op, skip_while, times)


def _hbm_charges(hlo: str, body: str, declared: set[str]) -> dict:
    """XLA:TPU: the HBM bytes of the token body's XLA ops (``_tpu_hbm``'s model: operands and results
    by the memory space their layout names; a prefetch into VMEM its HBM side once), the kernels at
    their declared cost apart; by opcode, largest first."""
    reader = _KernelsApart(hlo, declared)
    charges = reader.charges(body)
    by_opcode: dict[str, float] = {}
    for charge in charges:
        key = f"{charge.opcode}: {charge.what}"
        by_opcode[key] = by_opcode.get(key, 0.0) + charge.bytes
    return dict(xla_ops=int(sum(c.bytes for c in charges)), notes=sorted(set(reader.notes)),
                by_opcode={k: int(v) for k, v in sorted(by_opcode.items(), key=lambda kv: -kv[1]) if v})


def ideal_bytes(params, decoder_cfg, lengths: list[int]) -> int:
    """Weights once in the compute dtype (an untied input table: its looked-up rows only), each
    row's live k and v over every layer, the new token's k and v (see the module docstring)."""
    c = decoder_cfg
    itemsize = jnp.dtype(c.dtype).itemsize
    weights = sum(math.prod(x.shape) for x in jax.tree.leaves(params)) * itemsize
    if not c.tie_embeddings:
        weights -= (c.vocab_size - len(lengths)) * c.hidden_size * itemsize
    per_slot = 2 * c.num_layers * c.num_kv_heads * c.head_dim * itemsize
    return int(weights + per_slot * (sum(lengths) + len(lengths)))


def logits_bytes(decoder_cfg, rows: int) -> int:
    """The ``[rows, vocab]`` logits in the compute dtype (``Decoder.forward_cached``), written once and read once."""
    return 2 * rows * decoder_cfg.vocab_size * jnp.dtype(decoder_cfg.dtype).itemsize


def decode_program_report(targets: dict[str, StepTarget]) -> dict:
    """``{"targets": {name: {...}}, "settings": {...}}``: one compile per target (see the module docstring)."""
    from flax import nnx

    from llds_jax.models import Decoder
    from llds_jax.sampling.slots import DECODE_COMPILER_OPTIONS

    out = {}
    for name, target in targets.items():
        decoder_cfg = _decoder_config(target.model)
        device, compiler = _device(target.platform)
        lengths = mid_decode_lengths(target.rows, max_context=target.max_context)
        compiled, refused = compile_segment(target, decoder_cfg, device)
        charge = functools.cache(lambda dims, device=device, t=target, dtype=decoder_cfg.dtype: pool_excess(
            device, jax.ShapeDtypeStruct(dims, jnp.dtype(dtype)), t.rows, t.columns))
        lookup = functools.cache(lambda device=device, t=target, c=decoder_cfg: gather_excess(
            device, c.vocab_size, c.hidden_size, jnp.dtype(c.dtype), t.rows))
        pick = functools.cache(lambda device=device, t=target, c=decoder_cfg: row_pick_excess(
            device, t.rows, c.vocab_size))
        step = read_step(optimised_hlo(compiled), target.platform, decoder_cfg, lengths, target.block, charge,
                         lookup, pick)
        params = nnx.state(nnx.eval_shape(lambda c=decoder_cfg: Decoder(c, rngs=nnx.Rngs(0))))
        step["ideal_bytes"] = ideal_bytes(params, decoder_cfg, lengths)
        step["logits_bytes"] = logits_bytes(decoder_cfg, target.rows)
        step.update(bytes_over_ideal=round(step["bytes"] / step["ideal_bytes"], 3), model=target.model,
                    rows=target.rows, cache_slots_per_row=target.columns * target.block, kv_blocks=target.kv_blocks,
                    block=target.block, segment_steps=target.segment, compiler=compiler, sizing=target.source,
                    live_lengths=dict(mean=round(sum(lengths) / len(lengths), 1), max=max(lengths), min=min(lengths),
                                      source="llds_jax/data/bundled/searchr1_3b_lengths.jsonl"),
                    refused=refused)
        out[name] = step
    return dict(targets=out, settings=dict(
        program="sampling/slots.py::decode_segment, compiled whole; the step = the body of its token loop "
                "(inside the segment loop's chunk of STOP_CHECK_EVERY tokens)",
        compiler_options=dict(DECODE_COMPILER_OPTIONS),  # the program's own (slots.DECODE_COMPILER_OPTIONS)
        live_lengths=LENGTHS_POINT, sampling="traced knobs in the top-p mode, as the engine runs them (rollout: T 1, top-p 0.95)",
        ideal="weights once (bf16) + live k,v all layers + new token's k,v (issue 57's); logits_bytes: the "
              "[rows, vocab] logits in the compute dtype written once and read once, beside it"))
