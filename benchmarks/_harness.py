"""What every ``benchmarks/bench_*.py`` shares so that its numbers cannot lie.

* A load gate: on a loaded machine the two sides are not slowed equally (torch's OpenMP pool
  suffers far more than XLA's threads), so a comparison measured there is refused (exit 2)
  unless ``--allow-noisy`` is given, and then it is marked NOISY.
* Alternation: the sides run A, B, A, B, ... per repeat, so load that comes and goes during a
  run lands on both sides instead of on whichever ran second.
* Wall *and* CPU time per side (``time.process_time`` covers every thread of this process —
  XLA's and torch's pools — plus reaped child processes), load average at start and end.
* One record: ``--json`` prints exactly one JSON object on stdout (progress goes to stderr);
  otherwise a side-by-side table. The record names the git commit and library versions.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOAD_FRACTION = 0.5  # refuse when the 1-minute load average exceeds this share of the cores
OURS = "llds_jax"
_HARNESS_ARGS = ("json", "allow_noisy", "max_load")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The gate and output flags every bench script takes."""
    cores = os.cpu_count() or 1
    parser.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    parser.add_argument("--allow-noisy", action="store_true",
                        help="run even when the machine is loaded; the output is marked NOISY")
    parser.add_argument("--max-load", type=float, default=LOAD_FRACTION * cores,
                        help=f"refuse when the 1-minute load average at start exceeds this "
                             f"(default {LOAD_FRACTION} x {cores} cores)")


def cpu_seconds() -> float:
    """CPU seconds of this process (all threads) plus its reaped children (e.g. a retrieval server)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def git_commit() -> str | None:
    """HEAD of the checkout the scripts run from, with ``-dirty`` when tracked files differ.

    ``GIT_OPTIONAL_LOCKS=0``: ``git status`` otherwise refreshes the index under ``index.lock``
    and fails while another git process (a commit in the same checkout) holds it, which made
    records come out without a commit. If only the dirty check fails, the head is still kept.
    """
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}
    git = lambda *args: subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True,
                                       env=env).stdout.strip()
    try:
        head = git("rev-parse", "HEAD")
    except (OSError, subprocess.CalledProcessError) as error:
        print(f"warning: no git commit for the record: {error}", file=sys.stderr)
        return None
    try:
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return head + "-unknown-state"
    return head + ("-dirty" if dirty else "")


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"python": platform.python_version()}
    for package in ("jax", "jaxlib", "flax", "torch", "transformers"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    return found


@dataclass
class SideTimes:
    """Wall and CPU seconds of each timed call of one side."""

    wall_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)

    @property
    def median_s(self) -> float:
        return statistics.median(self.wall_s)

    @property
    def median_cpu_s(self) -> float:
        return statistics.median(self.cpu_s)


def alternation_order(sides: list[str], repeats: int) -> list[str]:
    """A, B, A, B, ...: one call of every side per repeat, never all of A before B."""
    return [side for _ in range(repeats) for side in sides]


def alternate(sides: dict[str, Callable[..., object]], repeats: int, warmup: bool = True,
              setup: dict[str, Callable[[], object]] | None = None) -> dict[str, SideTimes]:
    """Time every side ``repeats`` times in alternation, after one untimed call each (compilation, caches).

    ``setup[side]``, when given, runs untimed before each call of that side and its result is the
    call's argument (e.g. a freshly prefilled cache the timed call consumes).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    setup = setup or {}

    def call(name):
        fn = sides[name]
        if name not in setup:
            return fn
        argument = setup[name]()
        return lambda: fn(argument)

    if warmup:
        for name in sides:
            call(name)()
    times = {name: SideTimes() for name in sides}
    for name in alternation_order(list(sides), repeats):
        fn = call(name)
        wall, cpu = time.perf_counter(), cpu_seconds()
        fn()
        times[name].cpu_s.append(cpu_seconds() - cpu)
        times[name].wall_s.append(time.perf_counter() - wall)
    return times


