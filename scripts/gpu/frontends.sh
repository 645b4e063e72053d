#!/usr/bin/env bash
# Issue 17, item 4 on a lent machine, in one background job: translation traffic, then
# benchmarks/frontend_capacity.py (the capacity ladder for in-process AsyncLLM, our server and
# `vllm serve` at 1 and N front-end processes) for one model shape. Run from a copy of the
# checkout outside the one the device tool re-sends; results land in RUN_DIR/results/.
# Usage: MODEL=qwen2-1.5b-shape COLUMNS=in_process,ours:1,ours:4,vllm:1,vllm:4 [CLIENT_CPUS=auto|off|12-15] [SUFFIX=-split] [ROUNDS=2] \
#          frontends.sh KIT_DIR RUN_DIR   (then: bash scripts/gpu/poll.sh RUN_DIR SECONDS)
# Start it in the background and poll in the SAME device call: a lent machine goes back 30 s
# after a call returns, and a run launched by a call that returned before its first poll was lost.
# A column may change engine arguments, compared with the first column round by round:
#   COLUMNS=ours:1,ours:1+max_cudagraph_capture_size=1024,ours:1+max_num_batched_tokens=512 ROUNDS=2
# Several ladders per launch (issue 18: the spread within a launch against that between them),
# on the long-prompt traffic (RUN_DIR/traffic.jsonl made first by traffic-8b.sh):
#   MODEL=llama3.1-8b-shape MAX_MODEL_LEN=8192 WINDOW_S=60 STEP_REQUESTS=120 LADDERS=4 ROUNDS=2
#   START_SPEEDUP=0.917 COLUMNS=ours:1+max_num_seqs=1024+max_num_batched_tokens=1024
# The wait between steps, gauges alone against an idle probe too, ladder by ladder in one launch:
#   COLUMNS=vllm:1,ours:1 LADDERS=4 SETTLE=alternate START_SPEEDUP=5
set -euo pipefail
kit=${1:?kit dir}; run=${2:?run dir}
model=${MODEL:-qwen2-1.5b-shape}
source scripts/gpu/env.sh
mkdir -p "$run"
{
  [ -f "$run/traffic.jsonl" ] || python3 -m autotune generate "$run/traffic.jsonl" \
    --duration-s 120 --rate "${RATE:-100}" --seed 7
  cmd=(python3 benchmarks/frontend_capacity.py --trace "$run/traffic.jsonl"
    --model "$kit/models/$model" --max-model-len "${MAX_MODEL_LEN:-4096}"
    --columns "${COLUMNS:-in_process,ours:1,ours:4,vllm:1,vllm:4}" --window-s "${WINDOW_S:-30}"
    --slo ttft_p95_ms=500 --slo tpot_p95_ms=50 --client-cpus "${CLIENT_CPUS:-auto}" --rounds "${ROUNDS:-1}"
    ${LADDERS:+--ladders "$LADDERS"} ${START_SPEEDUP:+--start-speedup "$START_SPEEDUP"}
    ${STEP_REQUESTS:+--step-requests "$STEP_REQUESTS"} ${SETTLE:+--settle "$SETTLE"} --name "frontends-$model${SUFFIX:-}")
  printf '%q ' "${cmd[@]}" > "$run/command-$model.txt"; echo >> "$run/command-$model.txt"
  "${cmd[@]}"
  mkdir -p "$run/results" && cp -r results/benchmarks/frontends-"$model${SUFFIX:-}"* "$run/results/"
} >> "$run/frontends-$model.log" 2>&1
