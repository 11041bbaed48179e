#!/usr/bin/env bash
# Runs a command inside a private network namespace (loopback only) when this user may create
# one (root with unshare), so tests that start Ray or several JAX processes never leave loopback.
# Elsewhere it runs the command as is.
set -euo pipefail
if [ "$(id -u)" = 0 ] && command -v unshare >/dev/null && unshare --net true 2>/dev/null; then
  exec unshare --net sh -c 'ip link set lo up && exec "$@"' sh "$@"
fi
exec "$@"
