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
	$(PY) -m pip install -q --no-compile --no-deps tinker-cookbook==0.6.1  # see the test extra
	touch $(STAMP)

install: $(STAMP)

# The embedded default: llama3-tiny on this Python's standard library sources, byte tokenizer,
# 300 steps on this machine's devices; resumes from runs/llama3-tiny/checkpoints if it is there.
train: install
	$(VENV)/bin/podtrain train

# Tests without Ray run on two pytest workers; then the Ray tests (timing-sensitive: hang detection,
# heartbeats) run in two lanes, each in its own network and PID namespace, beside the wheel check: the
# wheel is built and run from a fresh virtualenv beside a decoy models/ package (it needs the package
# registry, so it runs outside the namespaces).
test: install
	$(VENV)/bin/ruff check .
	bash tests/netns.sh $(PY) -m pytest -q -n 2 -m "not ray" --durations=25
	bash tests/ray_lanes.sh $(PY)

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
	$(PY) bench/context.py
	$(PY) bench/step_estimate.py
	$(PY) bench/chat_sft.py
	$(PY) bench/host_memory.py
	$(PY) bench/paging.py
	$(PY) bench/serve_state.py
	bash tests/netns.sh $(PY) bench/serve.py --no-skyrl
	bash tests/netns.sh $(PY) bench/cluster.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
