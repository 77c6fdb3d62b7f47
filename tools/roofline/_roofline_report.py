"""The human-readable roofline report: ``roofline.py``'s record as a table and its notes.

Apart from ``roofline.py`` because formatting is its own job: the record (``--json``) is what
the measurement produces; this turns one into text.
"""

from __future__ import annotations

from _tpu_hbm import hbm_lines


def _si(value: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g}"


def format_report(report: dict) -> str:
    lines = [f"roofline report — {report['date']} — {report['command']}", ""]
    for model, info in report["models"].items():
        lines.append(f"{model}: {info['parameters'] / 1e6:.1f} M parameters; N_layers = {info['n_layers'] / 1e6:.1f} M "
                     f"(blocks + final norm), LM head D·V = {info['n_head'] / 1e6:.1f} M, tied={info['tied']}")
    lines.append("")
    for target, chip in report["chips"].items():
        lines.append(f"{target}: {chip['name']}: {chip['flops'] / 1e12:.3g} TFLOP/s, {chip['bandwidth'] / 1e9:.3g} GB/s "
                     f"({chip['source']}); compiler: {report['compilers'][target]}")
    header = (f"{'model':<13}{'target':<7}{'prec':<6}{'program':<9}{'shape':<28}{'XLA FLOP':>11}{'ideal':>11}{'x':>6}"
              f"{'XLA bytes':>11}{'ideal':>11}{'x':>7}{'ms@peak':>9}{'ideal ms':>9}  loops")
    lines += ["", header, "-" * len(header)]
    for r in report["rows"]:
        mark = "" if r["exact"] else " NOT EXACT"
        lines.append(f"{r['model']:<13}{r['target']:<7}{r['precision']:<6}{r['program']:<9}{r['shape']:<28}"
                     f"{_si(r['xla_flops'], ''):>11}{_si(r['ideal_flops'], ''):>11}{r['flops_ratio']:>6.2f}"
                     f"{_si(r['xla_bytes'], 'B'):>11}{_si(r['ideal_bytes'], 'B'):>11}{r['bytes_ratio']:>7.2f}"
                     f"{_ms(r['seconds_xla']):>9}{_ms(r['seconds_ideal']):>9}  {len(r['loops'])}{mark}"
                     + (f"  ({r['note']})" if r["note"] else ""))
    lines += [f"not compiled: {why}" for why in report.get("refused", [])]
    if report["slot_dependence"]:
        lines += ["", "decode bytes vs cache slots at the same live length (0 passes = cost follows live bytes only):"]
        for key, dep in report["slot_dependence"].items():
            lines.append(f"  {key}: {_si(dep['bytes'][0], 'B')} at {dep['slots'][0]} slots, {_si(dep['bytes'][1], 'B')} "
                         f"at {dep['slots'][1]} -> {_si(dep['bytes_per_extra_slot'], 'B')} per extra slot = "
                         f"{dep['whole_cache_passes']:.2f} whole-cache passes per step; real loop: "
                         f"{_si(dep['loop_bytes'][0], 'B')} -> {_si(dep['loop_bytes'][1], 'B')} = "
                         f"{dep['loop_whole_cache_passes']:.2f} passes, whole-cache copies in its body "
                         f"{dep['loop_cache_copies'][0]} / {dep['loop_cache_copies'][1]}")
    if charged := [r for r in report["rows"] if r["charged_detail"]]:
        lines += ["", "decode bytes as the program runs: XLA's, less what it charges for work not done, plus the "
                      "cuBLAS calls it does not cost (_xla_charges.py):"]
        lines += [f"  {r['model']} {r['target']} {r['shape']}: {_si(r['xla_bytes'], 'B')} - "
                  f"{_si(r['charged_not_run'], 'B')} + {_si(r['uncosted_gemms'], 'B')} ({r['charged_detail']}) = "
                  f"{_si(r['xla_bytes'] - r['charged_not_run'] + r['uncosted_gemms'], 'B')} = "
                  f"{r['bytes_ratio_run']:.2f}x ideal" for r in charged]
    if added := [r for r in report["rows"] if r.get("loop_trips_added")]:
        lines += ["", "loops whose other trips are added to XLA's figures (its analysis costs a body once; decode: per token):"]
        lines += [f"  {r['model']} {r['target']} {r['program']} {r['shape']}: " + "; ".join(r["loop_trips_added"])
                  for r in added]
    lines += hbm_lines(report["rows"])
    sources = sorted({r["cost_source"] for r in report["rows"]})
    lines += ["", "x = XLA / ideal. ms@peak = max(flops/peak, bytes/bandwidth) of XLA's numbers; ideal ms the same of "
              "the ideal.", "loops = while loops left in the optimised HLO (see --json); CPU/GPU: known trip counts are added, above.",
              "NOT EXACT = a loop body XLA counts once runs other than once, or custom-call kernels are not costed: see the note.",
              *(f"costs: {s}" for s in sources)]
    if report.get("show_ops"):
        for r in report["rows"]:
            lines += ["", f"largest ops, {r['model']} {r['target']} {r['program']} {r['shape']}:"]
            lines += [f"  {_si(op['bytes'], 'B'):>10} {op['opcode']:<22}{op['shape']:<28}{op['name']} [{op['op_name']}]"
                      for op in r["largest_ops"]]
    return "\n".join(lines)
