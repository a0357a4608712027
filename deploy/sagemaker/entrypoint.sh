#!/usr/bin/env bash
# SageMaker entrypoint: vLLM on 127.0.0.1:8081, Headroom on 0.0.0.0:8080 in front of it.
#
# SageMaker starts the container as `docker run IMAGE serve` and health-checks GET /ping on
# :8080, which Headroom answers. Knobs (environment of the SageMaker model):
#   ENGINE_MODEL                   model id or path (default: /opt/ml/model if it holds files,
#                                  else mistralai/Voxtral-Mini-4B-Realtime-2602)
#   ENGINE_GPU_MEMORY_UTILIZATION  vLLM --gpu-memory-utilization (default 0.90, pinned)
#   ENGINE_MAX_NUM_SEQS            vLLM --max-num-seqs (default: the replica's max_sessions
#                                  in Headroom's settings, so engine batch == admission cap)
#   ENGINE_EXTRA_ARGS              further vLLM arguments, split on whitespace
# Headroom itself reads HEADROOM_CONFIG and HEADROOM_* overrides.
set -Eeuo pipefail

if [[ "${1:-}" == "serve" ]]; then
    shift
fi

CONFIG="${HEADROOM_CONFIG:-/etc/headroom/config.yaml}"
ENGINE_HOST=127.0.0.1
ENGINE_PORT=8081

log() { echo "headroom-sagemaker: $*" >&2; }

export HEADROOM_CONFIG="$CONFIG"
python_bin=/opt/headroom/bin/python
[[ -x "$python_bin" ]] || python_bin=python3

# The cap lives in one place, Headroom's settings (the file plus HEADROOM_* overrides); the
# engine's batch limit follows it. This also fails early, with Headroom's own message, on
# an invalid configuration.
cap="$("$python_bin" -c 'from proxy.settings import load_settings
print(load_settings().pools[0].replicas[0].max_sessions)')"

model="${ENGINE_MODEL:-}"
if [[ -z "$model" ]]; then
    if [[ -d /opt/ml/model && -n "$(ls -A /opt/ml/model 2>/dev/null)" ]]; then
        model=/opt/ml/model
    else
        model=mistralai/Voxtral-Mini-4B-Realtime-2602
    fi
fi
read -r -a extra_args <<< "${ENGINE_EXTRA_ARGS:-}"

engine_pid=""
proxy_pid=""

# Headroom first: on SIGTERM it drains (no new sessions, running ones get drain_timeout_s),
# and the engine must keep serving those sessions until Headroom has exited.
stop_all() {
    if [[ -n "$proxy_pid" ]]; then
        kill -TERM "$proxy_pid" 2>/dev/null || true
        wait "$proxy_pid" 2>/dev/null || true
    fi
    if [[ -n "$engine_pid" ]]; then
        kill -TERM "$engine_pid" 2>/dev/null || true
        wait "$engine_pid" 2>/dev/null || true
    fi
}

trap 'log "SIGTERM: draining Headroom, then stopping vLLM"; stop_all; exit 0' TERM INT

log "starting vLLM ($model) on $ENGINE_HOST:$ENGINE_PORT, --max-num-seqs ${ENGINE_MAX_NUM_SEQS:-$cap}"
vllm serve "$model" \
    --host "$ENGINE_HOST" --port "$ENGINE_PORT" \
    --gpu-memory-utilization "${ENGINE_GPU_MEMORY_UTILIZATION:-0.90}" \
    --max-num-seqs "${ENGINE_MAX_NUM_SEQS:-$cap}" \
    "${extra_args[@]}" "$@" &
engine_pid=$!

log "starting Headroom on :8080 (config $CONFIG)"
headroom serve --config "$CONFIG" &
proxy_pid=$!

# Either process exiting on its own is a failure: stop the other and exit non-zero so that
# SageMaker replaces the container.
set +e
wait -n "$engine_pid" "$proxy_pid"
status=$?
set -e
log "a process exited unexpectedly (status $status); stopping"
stop_all
exit $(( status == 0 ? 1 : status ))
