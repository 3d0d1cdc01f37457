#!/usr/bin/env bash
# Per-node setup for deploy/cluster.yaml: idempotent, safe to re-run on every `ray up`.
set -euo pipefail
if [ "$(uname -s)" != Darwin ] && [ "${MLX_FLEET_STAND_IN:-}" != 1 ]; then
  # The Linux mini-hosts of tests/deploy/test_ray_up.py stand in for Macs and say so.
  echo "mac-setup.sh sets up a fleet Mac (Apple Silicon, macOS), and this is $(uname -s): nothing done." >&2
  echo "A Linux box can serve with 'make up' instead; see README.md." >&2
  exit 1
fi
cd "$(dirname "$0")/../.."
if [ "${MLX_FLEET_SKIP_DEPS:-}" = 1 ]; then
  # The node's ~/.bashrc already puts a venv with mlx-fleet first on PATH (e.g. the mini-hosts of
  # tests/deploy/test_ray_up.py share the test venv): do not build ~/mlx-fleet/.venv, only check it.
  # Opt-in rather than "mlx-fleet is on PATH": fleet-env.sh puts ~/mlx-fleet/.venv on PATH after the
  # first run, and `make deps` must still run then to pick up dependency changes.
  if ! { command -v mlx-fleet >/dev/null && python3 -c 'import cluster, ray'; }; then
    echo "MLX_FLEET_SKIP_DEPS=1 but no usable mlx-fleet on PATH ($PATH)" >&2; exit 1
  fi
  deploy/bootstrap/ensure-redis.sh
else
  make deps >/dev/null
fi
line="source $PWD/deploy/bootstrap/fleet-env.sh"
for rc in "$HOME/.bashrc" "$HOME/.bash_profile"; do
  touch "$rc"; grep -qxF "$line" "$rc" || echo "$line" >> "$rc"
done
token="$HOME/.ray/mlx-fleet-token"   # copied from deploy/.ray-token by cluster.yaml's file_mounts
[ -s "$token" ] || { echo "missing $token: run 'make fleet-token' on your laptop before 'ray up'" >&2; exit 1; }
chmod 600 "$token"
echo "mlx-fleet node $(hostname -s) ready"
