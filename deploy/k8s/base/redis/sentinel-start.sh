#!/bin/sh
# One Sentinel of the set. It waits (bounded) until the master answers, then monitors it; the
# other sentinels and the replicas it learns from the master. Hostnames, not pod IPs, so that a
# rescheduled pod keeps its identity.
set -eu
. "$(dirname "$0")/redis-common.sh"
CONF_DIR="${CONF_DIR:-/run/sentinel}"
BIND="${BIND:-0.0.0.0 -::*}"
QUORUM="${QUORUM:-2}"
DOWN_AFTER_MS="${DOWN_AFTER_MS:-5000}"
FAILOVER_TIMEOUT_MS="${FAILOVER_TIMEOUT_MS:-60000}"
WAIT_S="${WAIT_S:-120}"

waited=0
while :; do
  master="$(find_master)"
  [ "$(ask "$master" "$REDIS_PORT" PING)" = "PONG" ] && break
  waited=$((waited + 1))
  if [ "$waited" -ge "$WAIT_S" ]; then
    echo "sentinel-start: master $master does not answer after ${WAIT_S}s" >&2
    exit 1
  fi
  sleep 1
done
mkdir -p "$CONF_DIR"
cat > "$CONF_DIR/sentinel.conf" <<CONF
port $SENTINEL_PORT
bind $BIND
protected-mode no
dir $CONF_DIR
sentinel resolve-hostnames yes
sentinel announce-hostnames yes
sentinel announce-ip $SELF_HOST
sentinel announce-port $SENTINEL_PORT
sentinel monitor $MASTER_SET $master $REDIS_PORT $QUORUM
sentinel down-after-milliseconds $MASTER_SET $DOWN_AFTER_MS
sentinel failover-timeout $MASTER_SET $FAILOVER_TIMEOUT_MS
sentinel parallel-syncs $MASTER_SET 1
CONF
echo "sentinel-start: $SELF_HOST monitors $MASTER_SET at $master"
exec redis-server "$CONF_DIR/sentinel.conf" --sentinel
