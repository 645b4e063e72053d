#!/usr/bin/env bash
# Scenario 2 of the GPU headline, second objective: the smallest gpu_memory_utilization at which
# the Llama-3.1-8B shape (dummy weights) still meets TTFT p95 500 ms and TPOT p95 50 ms on the
# Azure 2023 conversation trace at 1.5x its recorded rate (--objective min-memory --headroom
# 1.5: one load step per launch), for several models sharing one GPU. The same run as
# shared-8b.sh (traffic, baseline at the 0.3 share, space, hand-tuned beside it; COMPARE= leaves
# it out) with this objective. Background (setsid) and restartable (add --resume).
# Usage: min-memory-8b.sh KIT_DIR RUN_DIR [extra autotune run flags, e.g. --resume]
set -euo pipefail
OBJECTIVE="--objective min-memory --headroom ${HEADROOM:-1.5}" STUDY=h100-llama8b-min-memory \
  STEP_REQUESTS=${STEP_REQUESTS:-200} TRIALS=${TRIALS:-5} exec bash "$(dirname "$0")/shared-8b.sh" "$@"
