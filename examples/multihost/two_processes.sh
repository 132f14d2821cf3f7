#!/usr/bin/env bash
# Two processes on one machine, one model over the devices of both.
#
# On CPU each process gets 2 fake devices (4 in all; collectives through gloo); on a machine
# with GPUs, set LOCAL_DEVICES_0 / LOCAL_DEVICES_1 to the GPUs of each process instead
# (e.g. "0,1" and "2,3"). Process 0 serves on 127.0.0.1:8000; process 1 follows and exits
# when process 0 does. Ctrl-C stops both.
#
#   examples/multihost/two_processes.sh [MODEL] [extra jaxllm serve flags...]
set -euo pipefail
MODEL=${1:-tiny-moe}
shift || true
PORT=${COORDINATOR_PORT:-12355}
COMMON=(--coordinator-address "127.0.0.1:${PORT}" --num-processes 2)

if [[ -n "${LOCAL_DEVICES_0:-}" ]]; then
  DEV0=(--local-device-ids "$LOCAL_DEVICES_0"); DEV1=(--local-device-ids "$LOCAL_DEVICES_1")
  TP=$(( $(tr ',' '\n' <<<"$LOCAL_DEVICES_0" | wc -l) + $(tr ',' '\n' <<<"$LOCAL_DEVICES_1" | wc -l) ))
else
  export JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=2
  DEV0=(); DEV1=(); TP=4
fi

jaxllm worker "${COMMON[@]}" --process-id 1 "${DEV1[@]}" &
WORKER=$!
trap 'kill $WORKER 2>/dev/null || true' EXIT
jaxllm serve --model "$MODEL" --tp-size "$TP" "${COMMON[@]}" --process-id 0 "${DEV0[@]}" "$@"
wait $WORKER
