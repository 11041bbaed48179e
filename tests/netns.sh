#!/usr/bin/env bash
# Runs a command inside a private network and PID namespace when this user may create them (root
# with unshare): tests that start Ray or several JAX processes never leave loopback, and `ray stop`
# sees only this namespace's Ray. bash is the namespace's first process, so it reaps the processes
# orphaned there (Ray's daemons). Elsewhere it runs the command as is. `--check` says whether the
# namespaces can be made.
set -euo pipefail
isolated() {
  [ "$(id -u)" = 0 ] && command -v unshare >/dev/null && unshare --net --pid --fork --mount-proc true 2>/dev/null
}
if [ "${1-}" = --check ]; then
  isolated
  exit
fi
if isolated; then
  exec unshare --net --pid --fork --mount-proc bash -c 'ip link set lo up && "$@" & wait $!' bash "$@"
fi
exec "$@"
