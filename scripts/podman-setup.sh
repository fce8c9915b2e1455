#!/usr/bin/env bash
# A Docker-compatible engine for the agent's `docker` runtime, without Docker and without /etc:
# Podman with runc (crun fails here: no CAP_SYS_RESOURCE, hybrid cgroups), a local busybox image
# (no registry is reachable) and Podman's Docker API on a socket under var/podman/.
# Idempotent: run it as often as you like; it only does what is missing.
# Last line of output: DOCKER_HOST=unix://<socket>. `eval "$(scripts/podman-setup.sh --env)"`
# sets DOCKER_HOST and CONTAINERS_CONF in the calling shell.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${GPUCP_PODMAN_DIR:-$repo/var/podman}"
sock="$dir/podman.sock"
image="localhost/busybox:latest"
env_only=0
[ "${1:-}" = "--env" ] && env_only=1

say() { [ "$env_only" = 1 ] && echo "$*" >&2 || echo "$*"; }
die() { echo "podman-setup: $*" >&2; exit 1; }

command -v podman >/dev/null || die "podman is not installed (apt-get install -y podman runc busybox-static)"
command -v runc >/dev/null || die "runc is not installed (apt-get install -y runc)"
busybox="$(command -v busybox || true)"
[ -x /bin/busybox ] && busybox=/bin/busybox
[ -n "$busybox" ] || die "busybox is not installed (apt-get install -y busybox-static)"

mkdir -p "$dir"
# Two callers at once (parallel test sessions) must not both build the image or start a service.
exec 9>"$dir/setup.lock"
flock 9

export CONTAINERS_CONF="$dir/containers.conf"
conf_text='[containers]
default_ulimits = ["nofile=1024:1024", "nproc=1000:1000"]

[engine]
runtime = "runc"'
if [ ! -f "$CONTAINERS_CONF" ] || [ "$(cat "$CONTAINERS_CONF")" != "$conf_text" ]; then
  printf '%s\n' "$conf_text" >"$CONTAINERS_CONF"
  say "wrote $CONTAINERS_CONF"
fi

if ! podman image exists "$image" 2>/dev/null; then
  rootfs="$(mktemp -d)"
  trap 'rm -rf "$rootfs"' EXIT
  mkdir -p "$rootfs/bin" "$rootfs/tmp" "$rootfs/etc"
  cp "$busybox" "$rootfs/bin/busybox"
  for tool in sh echo sleep cat env true false ls printf test kill ps grep sed wc head tail \
    date id pwd mkdir rm touch yes seq; do
    ln -sf busybox "$rootfs/bin/$tool"
  done
  echo "root:x:0:0:root:/:/bin/sh" >"$rootfs/etc/passwd"
  echo "root:x:0:" >"$rootfs/etc/group"
  tar -C "$rootfs" -cf "$rootfs.tar" .
  podman import --change 'ENV PATH=/bin' --change 'CMD ["/bin/sh"]' "$rootfs.tar" "$image" >/dev/null
  rm -f "$rootfs.tar"
  say "built $image from $busybox"
fi

answers() {
  [ -S "$sock" ] && curl -sf --max-time 2 --unix-socket "$sock" http://d/_ping >/dev/null 2>&1
}

if ! answers; then
  rm -f "$sock"
  # setsid + nohup: the service must outlive this script and the shell (or test) that ran it.
  setsid nohup podman system service --time=0 "unix://$sock" >"$dir/service.log" 2>&1 </dev/null 9>&- &
  echo $! >"$dir/service.pid"
  for _ in $(seq 1 100); do
    answers && break
    sleep 0.1
  done
  answers || die "podman system service did not answer on $sock (see $dir/service.log)"
  say "started podman system service (pid $(cat "$dir/service.pid")) on $sock"
fi

if [ "$env_only" = 1 ]; then
  echo "export CONTAINERS_CONF=$CONTAINERS_CONF"
  echo "export DOCKER_HOST=unix://$sock"
else
  echo "CONTAINERS_CONF=$CONTAINERS_CONF"
  echo "DOCKER_HOST=unix://$sock"
fi
