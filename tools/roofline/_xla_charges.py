"""Bytes XLA's ``HloCostAnalysis`` charges a decode token for work the compiled program does not do.

Two of its rules, each measured here on the target's own compiler with a standalone program of
the decode step's exact shapes (not assumed):

* an embedding lookup (``jnp.take`` of B rows, as ``Decoder.embed_tokens`` does) is charged the
  whole table, though a gather reads only the B rows;
* a cache write (``attend_cached``'s scatter of one token per row into a donated
  ``[B, KVH, S, Dh]`` cache, or into each of its key-block buffers on XLA:CPU) is charged the
  whole buffer read and written, though it runs in place
  (``roofline.py`` checks that the real loop body holds no cache-sized copy).

And one omission: XLA:GPU's cuBLAS GEMM custom calls are not costed at all; their operands and
result (what a GEMM must move) are added back.

How many of each one more token adds is read off the optimised HLO of the one- and two-token
programs, so a target whose program has no such op (XLA:TPU's decode kernel writes the cache
itself) is charged nothing for it. The report shows XLA's figure and the corrected one side by side.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
from _hlo_reading import _DTYPE_BYTES, as_entry, callees, computation_blocks, known_trip_loops


def xla_cost(compiled) -> tuple[float, float, str]:
    """(flops, bytes accessed, how they were obtained) from XLA's HloCostAnalysis.

    Its rules that matter here (checked with a 2 MB cache on each target): a dynamic-update-slice
    into a donated buffer is charged the update only; a scatter is charged its whole operand and
    output (CPU, GPU: 2x the buffer; TPU: 18x) whether or not it runs in place.
    """
    analysis = compiled.cost_analysis()
    if isinstance(analysis, list):
        analysis = analysis[0] if analysis else None
    how = "compiled.cost_analysis()"
    if not analysis:
        from jax._src.lib import _jax

        module = compiled.runtime_executable().hlo_modules()[0]
        analysis = _jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module)
        how = "HloCostAnalysis over the optimised module (compile-only executable reports none)"
    return float(analysis.get("flops", 0.0)), float(analysis.get("bytes accessed", 0.0)), how


def optimised_hlo(compiled) -> str:
    """The optimised module's text without metadata: parsable on its own, piece by piece."""
    from jax._src.lib import _jax  # noqa: F401  (loads the HLO bindings)
    from jaxlib import _hlo

    options = _hlo.HloPrintOptions()
    options.print_metadata = False
    return compiled.runtime_executable().hlo_modules()[0].to_string(options)


def uncounted_loop_trips(hlo: str) -> tuple[float, float, list[str]]:
    """(flops, bytes, one line per loop) that HloCostAnalysis leaves out of the while loops whose
    trip count XLA knows: it costs a body once, so each loop adds (trips − 1) × its body's cost,
    times the trips of the loops around it. A body is costed as a module of its own (``as_entry``),
    by the same analysis over the same optimised HLO; ``hlo`` from :func:`optimised_hlo`."""
    from jax._src.lib import _jax
    from jaxlib import _hlo

    blocks = computation_blocks(hlo)
    enclosing: dict[str, tuple[str, int]] = {}  # computation -> (its caller, trips of the loop it is the body of)
    loop_trips = {(holder, body): trips for holder, body, trips in known_trip_loops(blocks)}
    for name, block in blocks.items():
        for callee in callees(block):
            enclosing.setdefault(callee, (name, loop_trips.get((name, callee), 1)))

    def around(name: str) -> int:  # trips of every known loop around ``name``
        product, seen = 1, set()
        while name in enclosing and name not in seen:
            seen.add(name)
            name, trips = enclosing[name]
            product *= trips
        return product

    client = jax.devices("cpu")[0].client
    flops = bytes_ = 0.0
    lines = []
    for (holder, body), trips in loop_trips.items():
        cost = _jax.hlo_module_cost_analysis(client, _hlo.hlo_module_from_text(as_entry(blocks, body)))
        times = around(holder) * (trips - 1)
        flops += times * float(cost.get("flops", 0.0))
        bytes_ += times * float(cost.get("bytes accessed", 0.0))
        lines.append(f"{body}: {trips} trips, {float(cost.get('bytes accessed', 0.0)) / 1e6:.2f} MB a trip")
    return flops, bytes_, lines


