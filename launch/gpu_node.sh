#!/usr/bin/env bash
# Train on one multi-GPU node: one process drives every local GPU (no jax.distributed needed).
#
#   launch/gpu_node.sh --config configs/qwen3b.py --workdir runs/qwen3b [--retriever-url URL]
#                      [--max-restarts 3] [--dry-run] [-- --config.train.total_steps=200 ...]
#
# Without --retriever-url the retrieval service (configs/retriever.py) is started here on the
# CPU (JAX_PLATFORMS=cpu, so it takes no GPU memory), waited for, and stopped on exit.
# A failed run (retriever outage, NaN stop) is restarted up to --max-restarts times; each
# restart resumes from the newest checkpoint in --workdir.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=launch/_common.sh
source launch/_common.sh

CONFIG=configs/qwen3b.py WORKDIR="" RETRIEVER_URL="" RETRIEVER_CONFIG=configs/retriever.py
PORT=8000 MAX_RESTARTS=3 PYTHON=${PYTHON:-.venv/bin/python}
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --config) need_value "$@"; CONFIG=$2; shift 2 ;;
    --workdir) need_value "$@"; WORKDIR=$2; shift 2 ;;
    --retriever-url) need_value "$@"; RETRIEVER_URL=$2; shift 2 ;;
    --retriever-config) need_value "$@"; RETRIEVER_CONFIG=$2; shift 2 ;;
    --port) need_value "$@"; PORT=$2; shift 2 ;;
    --max-restarts) need_value "$@"; MAX_RESTARTS=$2; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done
[ -f "$CONFIG" ] || die "--config $CONFIG: no such file"
[[ "$MAX_RESTARTS" =~ ^[0-9]+$ ]] || die "--max-restarts $MAX_RESTARTS: not a number"

if [ -z "$RETRIEVER_URL" ]; then
  RETRIEVER_URL="http://127.0.0.1:${PORT}"
  mkdir -p logs 2>/dev/null || [ "$DRY_RUN" = 1 ]
  run_bg logs/retriever.log env JAX_PLATFORMS=cpu "$PYTHON" -m llds_jax.main --mode=serve \
    --config="$RETRIEVER_CONFIG" --config.retrieval.host=127.0.0.1 --config.retrieval.port="$PORT"
  [ "$BG_PID" = 0 ] || trap 'kill "$BG_PID" 2>/dev/null || true' EXIT
  wait_for_retriever "$RETRIEVER_URL"
fi

TRAIN=("$PYTHON" -m llds_jax.main --config="$CONFIG" --config.retrieval.url="$RETRIEVER_URL")
[ -z "$WORKDIR" ] || TRAIN+=(--config.workdir="$WORKDIR")
with_restarts "$MAX_RESTARTS" "${TRAIN[@]}" "${EXTRA[@]}"
