"""The bridge to verl: `train.py export` writes verl's GRPO parquets (export.py), and verl loads
the reward file, reward.py, by its path."""
