#!/usr/bin/env bash
# Fake a small fleet of hosts on one Linux box, for a real `ray up deploy/cluster.yaml` over SSH.
#
#   FLEET_DIR=/tmp/x FLEET_VENV=/path/to/venv tests/deploy/netns/fleet_netns.sh up
#   FLEET_DIR=/tmp/x tests/deploy/netns/fleet_netns.sh down     # idempotent; also after a failed `up`
#   FLEET_DIR=/tmp/x tests/deploy/netns/fleet_netns.sh status   # "<name> <ip> up|down" per host
#
# Each "mini-host" is its own network, PID, UTS and mount namespace (`ip netns` + `unshare`), with
# sshd as its PID 1, a private home mounted over the real $HOME and a private /tmp/ray. All hosts
# hang off one bridge; the root namespace gets <subnet>.1 on it. Each host's /etc/hosts (private)
# maps every host's name to its address. No default route, no forwarding:
# nothing leaves the bridge. See "Variant B" of the netns-ray reference notes.
#
# Host 0 is <prefix>-h0 at <subnet>.10, host N at <subnet>.(10+N). Every host's ~/.bashrc puts
# $FLEET_VENV/bin first on PATH and exports RAY_AUTH_MODE=token (what each Mac's ~/.bashrc carries),
# plus MLX_FLEET_SKIP_DEPS=1 (the venv is provided: mac-setup.sh must not build one); every host's
# ~/.ray/auth_token holds the same token, also at $FLEET_DIR/token.
#
# Environment:
#   FLEET_DIR        scratch dir (required); everything the script makes lives here except the
#                    netns/links and the empty mount points /run/sshd and /tmp/ray
#   FLEET_VENV       venv whose bin/ goes first on each host's PATH (required for `up`)
#   FLEET_PREFIX     names: netns <prefix>-hN, bridge <prefix>-br0, links v<prefix>-hN  (default: fleet,
#                    at most 8 characters because Linux link names have at most 15)
#   FLEET_SUBNET     first three octets, must be 10.77.x (default: 10.77.0)
#   FLEET_HOSTS      number of hosts (default: 3)
#   FLEET_KEEP_HOME  space-separated dirs under $HOME to keep visible in the private homes (default:
#                    the top dir under $HOME holding the venv's base interpreter, e.g. .pyenv, if any)
#
# Needs: Linux, root (CAP_NET_ADMIN + CAP_SYS_ADMIN), and the Debian packages iproute2 (ip),
# util-linux (unshare, mount), openssh-server (sshd), openssh-client (ssh, ssh-keygen) and rsync
# (`apt-get install -y iproute2 openssh-server openssh-client rsync`). Installing openssh-server must
# not start the system sshd on a test box (Docker images ship a policy-rc.d that prevents it).
# Client side: `ssh -i $FLEET_DIR/ssh/client_key root@<subnet>.1N`.
set -euo pipefail

SELF="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
PREFIX="${FLEET_PREFIX:-fleet}"
SUBNET="${FLEET_SUBNET:-10.77.0}"
HOSTS="${FLEET_HOSTS:-3}"
BRIDGE="$PREFIX-br0"

die() { echo "fleet_netns: $*" >&2; exit 1; }

check_params() {
  [ -n "${FLEET_DIR:-}" ] || die "set FLEET_DIR to a scratch directory"
  [[ "$PREFIX" =~ ^[a-z][a-z0-9]{0,7}$ ]] || die "FLEET_PREFIX must be 1-8 lowercase letters/digits"
  [[ "$SUBNET" =~ ^10\.77\.([0-9]|[1-9][0-9]|1[0-9][0-9]|2[0-4][0-9]|25[0-5])$ ]] ||
    die "FLEET_SUBNET must be 10.77.x (a private /24 for the bridge)"
  [[ "$HOSTS" =~ ^[1-9]$ ]] || die "FLEET_HOSTS must be 1-9"
}

has_ns() { ip netns list | awk '{print $1}' | grep -qxF "$1"; }
ns_name() { echo "$PREFIX-h$1"; }
host_ip() { echo "$SUBNET.$((10 + $1))"; }
host_dir() { echo "$FLEET_DIR/h$1"; }

