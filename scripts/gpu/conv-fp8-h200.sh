#!/usr/bin/env bash
# Issue 58's H200 scenario: the Llama-3.1-8B shape (dummy weights) on the Azure 2023
# conversation trace with its recorded arrivals (requests over the 8192-token context
# dropped), SLOs TTFT p95 1000 ms and TPOT p95 25 ms, objective capacity, vLLM's defaults as
# the baseline, the default space with the FP8 opt-in (`--allow fp8`: FP8 weights and KV
# cache). Started in the background (setsid) so it outlives one device call; restartable with
# --resume (the trace is converted again identically).
# Usage: conv-fp8-h200.sh KIT_DIR RUN_DIR [extra autotune run flags]
#   env ALLOW (default "--allow fp8"; "" for the default space), TRIALS, REPEATS, STUDY,
#   DETACH (default 1; 0 runs in the foreground, as issue58-h200.sh does for two runs in a row)
set -euo pipefail
kit=${1:?kit dir}; run=${2:?run dir}; shift 2
source scripts/gpu/env.sh
mkdir -p "$run"
[ -f "$run/traffic.jsonl" ] || python3 -m autotune convert --from azure "$kit/azure_conv_2023.csv" "$run/traffic.jsonl"
cmd=(python3 -m autotune run --workload "$run/traffic.jsonl" --over-context drop
  --model "$kit/models/llama3.1-8b-shape" --load-format dummy --max-model-len 8192
  ${ALLOW---allow fp8}
  --slo ttft_p95_ms=1000 --slo tpot_p95_ms=25 --objective capacity
  --trials ${TRIALS:-3} --tuning-window 60 --holdout-window 60 --top-k 1 --repeats ${REPEATS:-3}
  --study-name ${STUDY:-h200-conv-fp8} --output-dir "$run/study" --seed 0 "$@")
printf '%q ' "${cmd[@]}" > "$run/command.txt"; echo >> "$run/command.txt"
if [ "${DETACH:-1}" = 0 ]; then
  "${cmd[@]}" >> "$run/study.log" 2>&1 < /dev/null || echo "exit $?" >> "$run/study.log"
else
  setsid nohup "${cmd[@]}" >> "$run/study.log" 2>&1 < /dev/null &
  echo "started: $(cat "$run/command.txt")"
fi
