"""Lab: the table of lab/recipe_dev.sh. Per recipe: (a) the reward on its own training
prompts, warm-up -> RWML, and (b) held-out RWML - warm-up per kind, under the reward and exact match; paired
on triplets, 95 % CIs over games (one seed) or over seeds, then games (several; stats.py).

    python lab/recipe_report.py runs/recipe_dev [--recipes a,b] [--out TABLE.md]
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "lab")]
from readout import stats  # noqa: E402
from harness.common import write_atomic  # noqa: E402
from envs import UserError  # noqa: E402

CELLS = (("train", "rewards"), ("explore", "rewards"), ("explore", "exact"), ("purposeful", "rewards"),
         ("purposeful", "exact"))


def per_triplet(path: Path, key: str) -> dict:
    """(game, rollout, step, action) -> the mean of the triplet's predictions under `key`."""
    try:
        rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []
    except ValueError:
        raise UserError(f"{path} is not JSON lines; score the arm again (lab/recipe_dev.sh)") from None
    return {(str(r["game"]), r.get("rollout"), r.get("step"), r["action"]):
            sum(map(float, r[key])) / len(r[key]) for r in rows}


def compare(runs: list[tuple[Path, Path]], key: str):
    """(before, after) triplet files per seed -> (before mean, after mean, CI, items) or None."""
    data, means = [], []
    for b, a in runs:
        before, after = per_triplet(b, key), per_triplet(a, key)
        common = sorted(set(before) & set(after))
        if common:
            data.append(([after[k] for k in common], [before[k] for k in common], [k[0] for k in common]))
            means.append((sum(before[k] for k in common) / len(common),
                          sum(after[k] for k in common) / len(common)))
    if not data:
        return None
    ci = stats.over_seeds(data)
    return (sum(m[0] for m in means) / len(means), sum(m[1] for m in means) / len(means), ci,
            sum(len(d[0]) for d in data) // len(data))


def cell(c) -> str:
    if c is None:
        return "-"
    b, a, ci, _ = c
    seeds = "" if len(ci["per_seed"]) == 1 else " (" + " / ".join(f"{x:+.3f}" for x in ci["per_seed"]) + ")"
    return (f"{b:.3f} -> {a:.3f}, {ci['diff']:+.3f} [{ci['lo']:+.3f}, {ci['hi']:+.3f}]{seeds} "
            f"{stats.verdict(ci, stats.half_width(ci))}; sign-flip p {ci['p']:.3f}")


def table(out: Path, recipes: list[str] | None = None) -> list[str]:
    seeds = sorted(out.glob("seed*/eval"))
    if not seeds:
        raise UserError(f"no seed*/eval under {out}: give the folder lab/recipe_dev.sh wrote (its OUT)")
    names = sorted({re.sub(r"_(train|explore|purposeful)\.triplets\.jsonl$", "", f.name)
                    for d in seeds for f in d.glob("*.triplets.jsonl")})
    lines = [f"{len(seeds)} seed(s): {', '.join(d.parent.name for d in seeds)}. {stats.RULE}", "",
             "| recipe | (a) its training prompts: reward | (b) explore: reward | explore: exact | "
             "purposeful: reward | purposeful: exact |", "|---|---|---|---|---|---|"]
    for r in recipes or [n for n in names if not n.startswith("warmup_")]:
        cfgs = [json.loads(c.read_text()) for c in sorted(out.glob(f"seed*/{r}/config.json"))]
        filt = (Path(cfgs[0]["filter_dir"]).name.removeprefix("filter_")
                if cfgs and cfgs[0].get("filter_dir") else "plain")
        cs = [compare([(d / f"warmup_{filt}_{k}.triplets.jsonl", d / f"{r}_{k}.triplets.jsonl")
                       for d in seeds], key) for k, key in CELLS]
        lines.append(f"| {r} ({cs[0][3] if cs[0] else 0} prompts) | " + " | ".join(map(cell, cs)) + " |")
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(prog="lab/recipe_report.py")
    p.add_argument("out", help="lab/recipe_dev.sh's OUT folder")
    p.add_argument("--recipes", default=None, help="comma-separated recipe names (default: all)")
    p.add_argument("--out", dest="table", default=None, help="also write the table here")
    args = p.parse_args(argv)
    lines = table(Path(args.out), args.recipes.split(",") if args.recipes else None)
    print("\n".join(lines))
    if args.table:
        write_atomic(Path(args.table), "\n".join(lines) + "\n")


if __name__ == "__main__":
    from harness.cli import run_cli

    run_cli(main)
