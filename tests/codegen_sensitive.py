"""The two XLA:CPU code generators ``launch/test.sh`` runs the suite under, and the flags a test's child
process gets.

A test whose result can differ between XLA:CPU code generators (numeric kernels, reductions, sampler
arithmetic, objective values and gradients) carries ``@pytest.mark.codegen_sensitive`` (on the test, or
in its module's ``pytestmark``): ``launch/test.sh`` runs it under two, this host's default (the one a
user's CPU run gets) and :data:`SECOND_CODEGEN`, where reduction order and rounding differ, so its
tolerances must come from the quantities and not from one CPU's rounding.

Every other test runs once, under the second code generator, which compiles about 4x faster — but
``@pytest.mark.default_codegen_only`` tests, which read XLA:CPU's cost analysis as a target's model,
run under the default one only. An unmarked test's outcome cannot depend on how XLA:CPU turns a
program into machine code: config and error messages, exit codes, checkpoints, compile counts and
traced-program sizes, HLO layout or loop structure, sharding specs, compile-only TPU/GPU programs (the
same HLO and memory figures under either code generator: ``tests/scale/test_second_codegen.py``),
integer index bookkeeping, the stop-string byte automaton, and results compared with another run under
the same code generator.
"""

import os

# launch/test.sh's second code generator (with 8 simulated devices): another ISA and vector width, one Eigen
# thread, XLA:CPU's element-wise fusion emitters instead of its MLIR ones, and no LLVM optimisation — the
# last two cut compile time (≈ 70 % of the suite under the default alone) about 4× (a tiny update step: 6.4 → 1.6 s).
SECOND_CODEGEN = ("--xla_cpu_max_isa=AVX2 --xla_cpu_prefer_vector_width=128 --xla_cpu_multi_thread_eigen=false "
                  "--xla_cpu_use_fusion_emitters=false --xla_backend_optimization_level=0")


def child_xla_flags(devices: int | None = None, *, min_llvm_level: int | None = None) -> str:
    """XLA_FLAGS for a child process: this process's code generator, with ``devices`` simulated CPU devices
    (None: XLA's default of one, as a user's run has); ``min_llvm_level`` raises an explicit lower LLVM
    optimisation level (the second code generator's 0) to it.

    Children compile as the test process does: in paired runs under the second code generator, level 0 was
    faster for the CLI-mode and fault-recovery children (``--mode=plan`` of the default job most of all) and
    about even for the two-process training ones once they sample without top-p (150 vs 143 CPU-s; with
    top-p 0.95, 209 vs 155: level 0's slow code is the vocabulary-wide sampler); only the device check's dry
    run, which runs each part of the GPU check over Qwen's 151,936-token vocabulary (137 → 115 CPU-s), and the
    mesh-index training run of ``tests/retrieval/test_mesh_training.py`` (70 warm-up steps; 432 → 238) came
    out clearly faster at level 1 (docs/decisions.md, CI and harness).
    """
    prefix = "--xla_backend_optimization_level="
    flags = []
    for flag in os.environ.get("XLA_FLAGS", "").split():
        if flag.startswith("--xla_force_host_platform_device_count="):
            continue
        if min_llvm_level is not None and flag.startswith(prefix) and int(flag[len(prefix):]) < min_llvm_level:
            flag = f"{prefix}{min_llvm_level}"
        flags.append(flag)
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    return " ".join(flags)
