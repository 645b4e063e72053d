#!/usr/bin/env bash
# Scenario 1 of the GPU headline: the Llama-3.1-8B shape (dummy weights) on traffic with the
# lengths of the Azure 2023 code trace, Poisson arrivals at 12 req/s, SLOs TTFT p95 500 ms and
# TPOT p95 50 ms, objective capacity. Started in the background (setsid) so it outlives one
# device call; restartable: a second call with --resume continues the study (the trace is
# rebuilt identically from its seed).
# Usage: capacity-8b.sh KIT_DIR RUN_DIR [extra autotune run flags, e.g. --resume]
set -euo pipefail
kit=${1:?kit dir}; run=${2:?run dir}; shift 2
source scripts/gpu/env.sh
bash scripts/gpu/traffic-8b.sh "$kit" "$run"
cmd=(python3 -m autotune run --workload "$run/traffic.jsonl"
  --model "$kit/models/llama3.1-8b-shape" --load-format dummy --max-model-len 8192
  --space scripts/gpu/space-8b.yaml ${COMPARE:-}
  --slo ttft_p95_ms=500 --slo tpot_p95_ms=50 --objective capacity --step-requests ${STEP_REQUESTS:-200}
  --trials ${TRIALS:-4} --tuning-window 60 --holdout-window 60 --top-k 1 --repeats ${REPEATS:-3}
  --study-name ${STUDY:-h100-llama8b-code} --output-dir "$run/study" --seed 0 "$@")
printf '%q ' "${cmd[@]}" > "$run/command.txt"; echo >> "$run/command.txt"
setsid nohup "${cmd[@]}" >> "$run/study.log" 2>&1 < /dev/null &
echo "started: $(cat "$run/command.txt")"
