"""Every dev lever in one table: per arm and held-out kind, RWML's reward accuracy, the
warm-up's and RWML's exact match beside the template rule's, RWML's exact match on the targets the rule
misses, and the run's minutes (never alone). Each RUN: a `python train.py --heldout-split valid_seen`
folder or its lab copy.

    python lab/levers_table.py RUN [RUN ...] > all_levers.md
"""
import json
import sys
from pathlib import Path


def rows(run: Path, arm: str, kind: str) -> dict:
    """A scored held-out set, per triplet (game, rollout, step, action)."""
    with open(run / f"wm_eval_{arm}_{kind}.triplets.jsonl") as f:
        return {(r["game"], r.get("rollout"), r["step"], r["action"]): r for r in map(json.loads, f)}


def mean(rs: list[dict], field: str) -> float:
    return sum(float(r[field][0]) for r in rs) / len(rs)


def main() -> None:
    print("| arm | kind | RWML reward accuracy | warm-up exact | RWML exact | rule exact "
          "| RWML exact beyond the rule (n) | run (min) |\n|---|---|---|---|---|---|---|---|")
    for run in map(Path, sys.argv[1:]):
        minutes = json.loads((run / "cost.json").read_text())["seconds"] / 60
        for kind in ("explore", "purposeful"):
            rwml, before, rule = (rows(run, arm, kind) for arm in ("rwml", "before", "template"))
            r = list(rwml.values())
            missed = [x for k, x in rwml.items() if not rule[k]["exact"][0]]
            print(f"| {run.name} | {kind} | {mean(r, 'rewards'):.3f} "
                  f"| {mean(list(before.values()), 'exact'):.3f} | {mean(r, 'exact'):.3f} "
                  f"| {mean(list(rule.values()), 'exact'):.3f} "
                  f"| {mean(missed, 'exact'):.3f} ({len(missed)}) | {minutes:.1f} |")


if __name__ == "__main__":
    main()
