#!/usr/bin/env bash
# Keep the recorded results out of what each device call re-sends. The device tool copies the
# working tree (tracked and untracked files) at every call, 64 MiB at most with what is carried:
# results/ and benchmarks/data/ (~20 MiB) leave the kit parts ~38 MiB. A GPU run needs neither.
# `on` hides them with git's sparse checkout (git status stays clean, nothing is deleted from
# git); `off` brings them back. Run kit-parts.sh after `on`: it sizes the parts to what travels.
# Measured 2026-12-02: checkout 21 MiB -> 3.3 MiB, the kit in 6 calls instead of 9.
# Usage: travel-light.sh on|off
set -euo pipefail
cd "$(dirname "$0")/../.."
case "${1:?on or off}" in
  on) git sparse-checkout set --no-cone '/*' '!/results/' '!/benchmarks/data/' ;;
  off) git sparse-checkout disable ;;
  *) echo "travel-light.sh: on or off, not $1" >&2; exit 2 ;;
esac
echo "travel-light: $1 (kit-parts.sh prints the checkout's size when it sizes the parts)"
