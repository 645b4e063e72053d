#!/usr/bin/env bash
# The long-prompt scenario's grid (grid-8b.sh) on every GPU of a multi-GPU host at once: one
# table, a larger grid in the time one GPU measures a few points. The baseline (vLLM's
# defaults) is measured first on GPU 0 alone, since every other point's ladder starts at its
# capacity; then one shard per GPU (search_efficiency.py measure --shard K/N), each with that
# GPU alone (CUDA_VISIBLE_DEVICES), its own equal slice of the CPUs (taskset: the geometry of a
# one-GPU host of 16 CPUs on a 4-GPU host of 64), and its own vLLM compile cache, copied from the
# baseline's so that no shard pays a first compile the one-GPU grid paid once. Resumable: run it
# again with the same RUN_DIR and the measured points are kept; or copy a committed grid folder to
# RUN_DIR/grid (its traffic.jsonl to RUN_DIR) and give larger axes: the table's grid is extended.
# Run it from a copy of the checkout outside the one the device tool re-sends, in the background,
# and poll in the same device call (scripts/gpu/poll.sh RUN_DIR SECONDS).
# Usage: grid-8b-gpus.sh KIT_DIR RUN_DIR   (env SEQS, BATCHED, STEP_REQUESTS, WARM_CACHES)
set -euo pipefail
kit=${1:?kit dir}; run=${2:?run dir}
source scripts/gpu/env.sh
mkdir -p "$run"
[ -f "$run/traffic.jsonl" ] || bash scripts/gpu/traffic-8b.sh "$kit" "$run"
gpus=$(nvidia-smi -L | wc -l)
cpus=$(nproc)
per=$(( cpus / gpus ))
measure=(python3 benchmarks/search_efficiency.py measure --objective capacity
  --trace "$run/traffic.jsonl" --seqs "${SEQS:-128,256,512,1024}" --batched "${BATCHED:-512,1024,2048,4096,8192}"
  "--run-arg=--model=$kit/models/llama3.1-8b-shape" --run-arg=--load-format=dummy
  --run-arg=--max-model-len=8192 --run-arg=--slo=ttft_p95_ms=500 --run-arg=--slo=tpot_p95_ms=50
  --run-arg=--tuning-window=60 --run-arg=--holdout-window=60 "--run-arg=--step-requests=${STEP_REQUESTS:-200}")
printf '%q ' "${measure[@]}" --table "$run/grid" > "$run/grid-command.txt"; echo >> "$run/grid-command.txt"
echo "$gpus GPUs, $cpus CPUs: $per CPUs per shard" | tee -a "$run/grid.log"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv >> "$run/grid.log"
on_gpu() {  # on_gpu K COMMAND...: GPU K alone, the K-th CPU slice, compile cache K
  local k=$1; shift
  CUDA_VISIBLE_DEVICES=$k VLLM_CACHE_ROOT=/root/vllm-cache-$k \
    taskset -c "$(( k * per ))-$(( (k + 1) * per - 1 ))" "$@"
}
baseline_measured=0
if [ -f "$run/grid/table.json" ]; then
  baseline_measured=$(python3 -c 'import sys; from pathlib import Path; from benchmarks.search_table import load_table
print(int(load_table(Path(sys.argv[1])).baseline_point() is not None))' "$run/grid")
fi
if [ "$baseline_measured" = 0 ]; then
  # The baseline, alone, on GPU 0; its compile cache is every shard's.
  on_gpu 0 "${measure[@]}" --table "$run/grid" --max-points 1 >> "$run/grid.log" 2>&1
  for k in $(seq 1 $(( gpus - 1 ))); do
    [ -d "/root/vllm-cache-$k" ] || cp -r /root/vllm-cache-0 "/root/vllm-cache-$k"
  done
  warm=()
else
  # A table measured before (a grid extended on a fresh host): each shard first measures the
  # baseline again into a scratch table of its own. That compiles its cache, as the baseline did
  # for the points measured first, so no new point's cost carries a first compile; and it says
  # whether this host carries the defaults as the table's baseline did.
  # WARM_CACHES=0 skips that (each shard's first point then pays its compiles, as most new
  # configs do anyway: a cache holds what one sequence count and batched-token budget compiled).
  if [ "${WARM_CACHES:-1}" = 1 ]; then
    echo "the baseline is measured: each shard warms its compile cache on it (tables $run/warm-K)" | tee -a "$run/grid.log"
    warm=(1)
  else
    echo "the baseline is measured; WARM_CACHES=0: no warm-up" | tee -a "$run/grid.log"
    warm=()
  fi
fi
pids=()
for k in $(seq 0 $(( gpus - 1 ))); do
  (
    [ ${#warm[@]} = 0 ] || [ -d "/root/vllm-cache-$k" ] || on_gpu "$k" "${measure[@]}" --table "$run/warm-$k" --max-points 1
    on_gpu "$k" "${measure[@]}" --table "$run/grid" --shard "$k/$gpus"
  ) >> "$run/grid-shard$k.log" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
echo "shards done (exit $status)" | tee -a "$run/grid.log"
exit "$status"
