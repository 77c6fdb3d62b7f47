"""Reading a compiled program's HLO text in product tests: its while-loop bodies and the ops outside
fusions (what touches memory). The decode step itself is compiled by ``benchmarks/_decode_step.py``
(``compile_segment``: the engine's ``decode_segment`` through the planner's ``plan.aot``). The roofline
tool keeps a fuller reader of its own."""

from __future__ import annotations

import re

_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[([\d,]*)\]\S* ([\w\-]+)\(")
_NOT_MEMORY = {"parameter", "get-tuple-element", "bitcast", "constant", "tuple", "while", "call", "conditional"}


def while_bodies(hlo: str) -> set[str]:
    """Names of the computations that are while-loop bodies."""
    return set(re.findall(r" while\(.*?body=%([\w.\-]+)", hlo))


def ops_outside_fusions(hlo: str) -> list[dict]:
    """Every instruction of an unfused computation with an array result: name, opcode, shape
    (``f32[8,2,256,16]``), the computation holding it, and the tail of its ``op_name``."""
    fused = set(re.findall(r"kind=k\w+, calls=%([\w.\-]+)", hlo))
    computation, found = "", []
    for line in hlo.splitlines():
        if header := _COMPUTATION.match(line):
            computation = header[1]
        elif computation not in fused and (match := _INSTRUCTION.match(line)) and match[4] not in _NOT_MEMORY:
            op_name = re.search(r'op_name="([^"]*)"', line)
            found.append(dict(name=match[1], opcode=match[4], shape=f"{match[2]}[{match[3]}]",
                              computation=computation, op_name=op_name[1][-90:] if op_name else ""))
    return found
