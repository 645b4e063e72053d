#!/usr/bin/env bash
# Scenario 3 of the GPU headline (small model, high rate): the Qwen2-1.5B shape (dummy weights)
# on translation-length traffic generated at 200 req/s with bursts (200.4 req/s mean over 300
# s, seeded), SLOs TTFT p95 500 ms and TPOT p95 50 ms, objective capacity. Our own server's
# single front-end process cannot offer this rate (results/h100-2026-11-23: goodput 85 req/s
# at 105), so each trial runs stock `vllm serve --api-server-count ${API_SERVERS:-4}`
# (--server vllm); the replayer splits the load among worker processes on its own.
# Background (setsid) and restartable like capacity-8b.sh (add --resume).
# Usage: small-1.5b.sh KIT_DIR RUN_DIR [extra autotune run flags, e.g. --resume]
set -euo pipefail
kit=${1:?kit dir}; run=${2:?run dir}; shift 2
source scripts/gpu/env.sh
mkdir -p "$run"
[ -f "$run/traffic.jsonl" ] || python3 -m autotune generate "$run/traffic.jsonl" --duration-s 300 --rate 200 --seed 7
cmd=(python3 -m autotune run --workload "$run/traffic.jsonl" --server vllm --api-server-count "${API_SERVERS:-4}"
  --model "$kit/models/qwen2-1.5b-shape" --load-format dummy --max-model-len 4096
  --space scripts/gpu/space-h100.yaml --compare scripts/gpu/handtuned.yaml
  --slo ttft_p95_ms=500 --slo tpot_p95_ms=50 --objective capacity --step-requests ${STEP_REQUESTS:-1000}
  --trials ${TRIALS:-3} --tuning-window 60 --holdout-window 60 --top-k 1 --repeats ${REPEATS:-3}
  --study-name h100-qwen2-1.5b-vllm-serve --output-dir "$run/study" --seed 0 "$@")
printf '%q ' "${cmd[@]}" > "$run/command.txt"; echo >> "$run/command.txt"
setsid nohup "${cmd[@]}" >> "$run/study.log" 2>&1 < /dev/null &
echo "started: $(cat "$run/command.txt")"
