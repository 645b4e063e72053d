#!/usr/bin/env bash
# The long-prompt scenario's grid (grid-8b.sh) on every GPU of a multi-GPU host at once: one
# table, a larger grid in the time one GPU measures a few points. The baseline (vLLM's
# defaults) is measured first on GPU 0 alone, since every other point's ladder starts at its
# capacity; then one shard per GPU (search_efficiency.py measure --shard K/N), each with that
# GPU alone (CUDA_VISIBLE_DEVICES), its own equal slice of the CPUs (taskset: the geometry of a
# one-GPU host of 16 CPUs on a 4-GPU host of 64), and its own vLLM compile cache, copied from the
# baseline's so that no shard pays a first compile the one-GPU grid paid once. Resumable: run it
# again with the same RUN_DIR and the measured points are kept.
# Run it from a copy of the checkout outside the one the device tool re-sends, in the background,
# and poll in the same device call (scripts/gpu/poll.sh RUN_DIR SECONDS).
# Usage: grid-8b-gpus.sh KIT_DIR RUN_DIR   (env SEQS, BATCHED, STEP_REQUESTS)
set -euo pipefail
kit=${1:?kit dir}; run=${2:?run dir}
source scripts/gpu/env.sh
mkdir -p "$run"
[ -f "$run/traffic.jsonl" ] || bash scripts/gpu/traffic-8b.sh "$kit" "$run"
gpus=$(nvidia-smi -L | wc -l)
cpus=$(nproc)
per=$(( cpus / gpus ))
cmd=(python3 benchmarks/search_efficiency.py measure --objective capacity --table "$run/grid"
  --trace "$run/traffic.jsonl" --seqs "${SEQS:-128,256,512,1024}" --batched "${BATCHED:-512,1024,2048,4096,8192}"
  "--run-arg=--model=$kit/models/llama3.1-8b-shape" --run-arg=--load-format=dummy
  --run-arg=--max-model-len=8192 --run-arg=--slo=ttft_p95_ms=500 --run-arg=--slo=tpot_p95_ms=50
  --run-arg=--tuning-window=60 --run-arg=--holdout-window=60 "--run-arg=--step-requests=${STEP_REQUESTS:-120}")
printf '%q ' "${cmd[@]}" > "$run/grid-command.txt"; echo >> "$run/grid-command.txt"
echo "$gpus GPUs, $cpus CPUs: $per CPUs per shard" | tee -a "$run/grid.log"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv >> "$run/grid.log"
# The baseline, alone, on GPU 0 and the first CPU slice.
CUDA_VISIBLE_DEVICES=0 VLLM_CACHE_ROOT=/root/vllm-cache-0 \
  taskset -c "0-$(( per - 1 ))" "${cmd[@]}" --max-points 1 >> "$run/grid.log" 2>&1
for k in $(seq 1 $(( gpus - 1 ))); do
  [ -d "/root/vllm-cache-$k" ] || cp -r /root/vllm-cache-0 "/root/vllm-cache-$k"
done
pids=()
for k in $(seq 0 $(( gpus - 1 ))); do
  CUDA_VISIBLE_DEVICES=$k VLLM_CACHE_ROOT=/root/vllm-cache-$k \
    taskset -c "$(( k * per ))-$(( (k + 1) * per - 1 ))" "${cmd[@]}" --shard "$k/$gpus" \
    >> "$run/grid-shard$k.log" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
echo "shards done (exit $status)" | tee -a "$run/grid.log"
exit "$status"
