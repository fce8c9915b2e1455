#!/usr/bin/env bash
# Make sure PostgreSQL and Redis answer on 127.0.0.1; start them where installed but stopped.
set -euo pipefail

wait_for() { # name, check command...
  local name=$1; shift
  for _ in $(seq 1 30); do "$@" >/dev/null 2>&1 && return 0; sleep 1; done
  echo "error: $name does not answer on 127.0.0.1 and could not be started" >&2
  return 1
}

if ! pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; then
  echo "PostgreSQL is not answering; starting it"
  if command -v pg_ctlcluster >/dev/null && [ -d /etc/postgresql ]; then
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start || true
  fi
  wait_for PostgreSQL pg_isready -q -h 127.0.0.1 -p 5432
fi

if ! redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null | grep -q PONG; then
  echo "Redis is not answering; starting it"
  mkdir -p /var/lib/redis /var/log/redis
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
  wait_for Redis sh -c 'redis-cli -h 127.0.0.1 -p 6379 ping | grep -q PONG'
fi
echo "PostgreSQL and Redis answer."
