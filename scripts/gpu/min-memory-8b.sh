#!/usr/bin/env bash
# Scenario 2 of the GPU headline, second objective: the smallest gpu_memory_utilization at which
# the Llama-3.1-8B shape (dummy weights) still meets TTFT p95 500 ms and TPOT p95 50 ms on the
# Azure 2023 conversation trace at 1.5x its recorded rate (--objective min-memory --headroom
# 1.5: one load step per launch), for several models sharing one GPU. Baseline: vLLM's defaults
# at the reference user's 0.3 share; the hand-tuned config (16 / 8192 / 0.3) beside it (COMPARE= leaves it out).
# Background (setsid) and restartable like shared-8b.sh (add --resume).
# Usage: min-memory-8b.sh KIT_DIR RUN_DIR [extra autotune run flags, e.g. --resume]
set -euo pipefail
kit=${1:?kit dir}; run=${2:?run dir}; shift 2
source scripts/gpu/env.sh
mkdir -p "$run"
[ -f "$run/traffic.jsonl" ] || python3 -m autotune convert --from azure "$kit/azure_conv_2023.csv" "$run/traffic.jsonl"
cmd=(python3 -m autotune run --workload "$run/traffic.jsonl" --over-context drop
  --model "$kit/models/llama3.1-8b-shape" --load-format dummy --max-model-len 8192
  --baseline scripts/gpu/baseline-shared.yaml --space scripts/gpu/space-8b-shared.yaml
  ${COMPARE---compare scripts/gpu/handtuned.yaml}
  --slo ttft_p95_ms=500 --slo tpot_p95_ms=50 --objective min-memory --headroom ${HEADROOM:-1.5}
  --step-requests ${STEP_REQUESTS:-200}
  --trials ${TRIALS:-5} --tuning-window 60 --holdout-window 60 --top-k 1 --repeats ${REPEATS:-3}
  --study-name h100-llama8b-min-memory --output-dir "$run/study" --seed 0 "$@")
printf '%q ' "${cmd[@]}" > "$run/command.txt"; echo >> "$run/command.txt"
setsid nohup "${cmd[@]}" >> "$run/study.log" 2>&1 < /dev/null &
echo "started: $(cat "$run/command.txt")"
