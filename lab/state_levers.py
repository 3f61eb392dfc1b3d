"""The dev table of the state-probe levers: per arm (a `python train.py --heldout-split valid_seen`
folder or its lab copy), the held-out sets' exact match, the warm-up's and RWML's, beside the
content-free rule and "rule + copy the last listing seen"; the state probes by type; the run's
minutes; then each arm's RWML against the first arm's, paired by triplet (CI over games, the exact
sign-flip test over games, stats.verdict). Markdown on stdout.

    python lab/state_levers.py NAME=RUN [NAME=RUN ...] > levers.md
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from readout import stats  # noqa: E402 -- after the repository is on the path

KINDS = ("explore", "purposeful", "state")
TAKE_PUT = ("take_revisit", "put_revisit")


def summary(run: Path, arm: str, kind: str) -> dict:
    return json.loads((run / f"wm_eval_{arm}_{kind}.json").read_text())


def rows(run: Path, arm: str, kind: str) -> dict:
    """A scored held-out set, per triplet: (game, rollout, step, action) -> its row."""
    with open(run / f"wm_eval_{arm}_{kind}.triplets.jsonl") as f:
        return {(r["game"], r.get("rollout"), r["step"], r["action"]): r for r in map(json.loads, f)}


def minutes(run: Path) -> float:
    return json.loads((run / "cost.json").read_text())["seconds"] / 60


def paired(a: dict, b: dict, keep=lambda r: True) -> dict:
    """RWML of arm a - RWML of arm b, exact match, over the triplets both scored (and `keep` holds)."""
    keys = sorted(k for k in a if k in b and keep(b[k]))
    if set(a) != set(b):
        raise SystemExit("the arms scored different triplets: not the same held-out set (split, seed, H)")
    x = [float(sum(a[k]["exact"]) / len(a[k]["exact"])) for k in keys]
    y = [float(sum(b[k]["exact"]) / len(b[k]["exact"])) for k in keys]
    return stats.paired_bootstrap(x, y, [k[0] for k in keys], seed=0)


def main() -> None:
    arms = [(n, Path(p)) for n, p in (a.split("=", 1) for a in sys.argv[1:])]
    print("| arm | held-out set (n) | warm-up exact | RWML exact | RWML reward | rule | rule + copy "
          "| run (min) |\n|---|---|---|---|---|---|---|---|")
    for name, run in arms:
        for kind in KINDS:
            s = {a: summary(run, a, kind) for a in ("before", "rwml", "template", "rule_copy")}
            print(f"| {name} | {kind} ({s['rwml']['n']}) | {s['before']['exact_match']:.3f} "
                  f"| {s['rwml']['exact_match']:.3f} | {s['rwml']['wm_accuracy']:.3f} "
                  f"| {s['template']['exact_match']:.3f} | {s['rule_copy']['exact_match']:.3f} "
                  f"| {minutes(run):.1f} |")
    types = list(summary(arms[0][1], "rwml", "state")["per_probe"])
    print("\nState probes, exact match by type: the warm-up -> RWML (rule + copy; the tracker is 1.00 "
          "on each)\n")
    print("| arm | " + " | ".join(f"{t} (n)" for t in types) + " |\n|---|" + "---|" * len(types))
    for name, run in arms:
        b, r, c = (summary(run, a, "state")["per_probe"] for a in ("before", "rwml", "rule_copy"))
        print(f"| {name} | " + " | ".join(f"{b[t]['exact_match']:.2f} -> {r[t]['exact_match']:.2f} "
                                          f"({c[t]['exact_match']:.2f}; {r[t]['n']})" for t in types) + " |")
    base_name, base = arms[0]
    print(f"\nEach arm's RWML - {base_name}'s RWML, exact match, paired by triplet (95 % CI over games; "
          f"{stats.RULE})\n")
    print("| arm | set | difference |\n|---|---|---|")
    for name, run in arms[1:]:
        for kind in KINDS:
            c = paired(rows(run, "rwml", kind), rows(base, "rwml", kind))
            print(f"| {name} | {kind} | {stats.said(c)} |")
        after = paired(rows(run, "rwml", "state"), rows(base, "rwml", "state"),
                       lambda r: r["probe"] in TAKE_PUT)
        print(f"| {name} | state, after a take or a put | {stats.said(after)} |")
    print("\nWithin each arm, RWML - its warm-up on the state probes (exact match):\n")
    for name, run in arms:
        r, b = rows(run, "rwml", "state"), rows(run, "before", "state")
        print(f"- {name}: {stats.said(paired(r, b))}")


if __name__ == "__main__":
    main()
