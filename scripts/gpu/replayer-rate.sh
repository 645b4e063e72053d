#!/usr/bin/env bash
# Issue 17's load-generator target on the GPU host's CPUs (16 cores): the highest Poisson rate
# of streamed translation-length requests the replayer sends with send-lag p99 < 2 ms against
# the echo server, in 1, 2, 4 and 8 processes side by side in one run. No GPU needed, so it can
# share a device session with an engine run. Writes results/benchmarks/replayer_rate_gpu_host.*
# into the checkout copy; poll.sh-style: copy them into $OUT afterwards.
# Usage: replayer-rate.sh   (from the checkout copy, after the kit is installed)
set -euo pipefail
source scripts/gpu/env.sh
python3 benchmarks/replayer_rate.py --loop asyncio --workers 1,2,4,8 --rates 250,500,750,1000,1500,2000 \
  --step-seconds 6 --skip-client-cost --name replayer_rate_gpu_host 2>&1 | tee results/benchmarks/replayer_rate_gpu_host.log
if [ -n "${OUT:-}" ]; then cp results/benchmarks/replayer_rate_gpu_host.* "$OUT/"; fi
