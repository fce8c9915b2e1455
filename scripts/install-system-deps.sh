#!/usr/bin/env bash
# Debian packages the tests need: Podman (a real container engine with the Docker API), runc,
# busybox (to build a local image: no registry is reachable here) and Chromium (browser tests).
# Installs only what is missing; where apt is not usable, says so and lets those tests skip.
set -uo pipefail

need=()
command -v podman >/dev/null || need+=(podman)
command -v runc >/dev/null || need+=(runc)
[ -x /bin/busybox ] || need+=(busybox-static)
[ -x /usr/bin/chromium ] || need+=(chromium)
command -v docker-compose >/dev/null || need+=(docker-compose)

if ((${#need[@]} == 0)); then
  echo "System packages present."
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "warning: missing ${need[*]} and cannot apt-get install here; tests that need them will skip" >&2
  exit 0
fi
echo "Installing ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null && apt-get install -y -q "${need[@]}" >/dev/null \
  || echo "warning: apt-get install ${need[*]} failed; tests that need them will skip" >&2
exit 0
