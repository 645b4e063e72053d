#!/usr/bin/env bash
# Issue 58 on an H200: the Llama-3.1-8B shape (dummy weights) on the Azure 2023 conversation
# trace with its recorded arrivals, SLOs TTFT p95 1000 ms and TPOT p95 25 ms, objective capacity,
# vLLM's defaults as the baseline, the default space (it contains the defaults: 1024 sequences,
# 8192 batched tokens, 0.92) and the fp8 opt-in (--allow fp8: quantization and kv_cache_dtype).
# Measured by hand before: defaults 20.5 req/s, fp8 28.9, fp8 + 1024 batched tokens 36.2.
# Requests over the 8192-token context are dropped. Background (setsid), restartable with --resume.
# Usage: fp8-8b.sh KIT_DIR CONV_CSV RUN_DIR [extra autotune run flags, e.g. --resume]
#   KIT_DIR holds models/llama3.1-8b-shape (e.g. shared/gpu); CONV_CSV the Azure 2023
#   conversation CSV (e.g. shared/traces/azure_conv_2023.csv)
# (env TRIALS, REPEATS, TOP_K, STUDY)
set -euo pipefail
kit=${1:?kit dir}; csv=${2:?conversation csv}; run=${3:?run dir}; shift 3
source scripts/gpu/env.sh
mkdir -p "$run"
[ -f "$run/traffic.jsonl" ] || python3 -m autotune convert --from azure "$csv" "$run/traffic.jsonl"
cmd=(python3 -m autotune run --workload "$run/traffic.jsonl" --over-context drop
  --model "$kit/models/llama3.1-8b-shape" --load-format dummy --max-model-len 8192
  --allow fp8
  --slo ttft_p95_ms=1000 --slo tpot_p95_ms=25 --objective capacity
  --trials ${TRIALS:-8} --tuning-window 60 --holdout-window 60 --top-k ${TOP_K:-1} --repeats ${REPEATS:-3}
  --study-name ${STUDY:-h200-llama8b-conv-fp8} --output-dir "$run/study" --seed 0 "$@")
printf '%q ' "${cmd[@]}" > "$run/command.txt"; echo >> "$run/command.txt"
setsid nohup "${cmd[@]}" >> "$run/study.log" 2>&1 < /dev/null &
echo "started: $(cat "$run/command.txt")"
