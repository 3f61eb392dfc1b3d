"""Lab: the lines of Python outside tests/ and lab/ that each optional feature holds (what
would have to go to reach a line budget). A feature is whole modules and named top-level definitions; a
definition's lines run to the next top-level statement (its comments and blank lines with it). The hooks a
feature leaves in other modules (its settings, checks, eval.py's branches) are not counted: removing it
saves at least this much.

    python lab/feature_lines.py
"""
from __future__ import annotations

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FEATURES = {  # feature -> {module: names (None: the whole module)}
    "tau2-bench": {"worlds/tau2.py": None},
    "TextWorld": {"worlds/textworld.py": (
        "TW_SPLITS", "TW_POOL", "TW_MAX", "TW_GAME_KEYS", "tw_game_problem", "textworld_game_path",
        "make_textworld_game", "textworld_games", "TwGame", "TextWorld")},
    "choose mode": {"choose/__init__.py": None},
    "verl (export, reward file)": {"verl_bridge/export.py": None, "verl_bridge/reward.py": None},
    "the game pool (ALFWorld's speed)": {"envs.py": ("_ORIGINALS", "use_engine_cache", "_serve", "EnvPool")},
    "the fast log-prob paths": {"engine/__init__.py": (
        "_chunk_logps", "_decoder_logprobs", "_head_logprobs", "group_logprobs", "_shared_prompt_logprobs",
        "FastPaths", "_FAST_PATHS", "fast_paths", "_probe_fast_paths", "_check"), "rwml.py": (
        "micro_batches", "_trimmed", "batch_logprobs")},
    "model cards": {"cards/__init__.py": ("card_run", "card_folder", "METHODS", "write_card", "WM_KINDS",
                                         "shown_arg", "base_license", "_EXAMPLE", "query_snippet")},
    "cost line": {"cost/__init__.py": None},
}


def spans(path: Path) -> dict[str, int]:
    """Each top-level name of `path` -> its lines, to the next top-level statement."""
    text = path.read_text()
    body, n = ast.parse(text).body, len(text.splitlines())
    out = {}
    for node, nxt in zip(body, body[1:] + [None]):
        end = (nxt.lineno - 1 - len(getattr(nxt, "decorator_list", []) or [])) if nxt else n
        start = node.lineno - len(getattr(node, "decorator_list", []) or [])
        names = ([node.name] if hasattr(node, "name") else
                 [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
                 or ([node.target.id] if isinstance(getattr(node, "target", None), ast.Name) else []))
        for name in names:
            out[name] = end - start + 1
    return out


def main() -> None:
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True).stdout
    files = [ROOT / f for f in tracked.split()  # as tests/test_layout.py counts: no tests, lab
             if f.split("/")[0] not in ("tests", "lab")]
    total = sum(len(p.read_text().splitlines()) for p in files)
    print(f"Python outside tests/ and lab/: {total} lines\n\n| feature | lines |\n|---|---|")
    left = total
    for feature, where in FEATURES.items():
        n = 0
        for module, names in where.items():
            path = ROOT / module
            n += len(path.read_text().splitlines()) if names is None else sum(spans(path)[k] for k in names)
        left -= n
        print(f"| {feature} | {n} |")
        print(f"| *what is left without it and every one above* | *{left}* |")


if __name__ == "__main__":
    main()
