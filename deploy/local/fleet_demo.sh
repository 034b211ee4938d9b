#!/usr/bin/env bash
# make fleet-demo: a router, 2 rollout workers and 2 trainer processes on this machine, each started by
# the entry point the cluster recipes use (`mis-jax launch --role ...`; docs/guides/fleet.md).
set -euo pipefail
PY=${PY:-.venv/bin/python}
RUN=${RUN:-runs/fleet-demo-$(date +%Y%m%d-%H%M%S)}
ROUTER_PORT=${ROUTER_PORT:-30080}
COORD_PORT=${COORD_PORT:-30090}
STEPS=${STEPS:-10}
export MIS_JAX_ROUTER=http://127.0.0.1:$ROUTER_PORT
mkdir -p "$RUN"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM
# The workers serve the trainer's starting weights (the demo's preset, as `mis-jax train` writes them).
$PY -m trainers.cli init-model --preset tiny-qwen3 --out "$RUN/init" --seed 0 > /dev/null
$PY -m trainers.cli launch --role router --port "$ROUTER_PORT" > "$RUN/router.log" 2>&1 & pids+=($!)
for i in 0 1; do
  $PY -m trainers.cli launch --role worker --model-path "$RUN/init" --dtype float32 > "$RUN/worker$i.log" 2>&1 & pids+=($!)
done
for i in 0 1; do
  until grep -q registered "$RUN/worker$i.log" 2>/dev/null; do sleep 1; done
done
echo "router $MIS_JAX_ROUTER with 2 workers; logs in $RUN"
trainers=()
for i in 0 1; do
  JAX_COORDINATOR_ADDRESS=127.0.0.1:$COORD_PORT JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=$i \
    $PY -m trainers.cli launch --role trainer -- --config configs/demo.yaml --run-dir "$RUN/train" \
    --steps "$STEPS" --no-progress --set rollout.placement.server_dtype=float32 > "$RUN/trainer$i.log" 2>&1 &
  trainers+=($!)
done
status=0
for p in "${trainers[@]}"; do wait "$p" || status=$?; done
tail -n 20 "$RUN/trainer0.log"
exit $status
