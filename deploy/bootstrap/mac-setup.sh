#!/usr/bin/env bash
# Per-node setup for deploy/cluster.yaml: idempotent, safe to re-run on every `ray up`.
set -euo pipefail
cd "$(dirname "$0")/../.."
make deps >/dev/null
line="source $PWD/deploy/bootstrap/fleet-env.sh"
for rc in "$HOME/.bashrc" "$HOME/.bash_profile"; do
  touch "$rc"; grep -qxF "$line" "$rc" || echo "$line" >> "$rc"
done
token="$HOME/.ray/mlx-fleet-token"   # copied from deploy/.ray-token by cluster.yaml's file_mounts
[ -s "$token" ] || { echo "missing $token: run 'make fleet-token' on your laptop before 'ray up'" >&2; exit 1; }
chmod 600 "$token"
echo "mlx-fleet node $(hostname -s) ready"
