# Every target creates/reuses the local virtual environment .venv; nothing is installed by hand.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv test test-all test-fast demo docs example-tunix bench bench-memory bench-replay clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[all,tunix,docs,test]'
	touch $(STAMP)

venv: $(STAMP)

# Two workers (the CI machine has 2 cores); whole files per worker keep module fixtures (servers) shared.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not multihost" tests

test-all: $(STAMP)  ## everything, the 2-process trainer run included
	$(PY) -m pytest -q -n 2 --dist loadfile tests

test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not slow" tests

demo: $(STAMP)  ## the trainer on the embedded server (toy task); a fresh run dir each time
	$(PY) -m trainers.cli train --config configs/demo.yaml --run-dir runs/demo-$$(date +%Y%m%d-%H%M%S)

docs: $(STAMP)  ## the docs site into site/, strict: a broken link, anchor or docstring fails the build
	$(PY) -m mkdocs build --strict --site-dir site

example-tunix: $(STAMP)  ## tunix GRPO with mis_jax's correction on a tiny Qwen3 (examples/tunix_grpo_mis.py)
	$(PY) examples/tunix_grpo_mis.py --steps 8 --mis configs/mis.yaml

bench: $(STAMP)
	$(PY) -m benchmarks.run

bench-memory: $(STAMP)  ## compiled per-device memory of the training step, 8 simulated devices
	$(PY) -m benchmarks.memory

bench-replay: $(STAMP)  ## truncated sampling vs sampling-mask replay on the embedded server (the table in docs/guides/trainer.md)
	$(PY) -m benchmarks.sampling_replay

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
