#!/usr/bin/env bash
# FP8 smoke check (issue 58): the one engine `autotune run --allow fp8` can propose that the
# default space cannot, started through our own install path. Our server (`python -m server`)
# with `quantization: fp8` (weights quantized to FP8 at load) and `kv-cache-dtype: fp8` on the
# Llama-3.1-8B shape, dummy weights, then one completion request. vLLM's fp8 path imports
# loguru through compressed-tensors: the imports are checked first, so a kit that lacks one
# says which in one line instead of a server log. Needs a GPU of compute capability >= 8.9.
# Usage: fp8-smoke.sh KIT_DIR OUT_DIR   (KIT_DIR holds models/llama3.1-8b-shape, e.g. shared/gpu)
# Exit: 0 served one request; 1 the server died or the request failed; 3 a module is missing.
set -euo pipefail
kit=${1:?kit dir}; out=${2:?out dir}
source scripts/gpu/env.sh
mkdir -p "$out"
port=${PORT:-8101}
python3 - <<'PY' || exit 3
import importlib, sys
import torch
missing = []
for name in ("vllm", "compressed_tensors", "loguru"):
    try:
        importlib.import_module(name)
    except ImportError as error:
        missing.append(f"{name} ({error})")
if missing:
    sys.exit("fp8 smoke: missing module(s): " + "; ".join(missing) + " - add to the GPU install")
major, minor = torch.cuda.get_device_capability(0)
print(f"fp8 smoke: {torch.cuda.get_device_name(0)}, compute capability {major}.{minor}")
if (major, minor) < (8, 9):
    sys.exit("fp8 smoke: FP8 needs compute capability 8.9 or newer")
PY
cat > "$out/fp8.yaml" <<YAML
model: $kit/models/llama3.1-8b-shape
load-format: dummy
skip-tokenizer-init: true
max-model-len: 8192
quantization: fp8
kv-cache-dtype: fp8
YAML
python3 -m server --config "$out/fp8.yaml" --port "$port" --benchmark-mode > "$out/server.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true; wait $pid 2>/dev/null || true' EXIT
start=$(date +%s)
until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
  if ! kill -0 $pid 2>/dev/null; then
    echo "fp8 smoke: the server died before it was ready:"
    grep -m1 -E "No module named|ModuleNotFoundError" "$out/server.log" || true
    tail -40 "$out/server.log"
    exit 1
  fi
  (( $(date +%s) - start < ${READY_TIMEOUT_S:-600} )) || { echo "fp8 smoke: not ready after ${READY_TIMEOUT_S:-600} s"; tail -40 "$out/server.log"; exit 1; }
  sleep 1
done
echo "fp8 smoke: ready after $(( $(date +%s) - start )) s"
grep -m3 -iE "fp8|quantiz" "$out/server.log" || true
curl -sf "http://127.0.0.1:$port/v1/completions" -H 'content-type: application/json' \
  -d '{"prompt": [128000, 9906, 11, 1917, 0], "max_tokens": 16, "ignore_eos": true}' \
  | tee "$out/response.json" | python3 -c "import json, sys; r = json.load(sys.stdin); print('fp8 smoke: one request served,', r['usage'])"
