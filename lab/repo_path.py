"""Paths as a reader's clone has them: what the lab's scripts print or store names a file
relative to the repository (`runs/sanity/...`, `lab/results/...`), or `<path>` when it lies outside it — never
the absolute path of the machine that ran it. common.py holds the rule (train.py and eval.py record paths so
too); this module binds it to ROOT, which a test may point elsewhere."""
from __future__ import annotations

from pathlib import Path

from harness import common  # the lab's scripts put the repository first on sys.path
from harness.common import OUTSIDE, is_local_path  # noqa: F401 -- the lab's scripts import it from here

ROOT = Path(__file__).resolve().parents[1]


def repo_path(path, outside: str | None = OUTSIDE) -> str:
    """`path` relative to the repository when it lies inside it, else `outside` (None: the path as given).
    A relative path is taken from the working directory (the lab's scripts run from the repository root)."""
    return common.repo_path(path, outside, ROOT)


def stored_config(config: dict) -> dict:
    """A config as a result stores it: its paths relative to the repository (or `<path>`); ids as they are."""
    return common.stored_config(config, ROOT)