_DEFINITION = re.compile(r"%([\w.\-]+) = \w+\[([\d,]*)\]\S* ([\w\-]+)\(%([\w.\-]+)")
_ARRAY = re.compile(r"%([\w.\-]+) = (\w+)\[([\d,]*)\]")


def _array_bytes(dtype: str, dims: str) -> int:
    return math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BYTES.get(dtype, 4)


def _inventory(hlo: str, buffer_dims: tuple[tuple[int, ...], ...], table_dims: tuple[int, ...]
               ) -> tuple[tuple[int, ...], tuple[int, ...], int, int]:
    """(scatters into a pool of each of ``buffer_dims``, gathers from one, gathers from a
    ``table_dims`` table, bytes the cuBLAS GEMM calls move) in one program, fused computations included."""
    arrays = {name: (dtype, dims) for name, dtype, dims in _ARRAY.findall(hlo)}
    definitions = _DEFINITION.findall(hlo)

    def count(opcode: str, dims: tuple[int, ...]) -> int:  # a pool's leading device axis of 1 may be dropped
        wanted = {",".join(map(str, dims)), ",".join(map(str, dims[1:] if dims[:1] == (1,) else dims))}
        return sum(1 for _, _, op, first in definitions if op == opcode and arrays.get(first, ("", ""))[1] in wanted)

    return (tuple(count("scatter", dims) for dims in buffer_dims), tuple(count("gather", dims) for dims in buffer_dims),
            count("gather", table_dims), gemm_call_bytes(hlo, arrays))


def _bytes_accessed(fn, *args, donate=()) -> float:
    compiled = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
    return xla_cost(compiled)[1]


def gather_excess(device, vocab: int, hidden: int, dtype, batch: int) -> float:
    """Bytes charged for looking up ``batch`` rows of a ``[vocab, hidden]`` table beyond the rows
    read and written."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    table = jax.ShapeDtypeStruct((vocab, hidden), dtype, sharding=sharding)
    ids = jax.ShapeDtypeStruct((batch, 1), jnp.int32, sharding=sharding)
    charged = _bytes_accessed(lambda t, i: jnp.take(t, i, axis=0), table, ids)
    return max(charged - 2 * batch * hidden * jnp.dtype(dtype).itemsize, 0.0)


def row_pick_excess(device, rows: int, vocab: int, dtype=jnp.float32) -> float:
    """Bytes charged for picking one element of each row of a ``[rows, vocab]`` array (the sampled
    token's logit: ``take_along_axis``) beyond the elements read, the indices and the result."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    x = jax.ShapeDtypeStruct((rows, vocab), dtype, sharding=sharding)
    index = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=sharding)
    charged = _bytes_accessed(lambda x, i: jnp.take_along_axis(x, i[:, None], axis=-1), x, index)
    return max(charged - rows * (2 * jnp.dtype(dtype).itemsize + 4), 0.0)


def pool_gather_excess(device, pool_shape: tuple[int, ...], dtype, batch: int) -> float:
    """Bytes charged for gathering one block per row of ``batch`` from a paged pool
    ``[devices, blocks, KVH, block, Dh]`` (``attention.paged.gather_column``, the step's read of a key
    block where no kernel reads the pool) beyond the blocks read and written and the indices."""
    from llds_jax.models.attention.paged import gather_column

    _, _, kv_heads, block, head_dim = pool_shape
    sharding = jax.sharding.SingleDeviceSharding(device)
    pool = jax.ShapeDtypeStruct(pool_shape, dtype, sharding=sharding)
    table = jax.ShapeDtypeStruct((batch, 1), jnp.int32, sharding=sharding)
    column = jax.ShapeDtypeStruct((), jnp.int32, sharding=sharding)
    charged = _bytes_accessed(gather_column, pool, table, column)
    return max(charged - 2 * batch * kv_heads * block * head_dim * jnp.dtype(dtype).itemsize - batch * 4, 0.0)


