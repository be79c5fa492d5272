# `make quickstart` and `make test` set up .venv on a fresh machine, then run.
# TORCH picks the torch build, always with its matching torchvision (streaming shards import it). The default
# is a CUDA build that also runs on a CPU; on an NVIDIA machine with older drivers use e.g.
#   make quickstart TORCH="torch==2.5.1 torchvision==0.20.1 --index-url https://download.pytorch.org/whl/cu124"
PYTHON ?= python3
TORCH ?= torch==2.14.1 torchvision==0.29.1
VENV := .venv
PY := $(VENV)/bin/python

# The Colossal-AI environment, also the oldest stack we support: Colossal-AI 0.5 pins torch<=2.5.1,
# diffusers 0.29, transformers 4.51 and peft<=0.13.2.
COMPAT := .venv-compat
COMPAT_PINS := torch==2.5.1 torchvision==0.20.1 diffusers==0.29.0 transformers==4.51.3 "peft<=0.13.2"

.PHONY: setup quickstart test test-compat lint format bench clean

$(VENV)/.installed: setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[dev,ui]"
	# open_clip_torch only for its CLIP BPE vocabulary file; --no-deps keeps its other dependencies out.
	$(PY) -m pip install -q --no-deps open_clip_torch
	touch $@

setup: $(VENV)/.installed

quickstart: setup
	$(PY) -m examples.digits --out outputs/quickstart

test: setup lint
	$(PY) -m pytest -n 2 --dist loadgroup --durations=15

$(COMPAT)/.installed: setup.py
	test -x $(COMPAT)/bin/python || $(PYTHON) -m venv $(COMPAT)
	$(COMPAT)/bin/python -m pip install -q --upgrade pip
	$(COMPAT)/bin/python -m pip install -q $(COMPAT_PINS) -e ".[dev,colossalai]"
	$(COMPAT)/bin/python -m pip install -q --no-deps open_clip_torch
	touch $@

# The suite again in the Colossal-AI environment, ColossalAIStrategy tests included (a 906 MB torch
# wheel; about 5 minutes to install; the tests JIT-build Colossal-AI's CPU Adam kernel once, ~70 s).
test-compat: $(COMPAT)/.installed
	$(COMPAT)/bin/python -m pytest -p no:cacheprovider -n 2 --dist loadgroup --durations=15

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# The benchmarks (minutes each; see docs/performance.md). CI runs only their --smoke modes, in the tests.
bench: setup
	$(PY) benchmarks/throughput.py
	$(PY) benchmarks/memory.py
	$(PY) benchmarks/time_to_quality.py
	$(PY) benchmarks/pretrain.py
	$(PY) benchmarks/masking.py
	$(PY) benchmarks/microdit_vs_unet.py

format: setup
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

clean:
	rm -rf outputs logs .pytest_cache
