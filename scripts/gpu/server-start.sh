#!/usr/bin/env bash
# A trial server's start on the GPU, forked from a fork server against its own process
# (benchmarks/server_start.py), the Qwen2-1.5B shape with dummy weights.
# Usage: server-start.sh KIT_DIR OUT_DIR [ROUNDS]
set -euo pipefail
kit=${1:?kit dir}; out=${2:?out dir}; rounds=${3:-2}
source scripts/gpu/env.sh
mkdir -p "$out"
cat > "$out/qwen2-1.5b.yaml" <<YAML
model: $kit/models/qwen2-1.5b-shape
load-format: dummy
skip-tokenizer-init: true
max-model-len: 4096
YAML
python3 benchmarks/server_start.py --rounds "$rounds" --config "$out/qwen2-1.5b.yaml" --requests "${REQUESTS:-0}" \
  --name server_start_gpu 2>&1 | tee "$out/server_start_gpu.log"
cp results/benchmarks/server_start_gpu.* "$out/"
