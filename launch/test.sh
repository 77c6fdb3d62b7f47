#!/usr/bin/env bash
# The test command README shows: make/refresh the venv, install with test extras, lint, run the suite.
# Every step runs even when an earlier one fails (a red default step must not hide the slow one);
# the script exits non-zero if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
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
# --dist loadscope: a module's tests go to one worker, so a module-scoped fixture (a tiny training run,
# a rollout in three wave sizes, a real-weights load) is built once, not once per worker that gets one
# of its tests (docs/decisions.md, CI).
step "tests (default)" .venv/bin/python -m pytest -n 2 --dist loadscope -m "not slow" "$@"
step "tests (slow)" .venv/bin/python -m pytest -n 2 --dist loadscope -m slow "$@"
# The numeric tests again under a second XLA:CPU code generator: another ISA and vector width
# (reduction order differs between hosts), single-threaded Eigen. Tolerances must come from the
# quantities, not from one CPU's rounding. The ignored modules compute nothing on XLA (a tokenizer,
# error messages, config validation).
step "numeric tests (AVX2, 128-bit vectors, 1 Eigen thread)" env \
  XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_cpu_max_isa=AVX2 --xla_cpu_prefer_vector_width=128 --xla_cpu_multi_thread_eigen=false" \
  .venv/bin/python -m pytest -n 2 --dist loadscope -m "not slow" tests/rl tests/models tests/parallel tests/train/test_update_step.py \
  tests/train/test_scored_positions.py tests/train/test_apply_update.py tests/sampling \
  --ignore=tests/models/test_gguf_tokenizer.py --ignore=tests/models/test_checkpoint_errors.py \
  --ignore=tests/rl/test_rl_config.py "$@"

if [ "${#failed[@]}" -ne 0 ]; then
  printf 'FAILED step: %s\n' "${failed[@]}"
  exit 1
fi
echo "all test steps passed"
