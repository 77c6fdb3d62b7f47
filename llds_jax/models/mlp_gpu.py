"""GPU: a decode step's SwiGLU gate and up projections and SiLU·up as one Pallas (Triton) kernel per layer.

Why: XLA:GPU merges the gate and up GEMMs into one that writes ``[rows, 2F]`` in the compute dtype, then
SiLU·up runs as its own loop fusion that reads that back and writes ``[rows, F]`` for the down
projection. It cannot fold SiLU·up into a GEMM's operand: the SiLU's input has two users (``g·σ(g)``),
and its GEMM fusion takes single-user producers only. At decode the activations are not small next to
the weights: at 320 rows of Qwen2.5-0.5B the two extra passes move 12.4 MB a layer, 0.30 GB a step
(10 % of the step's bytes; qwen3b: 1.0 GB). Here one program per ``[BM, BN]`` output tile keeps the
gate and up accumulators (fp32) in registers over the hidden dimension and writes ``silu(g) · u``
once, in the compute dtype: the step reads the weights and the normed hidden state and writes
``[rows, F]``, the down projection's input, nothing else.

Numerics: fp32 accumulation as XLA's GEMMs, then SiLU·up in fp32 and one rounding to the compute
dtype; XLA's path rounds g and u to the compute dtype first and computes SiLU·up there, so this is
the more exact of the two (``tests/models/test_mlp_gpu.py`` pins the kernel within one rounding of
the float64 product).

Tiles: ``BM x BN = 64 x 64``, the hidden dimension in steps of ``BK = 64`` (Triton's tensor-core dot
takes 16 or more a side). The grid's first axis, the fastest in launch order, is the row tile, so the
row tiles of one column tile run together and read its weights from L2 after the first. The decode
step calls it where the paged backend is ``"triton"`` (``models/decoder.py``): shapes with ``D`` and
``F`` multiples of 64 (every Qwen2.5); others, prefill and training keep XLA's GEMMs. Under a mesh it
runs per device in ``jax.shard_map``: rows over the batch axes, ``F`` over the MLP's (tensor) axes,
the weights gathered over any other axis as XLA's own GEMM would.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from llds_jax.models.layers import project
from llds_jax.parallel.rules import constrain, current_rules

BLOCK_M = BLOCK_N = BLOCK_K = 64
NUM_WARPS, NUM_STAGES = 4, 2
NAME = "swiglu_gate_up_gpu"


def supported(hidden: int, intermediate: int) -> bool:
    """Shapes the kernel takes: whole ``BK`` steps over the hidden size, whole ``BN`` tiles of ``F``."""
    return hidden % BLOCK_K == 0 and intermediate % BLOCK_N == 0


def gate_up_bytes(rows: int, hidden: int, intermediate: int, itemsize: int) -> int:
    """What one call moves: the rows' hidden states, both weight matrices once (a column tile's later
    row tiles read it from L2, as XLA's cost analysis assumes of its own GEMMs) and the ``[rows, F]``
    output."""
    return itemsize * (rows * hidden + 2 * hidden * intermediate + rows * intermediate)


def swiglu_mlp(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, *, interpret: bool = False) -> jax.Array:
    """``layers.swiglu_mlp`` with :func:`gate_up_silu` before XLA's down projection; x [B, T, D]."""
    batch, length, hidden = x.shape
    h = gate_up_silu(x.reshape(batch * length, hidden), gate, up, interpret=interpret)
    return project(constrain(h.reshape(batch, length, -1), ("batch", "seq", "act_mlp")), down)


def gate_up_silu(x: jax.Array, gate: jax.Array, up: jax.Array, *, interpret: bool = False) -> jax.Array:
    """``silu(x @ gate) * (x @ up)`` in ``x``'s dtype: x [M, D], gate and up [D, F]. ``interpret=True``
    runs Pallas' interpreter (any backend; tests)."""
    rows, hidden = x.shape
    intermediate = gate.shape[1]
    if gate.shape != (hidden, intermediate) or up.shape != gate.shape:
        raise ValueError(f"gate_up_silu: x {x.shape}, gate {gate.shape}, up {up.shape}")
    if not supported(hidden, intermediate):
        raise ValueError(f"gate_up_silu: hidden {hidden} and intermediate {intermediate} must be multiples of "
                         f"{BLOCK_K} (see supported)")
    run = functools.partial(_per_device, interpret=interpret)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return run(x, gate, up)
    rows_axes, mlp_axes = current_rules().spec(("batch", "mlp"), (rows, intermediate), mesh)
    names = () if mlp_axes is None else (mlp_axes,) if isinstance(mlp_axes, str) else mlp_axes
    if (intermediate // math.prod(mesh.shape[name] for name in names)) % BLOCK_N:
        mlp_axes = None  # a device's share of F would cut a tile: each device computes all of F
    return jax.shard_map(run, mesh=mesh, in_specs=(jax.P(rows_axes, None), jax.P(None, mlp_axes), jax.P(None, mlp_axes)),
                         out_specs=jax.P(rows_axes, mlp_axes), check_vma=False)(x, gate, up)


def _per_device(x, gate, up, *, interpret: bool):
    rows, hidden = x.shape
    intermediate = gate.shape[1]
    padded = -(-rows // BLOCK_M) * BLOCK_M
    if padded != rows:  # whole row tiles (the engine's slot counts are multiples of 64 at the paper's shapes)
        x = jnp.pad(x, ((0, padded - rows), (0, 0)))
    itemsize = jnp.dtype(x.dtype).itemsize
    cost = pl.CostEstimate(flops=4 * padded * hidden * intermediate + 5 * padded * intermediate,
                           transcendentals=padded * intermediate,
                           bytes_accessed=gate_up_bytes(padded, hidden, intermediate, itemsize))
    out = pl.pallas_call(
        functools.partial(_kernel, steps=hidden // BLOCK_K),
        grid=(padded // BLOCK_M, intermediate // BLOCK_N),
        in_specs=[pl.BlockSpec((BLOCK_M, hidden), lambda i, j: (i, 0)),
                  pl.BlockSpec((hidden, BLOCK_N), lambda i, j: (0, j)),
                  pl.BlockSpec((hidden, BLOCK_N), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((BLOCK_M, BLOCK_N), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((padded, intermediate), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
        cost_estimate=cost,
        interpret=interpret,
        name=NAME,
    )(x, gate.astype(x.dtype), up.astype(x.dtype))
    return out[:rows] if padded != rows else out


def _kernel(x_ref, gate_ref, up_ref, out_ref, *, steps: int):
    def accumulate(k, acc):
        g, u = acc
        cut = pl.ds(k * BLOCK_K, BLOCK_K)
        x = x_ref[:, cut]
        g += jnp.dot(x, gate_ref[cut, :], preferred_element_type=jnp.float32)
        u += jnp.dot(x, up_ref[cut, :], preferred_element_type=jnp.float32)
        return g, u

    zeros = jnp.zeros(out_ref.shape, jnp.float32)
    g, u = jax.lax.fori_loop(0, steps, accumulate, (zeros, zeros))
    out_ref[...] = (g / (1.0 + jnp.exp(-g)) * u).astype(out_ref.dtype)
