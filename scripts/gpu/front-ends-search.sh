#!/usr/bin/env bash
# The front-end count as a searched parameter on stock `vllm serve` (--server vllm): the Qwen2-1.5B
# shape (dummy weights) on translation-length traffic generated at 200 req/s with bursts (as
# small-1.5b.sh), objective capacity, the space scripts/gpu/space-front-ends.yaml (1, 2 or 4 API
# processes). The baseline is vLLM's default (one); each trial's `vllm serve --api-server-count N`
# comes from its config's serving.api_processes. Background (setsid) and restartable (--resume).
# Usage: front-ends-search.sh KIT_DIR RUN_DIR [extra autotune run flags]
set -euo pipefail
kit=${1:?kit dir}; run=${2:?run dir}; shift 2
source scripts/gpu/env.sh
mkdir -p "$run"
[ -f "$run/traffic.jsonl" ] || python3 -m autotune generate "$run/traffic.jsonl" --duration-s 300 --rate 200 --seed 7
cmd=(python3 -m autotune run --workload "$run/traffic.jsonl" --server "${SERVER:-vllm}"
  --model "$kit/models/qwen2-1.5b-shape" --load-format dummy --max-model-len 4096
  --space scripts/gpu/space-front-ends.yaml
  --slo ttft_p95_ms=500 --slo tpot_p95_ms=50 --objective capacity --step-requests ${STEP_REQUESTS:-1000}
  --trials ${TRIALS:-3} --tuning-window 60 --holdout-window 60 --top-k 1 --repeats ${REPEATS:-1}
  --study-name front-ends-search --output-dir "$run/study" --seed 0 "$@")
printf '%q ' "${cmd[@]}" > "$run/command.txt"; echo >> "$run/command.txt"
setsid nohup "${cmd[@]}" >> "$run/study.log" 2>&1 < /dev/null &
echo "started: $(cat "$run/command.txt")"
