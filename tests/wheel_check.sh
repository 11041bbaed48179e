#!/usr/bin/env bash
# Builds podtrain's wheel, installs it into a fresh virtualenv and runs `podtrain plan` and a short
# `podtrain train` from a directory whose own `models/` package and `sharding.py` module would shadow
# podtrain's if it claimed those top-level names (as a user's project often has them).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# From a copy of the source files git knows of (tracked, or new and not ignored), so that no build
# output left in the working tree (a stale build/) can slip into the wheel.
mkdir "$work/src"
(cd "$root" && git ls-files -z --cached --others --exclude-standard \
  | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done) \
  | tar -C "$root" --null -T - -cf - | tar -C "$work/src" -xf -
python3 -m pip wheel -q --no-deps "$work/src" -w "$work/dist"
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q --no-compile "$work"/dist/podtrain-*.whl  # modules compile on first import
mkdir -p "$work/project/models"
echo 'raise ImportError("the project decoy models/ was imported instead of podtrain.models")' > "$work/project/models/__init__.py"
echo 'raise ImportError("the project decoy sharding.py was imported instead of podtrain.sharding")' > "$work/project/sharding.py"
cd "$work/project"
export JAX_PLATFORMS=cpu
"$work/venv/bin/podtrain" plan -c llama3-tiny --no-compile > plan.txt
grep -q "param" plan.txt
"$work/venv/bin/podtrain" train -c llama3-tiny cluster=none train.steps=3 model.num_layers=2 model.hidden_size=64 \
  model.intermediate_size=128 model.head_dim=16 train.batch_size=4 train.seq_len=32 train.eval_every=0 \
  checkpoint.every_steps=3 > train.txt
grep -q "steps 0 -> 3" train.txt
# Without the aot extra, --target says what to install (one line, exit code 2).
set +e
"$work/venv/bin/podtrain" plan -c llama3-tiny --target v5p-8 2> target.txt
code=$?
set -e
[ "$code" = 2 ] && grep -q "pip install 'podtrain\[aot\]'" target.txt && [ "$(wc -l < target.txt)" = 1 ]
echo "wheel check: plan and train ran from the installed wheel beside a decoy models/ and sharding.py"
