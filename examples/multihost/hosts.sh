#!/usr/bin/env bash
# One model over the GPUs of a plain list of hosts (no scheduler): ssh starts the same command
# on each, with its rank; the first host is process 0 (the coordinator and the server).
#
#   HOSTS="gpu-a gpu-b" GPUS_PER_HOST=8 examples/multihost/hosts.sh [MODEL]
#
# Every host needs jaxllm installed and the model reachable at the same path (or a Hub id /
# preset it can fetch itself). The coordinator port must be open between the hosts.
set -euo pipefail
MODEL=${1:-Qwen/Qwen3-30B-A3B}
read -r -a HOSTS <<<"${HOSTS:?set HOSTS to a space-separated host list, the server first}"
GPUS_PER_HOST=${GPUS_PER_HOST:-8}
PORT=${COORDINATOR_PORT:-12355}
N=${#HOSTS[@]}
COMMON="--coordinator-address ${HOSTS[0]}:${PORT} --num-processes ${N}"

PIDS=()
for (( i = N - 1; i >= 1; i-- )); do
  ssh "${HOSTS[$i]}" "jaxllm worker --model '$MODEL' $COMMON --process-id $i" &
  PIDS+=($!)
done
trap 'kill "${PIDS[@]}" 2>/dev/null || true' EXIT
ssh -t "${HOSTS[0]}" "jaxllm serve --model '$MODEL' --tp-size $(( N * GPUS_PER_HOST )) --host 0.0.0.0 $COMMON --process-id 0"
