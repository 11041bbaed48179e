# Two commands for a fresh machine: `make train` (the main job on the embedded local default)
# and `make test` (the whole test suite). Both build .venv first.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install train test test-quick lint bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile -e ".[test,aot,trackers]"  # modules compile on first import instead
	touch $(STAMP)

install: $(STAMP)

# The embedded default: llama3-tiny on this Python's standard library sources, byte tokenizer,
# 300 steps on this machine's devices; resumes from runs/llama3-tiny/checkpoints if it is there.
train: install
	$(VENV)/bin/podtrain train

# The tests without Ray run on two pytest workers. Beside them, in a network namespace of their
# own, the Ray tests run one at a time (each starts a cluster and several JAX processes, and their
# hang and heartbeat checks assume no second one), and the wheel is built and run from a fresh
# virtualenv beside a decoy models/ package (outside any namespace: it needs the package registry).
# Their output follows the first run's.
test: install
	$(VENV)/bin/ruff check .
	@ray=$$(mktemp); wheel=$$(mktemp); \
	bash tests/netns.sh $(PY) -m pytest -q -m ray --durations=10 > $$ray 2>&1 & ray_pid=$$!; \
	bash tests/wheel_check.sh > $$wheel 2>&1 & wheel_pid=$$!; \
	bash tests/netns.sh $(PY) -m pytest -q -n 2 -m "not ray" --durations=25; rest=$$?; \
	wait $$ray_pid; ray_rc=$$?; wait $$wheel_pid; wheel_rc=$$?; \
	echo "--- the Ray tests"; cat $$ray; echo "--- the wheel check"; cat $$wheel; rm -f $$ray $$wheel; \
	[ $$rest = 0 ] && [ $$ray_rc = 0 ] && [ $$wheel_rc = 0 ]

test-quick: install
	bash tests/netns.sh $(PY) -m pytest -q -n 2 -m "not slow"

lint: install
	$(VENV)/bin/ruff check .

bench: install
	$(PY) bench/train_step.py
	$(PY) bench/memory_depth.py
	$(PY) bench/loop.py
	$(PY) bench/moe.py
	$(PY) bench/generate.py
	$(PY) bench/generate_tp.py
	$(PY) bench/plan_targets.py
	$(PY) bench/chat_sft.py
	bash tests/netns.sh $(PY) bench/serve.py --no-skyrl
	bash tests/netns.sh $(PY) bench/cluster.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
