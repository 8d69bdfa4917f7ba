#!/bin/sh
# Shared by redis-start.sh and sentinel-start.sh: find the current master of the set.
#
# Environment (set by the StatefulSet; the deploy tests set them for loopback processes):
#   SELF_HOST      this pod's stable DNS name (what replicas and sentinels announce)
#   REDIS_PEERS    every member's DNS name, space separated, the seed (first start's master) first
#   REDIS_PORT     6379        SENTINEL_PORT  26379        MASTER_SET  kvgate
: "${SELF_HOST:?SELF_HOST must be set}"
: "${REDIS_PEERS:?REDIS_PEERS must be set}"
REDIS_PORT="${REDIS_PORT:-6379}"
SENTINEL_PORT="${SENTINEL_PORT:-26379}"
MASTER_SET="${MASTER_SET:-kvgate}"

ask() { # ask HOST PORT COMMAND...: one bounded redis-cli call, empty output on any failure
  host="$1"; port="$2"; shift 2
  timeout 3 redis-cli -h "$host" -p "$port" --raw "$@" 2>/dev/null || true
}

# The master is, in order: what any sentinel says (it knows about failovers); else a peer that
# says it is a master (sentinels all down, data still there); else the seed (a brand-new set).
find_master() {
  for peer in $REDIS_PEERS; do
    answer="$(ask "$peer" "$SENTINEL_PORT" SENTINEL get-master-addr-by-name "$MASTER_SET" | head -n 1)"
    if [ -n "$answer" ]; then echo "$answer"; return 0; fi
  done
  for peer in $REDIS_PEERS; do
    [ "$peer" = "$SELF_HOST" ] && continue
    if ask "$peer" "$REDIS_PORT" INFO replication | grep -q '^role:master'; then
      echo "$peer"; return 0
    fi
  done
  set -- $REDIS_PEERS
  echo "$1"
}