@dataclass
class Session:
    """One benchmark run: gate verdict, settings, measured cases; ``finish`` prints the record."""

    name: str
    settings: dict
    as_json: bool
    max_load: float
    noisy: bool
    load_start: tuple[float, float, float]
    cases: list[dict] = field(default_factory=list)
    results: dict = field(default_factory=dict)  # measurements that are not a side-by-side case

    def log(self, message: str) -> None:
        """Progress lines: stderr under ``--json`` (stdout holds only the object), else stdout."""
        print(message, file=sys.stderr if self.as_json else sys.stdout, flush=True)

    def add_case(self, case: str, times: dict[str, SideTimes], tokens: int | None = None, unit: str = "tokens",
                 **extra) -> dict:
        """Record one comparison; ratios are each other side's median time over ours (> 1: we are faster)."""
        sides = {}
        for side, t in times.items():
            sides[side] = {"median_s": t.median_s, "cpu_s": t.median_cpu_s, "wall_s": t.wall_s, "cpu_s_all": t.cpu_s}
            if tokens is not None:
                sides[side][f"{unit}_per_s"] = tokens / t.median_s
        ratios = {}
        if OURS in times:
            others = {side: t.median_s for side, t in times.items() if side != OURS}
            for side, seconds in others.items():
                ratios[f"{OURS}_speedup_vs_{side}"] = seconds / times[OURS].median_s
            if len(others) > 1:
                best = min(others, key=others.get)
                ratios[f"{OURS}_speedup_vs_best_peer"] = others[best] / times[OURS].median_s
        row = {"case": case, "work": {unit: tokens} if tokens is not None else {}, "sides": sides, "ratios": ratios,
               **extra}
        self.cases.append(row)
        return row

    def record(self) -> dict:
        return {"benchmark": self.name, "settings": self.settings, "cases": self.cases,
                "load_average": {"start": list(self.load_start), "end": list(os.getloadavg())},
                "max_load": self.max_load, "cpu_count": os.cpu_count(), "noisy": self.noisy,
                "git_commit": git_commit(), "versions": versions(), "results": self.results}

    def finish(self) -> dict:
        record = self.record()
        if self.as_json:
            print(json.dumps(record))
        else:
            print(format_table(record))
        return record


def start(name: str, args: argparse.Namespace) -> Session:
    """Check the load gate before anything is loaded or compiled; exit 2 when it refuses."""
    load = os.getloadavg()
    cores = os.cpu_count()
    noisy = load[0] > args.max_load
    if noisy and not args.allow_noisy:
        print(f"error: {name}: 1-minute load average {load[0]:.2f} exceeds the threshold {args.max_load:.2f} "
              f"(--max-load, default {LOAD_FRACTION} x {cores} cores); a comparison measured now would be skewed. "
              f"Wait for a quiet machine, or pass --allow-noisy to run anyway (output marked NOISY).",
              file=sys.stderr)
        raise SystemExit(2)
    settings = {k: v for k, v in vars(args).items() if k not in _HARNESS_ARGS}
    return Session(name, settings, bool(args.json), args.max_load, noisy, load)


def format_table(record: dict) -> str:
    """Side-by-side markdown table: per side median seconds, throughput and CPU seconds, then ratios."""
    lines = []
    if record["noisy"]:
        lines.append(f"NOISY: load average {record['load_average']['start'][0]:.2f} at start exceeded "
                     f"{record['max_load']:.2f}; these numbers are not a comparison.")
    v = record["versions"]
    lines.append(f"{record['benchmark']}: commit {record['git_commit']}, {record['cpu_count']} cores, load average "
                 f"{record['load_average']['start'][0]:.2f} -> {record['load_average']['end'][0]:.2f}; "
                 f"python {v['python']}, jax {v['jax']}, torch {v['torch']}, transformers {v['transformers']}")
    lines.append("settings: " + ", ".join(f"{k}={val}" for k, val in record["settings"].items()))
    for row in record["cases"]:
        lines.append("")
        lines.append(f"{row['case']}" + "".join(f"; {k}={val}" for k, val in row.items()
                                                if k not in ("case", "work", "sides", "ratios")))
        rate = next((f"{unit}_per_s" for unit in row["work"]), None)
        header = ["side", "median s", "cpu s"] + ([rate.replace("_", " ")] if rate else [])
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "---|" * len(header))
        for side, s in row["sides"].items():
            cells = [side, f"{s['median_s']:.4f}", f"{s['cpu_s']:.3f}"] + ([f"{s[rate]:,.1f}"] if rate else [])
            lines.append("| " + " | ".join(cells) + " |")
        for key, ratio in row["ratios"].items():
            lines.append(f"{key}: {ratio:.2f}x")
    return "\n".join(lines)
