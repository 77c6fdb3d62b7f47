#!/usr/bin/env bash
# Train on a Cloud TPU VM pod slice: the same command on every worker, from this machine.
#
#   launch/tpu_pod.sh --tpu NAME --zone ZONE [--project P] --workdir gs://BUCKET/run
#                     [--config configs/qwen3b.py] [--retriever-url URL] [--repo-dir DIR]
#                     [--dry-run] [-- --config.mesh.shape='(1,-1,1)' ...]
#
# Each worker runs `python -m llds_jax.main` with LLDS_DISTRIBUTED=auto, so the processes join
# through jax.distributed's Cloud TPU detection (no Pathways). The workdir must be shared
# storage (gs://): every host writes its shards of each checkpoint there. Without
# --retriever-url the retrieval service is started on worker 0 (CPU) and the workers reach
# it at worker 0's internal IP. After a preemption run the same command again: it resumes
# from the newest checkpoint (config.resume=auto).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=launch/_common.sh
source launch/_common.sh

TPU="" ZONE="" PROJECT="" WORKDIR="" CONFIG=configs/qwen3b.py RETRIEVER_URL=""
# shellcheck disable=SC2088  # the tilde is expanded by each worker's shell, not here
RETRIEVER_CONFIG=configs/retriever.py PORT=8000 REPO_DIR='~/llds_jax'
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --tpu) need_value "$@"; TPU=$2; shift 2 ;;
    --zone) need_value "$@"; ZONE=$2; shift 2 ;;
    --project) need_value "$@"; PROJECT=$2; shift 2 ;;
    --workdir) need_value "$@"; WORKDIR=$2; shift 2 ;;
    --config) need_value "$@"; CONFIG=$2; shift 2 ;;
    --retriever-url) need_value "$@"; RETRIEVER_URL=$2; shift 2 ;;
    --retriever-config) need_value "$@"; RETRIEVER_CONFIG=$2; shift 2 ;;
    --port) need_value "$@"; PORT=$2; shift 2 ;;
    --repo-dir) need_value "$@"; REPO_DIR=$2; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done
[ -n "$TPU" ] || die "--tpu NAME is required"
[ -n "$ZONE" ] || die "--zone ZONE is required"
[ -n "$WORKDIR" ] || die "--workdir is required (gs://... shared by every worker)"
[[ "$WORKDIR" == gs://* ]] || echo "warning: --workdir $WORKDIR is not gs://; every worker must see the same files" >&2
[ -f "$CONFIG" ] || die "--config $CONFIG: no such file"

GCLOUD=(gcloud compute tpus tpu-vm)
SCOPE=(--zone "$ZONE")
[ -z "$PROJECT" ] || SCOPE+=(--project "$PROJECT")

if [ -z "$RETRIEVER_URL" ]; then
  if [ "$DRY_RUN" = 1 ]; then
    WORKER0_IP="<worker0-internal-ip>"
    run "${GCLOUD[@]}" describe "$TPU" "${SCOPE[@]}" --format='value(networkEndpoints[0].ipAddress)'
  else
    WORKER0_IP=$(run "${GCLOUD[@]}" describe "$TPU" "${SCOPE[@]}" \
      --format='value(networkEndpoints[0].ipAddress)' | tail -n 1)
  fi
  SERVE="cd $REPO_DIR && mkdir -p logs && (JAX_PLATFORMS=cpu nohup .venv/bin/python -m llds_jax.main --mode=serve"
  SERVE+=" --config=$RETRIEVER_CONFIG --config.retrieval.host=0.0.0.0 --config.retrieval.port=$PORT"
  SERVE+=" > logs/retriever.log 2>&1 &)"
  run "${GCLOUD[@]}" ssh "$TPU" "${SCOPE[@]}" --worker=0 --command="$SERVE"
  RETRIEVER_URL="http://${WORKER0_IP}:${PORT}"
  WAIT="for i in \$(seq 600); do curl -sf $RETRIEVER_URL/health >/dev/null && exit 0; sleep 1; done; exit 1"
  run "${GCLOUD[@]}" ssh "$TPU" "${SCOPE[@]}" --worker=0 --command="$WAIT"
fi

TRAIN="cd $REPO_DIR && LLDS_DISTRIBUTED=auto .venv/bin/python -m llds_jax.main --config=$CONFIG"
TRAIN+=" --config.workdir=$WORKDIR --config.retrieval.url=$RETRIEVER_URL"
for arg in "${EXTRA[@]}"; do TRAIN+=" $(printf '%q' "$arg")"; done
run "${GCLOUD[@]}" ssh "$TPU" "${SCOPE[@]}" --worker=all --command="$TRAIN"
