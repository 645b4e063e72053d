#!/usr/bin/env bash
# Scenario 1 (issue 19) on a lent machine, in one background job: the traffic, the engine's
# saturated throughput on the held-out window (benchmarks/throughput_ceiling.py: the ceiling
# no capacity can pass), then the tuner run with the gate (capacity-8b.sh, hand-tuned config
# compared). Run from a copy of the checkout outside the one the device tool re-sends.
# Usage: scenario1-h200.sh KIT_DIR RUN_DIR   (then: bash scripts/gpu/poll.sh RUN_DIR SECONDS)
set -euo pipefail
kit=${1:?kit dir}; run=${2:?run dir}
source scripts/gpu/env.sh
mkdir -p "$run"
{
  bash scripts/gpu/traffic-8b.sh "$kit" "$run"
  python3 benchmarks/throughput_ceiling.py --trace "$run/traffic.jsonl" \
    --model "$kit/models/llama3.1-8b-shape" --max-model-len 8192 --batched "${CEILING_BATCHED:-8192,2048}" \
    --out "$run/ceiling.json" || echo "ceiling: failed (exit $?)"
  TRIALS=${TRIALS:-3} COMPARE="--compare scripts/gpu/handtuned.yaml" bash scripts/gpu/capacity-8b.sh "$kit" "$run"
} >> "$run/session.log" 2>&1
