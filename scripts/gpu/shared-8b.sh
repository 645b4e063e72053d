#!/usr/bin/env bash
# Scenario 2 of the GPU headline (shared GPU): the Llama-3.1-8B shape (dummy weights) capped at
# gpu_memory_utilization 0.3, on the Azure 2023 conversation trace with its recorded arrivals
# (5.5 req/s mean; prompts p50 1k tokens, answers p50 129), SLOs TTFT p95 500 ms and TPOT p95
# 50 ms, objective capacity; the baseline is vLLM's defaults at 0.3, the reference user's
# hand-tuned config (16 / 8192 / 0.3) measured beside it. Requests over the 8192-token context
# are dropped (--over-context drop). Background (setsid) and restartable like capacity-8b.sh.
# Usage: shared-8b.sh KIT_DIR RUN_DIR [extra autotune run flags, e.g. --resume]
# (env OBJECTIVE, STUDY, COMPARE, TRIALS, REPEATS, STEP_REQUESTS: min-memory-8b.sh sets them)
set -euo pipefail
kit=${1:?kit dir}; run=${2:?run dir}; shift 2
source scripts/gpu/env.sh
mkdir -p "$run"
[ -f "$run/traffic.jsonl" ] || python3 -m autotune convert --from azure "$kit/azure_conv_2023.csv" "$run/traffic.jsonl"
cmd=(python3 -m autotune run --workload "$run/traffic.jsonl" --over-context drop
  --model "$kit/models/llama3.1-8b-shape" --load-format dummy --max-model-len 8192
  --baseline scripts/gpu/baseline-shared.yaml --space scripts/gpu/space-8b-shared.yaml
  ${COMPARE---compare scripts/gpu/handtuned.yaml}
  --slo ttft_p95_ms=500 --slo tpot_p95_ms=50 ${OBJECTIVE:---objective capacity} --step-requests ${STEP_REQUESTS:-200}
  --trials ${TRIALS:-4} --tuning-window 60 --holdout-window 60 --top-k 1 --repeats ${REPEATS:-3}
  --study-name ${STUDY:-h100-llama8b-shared} --output-dir "$run/study" --seed 0 "$@")
printf '%q ' "${cmd[@]}" > "$run/command.txt"; echo >> "$run/command.txt"
setsid nohup "${cmd[@]}" >> "$run/study.log" 2>&1 < /dev/null &
echo "started: $(cat "$run/command.txt")"
