#!/usr/bin/env bash
# Best effort, for `make test`: the Debian packages tests/deploy/test_ray_up.py needs (iproute2,
# openssh-server, openssh-client, rsync), installed as root on Debian. Anywhere else it does nothing
# and the test skips, saying what is missing. It never leaves a system sshd running: the test runs
# its own sshd inside each mini-host, on the mini-hosts' private addresses only.
set -uo pipefail
{ [ "$(uname -s)" = Linux ] && [ "$(id -u)" = 0 ] && [ -f /etc/debian_version ]; } || exit 0
need=()
command -v ip >/dev/null 2>&1 || need+=(iproute2)
[ -x /usr/sbin/sshd ] || need+=(openssh-server)
command -v ssh >/dev/null 2>&1 || need+=(openssh-client)
command -v rsync >/dev/null 2>&1 || need+=(rsync)
[ ${#need[@]} -eq 0 ] && exit 0
echo "installing ${need[*]} (for the ray up test) ..."
export DEBIAN_FRONTEND=noninteractive
policy=/usr/sbin/policy-rc.d
made_policy=0
if [ ! -e "$policy" ]; then  # tell dpkg not to start services: a system sshd would listen everywhere
  printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy" && made_policy=1
fi
apt-get install -y -q "${need[@]}" >/dev/null 2>&1 || {
  apt-get update -q >/dev/null 2>&1 && apt-get install -y -q "${need[@]}" >/dev/null 2>&1; } ||
  echo "could not install ${need[*]}; the ray up test will skip" >&2
[ "$made_policy" = 1 ] && rm -f "$policy"
(systemctl disable --now ssh >/dev/null 2>&1 || true)
exit 0
