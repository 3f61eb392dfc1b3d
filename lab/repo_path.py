"""Paths as a reader's clone has them (issue 50 item 7): what the lab's scripts print or store names a file
relative to the repository (`runs/sanity/...`, `lab/results/...`), or `<path>` when it lies outside it — never
the absolute path of the machine that ran it. The standard library only."""
from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = "<path>"  # what a stored path outside the repository becomes
PATH_KEYS = ("transitions", "eval_transitions", "adapter", "out", "filter_dir")  # config fields: paths
MAYBE_PATH_KEYS = ("model", "embedder")  # a Hub id or bundled:NAME, or a local folder


def repo_path(path, outside: str | None = OUTSIDE) -> str:
    """`path` relative to the repository when it lies inside it, else `outside` (None: the path as given).
    A relative path is taken from the working directory (the lab's scripts run from the repository root)."""
    full = Path(os.path.abspath(os.path.expanduser(str(path))))
    for candidate in (full, full.resolve()):  # a symlinked folder under the repository counts as inside
        try:
            return candidate.relative_to(ROOT).as_posix()
        except ValueError:
            continue
    return str(path) if outside is None else outside


def is_local_path(value: str) -> bool:
    """An absolute or home path, or one that exists here (a local model folder, not a Hub id)."""
    return os.path.isabs(os.path.expanduser(value)) or Path(value).exists()


def stored_config(config: dict) -> dict:
    """A config as a result stores it: its paths relative to the repository (or `<path>`); ids as they are."""
    return {k: repo_path(v) if isinstance(v, str) and (k in PATH_KEYS or k in MAYBE_PATH_KEYS
                                                       and is_local_path(v)) else v
            for k, v in config.items()}
