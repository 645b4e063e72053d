#!/usr/bin/env bash
# GPU smoke check: our server on vLLM from the offline kit, the Qwen2-1.5B shape with dummy
# weights, a closed-loop replay at concurrency 25. Usage: smoke.sh MODEL_DIR OUT_DIR
set -euo pipefail
model=${1:?model dir}; out=${2:?out dir}
source scripts/gpu/env.sh
mkdir -p "$out"
cat > "$out/smoke.yaml" <<YAML
model: $model
load-format: dummy
skip-tokenizer-init: true
YAML
python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, torch.cuda.get_device_name(0))"
python3 -m server --config "$out/smoke.yaml" --port 8100 --benchmark-mode > "$out/server.log" 2>&1 &
pid=$!
start=$(date +%s)
until curl -sf http://127.0.0.1:8100/health >/dev/null; do
  kill -0 $pid 2>/dev/null || { echo "server died"; tail -40 "$out/server.log"; exit 1; }
  sleep 1
done
echo "ready after $(( $(date +%s) - start )) s"
curl -s http://127.0.0.1:8100/info || true; echo
python3 -m autotune replay --workload workloads/samples/translation_trace.jsonl \
  --url http://127.0.0.1:8100 --mode concurrency=25 --duration 90 --out "$out/replay.jsonl" | tee "$out/replay.txt"
curl -s http://127.0.0.1:8100/metrics | grep -E '^vllm:(kv_cache_usage_perc|gpu_cache_usage_perc|num_requests_running|time_to_first_token_seconds_count)' | head
kill $pid; wait $pid 2>/dev/null || true
