#!/usr/bin/env bash
# The fleet's shared Redis on the head Mac: LAN-reachable, password-protected, persistent.
# Prints the redis_url to put into deploy/serve.yaml. Idempotent.
set -euo pipefail
# shellcheck source=deploy/bootstrap/fleet-env.sh
source "$(dirname "$0")/fleet-env.sh"
deploy/bootstrap/ensure-redis.sh
dir="$MLX_FLEET_DATA_DIR/redis"; mkdir -p "$dir"
pass_file="$dir/password"
[ -s "$pass_file" ] || { python3 -c 'import secrets; print(secrets.token_hex(24), end="")' > "$pass_file"; chmod 600 "$pass_file"; }
port="${MLX_FLEET_REDIS_PORT:-6380}"
if ! redis-cli -p "$port" -a "$(cat "$pass_file")" --no-auth-warning ping >/dev/null 2>&1; then
  redis-server --port "$port" --bind 0.0.0.0 --requirepass "$(cat "$pass_file")" --dir "$dir" \
    --dbfilename index.rdb --save "60 1" --daemonize yes --logfile "$dir/redis.log"
fi
ip=$(echo "${SSH_CONNECTION:-x x 127.0.0.1}" | awk '{print $3}')
echo "redis_url: redis://:$(cat "$pass_file")@$ip:$port/0"
