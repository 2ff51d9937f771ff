#!/usr/bin/env bash
# A real Dask deployment on this machine, from the command line: one `dask scheduler`,
# 2 ps and 2 worker processes started with `dtrain worker`, and `dtrain run --scheduler`
# against them. Everything listens on 127.0.0.1 and everything started here is stopped on
# exit (success, failure or Ctrl-C), by process id.
#
#   examples/deploy_local.sh                      # pipelines/digits_async.yaml, 1500 steps
#   STEPS=200 examples/deploy_local.sh            # a quick run
#   PIPELINE=pipelines/digits_sync.yaml RUN_DIR=/tmp/run examples/deploy_local.sh
#
# Environment: PIPELINE, RUN_DIR (default: a fresh temporary directory), STEPS (sets
# training.steps), PYTHON (the interpreter that has dtrain installed; default python3),
# KEEP_LOGS=1 to keep the scheduler's and workers' logs. On several machines, run the same
# commands on different hosts: see docs/deployment.md.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
PYTHON="${PYTHON:-python3}"
PIPELINE="${PIPELINE:-$ROOT/pipelines/digits_async.yaml}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/dtrain-deploy.XXXXXX")"
RUN_DIR="${RUN_DIR:-$WORK/run}"
SCHEDULER_FILE="$WORK/scheduler.json"
PIDS=()          # workers first, the scheduler last: stopped in reverse order
SCHEDULER_PID=""

log() { echo "[deploy_local] $*" >&2; }

stop_pid() {     # SIGTERM, then SIGKILL (the process and its children) after a grace period
    local pid="$1" grace="${2:-30}" kids p i alive
    kill -0 "$pid" 2>/dev/null || return 0
    kids="$(pgrep -P "$pid" || true)"        # a nanny's worker process (it may outlive the nanny briefly)
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < grace * 10; i++)); do
        alive=0
        for p in $pid $kids; do kill -0 "$p" 2>/dev/null && alive=1; done
        [ "$alive" = 0 ] && break
        sleep 0.1
    done
    for p in $pid $kids; do
        if kill -0 "$p" 2>/dev/null; then
            log "process $p did not stop in ${grace} s; SIGKILL"
            kill -KILL "$p" 2>/dev/null || true
        fi
    done
}

cleanup() {
    local code=$?
    trap - EXIT INT TERM
    local pid stoppers=()
    for pid in "${PIDS[@]}"; do stop_pid "$pid" & stoppers+=($!); done   # the workers in parallel
    [ "${#stoppers[@]}" -eq 0 ] || wait "${stoppers[@]}"
    for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done  # reap them
    if [ -n "$SCHEDULER_PID" ]; then stop_pid "$SCHEDULER_PID"; wait "$SCHEDULER_PID" 2>/dev/null || true; fi
    if [ "$code" -ne 0 ]; then
        for f in "$WORK"/*.log; do
            [ -f "$f" ] && { log "--- tail of $f"; tail -n 20 "$f" >&2; }
        done
    fi
    if [ "${KEEP_LOGS:-0}" = 1 ]; then log "logs kept in $WORK"; else rm -rf "$WORK"/*.log "$SCHEDULER_FILE"; fi
    [ "$RUN_DIR" = "$WORK/run" ] || rmdir "$WORK" 2>/dev/null || true
    log "stopped everything (exit $code)"
    exit "$code"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Lower worker-ttl (default 5 minutes) so that a hung worker is dropped in seconds.
export DASK_DISTRIBUTED__SCHEDULER__WORKER_TTL="${DASK_DISTRIBUTED__SCHEDULER__WORKER_TTL:-30s}"

log "starting the scheduler"
"$PYTHON" -m dask scheduler --host 127.0.0.1 --port 0 --no-dashboard \
    --scheduler-file "$SCHEDULER_FILE" >"$WORK/scheduler.log" 2>&1 &
SCHEDULER_PID=$!
for _ in $(seq 300); do
    [ -s "$SCHEDULER_FILE" ] && break
    kill -0 "$SCHEDULER_PID" 2>/dev/null || { log "the scheduler exited"; exit 1; }
    sleep 0.1
done
[ -s "$SCHEDULER_FILE" ] || { log "no scheduler file after 30 s"; exit 1; }
ADDRESS="$("$PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1]))["address"])' "$SCHEDULER_FILE")"
log "scheduler at $ADDRESS"

for task in ps:0 ps:1 worker:0 worker:1; do
    job="${task%%:*}" index="${task##*:}"
    # the same as: dask worker $ADDRESS --name $job-$index --resources $job=1 ...
    "$PYTHON" -m dtrain.cli worker --job "$job" --task "$index" --scheduler "$ADDRESS" \
        --host 127.0.0.1 --nthreads 2 --memory-limit 2GiB >"$WORK/$job-$index.log" 2>&1 &
    PIDS+=($!)
    log "started $job-$index (pid $!)"
done

ARGS=(run "$PIPELINE" --scheduler "$ADDRESS" --run-dir "$RUN_DIR" --quiet --set cluster.wait_s=120)
[ -n "${STEPS:-}" ] && ARGS+=(--set "training.steps=$STEPS")
log "dtrain ${ARGS[*]}"
"$PYTHON" -m dtrain.cli "${ARGS[@]}"
log "summary: $RUN_DIR/summary.json"
