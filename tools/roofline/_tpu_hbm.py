"""HBM bytes of one XLA:TPU decode token, read from the optimised HLO of the real decode ``while`` loop.

Why not XLA's figure: XLA:TPU's ``HloCostAnalysis`` charges memory-space-assignment traffic as
if it were extra work (a weight sliced into VMEM by ``slice-start``/``slice-done`` is charged at
both ends, then again when the dot reads it from VMEM), does not tell memory spaces apart, and
does not cost the Pallas decode kernel (a ``tpu_custom_call``) at all. In the optimised HLO every
instruction's result carries a layout whose ``S(n)`` names its memory space (``S(1)`` VMEM,
``S(2)`` sync flags, ``S(6)`` scalar memory; none = HBM), so HBM traffic can be read off it:

* an op is charged the HBM operands it reads and the HBM results it writes; VMEM ones are free;
* a fusion whose HBM operand is only read through a ``slice``/``dynamic-slice``/``gather``
  inside it is charged what those read; a ``dynamic-update-slice`` into a buffer is charged the
  update, not the buffer (it runs in place);
* ``copy-start``/``slice-start`` are charged their HBM side once (the read of a prefetch, the
  write of an eviction); the matching ``-done`` is free;
* a ``while`` nested in the body counts its body times its trip count (XLA:TPU prints no
  known_trip_count: read off a ``fori_loop``'s counter; once, noted, when it cannot be read);
  a ``conditional`` is charged its costliest branch (noted);
* the Pallas paged decode kernel's DMAs are computed from its block schedule (``decode_tpu.py``),
  for the live length asked for, on the operands that live in HBM: they are not read from XLA.

One token = one trip of the decode loop's body. The ENTRY computation around the loop (layer
weight slices, layout converts of the caches) runs once per call and is reported apart.

``decode_loop`` is the rollout engine's token step over the paged cache (``slots.decode_segment``'s
step) with the sampler fixed at compile time, as ``_decode_program.py`` fixes it for the
straight-line steps: the engine's program takes the knobs as traced arrays.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import jax
from _decode_program import engine_step, fixed_sampling
from _hlo_reading import _DTYPE_BYTES

_HEADER = re.compile(r"^(ENTRY )?%([\w.\-]+) \(")
_INSTRUCTION = re.compile(r"\s*(ROOT )?%[\w.\-]+ = ")
_LEAF = re.compile(r"(\w+)\[([\d,]*)\](?:\{([^}]*)\})?")
_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "copy-done", "slice-done", "after-all",
         "partition-id", "replica-id", "opt-barrier"}
_SLICING = {"slice", "dynamic-slice", "gather"}  # ops that read part of their first operand
FREE_CALLS = frozenset({"ConcatBitcast"})  # slices of one buffer laid side by side: no data moves
KERNEL = "paged_decode_attention"  # decode_tpu.paged_decode_and_write's pallas_call


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One array of an instruction's (possibly tuple) result: dtype, dims, memory space."""
    dtype: str
    dims: tuple[int, ...]
    space: int

    @property
    def bytes(self) -> int:
        return math.prod(self.dims) * _DTYPE_BYTES.get(self.dtype, 4)

    @property
    def hbm(self) -> bool:
        return self.space == 0 and self.dtype in _DTYPE_BYTES


@dataclasses.dataclass
class Op:
    name: str
    leaves: list[Leaf]
    opcode: str
    operands: list[str]
    attrs: str
    root: bool = False
    args: str = ""

    @property
    def bytes(self) -> int:
        return sum(leaf.bytes for leaf in self.leaves)

    def hbm_bytes(self) -> int:
        return sum(leaf.bytes for leaf in self.leaves if leaf.hbm)

    def called(self, key: str) -> list[str]:
        found = re.search(key + r"=\{?(%[\w.\-]+(?:, %[\w.\-]+)*)\}?", self.attrs)
        return [c.lstrip("%") for c in found[1].split(", ")] if found else []


def _leaves(shape: str) -> list[Leaf]:
    leaves = []
    for dtype, dims, layout in _LEAF.findall(shape):
        space = re.search(r"S\((\d+)\)", layout or "")
        leaves.append(Leaf(dtype, tuple(int(d) for d in dims.split(",") if d), int(space[1]) if space else 0))
    return leaves