def scatter_excess(device, pool_shape: tuple[int, ...], dtype, batch: int) -> float:
    """Bytes charged for writing one token per row of ``batch`` into a donated paged pool
    ``[devices, blocks, KVH, block, Dh]`` (``attention.paged.paged_write``, the step's own write)
    beyond the token's values read and written."""
    from llds_jax.models.attention.paged import paged_write

    kv_heads, head_dim = pool_shape[2], pool_shape[4]
    sharding = jax.sharding.SingleDeviceSharding(device)
    pool = jax.ShapeDtypeStruct(pool_shape, dtype, sharding=sharding)
    token = jax.ShapeDtypeStruct((batch, 1, kv_heads, head_dim), dtype, sharding=sharding)
    table = jax.ShapeDtypeStruct((batch, 1), jnp.int32, sharding=sharding)
    slots = jax.ShapeDtypeStruct((batch, 1), jnp.int32, sharding=sharding)
    write = jax.ShapeDtypeStruct((batch, 1), jnp.bool_, sharding=sharding)
    charged = _bytes_accessed(paged_write, pool, token, table, slots, write, donate=(0,))
    return max(charged - 2 * math.prod(token.shape) * jnp.dtype(dtype).itemsize, 0.0)


_GEMM_CALL = re.compile(r"= (\([^)]*\)|\w+\[[\d,]*\]\S*) custom-call\(([^)]*)\).*?custom_call_target=\"__cublas")


def gemm_call_bytes(hlo: str, arrays: dict | None = None) -> int:
    """Bytes the cuBLAS GEMM custom calls read and write (operands + result, not the workspace):
    work HloCostAnalysis leaves out, as much of it as a GEMM must move."""
    arrays = arrays if arrays is not None else {name: (d, s) for name, d, s in _ARRAY.findall(hlo)}
    total = 0
    for result, operands in _GEMM_CALL.findall(hlo):
        total += _array_bytes(*re.match(r"\(?(\w+)\[([\d,]*)\]", result).groups())
        total += sum(_array_bytes(*arrays[name]) for name in re.findall(r"%([\w.\-]+)", operands) if name in arrays)
    return total


def decode_charges(hlo_one: str, hlo_two: str, device, decoder_cfg, batch: int,
                   buffer_dims: tuple[tuple[int, ...], ...]) -> tuple[float, float, str]:
    """(bytes charged to one more decode token for gathers and scatters that do not run as
    charged — one-token-per-row lookups, one-block-per-row reads of a pool and in-place cache
    writes —, bytes of its cuBLAS GEMMs
    that are not charged at all, what they are). ``buffer_dims``: the shapes of the paged cache's
    pools (a k and a v pool per layer)."""
    dtype = jnp.dtype(decoder_cfg.dtype)
    table_dims = (decoder_cfg.vocab_size, decoder_cfg.hidden_size)
    (scatters_one, blocks_one, gathers_one, gemms_one) = _inventory(hlo_one, buffer_dims, table_dims)
    (scatters_two, blocks_two, gathers_two, gemms_two) = _inventory(hlo_two, buffer_dims, table_dims)
    gathers, gemms = gathers_two - gathers_one, gemms_two - gemms_one
    total, parts = 0.0, []
    for dims, one, two in zip(buffer_dims, scatters_one, scatters_two, strict=True):
        if two - one > 0:
            per_scatter = scatter_excess(device, dims, dtype, batch)
            total += (two - one) * per_scatter
            parts.append(f"{two - one} in-place cache scatters x {per_scatter / 1e6:.3g} MB")
    if not parts:
        parts.append("0 in-place cache scatters")
    for dims, one, two in zip(buffer_dims, blocks_one, blocks_two, strict=True):
        if two - one > 0:  # the XLA attention's key-block reads (no decode kernel): one block a row each
            per_block = pool_gather_excess(device, dims, dtype, batch)
            total += (two - one) * per_block
            parts.append(f"{two - one} key-block gathers x {per_block / 1e6:.3g} MB")
    per_gather = gather_excess(device, decoder_cfg.vocab_size, decoder_cfg.hidden_size, dtype, batch) if gathers > 0 else 0.0
    total += max(gathers, 0) * per_gather
    parts.append(f"{gathers} embedding lookups x {per_gather / 1e6:.3g} MB")
    what = " + ".join(parts) + " charged, not run" + (f"; cuBLAS GEMMs not charged {gemms / 1e6:.3g} MB" if gemms else "")
    return total, float(gemms), what


__all__ = ["decode_charges", "gather_excess", "gemm_call_bytes", "pool_gather_excess", "scatter_excess", "xla_cost"]
