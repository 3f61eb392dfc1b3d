# Quick start:  make train   (set up, then `python train.py` on the bundled defaults, and its verdict)
#               make test    (set up, then the test suite)
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
export ALFWORLD_DATA ?= $(HOME)/.cache/alfworld
export HF_HUB_OFFLINE ?= 1
# Which PyTorch build `make setup` installs, chosen here unless TORCH is set: PyPI's (on Linux the CUDA build with
# its nvidia-* wheels, several GB) where an NVIDIA GPU answers `nvidia-smi -L`; else (a laptop, CI, no driver or
# no GPU) PyTorch's CPU build from its own index. TORCH=cuda or TORCH=cpu forces either.
TORCH_SET := $(filter command line environment environment override,$(origin TORCH))
NVIDIA_GPU := $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU ' && echo yes)
TORCH ?= $(if $(NVIDIA_GPU),cuda,cpu)
ifeq ($(filter cpu cuda,$(TORCH)),)
$(error TORCH=$(TORCH): set TORCH=cpu or TORCH=cuda, or leave it unset to choose by `nvidia-smi -L`)
endif
TORCH_WHY := $(if $(TORCH_SET),TORCH=$(TORCH) was set,$(if $(NVIDIA_GPU),an NVIDIA GPU answers nvidia-smi -L,no NVIDIA GPU answers nvidia-smi -L)); TORCH=cpu or TORCH=cuda forces either
# cpu: torch alone from the CPU index (--no-deps: its dependencies are in the lock file, from PyPI); cuda: PyPI's
# torch with its dependencies, the nvidia-* wheels among them
TORCH_INSTALL := $(if $(filter cpu,$(TORCH)),--no-deps torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu,torch==2.13.0)
TORCH_BUILD := $(if $(filter cpu,$(TORCH)),PyTorch's CPU build (its own index),PyPI's torch (on Linux the CUDA build))

.PHONY: setup data train test sanity bench gpu-check arms agent-sanity clean

setup: $(VENV)/.installed

# torch first and alone (the build chosen above, said in one line); then the lock file with --no-deps, so
# exactly the pinned set is installed (torch==2.13.0 is there already: 2.13.0+cpu counts).
$(VENV)/.installed: requirements.txt
	@echo "torch: $(TORCH_BUILD): $(TORCH_WHY)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_INSTALL)
	$(PY) -m pip install -q --no-deps -r requirements.txt
	touch $@

# ALFWorld's game files: $$ALFWORLD_DATA/json_2.1.1 if present, else an archive named by
# ALFWORLD_ARCHIVE, else alfworld's own downloader (needs internet), its progress shown: first what it fetches,
# then a bar per file with its size (redrawn at most every 10 s), a line when each ends.
data: setup
	@if [ -d "$$ALFWORLD_DATA/json_2.1.1" ]; then echo "ALFWorld data: $$ALFWORLD_DATA/json_2.1.1"; \
	elif [ -n "$$ALFWORLD_ARCHIVE" ]; then mkdir -p "$$ALFWORLD_DATA" && tar -xJf "$$ALFWORLD_ARCHIVE" -C "$$ALFWORLD_DATA"; \
	elif echo "ALFWorld data: downloading into $$ALFWORLD_DATA with alfworld-download (GitHub releases of" \
	     "alfworld/alfworld): 4 steps, each downloaded then unpacked: the games' json, their pddl, their" \
	     "TextWorld pddl, a detector checkpoint; each bar shows its size; up to 15 min" \
	     && TQDM_MININTERVAL=10 timeout 900 $(VENV)/bin/alfworld-download --data-dir "$$ALFWORLD_DATA" 2>&1 \
	     && [ -d "$$ALFWORLD_DATA/json_2.1.1" ]; then echo "ALFWorld data downloaded to $$ALFWORLD_DATA"; \
	else echo "error: no ALFWorld data in $$ALFWORLD_DATA/json_2.1.1 and alfworld-download failed; set ALFWORLD_DATA to a folder holding json_2.1.1/, or ALFWORLD_ARCHIVE=path/to/json_2.1.1_all.tar.xz" >&2; exit 2; fi

# OUT: the run's folder (train.py's --out); `python -m readout` reads its verdict from it
OUT ?= runs/rwml
train: data
	$(PY) train.py --out $(OUT) $(ARGS)
	$(PY) -m readout $(OUT)

# TRL for the tests of lab/trl_grpo.py and for lab/bench/; ruff for the lint check; training needs neither
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
