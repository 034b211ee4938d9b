# Every target creates/reuses the local virtual environment .venv; nothing is installed by hand.
# One venv, extended as needed: `make demo` installs what the demo runs (the trainer and the
# embedded server), the other targets everything (the tests, tunix, the docs tools, torch).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo

.PHONY: venv engine browser lint test test-all test-fast demo fleet-demo demo-agent demo-sglang-jax docs docs-check example-tunix example-tunix-sglang-jax bench bench-memory bench-replay bench-exact bench-engines bench-colocated bench-colocated-sglang-jax bench-agents bench-fleet bench-sync bench-real bench-gpu clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[all,tunix,docs,test]'
	touch $(STAMP)

$(DEMO_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	test -f $(STAMP) -a $(STAMP) -nt pyproject.toml || $(PY) -m pip install -q -e '.[train,serve]'
	touch $(DEMO_STAMP)

venv: $(STAMP)

# sglang-jax's own venv (Python >= 3.12, ~/.cache/mis_jax; tunix and the trainer's requirements installed
# beside it: colocated sglang-jax rollouts run the trainer there), created once:
# the real-engine tests need it, and a missing one fails here, before the suite.
engine: $(STAMP)
	$(PY) -m trainers.serving.sglang_jax --prepare --tunix --trainer

# Debian's Chromium, for the docs' check in a headless browser (tests/test_docs.py); once per machine.
browser:
	command -v chromium >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }

# Two workers (the CI machine has 2 cores); whole files per worker keep module fixtures (servers) shared.
lint: $(STAMP)  ## ruff: the format and the lint (pyproject.toml), before any test
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .

test: $(STAMP) engine lint
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=25 -m "not multihost and not repeat and not browser" tests

test-all: $(STAMP) engine browser  ## everything: the 2-process trainer runs and the repeats (marker repeat) included
	$(PY) -m pytest -q -n 2 --dist loadfile tests

test-fast: $(STAMP) lint  ## the library and the trainer's unit parts: no server, subprocess, venv or long invariant (3–4 min on 2 cores)
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not slow and not repeat and not integration and not browser" tests

demo: $(DEMO_STAMP)  ## the trainer on the embedded server (toy task); a fresh run dir each time
	$(PY) -m trainers.cli train --config configs/demo.yaml --run-dir runs/demo-$$(date +%Y%m%d-%H%M%S)

fleet-demo: $(STAMP)  ## router + 2 rollout workers + 2 trainer processes on this machine, by `mis-jax launch` (docs/guides/fleet.md)
	PY=$(PY) deploy/local/fleet_demo.sh

demo-agent: $(DEMO_STAMP)  ## a multi-turn tool task (lookup_digits) on the embedded server: the model learns to call its tool
	$(PY) -m trainers.cli train --config configs/agent_demo.yaml --run-dir runs/agent-demo-$$(date +%Y%m%d-%H%M%S)

demo-sglang-jax: $(STAMP) engine  ## the demo's task with sglang-jax's Engine colocated in the trainer (its venv)
	PYTHONPATH=. JAX_PLATFORMS=cpu $$($(PY) -m trainers.serving.sglang_jax --prepare --trainer) -m trainers.cli train \
	    --config configs/sglang_jax.yaml --run-dir runs/demo-sglang-jax-$$(date +%Y%m%d-%H%M%S)

docs: $(STAMP)  ## the docs site into site/, strict: a broken link, anchor or docstring fails the build
	$(PY) -m mkdocs build --strict --site-dir site

docs-check: $(STAMP) browser  ## the site built strict, and its formulas typeset by MathJax in headless Chromium, offline
	CI=true $(PY) -m pytest -q -p no:cacheprovider -m browser tests/test_docs.py

example-tunix: $(STAMP)  ## tunix GRPO with mis_jax's correction on a tiny Qwen3 (examples/tunix_grpo_mis.py)
	$(PY) examples/tunix_grpo_mis.py --steps 8 --mis configs/mis.yaml

example-tunix-sglang-jax: $(STAMP) engine  ## the same with sglang-jax as tunix's sampler, its log-probs kept (its venv)
	PYTHONPATH=. JAX_PLATFORMS=cpu $$($(PY) -m trainers.serving.sglang_jax --prepare --tunix) examples/tunix_grpo_mis.py \
	    --sglang-jax --steps 8 --mis configs/mis.yaml

bench: $(STAMP)
	$(PY) -m benchmarks.run
	$(PY) -m benchmarks.forms
	$(PY) -m benchmarks.centering
	$(PY) -m benchmarks.proximal
	$(PY) -m benchmarks.agents

bench-memory: $(STAMP)  ## compiled per-device memory of the training step, 8 simulated devices
	$(PY) -m benchmarks.memory

bench-replay: $(STAMP)  ## truncated sampling vs sampling-mask replay on the embedded server (the table in docs/guides/trainer.md)
	$(PY) -m benchmarks.sampling_replay

bench-exact: $(STAMP)  ## exact mode: XLA:CPU's row-dependence probe, 20 demo steps of zero mismatch (bf16/f32, colocated/serve) and the control, the cost against the default (docs/performance.md)
	$(PY) -m benchmarks.exact

bench-colocated: $(STAMP)  ## our step colocated and with the embedded server against tunix's GRPO (docs/performance.md)
	$(PY) -m benchmarks.colocated

bench-colocated-sglang-jax: $(STAMP) engine  ## the same with sglang-jax generating for every contender (its venv)
	PYTHONPATH=. JAX_PLATFORMS=cpu $$($(PY) -m trainers.serving.sglang_jax --prepare --tunix --trainer) \
	    -m benchmarks.colocated --engine sglang-jax

bench-gpu: $(STAMP)  ## one accelerator: the step's MFU (Qwen3-0.6B, 1.7B at 16k tokens), sampler tokens/s, colocated handover (<= 8 min on an H100/H200)
	$(PY) -m benchmarks.gpu_step --json benchmarks/results/gpu_step.json

bench-agents: $(STAMP) engine  ## multi-turn vs single-turn rollouts of the same model tokens on the embedded server and sglang-jax (docs/performance.md)
	$(PY) -m benchmarks.agents

bench-engines: $(STAMP) engine  ## sglang-jax vs mis-jax serve: tokens/s and weight-sync time (docs/performance.md)
	$(PY) -m benchmarks.engines

bench-fleet: $(STAMP)  ## weight sync to 1, 2, 4 mis-jax serve workers behind sglang-router, demo and Qwen3-0.6B shapes (docs/performance.md)
	$(PY) -m benchmarks.fleet

bench-sync: $(STAMP)  ## weights through a file, streamed over HTTP, as deltas: 1 and 4 workers, demo and Qwen3-0.6B shapes, against the machine's file floor (docs/performance.md; ~15 GB at 4 workers)
	$(PY) -m benchmarks.sync

bench-real: $(STAMP)  ## Qwen3-0.6B from transformers trained 3 steps with its server: peak memory against the state, phases against the file floor (docs/performance.md; ~14 GB)
	$(PY) -m benchmarks.real_size

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
