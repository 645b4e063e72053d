#!/usr/bin/env bash
# The checkout a device call carries must stay under 64 MiB with a kit part beside it, and the
# committed GPU/CPU run folders alone are over 100 MiB. This leaves the bulky run folders out of
# the working tree with a sparse checkout (still committed and tracked; `git status` stays
# clean; new files elsewhere commit as usual); `travel-light.sh off` brings them back.
# `travel-light.sh kib` only prints the KiB that travel now (kit-parts.sh sizes its parts by it).
# Usage: travel-light.sh [on|off|kib]
set -euo pipefail
cd "$(dirname "$0")/../.."
travelling_kib() {
  python3 - <<'PY'
import os, subprocess
names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                       capture_output=True, check=True).stdout.split(b"\0")
print(sum(os.path.getsize(n) for n in names if n and os.path.isfile(n)) // 1024)
PY
}
if [ "${1:-on}" = kib ]; then
  travelling_kib
  exit 0
elif [ "${1:-on}" = off ]; then
  git sparse-checkout disable
else
  git sparse-checkout set --no-cone '/*' '!/results/benchmarks/frontends-*/' \
    '!/results/benchmarks/serving_overhead-*/' '!/results/cpu-2026-11-23/' \
    '!/results/h100-2026-11-22/' '!/results/h100-2026-11-23/' '!/results/h100-2026-11-23b/' \
    '!/results/h100-2026-11-24/' '!/results/h200-2026-11-25/long-prompts/study/'
fi
echo "the working tree that travels: $(( $(travelling_kib) / 1024 )) MiB"
