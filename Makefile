# Quick start:  make train   (set up, then `python train.py` on the bundled defaults)
#               make test    (set up, then the test suite)
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
export ALFWORLD_DATA ?= $(HOME)/.cache/alfworld
export HF_HUB_OFFLINE ?= 1

.PHONY: setup data train test sanity bench gpu-check arms agent-sanity clean

setup: $(VENV)/.installed

# torch first and alone: with it pinned on its own pip takes the local CPU build where there is one;
# then the lock file with --no-deps, so exactly the pinned set is installed.
$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-deps -r requirements.txt
	touch $@

# ALFWorld's game files: $$ALFWORLD_DATA/json_2.1.1 if present, else an archive named by
# ALFWORLD_ARCHIVE, else alfworld's own downloader (needs internet).
data: setup
	@if [ -d "$$ALFWORLD_DATA/json_2.1.1" ]; then echo "ALFWorld data: $$ALFWORLD_DATA/json_2.1.1"; \
	elif [ -n "$$ALFWORLD_ARCHIVE" ]; then mkdir -p "$$ALFWORLD_DATA" && tar -xJf "$$ALFWORLD_ARCHIVE" -C "$$ALFWORLD_DATA"; \
	elif timeout 900 $(VENV)/bin/alfworld-download --data-dir "$$ALFWORLD_DATA" >/dev/null 2>&1 \
	     && [ -d "$$ALFWORLD_DATA/json_2.1.1" ]; then echo "ALFWorld data downloaded to $$ALFWORLD_DATA"; \
	else echo "error: no ALFWorld data in $$ALFWORLD_DATA/json_2.1.1 and alfworld-download failed; set ALFWORLD_DATA to a folder holding json_2.1.1/, or ALFWORLD_ARCHIVE=path/to/json_2.1.1_all.tar.xz" >&2; exit 2; fi

train: data
	$(PY) train.py $(ARGS)

# TRL for the tests of `--trainer trl` and for lab/bench/; ruff for the lint check; training needs neither
$(VENV)/.installed-trl: $(VENV)/.installed lab/bench/requirements.txt
	$(PY) -m pip install -q --no-deps -r lab/bench/requirements.txt
	touch $@

test: data $(VENV)/.installed-trl
	$(PY) -m ruff check .
	$(PY) -m pytest -q tests $(ARGS)

# RWML learning, measured: 3 seeds, warm-up vs warm-up + RWML vs the matched WM-SFT and COIN controls
sanity: data
	PY=$(PY) bash lab/sanity.sh

bench: data
	$(PY) lab/bench/env_speed.py $(ARGS)

# every CUDA path once, on random Qwen2.5-0.5B / 1.5B-shaped models (no download); output -> lab/results/
gpu-check: setup
	$(PY) lab/bench/gpu_check.py --out lab/results/gpu_check/gpu_check.txt $(ARGS)

# every arm of the paper's comparison, small, then one table (runs/arms/results.md); see lab/arms.sh
arms: data
	PY=$(PY) bash lab/arms.sh

# the agent comparison on a laptop: TextWorld, --action-mode choose, five arms x 3 seeds (lab/agent_sanity.sh)
agent-sanity: setup
	PY=$(PY) bash lab/agent_sanity.sh

clean:
	rm -rf $(VENV) runs
