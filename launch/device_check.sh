#!/usr/bin/env bash
# The one-GPU check (docs/performance.md, "Device check"): decoder parity against transformers,
# 2 steps of a Qwen2.5-0.5B-shaped job with random weights at the paper's shapes, and the plan's
# prediction of that step, in one table. Needs no network; ≈ 9 min on one H100.
#
#   launch/device_check.sh --tokenizer DIR [--out DIR] [--plan-json FILE] [--skip parity|train] [--with-passes]
#                          [--passes-model SOURCE --passes-prompts N --passes-rows R] [-- CONFIG FLAGS]
#   (--passes-model random:Qwen2.5-3B --passes-prompts 16 --passes-rows 2 --skip parity,decode,train --with-passes:
#    the passes at qwen3b's widths and at what one device of qwen3b's 8xH100 mesh computes, 2 rows a micro-batch,
#    the second shape of the plan's matmul efficiency; ≈ 4 min on one H100 or H200: 69.9 GB planned (16 rows a
#    micro-batch plan 86.6 GB, more than an H100's 80))
#   launch/device_check.sh --dry-run      # tiny model on CPU, ≈ 1 min (the test suite runs it)
#
# On a machine whose image lacks the wheels of launch/device_check_wheels.txt, put them in .whl/
# (that file says how): they are installed into /tmp/site and put on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=launch/_common.sh
source launch/_common.sh

OUT="" TOKENIZER="" DRY=0 ARGS=()
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
while [ $# -gt 0 ]; do
  case "$1" in
    --out) need_value "$@"; OUT=$2; shift 2 ;;
    --tokenizer) need_value "$@"; TOKENIZER=$2; shift 2 ;;
    --plan-json|--skip|--hardware|--train-timeout|--passes-model|--passes-prompts|--passes-rows) need_value "$@"; ARGS+=("$1=$2"); shift 2 ;;
    --dry-run) DRY=1; shift ;;
    --with-passes) ARGS+=("$1"); shift ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    --) shift; ARGS+=("$@"); break ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done
if [ -z "$TOKENIZER" ]; then
  for candidate in ../shared/assets/qwen2_tokenizer .device/qwen2_tokenizer; do
    [ -d "$candidate" ] && TOKENIZER=$candidate && break
  done
fi
[ -n "$TOKENIZER" ] && [ -d "$TOKENIZER" ] || die "--tokenizer: a Qwen2 tokenizer directory is needed (got '${TOKENIZER}')"
TOKENIZER=$(cd "$TOKENIZER" && pwd)

if ls .whl/*.whl >/dev/null 2>&1 && ! "$PYTHON" -c "import ml_collections, bm25s" 2>/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# The plan's USABLE_FRACTION: XLA's default preallocation is 75 % of the GPU.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}

if [ "$DRY" = 1 ]; then
  OUT=${OUT:-$(mktemp -d)}
  exec "$PYTHON" benchmarks/device_check.py --dry-run --out "$OUT" --tokenizer "$TOKENIZER" "${ARGS[@]}"
fi
OUT=${OUT:-runs/device_check_out}
exec "$PYTHON" benchmarks/device_check.py --out "$OUT" --tokenizer "$TOKENIZER" "${ARGS[@]}"
