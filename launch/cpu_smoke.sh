#!/usr/bin/env bash
# The default job README shows: install into .venv and run the CPU-sized config end to end.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e .
# A CPU job: skip probing for TPU/GPU runtimes (the test extras install compile-only ones).
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
exec .venv/bin/python -m llds_jax.main --config=configs/cpu_smoke.py "$@"
