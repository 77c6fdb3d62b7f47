#!/usr/bin/env bash
# The test command README shows: make/refresh the venv, install with test extras, lint, run the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# plan-tpu / plan-gpu: the compile-only XLA:TPU and XLA:GPU targets, so the plan tests compile for real chips
.venv/bin/python -m pip install -q -e '.[test,plan-tpu,plan-gpu]'
.venv/bin/ruff check llds_jax tests benchmarks configs
# Default run first, then the slow-marked tests as their own step (both always run).
.venv/bin/python -m pytest -n 2 -m "not slow" "$@"
.venv/bin/python -m pytest -n 2 -m slow "$@" || { rc=$?; [ "$rc" -eq 5 ] || exit "$rc"; }
