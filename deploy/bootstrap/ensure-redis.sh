#!/usr/bin/env bash
# Make sure a redis-server binary exists: apt on Debian/Ubuntu (as root, or
# with passwordless sudo), Homebrew on macOS; otherwise say what to install.
set -euo pipefail

have_redis() {
  command -v redis-server >/dev/null 2>&1 && return 0
  for p in /opt/homebrew/bin/redis-server /usr/local/bin/redis-server /usr/bin/redis-server /usr/sbin/redis-server; do
    [ -x "$p" ] && return 0
  done
  return 1
}

have_redis && exit 0

case "$(uname -s)" in
  Linux)
    if [ -f /etc/debian_version ]; then
      if [ "$(id -u)" = 0 ]; then SUDO=""; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
        echo "redis-server is missing: run 'sudo apt-get install -y redis-server' and retry" >&2; exit 1
      fi
      echo "installing redis-server with apt ..."
      export DEBIAN_FRONTEND=noninteractive
      $SUDO apt-get install -y -q redis-server >/dev/null 2>&1 || {
        $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q redis-server >/dev/null; }
      # We run our own redis-server per fleet; the distro's service is not needed.
      ($SUDO systemctl disable --now redis-server >/dev/null 2>&1 || true)
    else
      echo "redis-server is missing: install Redis 6+ with your package manager and retry" >&2; exit 1
    fi ;;
  Darwin)
    if command -v brew >/dev/null 2>&1; then
      echo "installing redis with Homebrew ..."; brew install redis >/dev/null
    else
      echo "redis-server is missing: install Homebrew (https://brew.sh) then 'brew install redis', and retry" >&2; exit 1
    fi ;;
  *)
    echo "redis-server is missing: install Redis 6+ and retry" >&2; exit 1 ;;
esac

have_redis || { echo "redis-server still not found after installing; add it to PATH" >&2; exit 1; }
