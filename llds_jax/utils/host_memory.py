"""Keep freed host memory mapped in a CPU run, so XLA:CPU's per-execution buffers are not faulted in anew every step.

Why: XLA:CPU allocates each execution's temporary buffer with ``malloc`` and frees it when the
execution ends (1.9 GB for SmolLM2-135M's update step). glibc serves an allocation that large
with ``mmap`` — a worker thread's arena always does, whatever ``M_MMAP_MAX`` says — and unmaps
it on ``free``, so every step touches every page of its temporaries afresh: ~470 k page faults
and ~1.5–2 s of kernel time per SmolLM2 update on a 2-core VM (BUILD_NOTES, "Host memory").
One arena, no ``mmap`` and no trimming keep those pages mapped from one step to the next, which
is what tcmalloc does by default (JAX deployments such as MaxText preload it; this needs no
extra library). The price: the process's resident memory stays at its peak.

It must run before XLA starts its threads (a thread keeps the arena it was given), so the
entry point calls it first thing. It applies to CPU runs only (``JAX_PLATFORMS`` naming ``cpu``
first, as ``launch/cpu_smoke.sh`` sets): an accelerator's buffers are not host ``malloc``.
``LLDS_JAX_KEEP_HOST_MEMORY=1`` / ``=0`` forces it on or off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

from llds_jax.errors import InputError

ENV = "LLDS_JAX_KEEP_HOST_MEMORY"
# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_NEVER_TRIM = 2**31 - 1  # mallopt takes an int: the largest threshold it can express


def wanted(environ=os.environ) -> bool:
    """Whether this process should keep its freed memory: ``ENV`` if set, else a CPU run."""
    forced = environ.get(ENV, "").strip().lower()
    if forced in ("1", "true", "yes", "on"):
        return True
    if forced in ("0", "false", "no", "off"):
        return False
    if forced:
        raise InputError(f"environment variable {ENV}={environ[ENV]!r}: expected 1 or 0")
    platforms = environ.get("JAX_PLATFORMS", "").replace(" ", "").lower()
    return platforms.split(",")[0] == "cpu"


def keep_freed_memory(environ=os.environ) -> bool:
    """Set glibc's malloc to one arena, no mmap, no trimming when :func:`wanted`; True if it did.

    A no-op (False) off glibc (macOS, musl), where ``mallopt`` does not exist.
    """
    if not wanted(environ):
        return False
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False
    return all(mallopt(param, value) == 1 for param, value in (
        (_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _NEVER_TRIM)))
