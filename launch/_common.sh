# shellcheck shell=bash
# Shared by launch/tpu_pod.sh, launch/gpu_node.sh and launch/slurm.sbatch (sourced, not run).
#
# Every command a launcher would execute goes through `run` (or `run_bg`), so `--dry-run`
# prints exactly those commands, one per line, prefixed with "+ ", and executes nothing.
# That is what tests/scale/test_launch.py checks, with `bash -n` for syntax.

DRY_RUN=${DRY_RUN:-0}

die() { echo "error: $*" >&2; exit 2; }

# Quote each argument (single quotes where needed) so a printed command can be pasted back
# into a shell and still reads like what a person would type.
quote_arg() {
  if [[ "$1" =~ ^[A-Za-z0-9_./:=@%+,~-]+$ ]]; then
    printf '%s' "$1"
  else
    printf "'%s'" "${1//\'/\'\\\'\'}"
  fi
}

quote_cmd() {
  local out="" arg
  for arg in "$@"; do out+="$(quote_arg "$arg") "; done
  printf '%s' "${out% }"
}

run() {
  echo "+ $(quote_cmd "$@")"
  [ "$DRY_RUN" = 1 ] || "$@"
}

# run_bg LOGFILE CMD...: start CMD in the background with output to LOGFILE; sets BG_PID.
run_bg() {
  local logfile=$1; shift
  echo "+ $(quote_cmd "$@") > $(quote_arg "$logfile") 2>&1 &"
  BG_PID=0  # read by the sourcing script
  # shellcheck disable=SC2034  # BG_PID is read by the sourcing script
  if [ "$DRY_RUN" != 1 ]; then "$@" >"$logfile" 2>&1 & BG_PID=$!; fi
}

need_value() { [ $# -ge 2 ] && [ -n "$2" ] && [ "${2#--}" = "$2" ] || die "$1 needs a value"; }

# wait_for_retriever URL: poll GET URL/health until it answers (the index may take minutes to load).
wait_for_retriever() {
  local url=$1 tries=${RETRIEVER_WAIT_TRIES:-600}
  echo "+ wait for ${url}/health"
  [ "$DRY_RUN" = 1 ] && return 0
  for _ in $(seq "$tries"); do
    if python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/health', timeout=2)" "$url" 2>/dev/null; then
      return 0
    fi
    sleep 1
  done
  die "retriever at $url did not answer /health after ${tries}s"
}

# with_restarts N CMD...: run CMD; on a non-zero exit run it again, up to N more times.
# The trainer resumes from the newest checkpoint (config.resume=auto), so a crash from a
# flaky retriever or a NaN stop loses at most the steps since the last checkpoint.
with_restarts() {
  local restarts=$1 attempt=0 rc=0; shift
  while :; do
    run "$@" && return 0 || rc=$?
    [ "$DRY_RUN" = 1 ] && return 0
    attempt=$((attempt + 1))
    if [ "$attempt" -gt "$restarts" ]; then
      echo "training exited with $rc after $attempt attempt(s); giving up" >&2
      return "$rc"
    fi
    echo "training exited with $rc; restart $attempt of $restarts (resumes from the last checkpoint)" >&2
    sleep 5
  done
}
