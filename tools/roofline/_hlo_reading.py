"""Reading XLA's optimised HLO text for ``roofline.py``: while loops and their trip counts (and the
trips the attention's key-block loops make), kernel custom calls HloCostAnalysis cannot see, and
the largest buffers outside fusions."""

from __future__ import annotations

import math
import re

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[([\d,]*)\]\S* ([\w\-]+)\(")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{\s*$")
_WHILE_BODY = re.compile(r" while\(.*?body=%([\w.\-]+)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_SKIPPED_OPS = {"parameter", "get-tuple-element", "bitcast", "constant", "tuple", "while", "call", "conditional"}


def while_loops(hlo: str) -> list[str]:
    """Every while loop in optimised HLO: its name and known trip count ('?' when XLA does not know it)."""
    loops = []
    for line in hlo.splitlines():
        if match := re.search(r"%([\w.\-]+) = .* while\(", line):
            trips = _TRIPS.search(line)
            op_name = re.search(r'op_name="([^"]*)"', line)
            loops.append(f"{match[1]}(trips={trips[1] if trips else '?'}) {op_name[1][-60:] if op_name else ''}".strip())
    return loops


def while_bodies(hlo: str) -> set[str]:
    """Names of the computations that are while-loop bodies (``largest_ops``' ``computation`` field)."""
    return set(_WHILE_BODY.findall(hlo))


# XLA:TPU's own bookkeeping custom calls (index packing, bitcasts, a loop carry's uninitialised buffer —
# ``AllocateBuffer``, no operands, nothing read or written): no kernel behind them.
BOOKKEEPING_CALLS = frozenset({"ConcatBitcast", "GatherScatterIndicesBitpacked", "AssumeGatherIndicesInBound",
                               "AllocateBuffer"})


def custom_calls(hlo: str) -> dict[str, int]:
    """Kernel custom calls and how often they occur (Pallas/Mosaic ``tpu_custom_call``, cuBLAS,
    cuDNN): HloCostAnalysis does not see their flops or bytes, so a program with them is
    under-counted. XLA:TPU's bookkeeping calls (BOOKKEEPING_CALLS) are left out."""
    counts: dict[str, int] = {}
    for target in re.findall(r' custom-call\(.*?custom_call_target="([^"]+)"', hlo):
        if target not in BOOKKEEPING_CALLS:
            counts[target] = counts.get(target, 0) + 1
    return counts


def largest_ops(hlo: str, top: int = 8) -> list[dict]:
    """The instructions with the largest results outside fused computations (what touches memory):
    the evidence for whole-cache copies or fp32 weight copies."""
    fused = set(re.findall(r"kind=k\w+, calls=%([\w.\-]+)", hlo))
    computation, found = "", []
    for line in hlo.splitlines():
        if header := _COMPUTATION.match(line):
            computation = header[1]
            continue
        if computation in fused or not (match := _INSTRUCTION.match(line)) or match[2] not in _DTYPE_BYTES:
            continue
        name, dtype, dims, opcode = match.groups()
        if opcode in _SKIPPED_OPS:
            continue
        shape = [int(d) for d in dims.split(",") if d]
        size = math.prod(shape) * _DTYPE_BYTES[dtype]
        op_name = re.search(r'op_name="([^"]*)"', line)
        found.append(dict(name=name, opcode=opcode, shape=f"{dtype}[{dims}]", bytes=size, computation=computation,
                          op_name=op_name[1][-90:] if op_name else ""))
    return sorted(found, key=lambda op: -op["bytes"])[:top]


def attention_loop_trips(program: str, length: int) -> set[int]:
    """Trip counts of the blockwise attention's key-block loops at this live length (decode) or
    sequence length. Key block 0 is peeled off each forward loop (models/attention/blockwise.py),
    so a forward loop runs blocks − 1 times and a backward loop (update only) blocks times."""
    from llds_jax.models.attention import CACHED_BLOCK, DEFAULT_BLOCK, QUERY_BLOCK, query_piece

    if program == "decode":
        return {-(-length // CACHED_BLOCK) - 1}
    piece = query_piece(length)
    if length > piece:  # causal pieces, each walking QUERY_BLOCK keys up to its own last query
        blocks = [-(-min(start + piece, length) // min(QUERY_BLOCK, length)) for start in range(0, length, piece)]
    else:
        blocks = [-(-length // min(DEFAULT_BLOCK, length))]
    return {b - 1 for b in blocks} | ({*blocks} if program == "update" else set())


_CALLEE = re.compile(r"(?:calls|to_apply|body|condition|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def computation_blocks(hlo: str) -> dict[str, str]:
    """Name → text of every computation of an HLO module printed without metadata (``ENTRY``
    dropped from the entry's header)."""
    blocks, name, lines = {}, None, []
    for line in hlo.splitlines():
        if name is None:
            if header := _COMPUTATION.match(line):
                name, lines = header[1], [line.removeprefix("ENTRY ")]
        else:
            lines.append(line)
            if line.strip() == "}":
                blocks[name], name = "\n".join(lines), None
    return blocks


def callees(block: str) -> set[str]:
    """Computations one computation's instructions call (fusions, reductions, loops, branches)."""
    names = set(_CALLEE.findall(block))
    for branches in _BRANCHES.findall(block):
        names.update(re.findall(r"%([\w.\-]+)", branches))
    return names


def as_entry(blocks: dict[str, str], entry: str) -> str:
    """A module whose entry is ``entry`` with every computation it reaches: a loop body as a
    program of its own, for HloCostAnalysis to cost one trip."""
    reached, todo = set(), [entry]
    while todo:
        if (name := todo.pop()) not in reached:
            reached.add(name)
            todo.extend(callees(blocks[name]))
    # in the module's own order, where every computation comes after the ones it calls
    others = [block for name, block in blocks.items() if name in reached and name != entry]
    return "\n\n".join([f"HloModule {entry}_as_entry", *others, "ENTRY " + blocks[entry]]) + "\n"


def loop_trips(blocks: dict[str, str]) -> dict[str, int | None]:
    """Body → trip count of every while loop (None where XLA does not know it: a traced count);
    ``blocks`` from :func:`computation_blocks`."""
    trips = {}
    for block in blocks.values():
        for line in block.splitlines():
            if body := _WHILE_BODY.search(line):
                trips[body[1]] = int(known[1]) if (known := _TRIPS.search(line)) else None
    return trips


def known_trip_loops(blocks: dict[str, str]) -> list[tuple[str, str, int]]:
    """(computation holding it, body, trips) of every while loop whose trip count XLA knows;
    ``blocks`` from :func:`computation_blocks`."""
    loops = []
    for name, block in blocks.items():
        for line in block.splitlines():
            if (body := _WHILE_BODY.search(line)) and (trips := _TRIPS.search(line)):
                loops.append((name, body[1], int(trips[1])))
    return loops
