# Two commands for a fresh machine: `make train` (the main job on the embedded local default)
# and `make test` (the whole test suite). Both build .venv first.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install train test test-quick lint bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# Until `podtrain train` lands: plan + real sharded train steps of llama3-tiny on 8 simulated devices.
train: install
	$(VENV)/bin/podtrain check -c llama3-tiny --cpu-devices 8 mesh.fsdp=4 mesh.tp=2 --steps 3

test: install
	$(VENV)/bin/ruff check .
	bash tests/netns.sh $(PY) -m pytest -q

test-quick: install
	bash tests/netns.sh $(PY) -m pytest -q -m "not slow"

lint: install
	$(VENV)/bin/ruff check .

bench: install
	$(PY) bench/train_step.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
