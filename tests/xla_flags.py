"""The XLA flags of every test process and of every process a test starts.

``--xla_backend_optimization_level=0``: XLA:CPU hands LLVM its IR unoptimised. LLVM's passes do not
change IEEE results (XLA:CPU leaves fast-math off, and XLA itself emits the vector code and the order
of every reduction), so what a test checks is the same; the time is not: on this suite's tiny programs
compiling is most of the work, and the level cuts a test module's CPU seconds by ≈ 40 %
(docs/performance.md, CI time). The golden files are written at the default level
(``tests/train/pinned_update.py``) and read at this one, and the numeric second pass of
``launch/test.sh`` runs the ``isa_sensitive`` tests at the default level on another ISA, so the
optimised code generator stays covered where the numbers live.
"""

TEST_CODEGEN = "--xla_backend_optimization_level=0"


def xla_flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a test process: the test code generator, and ``devices`` simulated CPU devices
    (None: XLA's default of one, as a user's process has)."""
    count = "" if devices is None else f"--xla_force_host_platform_device_count={devices} "
    return count + TEST_CODEGEN
