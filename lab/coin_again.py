"""Lab: `python train.py --reward-control coin` with a second fair coin, the one of seed + COIN_STREAM (the
matched COIN arm's): two coin runs on one seed's data, filter, warm-up and prompts that differ only in their
coins. The over-seeds study's null check: a coin against a coin must not pass the verdict rule.

    python lab/coin_again.py --reward-control coin --seed 71 [train.py's arguments]
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo's modules

import train  # noqa: E402
from envs import RERUN  # noqa: E402
from harness.cli import run_cli  # noqa: E402

STREAM = 1_000_003  # the matched COIN arm's second coin: train.py's COIN_STREAM (readout's at e3e457a)
# where reward_control finds coin_reward: reward.py here, readout/verdict.py at the study's commit (e3e457a)
for name in ("reward", "readout.verdict"):
    module = importlib.import_module(name)
    if hasattr(module, "reward_control") and hasattr(module, "coin_reward"):
        module.coin_reward = lambda seed=0, first=module.coin_reward: first(seed + STREAM)

if __name__ == "__main__":
    print(f"lab/coin_again.py: the coin of seed + {STREAM:,} (a second coin)", file=sys.stderr)
    run_cli(train.main, f"interrupted: {RERUN}")
