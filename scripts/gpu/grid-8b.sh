#!/usr/bin/env bash
# The coarse grid of the long-prompt scenario (issue 19, scenario 1; the table issue 18's search
# benchmark replays): every max_num_seqs x max_num_batched_tokens point, plus vLLM's defaults,
# measured once with the capacity ladder on the same tuning window `capacity-8b.sh` searches,
# one engine launch per point. Started in the background (setsid); resumable: run it again
# with the same RUN_DIR and the measured points are kept (RUN_DIR/grid/table.json).
# It is grid-8b-gpus.sh (which uses every GPU of the host at once) with the axes of the 8-point
# grids of 2026-11-23 and 2026-11-25.
# Then: python3 benchmarks/search_efficiency.py replay --table RUN_DIR/grid
# Usage: grid-8b.sh KIT_DIR RUN_DIR   (env SEQS, BATCHED, STEP_REQUESTS)
set -euo pipefail
kit=${1:?kit dir}; run=${2:?run dir}
mkdir -p "$run"
SEQS=${SEQS:-256,512,1024} BATCHED=${BATCHED:-1024,2048,4096,8192} \
  setsid nohup bash scripts/gpu/grid-8b-gpus.sh "$kit" "$run" >> "$run/driver.log" 2>&1 < /dev/null &
echo "started: grid-8b-gpus.sh $kit $run (log: $run/grid.log)"
