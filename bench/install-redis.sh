#!/usr/bin/env bash
# Installs redis-server (the comparison reference of `kvtier-bench server`) when missing.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1; then
  echo "redis-server: $(redis-server --version)"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "install-redis.sh: needs root for apt-get (or install redis-server yourself)" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq redis-server >/dev/null
# The package starts a system instance; the bench starts its own on private ports.
systemctl disable --now redis-server >/dev/null 2>&1 || true
echo "redis-server: $(redis-server --version)"
