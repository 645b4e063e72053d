#!/usr/bin/env bash
# Re-tune on a plain host (cron or the systemd timer) and restart the server on a new config.
#
# `autotune retune` exit status: 0 no drift, 10 new best.yaml written, 11 drift but the
# deployed config stays (it still carries --headroom x the traffic, or no config beat it), 2 bad input, 12 the deployed config could not be measured on the
# current traffic (nothing published), 1 failure, 143 stopped by SIGTERM. Only 10 restarts the
# server; 0 and 11 are a normal night (exit 0 here); anything else is passed on so cron mails
# it / systemd marks the unit failed.
#
# Settings (environment, with defaults):
#   AUTOTUNE        the autotune command              /opt/vllm-autotune/.venv/bin/autotune
#   CONFIG_DIR      where best.yaml and best-vN.yaml  /etc/autotune
#   TRAFFIC_DIR     the server recorder's folder       /var/lib/autotune/traffic
#   RESTART         command run after a new config    systemctl restart autotune-server.service
#   RETUNE_ARGS     extra `autotune retune` flags      (none), e.g. "--trials 12 --time-budget 2h"
set -uo pipefail

AUTOTUNE="${AUTOTUNE:-/opt/vllm-autotune/.venv/bin/autotune}"
CONFIG_DIR="${CONFIG_DIR:-/etc/autotune}"
TRAFFIC_DIR="${TRAFFIC_DIR:-/var/lib/autotune/traffic}"
RESTART="${RESTART:-systemctl restart autotune-server.service}"
read -r -a extra <<< "${RETUNE_ARGS:-}"

"$AUTOTUNE" retune --current "$TRAFFIC_DIR" --config "$CONFIG_DIR/best.yaml" \
    --output-dir "$CONFIG_DIR" "${extra[@]}"
status=$?
case "$status" in
    0)  echo "retune: no drift; nothing to do" ;;
    10) echo "retune: new config $CONFIG_DIR/best.yaml; restarting: $RESTART"
        read -r -a restart <<< "$RESTART"
        "${restart[@]}" || { echo "retune: restart failed" >&2; exit 1; } ;;
    11) echo "retune: drift, but the deployed config stays (it still has the headroom, or no config beat it)" ;;
    *)  echo "retune: failed with exit status $status" >&2; exit "$status" ;;
esac
exit 0
