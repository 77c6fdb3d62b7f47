"""Timing shared by the benchmark scripts: one untimed call (compilation, caches), then the median."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``repeats`` calls of ``fn`` after one warm-up call.

    The median, not the mean: on a shared machine single calls are delayed by other load,
    and the median ignores those without hiding a consistently slower implementation.
    """
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
