#!/usr/bin/env bash
# Wait on a background GPU run and bring its results back on EVERY call.
# A lent machine goes back 30 s after a call ends (and after 30 minutes held), and everything
# on it is lost: each poll therefore packs the run folder into $OUT before it returns, so the
# latest state is always on the developer's machine. Usage: poll.sh RUN_DIR [SECONDS]
set -uo pipefail
run=${1:?run dir}; wait_s=${2:-480}
deadline=$(( $(date +%s) + wait_s ))
while [ "$(date +%s)" -lt "$deadline" ]; do
  # The tuner (or the grid) has exited (or never started): no point waiting longer.
  # Anchored at the start of the command line, so that the device call's own shell (whose
  # command text may name these scripts) is not mistaken for the run.
  pgrep -f "^(bash scripts/gpu/(grid-8b-gpus|frontends|scenario1-h200|topology-h200x2|headline-h200)\.sh|python3 (-m autotune run|benchmarks/(search_efficiency\.py measure|throughput_ceiling\.py|frontend_capacity\.py)))" >/dev/null || break
  sleep 10
done
# The run folder's logs, and those of runs kept in its subfolders (one folder per repeat).
grep -E "step|round|capacity|trial|first move|paid off|gate|Headroom|KEPT|winner|wrote|Error|error" \
  "$run"/*.log "$run"/*/*.log 2>/dev/null | tail -25
if [ -n "${OUT:-}" ]; then
  tar -C "$(dirname "$run")" -czf "$OUT/run.tar.gz" --exclude='*.db-journal' "$(basename "$run")" \
    && ls -la "$OUT"
fi
