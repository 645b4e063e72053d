#!/usr/bin/env bash
# The coarse grid of the long-prompt scenario (issue 19, scenario 1; the table issue 18's search
# benchmark replays): every max_num_seqs x max_num_batched_tokens point, plus vLLM's defaults,
# measured once with the capacity ladder on the same tuning window `capacity-8b.sh` searches,
# one engine launch per point. Started in the background (setsid); resumable: run it again
# with the same RUN_DIR and the measured points are kept (RUN_DIR/grid/table.json).
# Then: python3 benchmarks/search_efficiency.py replay --table RUN_DIR/grid
# Usage: grid-8b.sh KIT_DIR RUN_DIR   (env SEQS, BATCHED, STEP_REQUESTS)
set -euo pipefail
kit=${1:?kit dir}; run=${2:?run dir}
source scripts/gpu/env.sh
[ -f "$run/traffic.jsonl" ] || bash scripts/gpu/traffic-8b.sh "$kit" "$run"
cmd=(python3 benchmarks/search_efficiency.py measure --objective capacity --table "$run/grid"
  --trace "$run/traffic.jsonl" --seqs "${SEQS:-256,512,1024}" --batched "${BATCHED:-1024,2048,4096,8192}"
  "--run-arg=--model=$kit/models/llama3.1-8b-shape" --run-arg=--load-format=dummy
  --run-arg=--max-model-len=8192 --run-arg=--slo=ttft_p95_ms=500 --run-arg=--slo=tpot_p95_ms=50
  --run-arg=--tuning-window=60 --run-arg=--holdout-window=60 "--run-arg=--step-requests=${STEP_REQUESTS:-120}")
printf '%q ' "${cmd[@]}" > "$run/grid-command.txt"; echo >> "$run/grid-command.txt"
setsid nohup "${cmd[@]}" >> "$run/grid.log" 2>&1 < /dev/null &
echo "started: $(cat "$run/grid-command.txt")"
