#!/usr/bin/env bash
# The H100 headline study, started in the background (setsid) so it outlives one device call.
# Usage: headline.sh MODEL_DIR RUN_DIR ; then poll RUN_DIR/study.log, collect with collect.sh.
set -euo pipefail
model=${1:?model dir}; run=${2:?run dir}
source scripts/gpu/env.sh
mkdir -p "$run"
# Translation traffic at GPU scale: 60 req/s mean with bursts (2.5x) for 5 minutes.
python3 -m autotune generate "$run/translation_gpu.jsonl" --duration-s 300 --rate 60 --seed 7
cmd=(python3 -m autotune run --workload "$run/translation_gpu.jsonl"
  --model "$model" --load-format dummy --max-model-len 4096
  --space scripts/gpu/space-h100.yaml --compare scripts/gpu/handtuned.yaml
  --slo ttft_p95_ms=500 --slo tpot_p95_ms=50
  --trials ${TRIALS:-10} --time-budget ${SEARCH_BUDGET:-11m}
  --tuning-window 20 --holdout-window 20 --top-k 1 --repeats ${REPEATS:-3}
  --study-name h100-qwen2-1.5b --output-dir "$run/study" --seed 0)
printf '%q ' "${cmd[@]}" > "$run/command.txt"; echo >> "$run/command.txt"
setsid nohup "${cmd[@]}" > "$run/study.log" 2>&1 < /dev/null &
echo "started: $(cat "$run/command.txt")"