def _matching(text: str, start: int) -> int:
    """Index just past the parenthesis that closes the one at ``start``."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    raise ValueError(f"unbalanced parentheses: {text[start:start + 80]}")


def parse_instruction(line: str) -> Op | None:
    """``%name = SHAPE opcode(%a, %b), attrs`` (SHAPE an array or a nested tuple, with layouts)."""
    match = re.match(r"\s*(ROOT )?%([\w.\-]+) = ", line)
    if not match:
        return None
    rest = line[match.end():]
    end = _matching(rest, 0) if rest.startswith("(") else rest.index(" ")
    shape, rest = rest[:end], rest[end:].lstrip()
    opcode = re.match(r"[\w\-]+", rest)[0]
    args_end = _matching(rest, len(opcode))
    operands = re.findall(r"%([\w.\-]+)", rest[len(opcode):args_end])
    return Op(match[2], _leaves(shape), opcode, operands, rest[args_end:], bool(match[1]), rest[len(opcode):args_end])


def parse_module(hlo: str) -> tuple[dict[str, dict[str, Op]], str]:
    """(computation name -> {instruction name -> Op} in program order, ENTRY's name).

    An instruction may run over several lines: a Pallas kernel's ``kernel_metadata`` holds a
    JSON string with newlines, so a continuation line can start with ``}}``. A computation ends
    at a line that is ``}`` alone; any other line not opening an instruction continues the last.
    """
    computations, entry, current = {}, "", None
    pending: list[str] = []

    def flush():
        if current is not None and pending and (op := parse_instruction(" ".join(pending))):
            current[op.name] = op
        pending.clear()

    for line in hlo.splitlines():
        if header := _HEADER.match(line):
            flush()
            current = computations.setdefault(header[2], {})
            entry = header[2] if header[1] else entry
        elif line.rstrip() == "}":
            flush()
            current = None
        elif current is not None:
            if _INSTRUCTION.match(line):
                flush()
                pending.append(line)
            elif pending:
                pending.append(line)
    flush()
    return computations, entry


# ------------------------------------------------------------------ the charges
@dataclasses.dataclass
class Charge:
    computation: str
    name: str
    opcode: str
    bytes: float
    what: str
    op_name: str = ""  # the JAX operation it came from (metadata), for the per-op breakdown


@dataclasses.dataclass(frozen=True)
class KernelShape:
    """One paged decode kernel call (``decode_tpu.paged_decode_and_write``), from its operands: the
    rows' grouped queries [B, KVH, G, Dh] (B padded to whole programs), the pools [NB, KVH, block, Dh],
    the flattened block table [B x C], and which of them live in HBM."""
    batch: int
    kv_heads: int
    blocks: int
    columns: int
    head_dim: int
    group: int
    block: int
    itemsize: int
    pool_hbm: tuple[bool, bool]
    q_hbm: bool
    new_hbm: tuple[bool, bool]
    out_hbm: bool


def kernel_dma_bytes(k: KernelShape, live: int) -> float:
    """HBM bytes one paged decode kernel call moves (``decode_tpu._paged_rows_kernel``), per (row, KV
    head), every row at ``live`` slots: ``ceil(live / block)`` key blocks (at most the table's
    columns) and as many value blocks in; the new slot's tile of ``row_tile`` slots read, patched and
    written back, for k and for v; its G query heads and the new k and v in (BlockSpec inputs); its
    G output heads out. Only operands that live in HBM count (``decode_tpu.decode_read_bytes`` is the
    same schedule's reads, for rows of their own lengths)."""
    blocks = min(-(-live // k.block), k.columns)
    tile = 8 * max(1, 4 // k.itemsize)  # decode_tpu.row_tile
    row = k.head_dim * k.itemsize
    per_head = sum(blocks * k.block * row + 2 * tile * row for hbm in k.pool_hbm if hbm)
    per_head += k.group * row * (k.q_hbm + k.out_hbm) + sum(row for hbm in k.new_hbm if hbm)
    return k.batch * k.kv_heads * per_head


class Reader:
    """HBM charges of the instructions of one parsed module."""

    def __init__(self, hlo: str):
        self.computations, self.entry = parse_module(hlo)
        self.notes: list[str] = []
        self.kernels: list[KernelShape] = []

    def leaves_of(self, computation: str, name: str) -> list[Leaf]:
        op = self.computations[computation].get(name)
        return op.leaves if op else []

    def charges(self, computation: str, skip_while: str = "", times: float = 1.0) -> list[Charge]:
        """Every HBM charge of ``computation`` (called computations included), times ``times``;
        a ``while`` whose body is ``skip_while`` is left out (the decode loop, seen from ENTRY)."""
        found = []
        for op in self.computations[computation].values():
            found += self._charge(computation, op, skip_while, times)
        return found

    def _charge(self, comp: str, op: Op, skip_while: str, times: float) -> list[Charge]:
        code = op.opcode
        if code in _FREE:
            return []

        def one(nbytes: float, what: str) -> list[Charge]:
            source = re.search(r'op_name="([^"]*)"', op.attrs)
            return [Charge(comp, op.name, code, nbytes * times, what, source[1][-80:] if source else "")] if nbytes else []

        operands = [self.leaves_of(comp, name) for name in op.operands]
        read = sum(leaf.bytes for leaves in operands for leaf in leaves if leaf.hbm)
        if code in ("copy-start", "slice-start"):
            # copy-start: (destination, source, context); slice-start: ((source), slice, context)
            source = operands[0]
            moved = op.leaves[0] if code == "copy-start" else op.leaves[len(source)]
            nbytes = moved.bytes * (any(leaf.hbm for leaf in source) + moved.hbm)
            return one(nbytes, "prefetch into VMEM (HBM read)" if not moved.hbm else "to HBM")
        if code == "while":
            body = op.called("body")[0]
            if body == skip_while:
                return []
            trips = self.trip_count(comp, op)
            if trips is None:
                self.notes.append(f"{op.name}: trip count unknown, its body counted once")
            return self.charges(body, skip_while, times * (1 if trips is None else trips))
        if code == "conditional":
            branches = [self.charges(b, skip_while, times) for b in op.called("branch_computations")]
            costliest = max(branches, key=lambda cs: sum(c.bytes for c in cs), default=[])
            if len(branches) > 1:
                self.notes.append(f"{op.name}: conditional, its costliest of {len(branches)} branches charged")
            return costliest
        if code == "call":
            return self.charges(op.called("to_apply")[0], skip_while, times)
        if code == "custom-call":
            target = re.search(r'custom_call_target="([^"]+)"', op.attrs)[1]
            if target in FREE_CALLS:
                return []
            if target == "tpu_custom_call" and KERNEL in op.name:
                self.kernels.append(self._kernel_shape(operands, op))
                return []  # its DMAs: kernel_dma_bytes
            return one(read + op.hbm_bytes(), f"custom call {target}: operands + results")
        if code == "dynamic-update-slice":
            update = sum(leaf.bytes for leaf in operands[1])
            return one(update * (any(leaf.hbm for leaf in operands[1]) + op.leaves[0].hbm), "in-place update")
        if code in _SLICING:
            part = op.bytes
            return one(part * (any(leaf.hbm for leaf in operands[0]) + any(leaf.hbm for leaf in op.leaves)) +
                       sum(leaf.bytes for leaves in operands[1:] for leaf in leaves if leaf.hbm), f"{code}: the part read")
        if code == "fusion":
            return one(self._fusion_bytes(op, operands), "fusion: HBM operands read + HBM results written")
        return one(read + op.hbm_bytes(), "HBM operands + HBM results")

    def _value(self, computation: str, name: str) -> int | None:
        """The integer a scalar constant holds, past copies and bitcasts (None if not one)."""
        op = self.computations[computation].get(name)
        while op is not None and op.opcode in ("copy", "bitcast"):
            op = self.computations[computation].get(op.operands[0])
        found = re.fullmatch(r"\((-?\d+)\)", op.args) if op is not None and op.opcode == "constant" else None
        return int(found[1]) if found else None

    def trip_count(self, computation: str, op: Op) -> int | None:
        """Trips of a ``while``: XLA's known_trip_count when it prints one (XLA:TPU does not), else
        read off the loop: condition ``counter < N``, the counter starting at a constant and the
        body adding a constant to it (a ``fori_loop``)."""
        if known := re.search(r'"known_trip_count":\{"n":"(\d+)"\}', op.attrs):
            return int(known[1])
        cond_name, body_name = op.called("condition")[0], op.called("body")[0]
        cond, body = self.computations[cond_name], self.computations[body_name]
        root = next(o for o in cond.values() if o.root)
        if root.opcode != "compare" or "direction=LT" not in root.attrs:
            return None
        counter, bound = (cond[name] for name in root.operands)
        limit = self._value(cond_name, bound.name)
        if counter.opcode != "get-tuple-element" or limit is None:
            return None
        index = int(re.search(r"index=(\d+)", counter.attrs)[1])
        init = self.computations[computation].get(op.operands[0])
        start = self._value(computation, init.operands[index]) if init is not None and init.opcode == "tuple" else None
        body_root = next(o for o in body.values() if o.root)
        step_op = body.get(body_root.operands[index]) if body_root.opcode == "tuple" else None
        if start is None or step_op is None or step_op.opcode != "add":
            return None
        counters = [n for n in step_op.operands if body[n].opcode == "get-tuple-element"
                    and re.search(r"index=(\d+)", body[n].attrs)[1] == str(index)]
        steps = [self._value(body_name, n) for n in step_op.operands if n not in counters]
        if len(counters) != 1 or len(steps) != 1 or not steps[0] or steps[0] < 0:
            return None
        return max(0, -(-(limit - start) // steps[0]))

    def _fusion_bytes(self, op: Op, operands: list[list[Leaf]]) -> int:
        """HBM operands a fusion reads (only the parts its slices read, nested fusions included;
        not at all a buffer it updates in place) and HBM results it writes (only the update of an
        in-place dynamic-update-slice)."""
        fused_name = op.called("calls")[0]
        fused = self.computations[fused_name]
        total = 0
        for index, leaves in enumerate(operands):
            if not any(leaf.hbm for leaf in leaves):
                continue
            part = self._sliced_read(fused_name, index)
            total += part if part is not None else sum(leaf.bytes for leaf in leaves if leaf.hbm)
        root = next(o for o in fused.values() if o.root)
        outputs = [fused[n] for n in root.operands] if root.opcode == "tuple" else [root]
        for leaf, out in zip(op.leaves, outputs, strict=False):
            while out.opcode == "bitcast":
                out = fused[out.operands[0]]
            if leaf.hbm:
                in_place = out.opcode == "dynamic-update-slice"
                total += sum(x.bytes for x in fused[out.operands[1]].leaves) if in_place else leaf.bytes
        return total

    def _uses(self, computation: str, name: str) -> list[tuple[int, Op]]:
        """(operand position, user) of ``name`` in ``computation``, looking past bitcasts."""
        found = []
        for user in self.computations[computation].values():
            for position, operand in enumerate(user.operands):
                if operand == name:
                    found += self._uses(computation, user.name) if user.opcode == "bitcast" else [(position, user)]
        return found

    def _sliced_read(self, fused: str, index: int) -> int | None:
        """Bytes a fused computation reads of its parameter ``index`` when every use only slices
        it or updates it in place (through nested fusions too: XLA:TPU puts a layer's slice of a
        stacked weight in a fusion inside the matmul's); None when some use reads all of it."""
        params = [o for o in self.computations[fused].values()
                  if o.opcode == "parameter" and o.args.strip("()") == str(index)]
        uses = self._uses(fused, params[0].name) if params else []
        if not uses:
            return None
        total = 0
        for position, user in uses:
            if position == 0 and user.opcode in _SLICING:
                total += user.bytes
            elif position == 0 and user.opcode == "dynamic-update-slice":
                continue
            elif user.opcode == "fusion" and (inner := self._sliced_read(user.called("calls")[0], position)) is not None:
                total += inner
            else:
                return None
        return total

    def _kernel_shape(self, operands: list[list[Leaf]], op: Op) -> KernelShape:
        # operands: 7 scalar-prefetch vectors (the last the flattened table), q, k_new, v_new, k_pool, v_pool
        table = operands[-6][0]
        q, k_new, v_new, k_pool, v_pool = (leaves[0] for leaves in operands[-5:])
        blocks, kv_heads, block, head_dim = k_pool.dims
        batch = q.dims[0]
        return KernelShape(batch, kv_heads, blocks, table.dims[0] // batch, head_dim, q.dims[2], block,
                           _DTYPE_BYTES[k_pool.dtype], (k_pool.hbm, v_pool.hbm), q.hbm, (k_new.hbm, v_new.hbm),
                           op.leaves[0].hbm)


def cache_moves(reader: Reader, body: str, charges: list[Charge], kernels: list[KernelShape]) -> float:
    """Bytes of the body's XLA ops on a KV pool (``[NB, KVH, block, Dh]``, with or without the device
    axis): memory-space assignment moving pools between HBM and VMEM. ``roofline.py``'s copy probe
    counts ops, and only ``copy``/``copy-done`` of a whole pool: a pool brought back in
    ``slice-start`` pieces is not among them."""
    pools = {(k.blocks, k.kv_heads, k.block, k.head_dim) for k in kernels}
    ops = reader.computations[body]
    total = 0.0
    for charge in charges:
        op = ops.get(charge.name)
        arrays = (op.leaves + [leaf for name in op.operands for leaf in reader.leaves_of(body, name)]) if op else []
        total += charge.bytes if any(leaf.dims[-4:] in pools for leaf in arrays) else 0.0
    return total


def decode_loop_body(reader: Reader) -> str:
    """The computation run once per decode token: ``decode_loop.run_steps``' loop in ENTRY (the one
    whose trip count is data-dependent) and, inside it, the body of its static chunk loop."""
    loops = [op for op in reader.computations[reader.entry].values() if op.opcode == "while"]
    loops = [op for op in loops if reader.trip_count(reader.entry, op) is None] or loops
    if len(loops) != 1:
        raise ValueError(f"expected one decode loop in ENTRY, found {len(loops)} while loops")
    return token_body(reader, loops[0].called("body")[0])


_PLUMBING = {"parameter", "get-tuple-element", "tuple", "constant", "copy", "bitcast"}
_BOOKKEEPING_BYTES = 64 * 1024


def token_body(reader: Reader, body: str) -> str:
    """``body``'s token: ``body`` itself, or — when ``body`` only runs one static loop (``run_steps``'
    chunk of tokens between two checks), nothing else but tuple plumbing and small bookkeeping —
    that loop's body. Bookkeeping: ops whose results are all under ``_BOOKKEEPING_BYTES`` (XLA:GPU's
    scalar fusion adding the chunk to ``run_steps``' step count; XLA:TPU's loop-invariant iota and
    reshape of the stop table's indices sunk into the chunk): at most kilobytes once a chunk, against
    gigabytes a token, left out of the token's count."""
    ops = reader.computations[body].values()
    inner = [op for op in ops if op.opcode == "while"]

    def bookkeeping(op) -> bool:
        return op.opcode in _PLUMBING or sum(leaf.bytes for leaf in op.leaves) <= _BOOKKEEPING_BYTES

    if (len(inner) == 1 and reader.trip_count(body, inner[0]) is not None
            and all(bookkeeping(op) or op is inner[0] for op in ops)):
        return inner[0].called("body")[0]
    return body


def _evidence(charges: list[Charge], reader: Reader) -> dict:
    """What a count rests on: its bytes by opcode and its largest charges, both largest first, and
    the reader's notes (conditionals charged their costliest branch, unknown trip counts)."""
    by_opcode: dict[str, float] = {}
    for c in charges:
        by_opcode[c.opcode] = by_opcode.get(c.opcode, 0.0) + c.bytes
    return dict(by_opcode=dict(sorted(by_opcode.items(), key=lambda kv: -kv[1])),
                largest=[dataclasses.asdict(c) for c in sorted(charges, key=lambda c: -c.bytes)[:12]],
                notes=sorted(set(reader.notes)))


def hbm_per_token(hlo: str, live: int) -> dict:
    """One decode token's HBM bytes from the optimised XLA:TPU HLO of a decode loop: the body's
    XLA ops, the decode kernels' DMAs at ``live`` slots (computed), the per-call set-up apart,
    and the body's charges by opcode and largest first (the evidence)."""
    reader = Reader(hlo)
    body = decode_loop_body(reader)
    charges = reader.charges(body)
    kernels = list(reader.kernels)
    setup = reader.charges(reader.entry, skip_while=body)
    ops = sum(c.bytes for c in charges)
    dma = sum(kernel_dma_bytes(k, live) for k in kernels)
    hbm_caches = sum(k.pool_hbm.count(True) for k in kernels)
    return dict(bytes=ops + dma, xla_ops=ops, kernel_dma=dma, setup_per_call=sum(c.bytes for c in setup),
                cache_moves=cache_moves(reader, body, charges, kernels),
                kernels=len(kernels), kernel_caches_in_hbm=hbm_caches, kernel_caches=2 * len(kernels),
                **_evidence(charges, reader),
                how=f"HBM-only model of the loop body's optimised HLO (_tpu_hbm.py); kernel DMAs computed from "
                    f"decode_tpu's block schedule at live={live}, not read from XLA")


def hbm_of_program(hlo: str, ideal: float, kernel_flops: float = 0.0) -> dict:
    """One run's HBM bytes of a whole XLA:TPU program, the log-prob pass or the update: ENTRY and
    what it calls, a ``while`` times its trips, a ``conditional`` its costliest branch (noted).

    Why: XLA's figure for these programs charges VMEM traffic as if it were HBM traffic (a
    SmolLM2 log-prob pass: 4.84 GB, of which 2.08 GB touch HBM). A Pallas kernel (splash
    attention) is charged its HBM operands and results, which is what it moves when one block
    spans the sequence; past that it re-reads keys and values per query block, so the count is
    a lower bound there. ``kernel_flops``: the kernels' work, which XLA does not cost either,
    for the "as run" prediction (``roofline.py`` passes the ideal's causal attention term).
    """
    reader = Reader(hlo)
    charges = reader.charges(reader.entry)
    total = sum(c.bytes for c in charges)
    kernels = [c for c in charges if c.opcode == "custom-call" and "pallas_call" in c.op_name]
    return dict(bytes=total, ideal=ideal, ratio=total / ideal, kernel_bytes=sum(c.bytes for c in kernels),
                kernel_calls=len(kernels), kernel_flops=kernel_flops,
                **_evidence(charges, reader),
                how="HBM-only model of the whole program's optimised HLO (_tpu_hbm.py); Pallas kernels charged "
                    "their HBM operands and results")


@functools.partial(jax.jit, static_argnames=("graphdef", "width", "sampling_mode"), donate_argnames=("cache",))
def decode_loop(graphdef, params, logits, cache, done, budget, keys, drawn, sampling, *, width: int,
                sampling_mode: str):
    """The engine's token step (``_decode_program.engine_step``: ``decode_loop.token_step`` over the
    paged cache) in ``run_steps`` with the sampler's knobs constants of the program and its static
    mode the one they need, as ``SamplingParams.create`` sets it. Checked every token (``every=1``):
    one loop whose body is one token, the body this model reads (the engine's chunks of 8 on an
    accelerator run the same step in a static loop inside)."""
    from llds_jax.sampling.decode_loop import run_steps

    state, step = engine_step(graphdef, params, logits, cache, done, budget, keys, drawn,
                              fixed_sampling(sampling, sampling_mode), width=width)
    return run_steps(step, state, width, every=1)


def measure_hbm(compile_for, args, mesh, platform: str, sampling_mode: str, live: int, ideal: float,
                real_hlo: str = "", width: int = 64) -> dict:
    """``roofline.py``'s hook: compile :func:`decode_loop` for the target, read one token's HBM
    bytes off its body (:func:`hbm_per_token`), with XLA's own figure for the same program. With
    ``real_hlo`` (the engine's real program, ``slots.decode_segment``, knobs traced) its figure too:
    any sampler ``conditional`` charged its costliest branch, so a bound, not the mode's."""
    from _xla_charges import xla_cost

    compiled, _ = compile_for(decode_loop, args, dict(width=width, sampling_mode=sampling_mode), mesh, platform)
    found = hbm_per_token(compiled.as_text(), live)
    real = hbm_per_token(real_hlo, live) if real_hlo else {}
    real = {key: real[key] for key in ("bytes", "xla_ops", "kernel_dma", "setup_per_call", "kernel_caches_in_hbm", "cache_moves",
                                       "notes", "by_opcode", "largest") if key in real}
    return dict(found, ideal=ideal, ratio=found["bytes"] / ideal, xla_loop_bytes=xla_cost(compiled)[1], real_decode=real)


def program_hbm_lines(rows: list[dict]) -> list[str]:
    """The report's lines for TPU log-prob and update rows: HBM bytes as run and the time they predict."""
    lines = ["", "TPU log-probs / update as run (HBM): one run's HBM traffic read off the optimised HLO's memory "
                 "spaces (_tpu_hbm.py; VMEM traffic, which XLA's bytes include, is free); splash kernels charged "
                 "their HBM operands and results, their FLOPs taken from the ideal's attention term:"] if rows else []
    for r in rows:
        h = r["hbm"]
        top = ", ".join(f"{op} {nbytes / 1e9:.2f}" for op, nbytes in list(h["by_opcode"].items())[:4])
        lines.append(f"  {r['model']} {r['program']} {r['shape']}: {h['bytes'] / 1e9:.2f} GB = {h['ratio']:.2f}x ideal "
                     f"{h['ideal'] / 1e9:.2f} GB (XLA: {r['xla_bytes'] / 1e9:.2f} GB; GB by opcode: {top}); "
                     f"{h['seconds'] * 1e3:.3g} ms at peak vs ideal {r['seconds_ideal'] * 1e3:.3g} ms: "
                     f"{'compute' if h['compute_share'] >= 1.0 else 'memory'}-bound, the matmul units busy "
                     f"{100 * h['compute_share']:.0f}% of it"
                     + (f" ({'; '.join(h['notes'])})" if h["notes"] else ""))
    return lines


def hbm_lines(rows: list[dict]) -> list[str]:
    """The report's lines for rows with an HBM figure (TPU decode, log-prob pass, update)."""
    programs = [r for r in rows if r.get("hbm") and r["program"] != "decode"]
    rows = [r for r in rows if r.get("hbm") and r["program"] == "decode"]
    lines = program_hbm_lines(programs)
    lines += ["", "TPU decode as run (HBM): one trip of the real decode loop's body, HBM traffic only, read off "
                  "the optimised HLO's memory spaces (_tpu_hbm.py); the decode kernel's DMAs are COMPUTED from its "
                  "block schedule, not read from XLA:"] if rows else []
    for r in rows:
        h = r["hbm"]
        lines.append(f"  {r['model']} {r['shape']}: XLA ops {h['xla_ops'] / 1e6:.1f} MB + kernel DMAs "
                     f"{h['kernel_dma'] / 1e6:.1f} MB ({h['kernel_caches_in_hbm']} of {h['kernel_caches']} layer pools "
                     f"in HBM) = {h['bytes'] / 1e6:.1f} MB per token = {h['ratio']:.2f}x ideal "
                     f"{h['ideal'] / 1e6:.1f} MB (of it on whole pools: {h['cache_moves'] / 1e6:.1f} MB); "
                     f"per call, not per token: {h['setup_per_call'] / 1e6:.1f} MB; XLA "
                     f"charges the loop program {h['xla_loop_bytes'] / 1e6:.1f} MB"
                     + (f" ({'; '.join(h['notes'])})" if h["notes"] else ""))
        if real := h.get("real_decode"):
            lines.append(f"    the engine's real decode program (slots.decode_segment, knobs traced; {len(real['notes'])} notes, each "
                         f"conditional its costliest branch): {real['bytes'] / 1e6:.1f} MB per token = "
                         f"{real['bytes'] / h['ideal']:.2f}x ideal; per call {real['setup_per_call'] / 1e6:.1f} MB")
    return lines


__all__ = ["KernelShape", "Reader", "decode_loop", "hbm_lines", "hbm_of_program", "hbm_per_token", "kernel_dma_bytes",
           "measure_hbm", "program_hbm_lines",
           "parse_instruction", "parse_module"]
