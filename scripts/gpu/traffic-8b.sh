#!/usr/bin/env bash
# The traffic of the long-prompt scenario (issue 19, scenario 1): lengths of the Azure 2023 code
# trace, Poisson arrivals at 12 req/s for 600 s (seeded: rebuilt identically on every host),
# requests over the 8192-token context dropped and counted. Writes RUN_DIR/traffic.jsonl.
# Usage: traffic-8b.sh KIT_DIR RUN_DIR
set -euo pipefail
kit=${1:?kit dir}; run=${2:?run dir}
source scripts/gpu/env.sh
mkdir -p "$run"
python3 -m autotune convert --from azure "$kit/azure_code_2023.csv" "$run/code.jsonl"
python3 -m autotune generate "$run/generated.jsonl" --like "$run/code.jsonl" --arrivals poisson \
  --rate 12 --duration-s 600 --seed 0
# The model's context is 8192 tokens: requests whose prompt + answer exceed it are dropped
# (counted in the log), since the server would refuse them.
python3 - "$run/generated.jsonl" "$run/traffic.jsonl" 8192 <<'PY'
import sys
from workloads.trace_io import load_trace, write_trace
source, target, context = sys.argv[1], sys.argv[2], int(sys.argv[3])
trace = load_trace(source)
fits = (trace.input_lengths + trace.output_lengths) <= context
write_trace(target, trace.subset(fits))
print(f"kept {int(fits.sum())} of {len(trace)} requests (dropped {int((~fits).sum())} over {context} tokens)")
PY
