#!/usr/bin/env bash
# Issue 58's two H200 runs in one background job, the fp8 one first (the done-when's headline):
# 1. `--allow fp8`, 3 trials, a gate of 3 interleaved repeats on the held-out window: does the
#    exported config carry >= 1.5x the defaults' capacity? (RUN_DIR/fp8)
# 2. the default space, 2 trials and a gate of 1 repeat: does any trial run a clamped config?
#    (RUN_DIR/default; the space must contain vLLM's resolved 1024 seqs / 8192 batched tokens)
# Run from a copy of the checkout outside the one the device tool re-sends.
# Usage: issue58-h200.sh KIT_DIR RUN_DIR   (then: bash scripts/gpu/poll.sh RUN_DIR SECONDS)
set -uo pipefail
kit=${1:?kit dir}; run=${2:?run dir}
mkdir -p "$run/fp8" "$run/default"
{
  date -u +"fp8 run start %FT%TZ"
  DETACH=0 bash scripts/gpu/conv-fp8-h200.sh "$kit" "$run/fp8"
  date -u +"fp8 run end %FT%TZ"
  cp "$run/fp8/traffic.jsonl" "$run/default/traffic.jsonl"
  ALLOW="" TRIALS=${DEFAULT_TRIALS:-2} REPEATS=1 STUDY=h200-conv-default DETACH=0 \
    bash scripts/gpu/conv-fp8-h200.sh "$kit" "$run/default"
  date -u +"default run end %FT%TZ"
} >> "$run/session.log" 2>&1
