"""Which closing verdict a coin run fails and the real run passes, each candidate read from a run's
per-triplet files (no training). Chosen on valid_seen (seed 0's real and coin runs; recipe_dev's flipped
sign); the seeds of valid_unseen are shown apart, as a check, never to choose.

    python lab/verdict_designs.py --dev RUN [RUN ...] --test RUN [RUN ...] [--out designs.md]
    python lab/verdict_designs.py --pairs REAL COIN [REAL COIN ...] [--out pairs.md]

--pairs: what no single run can say, over seeds: each seed's real run - its coin run (`--reward-control coin`,
the same data, filter and warm-up), RWML's scores paired by triplet, on (a) and (b) both kinds pooled; then
the seeds pooled (stats.over_seeds: a t-interval over 2-4 seeds, at least the bootstrap's; a bootstrap over
seeds, then games, from 5; the sign-flip test over seeds); each seed's cell: its CI over games and sign-flip p
over games.

Each RUN is a `python train.py` folder (or its lab/results copy). The candidates, each "passes" only where
every part holds (95 % CI over games, exact match but (a)):
  old: (b) RWML - warm-up on each held-out kind and (e) RWML - the matched COIN arm on each (c290165-f7d2162)
  e: (e) alone, both kinds pooled;  b: (b) alone, both kinds pooled;  a: (a) the sim-to-real reward on
  RWML's own training prompts, warm-up -> RWML;  a+b: (a) and (b) both kinds pooled (train.py's verdict)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "lab")]
from readout import verdict  # noqa: E402
from fresh_seeds_report import sides  # noqa: E402
from readout.verdict import compare  # noqa: E402
from readout import stats  # noqa: E402

KINDS = verdict.HELDOUT_KINDS


def parts(run: Path) -> dict:
    """Each part's paired difference with its CI; None where the run did not score that arm."""
    coin = (run / "wm_eval_coin_explore.triplets.jsonl").is_file()
    got = {"a": compare(run, "rwml", "before", "train", "rewards"),
           "b": compare(run, "rwml", "before", KINDS, "exact"),
           "e": compare(run, "rwml", "coin", KINDS, "exact") if coin else None}
    got |= {f"b {k}": compare(run, "rwml", "before", k, "exact") for k in KINDS}
    got |= {f"e {k}": compare(run, "rwml", "coin", k, "exact") if coin else None for k in KINDS}
    return got


def designs(p: dict) -> dict:
    def holds(*names):
        if any(p[n] is None for n in names):
            return None
        return all(stats.verdict(p[n]) == "holds" for n in names)
    return {"old": holds(*(f"{x} {k}" for x in "be" for k in KINDS)), "e": holds("e"), "b": holds("b"),
            "a": holds("a"), "a+b": holds("a", "b")}


def table(runs: list[Path]) -> str:
    cells = lambda c: "—" if c is None else f"{c['diff']:+.3f} [{c['lo']:+.3f}, {c['hi']:+.3f}]"  # noqa: E731
    said = {True: "**passes**", False: "fails", None: "—"}
    rows = ["| run | (a) | (b) pooled | (e) pooled | old | e | b | a | a+b |", "|---" * 9 + "|"]
    for run in runs:
        p = parts(run)
        d = designs(p)
        rows.append(f"| {run.parent.name}/{run.name} | {cells(p['a'])} | {cells(p['b'])} | {cells(p['e'])} | "
                    + " | ".join(said[d[k]] for k in ("old", "e", "b", "a", "a+b")) + " |")
    return "\n".join(rows) + "\n"


def pairs_table(runs: list[Path]) -> str:
    pairs = list(zip(runs[::2], runs[1::2]))
    names = " | ".join(r.name for r, _ in pairs)
    rows = [f"| real − coin run | {names} | seeds pooled [95 % CI] | verdict |",
            "|---" * (len(pairs) + 3) + "|"]
    for label, kinds, key in (("(a) sim-to-real reward, training prompts", ("train",), "rewards"),
                              ("(a) exact match, training prompts", ("train",), "exact"),
                              ("(b) held-out exact match, both kinds", KINDS, "exact")):
        seeds = [sides(r, "rwml", c, "rwml", kinds, key) for r, c in pairs]
        each = [stats.paired_bootstrap(*s) for s in seeds]
        ci = stats.over_seeds(seeds)
        rows.append(f"| {label} | " + " | ".join(f"{c['diff']:+.3f} [{c['lo']:+.3f}, {c['hi']:+.3f}] "
                                                 f"(p {c['p']:.3f})" for c in each)
                    + f" | {ci['diff']:+.3f} [{ci['lo']:+.3f}, {ci['hi']:+.3f}] | {stats.verdict(ci)}; "
                      f"sign-flip over {ci['seeds']} seeds p {ci['p']:.3f} |")
    return "\n".join(rows) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dev", type=Path, nargs="*", default=[], help="valid_seen runs: these choose")
    ap.add_argument("--pairs", type=Path, nargs="*", default=[], help="REAL COIN folders, seed by seed")
    ap.add_argument("--test", type=Path, nargs="*", default=[], help="valid_unseen: shown only")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    text = "## valid_seen (chooses)\n\n" + table(args.dev) if args.dev else ""
    if args.test:
        text += "\n## valid_unseen (checks)\n\n" + table(args.test)
    if args.pairs:
        text += "\n## real run − coin run, seed by seed and pooled\n\n" + pairs_table(args.pairs)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
