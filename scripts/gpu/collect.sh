#!/usr/bin/env bash
# Pack a study's results (without the bulky per-request logs beyond what fits) into OUT.
set -uo pipefail
run=${1:?run dir}; out=${2:?out dir}
tar -C "$(dirname "$run")" -czf "$out/study.tar.gz" --exclude='*.db-journal' "$(basename "$run")"
ls -la "$out"
