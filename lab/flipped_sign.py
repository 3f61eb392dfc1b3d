"""Lab: `python train.py` with GRPO's advantage sign flipped, a broken RWML the quick check must not pass.

    python lab/flipped_sign.py [train.py's arguments]     # e.g. --heldout-split valid_seen --out runs/flip

Every advantage A_i becomes -A_i (rwml.group_advantages patched in this process only): the update then pushes
down the predictions the reward liked. Line (a) of the run's printout must not hold.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo's modules

import rwml  # noqa: E402
import train  # noqa: E402
from envs import RERUN
from harness.cli import run_cli  # noqa: E402

_advantages = rwml.group_advantages


def flipped(*args, **kwargs):
    return -_advantages(*args, **kwargs)


rwml.group_advantages = flipped  # grpo_step looks the name up in rwml at each call

if __name__ == "__main__":
    print("lab/flipped_sign.py: GRPO's advantages are negated in this run (a broken RWML)", file=sys.stderr)
    run_cli(train.main, f"interrupted: {RERUN}")
