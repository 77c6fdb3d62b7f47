#!/usr/bin/env bash
# The test command README shows: make/refresh the venv, install with test extras, lint, run the suite.
# Every step runs even when an earlier one fails (a red test step must not hide the numeric one);
# the script exits non-zero if any step failed. At the end it prints the suite's CPU seconds.
#   bash launch/test.sh          every test (what .ci/run runs)
#   bash launch/test.sh --unit   the unit tier only (pytest -m unit, tests/conftest.py) under the second code
#                                generator alone: the loop for a change (the numeric re-run under this host's
#                                default code generator is the full run's)
# Other arguments go to both pytest steps.
set -uo pipefail
cd "$(dirname "$0")/.."
unit="" args=()
for arg in "$@"; do
  if [ "$arg" = --unit ]; then unit="unit and "; else args+=("$arg"); fi
done
set -- "${args[@]}"
set -e
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# plan-tpu / plan-gpu: the compile-only XLA:TPU and XLA:GPU targets, so the plan tests compile for real chips
.venv/bin/python -m pip install -q -e '.[test,plan-tpu,plan-gpu]'
set +e

failed=()
step() {  # step NAME CMD...: run it, remember a failure (pytest's 5 = "nothing collected" is not one)
  local name=$1; shift
  echo "=== $name"
  "$@"; local rc=$?
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then failed+=("$name (exit $rc)"); fi
}

step lint .venv/bin/ruff check llds_jax tests benchmarks tools configs
# No persistent XLA compilation cache: measured in a pair, it cost CPU seconds rather than saving them
# (docs/decisions.md, CI and harness).
cpu=$(mktemp -d)
trap 'rm -rf "$cpu"' EXIT
# Two XLA:CPU code generators (tests/codegen_sensitive.py). Every test, slow ones included, runs once under the
# second: AVX2, 128-bit vectors, one Eigen thread, XLA's element-wise fusion emitters, no LLVM optimisation (the
# processes a test starts too, but the device check's dry run: level 1); it compiles about 4x faster (compiling
# was about 70 % of the suite's time under the default alone). The tests marked codegen_sensitive (numeric
# kernels, reductions, objectives, gradients: results can differ between code generators) run again under this
# host's default, the one a user's CPU run gets; reduction order and rounding differ between the two, so
# tolerances must come from the quantities, not from one CPU's rounding. The few tests that read XLA:CPU's cost
# analysis as a target's model run under the default only (marked default_codegen_only).
mapfile -t codegen < <(.venv/bin/python -c "import tests.codegen_sensitive as t; print(t.SECOND_CODEGEN)")
# CPU seconds: bash's `times` (second line) is the user and system time of this shell's finished children, each
# with the children it waited for: pytest, its xdist workers and the processes the tests start and wait for.
times > "$cpu/start"
# Two workers for two cores, started once. --dist loadscope: a module's tests go to one worker, so a
# module-scoped fixture (a tiny training run, a rollout in three wave sizes, a real-weights load) is built once,
# not once per worker that gets one of its tests. --no-loadscope-reorder: modules run in the order
# tests/conftest.py gives (the ones holding slow tests first, so no long module starts last); --durations=30:
# the slowest tests in the log.
step "tests (second code generator)" env XLA_FLAGS="--xla_force_host_platform_device_count=8 ${codegen[0]}" \
  .venv/bin/python -m pytest -n 2 --dist loadscope --no-loadscope-reorder --durations=30 \
  -m "${unit}not default_codegen_only" "$@"
times > "$cpu/main"
if [ -z "$unit" ]; then  # --unit: the quick loop stops here (about 25 minutes with this step, 6.5 without: decisions.md)
  step "numeric tests (this host's default code generator)" env XLA_FLAGS="--xla_force_host_platform_device_count=8" \
    .venv/bin/python -m pytest -n 2 --dist loadscope --no-loadscope-reorder --durations=10 \
    -m "(codegen_sensitive or default_codegen_only)" "$@"
fi
times > "$cpu/numeric"

seconds() {  # user + system CPU seconds between two `times` readings
  awk 'FNR == 2 { gsub(",", "."); for (i = 1; i <= 2; i++) { split($i, t, /[ms]/); s += (FILENAME == ARGV[1] ? -1 : 1) * (60 * t[1] + t[2]) } }
       END { printf "%.0f", s }' "$cpu/$1" "$cpu/$2"
}
echo "=== CPU: $(seconds start numeric) s user+system for the ${unit:+unit }test steps (second code generator" \
  "$(seconds start main) s, this host's default $(seconds main numeric) s; pytest and every process it waited for)"

if [ "${#failed[@]}" -ne 0 ]; then
  printf 'FAILED step: %s\n' "${failed[@]}"
  exit 1
fi
echo "all test steps passed"
