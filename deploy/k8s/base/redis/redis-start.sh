#!/bin/sh
# One Redis of the Sentinel-managed set: master if the set says so (or on a brand-new set's
# seed), else a replica of the current master. Config goes to a writable emptyDir: the root
# filesystem is read-only.
set -eu
. "$(dirname "$0")/redis-common.sh"
DATA_DIR="${DATA_DIR:-/data}"
CONF_DIR="${CONF_DIR:-/run/redis}"
BIND="${BIND:-0.0.0.0 -::*}"

master="$(find_master)"
mkdir -p "$CONF_DIR" "$DATA_DIR"
conf="$CONF_DIR/redis.conf"
cat > "$conf" <<CONF
port $REDIS_PORT
bind $BIND
protected-mode no
dir $DATA_DIR
appendonly yes
save ""
replica-announce-ip $SELF_HOST
replica-announce-port $REDIS_PORT
CONF
if [ "$master" != "$SELF_HOST" ]; then
  echo "replicaof $master $REDIS_PORT" >> "$conf"
  echo "redis-start: $SELF_HOST starts as a replica of $master"
else
  echo "redis-start: $SELF_HOST starts as the master"
fi
exec redis-server "$conf"
