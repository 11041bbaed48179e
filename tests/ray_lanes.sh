#!/usr/bin/env bash
# The Ray tests in two lanes at once, beside the wheel check (tests/wheel_check.sh). Each lane runs in
# its own namespaces (tests/netns.sh): its own loopback ports, and a test's `ray stop` reaches only its
# lane's Ray. Where the namespaces cannot be made, the lanes and the wheel check run one after another.
# Each lane's output is printed whole when it ends.
set -euo pipefail
cd "$(dirname "$0")/.."
py="$1"
lane_a=(tests/cluster/test_cluster.py tests/cluster/test_driver_leftovers.py)
lane_b=(tests/cluster/test_tpu_slices.py tests/cluster/test_resume_layout.py tests/serve/test_service.py
        tests/cluster/test_quarantine.py)
ray_tests() { bash tests/netns.sh "$py" -m pytest -q -m ray --durations=10 "$@"; }
if ! bash tests/netns.sh --check; then
  ray_tests "${lane_a[@]}" "${lane_b[@]}"
  bash tests/wheel_check.sh
  exit
fi
logs="$(mktemp -d)"
trap 'rm -rf "$logs"' EXIT
ray_tests "${lane_a[@]}" > "$logs/ray-lane-a" 2>&1 &
a=$!
ray_tests "${lane_b[@]}" > "$logs/ray-lane-b" 2>&1 &
b=$!
bash tests/wheel_check.sh > "$logs/wheel-check" 2>&1 &
w=$!
failed=0
for job in "wheel-check:$w" "ray-lane-b:$b" "ray-lane-a:$a"; do
  name="${job%%:*}"
  if wait "${job#*:}"; then result=passed; else result=failed; failed=1; fi
  echo "=== $name ($result)"
  cat "$logs/$name"
done
exit "$failed"
