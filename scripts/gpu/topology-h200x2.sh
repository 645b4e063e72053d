#!/usr/bin/env bash
# Issue 62's GPU done-when on a 2-GPU H200 host: the Llama-3.1-8B shape (dummy weights) on the
# Azure 2023 conversation trace with its recorded arrivals (requests over the 8192-token context
# dropped), SLOs TTFT p95 1000 ms and TPOT p95 25 ms.
#   1. Each topology measured alone with the capacity ladder (`autotune run --trials 1`: the
#      baseline's trial is one launch, one ladder on the tuning window): one GPU, TP=2, DP=2.
#   2. `autotune run` over the topology (scripts/gpu/space-topology.yaml: the three that fit two
#      GPUs, vLLM's defaults otherwise) from one GPU as the baseline, validated on the held-out
#      window (top 2 and the baseline, interleaved repeats): once per objective in OBJECTIVES,
#      `capacity` (what carries most on this host) and `capacity-per-gpu` (what serves most per
#      GPU held).
# It starts itself in the background (setsid) so that it outlives one device call, writing
# RUN_DIR/session.log; run it again with the same RUN_DIR to go on: finished ladders are kept,
# studies resume. Poll with scripts/gpu/poll.sh RUN_DIR SECONDS; RUN_DIR/summary.md at the end.
# Usage: topology-h200x2.sh KIT_DIR RUN_DIR [extra autotune run flags]
#   env OBJECTIVES (default "capacity capacity-per-gpu"), TRIALS (3), REPEATS (3), SERVER
#   (autotune: our server; vllm: stock `vllm serve`)
set -euo pipefail
kit=${1:?kit dir}; run=${2:?run dir}; shift 2
mkdir -p "$run"
if [ -z "${TOPOLOGY_IN_BACKGROUND:-}" ]; then
  TOPOLOGY_IN_BACKGROUND=1 setsid nohup bash "$0" "$kit" "$run" "$@" >> "$run/session.log" 2>&1 < /dev/null &
  echo "started in the background: $run/session.log"
  exit 0
fi
source scripts/gpu/env.sh
gpus=$(nvidia-smi -L | grep -c '^GPU ' || true)
if [ "$gpus" -lt 2 ]; then
  echo "topology-h200x2.sh: this host has $gpus GPU(s); the topologies need 2" >&2
  exit 2
fi
echo "$(date -u +%FT%TZ) $gpus GPUs"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
[ -f "$run/traffic.jsonl" ] || python3 -m autotune convert --from azure "$kit/azure_conv_2023.csv" "$run/traffic.jsonl"
common=(--workload "$run/traffic.jsonl" --over-context drop
  --model "$kit/models/llama3.1-8b-shape" --load-format dummy --max-model-len 8192
  --slo ttft_p95_ms=1000 --slo tpot_p95_ms=25 --tuning-window 60 --holdout-window 60
  --server "${SERVER:-autotune}" --seed 0)

# 1. One ladder per topology, each its own one-trial study.
printf 'tensor_parallel_size: 1\n' > "$run/one-gpu.yaml"
printf 'tensor_parallel_size: 2\n' > "$run/tp2.yaml"
printf 'data_parallel_size: 2\n' > "$run/dp2.yaml"
for topology in one-gpu tp2 dp2; do
  out=$run/ladder-$topology
  if [ -f "$out/report.md" ]; then
    echo "ladder $topology: measured already ($out)"
    continue
  fi
  resume=(); [ -f "$out/study.db" ] && resume=(--resume)
  cmd=(python3 -m autotune run "${common[@]}" --baseline "$run/$topology.yaml" --objective capacity
    --trials 1 --study-name "h200x2-ladder-$topology" --output-dir "$out" "${resume[@]}" "$@")
  printf '%q ' "${cmd[@]}" > "$run/command-ladder-$topology.txt"; echo >> "$run/command-ladder-$topology.txt"
  echo "$(date -u +%FT%TZ) ladder $topology: $(cat "$run/command-ladder-$topology.txt")"
  "${cmd[@]}" || echo "ladder $topology: exit $?"
done

# 2. The search over the topology, one study per objective, each validated on the held-out window.
for objective in ${OBJECTIVES:-capacity capacity-per-gpu}; do
  out=$run/search-$objective
  if [ -f "$out/report.md" ]; then
    echo "search $objective: done already ($out)"
    continue
  fi
  resume=(); [ -f "$out/study.db" ] && resume=(--resume)
  cmd=(python3 -m autotune run "${common[@]}" --space scripts/gpu/space-topology.yaml --objective "$objective"
    --trials "${TRIALS:-3}" --top-k 2 --repeats "${REPEATS:-3}" --study-name "h200x2-topology-$objective"
    --output-dir "$out" "${resume[@]}" "$@")
  printf '%q ' "${cmd[@]}" > "$run/command-search-$objective.txt"; echo >> "$run/command-search-$objective.txt"
  echo "$(date -u +%FT%TZ) search $objective: $(cat "$run/command-search-$objective.txt")"
  "${cmd[@]}" || echo "search $objective: exit $?"
done

# What a reader wants first: each topology's capacity, and what each study exported.
python3 - "$run" > "$run/summary.md" <<'PY'
import json
import sys
from pathlib import Path

import yaml

run = Path(sys.argv[1])
print("# Topology on 2 H200s: Llama-3.1-8B shape, Azure conversation, TTFT p95 1000 ms, TPOT p95 25 ms\n")
print("| topology | capacity (req/s, tuning window) | per GPU | headroom | broke first |")
print("|---|---|---|---|---|")
for topology, gpus in (("one-gpu", 1), ("tp2", 2), ("dp2", 2)):
    ladder = run / f"ladder-{topology}" / "trials" / "trial-0000" / "ladder.json"
    if not ladder.is_file():
        print(f"| {topology} | not measured | - | - | - |")
        continue
    found = json.loads(ladder.read_text())
    rps, recorded = found["capacity_rps"], found["recorded_rps"]
    broke = next((s["reason"] for s in found["steps"] if not s["passed"]), "-")[:60]
    print(f"| {topology} | {rps:.3g} | {rps / gpus:.3g} | {rps / recorded:.2f}x | {broke} |")
for study in sorted(run.glob("search-*")):
    best = study / "best.yaml"
    report = study / "report.md"
    if not best.is_file():
        print(f"\n## {study.name}: no best.yaml (see {study.name}/report.md or the session log)")
        continue
    config = {k: v for k, v in (yaml.safe_load(best.read_text()) or {}).items() if k.endswith("parallel-size")}
    lines = report.read_text().splitlines() if report.is_file() else []
    print(f"\n## {study.name}: exported {config or 'the baseline (one GPU)'}\n")
    print("\n".join(line for line in lines[:6] if line.startswith("**")))
PY
echo "$(date -u +%FT%TZ) done: $run/summary.md"