need_tools() {
  local missing=() t
  for t in ip unshare mount ssh ssh-keygen rsync /usr/sbin/sshd; do
    command -v "$t" >/dev/null 2>&1 || missing+=("$t")
  done
  [ ${#missing[@]} -eq 0 ] ||
    die "missing: ${missing[*]} (apt-get install -y iproute2 openssh-server openssh-client rsync)"
  [ "$(id -u)" = 0 ] || die "must run as root"
}

# --- inside a mini-host: PID 1 (exec'd by unshare in the host's netns) --------------------------
host_init() {
  local i="$1" h home keep
  h="$(host_dir "$i")"
  home="${FLEET_REAL_HOME:?}"
  hostname "$(ns_name "$i")"
  for keep in ${FLEET_KEEP_HOME_RESOLVED:-}; do
    mkdir -p "$h/home/$keep"
    mount --bind "$home/$keep" "$h/home/$keep"
  done
  mount --rbind "$h/home" "$home"       # private ~: .bashrc, ~/.ray, ~/ray_bootstrap_*, ~/mlx-fleet
  mount --bind "$h/tmpray" /tmp/ray     # private /tmp/ray: sessions, cluster-*.state
  mount --bind "$h/hosts" /etc/hosts    # the hosts' names resolve to their bridge IPs (as mDNS on a LAN)
  exec /usr/sbin/sshd -D -f "$h/sshd.conf" -E "$h/sshd.log"   # PID 1: reaps orphans; its death ends the host
}

keep_home_dirs() {
  # The venv's python is a symlink to a base interpreter; if that lives under $HOME (pyenv), the
  # private home would hide it ("ray: cannot execute: required file not found").
  if [ -n "${FLEET_KEEP_HOME+x}" ]; then echo "$FLEET_KEEP_HOME"; return; fi
  local real rel
  real="$(readlink -f "$FLEET_VENV/bin/python")"
  for p in "$real" "$(readlink -f "$FLEET_VENV")"; do
    case "$p" in
      "$HOME"/*) rel="${p#"$HOME"/}"; echo "${rel%%/*}" ;;
    esac
  done | sort -u | tr '\n' ' '
}

up() {
  check_params; need_tools
  [ -n "${FLEET_VENV:-}" ] || die "set FLEET_VENV to the venv to put on each host's PATH"
  [ -x "$FLEET_VENV/bin/python" ] || die "$FLEET_VENV/bin/python does not exist"
  [ -x "$FLEET_VENV/bin/ray" ] || die "$FLEET_VENV/bin/ray does not exist (the venv needs ray)"
  ip link show "$BRIDGE" >/dev/null 2>&1 && die "$BRIDGE exists already (run down first, or use another FLEET_PREFIX)"
  mkdir -p "$FLEET_DIR/ssh" /run/sshd /tmp/ray
  FLEET_DIR="$(cd "$FLEET_DIR" && pwd)"
  local keep; keep="$(keep_home_dirs)"

  local ssh="$FLEET_DIR/ssh"
  [ -f "$ssh/client_key" ] || ssh-keygen -q -t ed25519 -N '' -C fleet-client -f "$ssh/client_key"
  [ -f "$ssh/host_key" ] || ssh-keygen -q -t ed25519 -N '' -C fleet-host -f "$ssh/host_key"
  cp "$ssh/client_key.pub" "$ssh/authorized_keys"
  chmod 600 "$ssh/client_key" "$ssh/host_key" "$ssh/authorized_keys"
  [ -s "$FLEET_DIR/token" ] || (umask 077; "$FLEET_VENV/bin/python" -c \
    'import secrets; print(secrets.token_hex(32), end="")' > "$FLEET_DIR/token")

  ip link add "$BRIDGE" type bridge
  ip addr add "$SUBNET.1/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up

  local i ns h addr
  {
    printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n'
    for ((i = 0; i < HOSTS; i++)); do printf '%s\t%s\n' "$(host_ip "$i")" "$(ns_name "$i")"; done
  } > "$FLEET_DIR/hosts"
  for ((i = 0; i < HOSTS; i++)); do
    ns="$(ns_name "$i")"; h="$(host_dir "$i")"; addr="$(host_ip "$i")"
    mkdir -p "$h/home/.ray" "$h/tmpray"
    cp "$FLEET_DIR/hosts" "$h/hosts"
    install -m 600 "$FLEET_DIR/token" "$h/home/.ray/auth_token"
    cat > "$h/home/.bashrc" <<EOF
# mini-host $ns ($addr): what a fleet Mac's ~/.bashrc carries before mac-setup.sh appends fleet-env.sh
export PATH="$FLEET_VENV/bin:\$PATH"
export RAY_AUTH_MODE=token
# The venv above already has mlx-fleet: mac-setup.sh must not build ~/mlx-fleet/.venv (make deps).
export MLX_FLEET_SKIP_DEPS=1
export MLX_FLEET_STAND_IN=1
EOF
    cat > "$h/sshd.conf" <<EOF
ListenAddress $addr
Port 22
HostKey $ssh/host_key
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
AuthorizedKeysFile $ssh/authorized_keys
StrictModes no
MaxStartups 100
MaxSessions 100
PidFile none
PrintMotd no
Subsystem sftp internal-sftp
EOF
    ip netns add "$ns"
    ip link add "v$ns" type veth peer name eth0 netns "$ns"
    ip link set "v$ns" master "$BRIDGE"
    ip link set "v$ns" up
    ip -n "$ns" addr add "$addr/24" dev eth0
    ip -n "$ns" link set lo up
    ip -n "$ns" link set eth0 up
    FLEET_REAL_HOME="$HOME" FLEET_KEEP_HOME_RESOLVED="$keep" FLEET_DIR="$FLEET_DIR" \
      setsid ip netns exec "$ns" unshare --pid --fork --kill-child --mount-proc --uts --mount \
      --propagation private "$SELF" _init "$i" </dev/null >"$h/host.log" 2>&1 &
    echo $! > "$h/unshare.pid"
  done

  # Wait until every sshd accepts our key.
  local deadline=$((SECONDS + 30))
  for ((i = 0; i < HOSTS; i++)); do
    addr="$(host_ip "$i")"
    until ssh -i "$ssh/client_key" -o IdentitiesOnly=yes -o BatchMode=yes -o StrictHostKeyChecking=no \
        -o UserKnownHostsFile=/dev/null -o ConnectTimeout=2 -o LogLevel=ERROR "root@$addr" true 2>/dev/null; do
      if ((SECONDS > deadline)); then
        cat "$(host_dir "$i")/host.log" "$(host_dir "$i")/sshd.log" >&2 2>/dev/null || true
        die "sshd on $addr does not answer"
      fi
      sleep 0.2
    done
  done
  echo "fleet up: $(for ((i = 0; i < HOSTS; i++)); do printf '%s=%s ' "$(ns_name "$i")" "$(host_ip "$i")"; done)"
}

down() {
  check_params
  local i ns h pid upid deadline pids
  for ((i = 0; i < HOSTS; i++)); do
    ns="$(ns_name "$i")"; h="$(host_dir "$i")"
    # Gently first: SIGTERM to the host's PID 1 (unshare itself ignores SIGTERM); the kernel then
    # SIGKILLs everything else in that PID namespace.
    if [ -f "$h/unshare.pid" ]; then
      upid="$(cat "$h/unshare.pid")"
      if grep -qa unshare "/proc/$upid/cmdline" 2>/dev/null; then
        for pid in $(pgrep -P "$upid" || true); do kill -TERM "$pid" 2>/dev/null || true; done
      fi
    fi
    if has_ns "$ns"; then
      # Then anything still in the host's network namespace (e.g. after a half-failed `up`).
      deadline=$((SECONDS + 5))
      while pids="$(ip netns pids "$ns" 2>/dev/null)" && [ -n "$pids" ]; do
        if ((SECONDS > deadline - 3)); then
          # shellcheck disable=SC2086  # one PID per word
          kill -KILL $pids 2>/dev/null || true
        fi
        ((SECONDS > deadline)) && die "processes left in $ns: $pids"
        sleep 0.1
      done
      ip netns del "$ns"
    fi
    if [ -f "$h/unshare.pid" ]; then
      upid="$(cat "$h/unshare.pid")"
      if grep -qa unshare "/proc/$upid/cmdline" 2>/dev/null; then kill -KILL "$upid" 2>/dev/null || true; fi
      rm -f "$h/unshare.pid"
    fi
    ip link del "v$ns" 2>/dev/null || true    # normally gone with its peer's namespace
  done
  ip link del "$BRIDGE" 2>/dev/null || true
}

status() {
  check_params
  local i ns state
  for ((i = 0; i < HOSTS; i++)); do
    ns="$(ns_name "$i")"; state=down
    if has_ns "$ns" && [ -n "$(ip netns pids "$ns" 2>/dev/null)" ]; then state=up; fi
    echo "$ns $(host_ip "$i") $state"
  done
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  _init) host_init "$2" ;;
  *) echo "usage: FLEET_DIR=... [FLEET_VENV=...] $0 up|down|status" >&2; exit 2 ;;
esac
