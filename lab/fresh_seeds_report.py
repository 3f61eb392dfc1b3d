"""On valid_unseen: the default run's closing comparisons on fresh seeds, each seed's value
and the seeds pooled (stats.over_seeds: a t-interval, at least the bootstrap's, and the sign-flip test over
2-4 seeds).
Exact match, paired by triplet (verdict.compare on each seed; stats.over_seeds over them).

    python lab/fresh_seeds_report.py RUN [RUN ...] [--out table.md]

Each RUN is a `python train.py` folder (or its lab/results copy) holding wm_eval_<arm>_<kind>.triplets.jsonl
for rwml, before (the warm-up), template (the rule), and coin (the matched COIN arm) where the runs were made
with --coin-control; rows (a), the sim-to-real reward on the training prompts, and (b) both held-out kinds
pooled are the verdict's. A coin run
(--reward-control coin) reads the same way: its "RWML" was trained on a coin, its matched arm on another coin.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]
from stages.runs import triplet_key  # noqa: E402
from readout import verdict  # noqa: E402
from readout.verdict import compare  # noqa: E402
from readout import stats  # noqa: E402
from harness.common import read_jsonl  # noqa: E402
from envs import UserError  # noqa: E402

ROWS = (("template", "the template rule"), ("before", "the warm-up"), ("coin", "the matched COIN arm"))


def sides(x_run: Path, x_arm: str, y_run: Path, y_arm: str, kinds: tuple, key: str) -> tuple:
    """(x's per-triplet means, y's, games): wm_eval_<arm>_<kind> of two folders (or one), by triplet."""
    a, b, games = [], [], []
    for kind in kinds:
        x = read_jsonl(x_run / f"wm_eval_{x_arm}_{kind}.triplets.jsonl")
        x = {json.dumps(triplet_key(r)): r for r in x}
        for r in read_jsonl(y_run / f"wm_eval_{y_arm}_{kind}.triplets.jsonl"):
            a.append(sum(map(float, x[json.dumps(triplet_key(r))][key])) / len(r[key]))
            b.append(sum(map(float, r[key])) / len(r[key]))
            games.append(str(r["game"]))
    return a, b, games


def pooled(runs: list[Path], arm: str, base: str, kinds: tuple, key: str = "exact") -> dict:
    """arm - base over the seeds (runs), each seed's triplets (of every kind in `kinds`) paired by key, games
    as units."""
    return stats.over_seeds([sides(run, arm, run, base, kinds, key) for run in runs])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", type=Path, nargs="+")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    for run in args.runs:
        missing = [f"wm_eval_{a}_{k}" for a in ("rwml", "before", "template") for k in verdict.HELDOUT_KINDS
                   if not (run / f"wm_eval_{a}_{k}.triplets.jsonl").is_file()]
        if missing:
            raise UserError(f"{run} lacks {', '.join(missing)}: give folders of `python train.py` runs")
    coin = all((run / f"wm_eval_coin_{k}.triplets.jsonl").is_file()  # --coin-control's arm, when scored
               for run in args.runs for k in verdict.HELDOUT_KINDS)
    names = " / ".join(r.name for r in args.runs)
    rows = [f"| kind | RWML − | each seed ({names}) | seeds pooled [95 % CI] | verdict |",
            "|---|---|---|---|---|"]
    cases = [("(a) train prompts, sim-to-real reward", "before", ("train",), "rewards")]
    cases += [(kind, base, (kind,), "exact") for kind in verdict.HELDOUT_KINDS for base, _ in ROWS
              if coin or base != "coin"]
    cases.append(("(b) both kinds pooled", "before", verdict.HELDOUT_KINDS, "exact"))
    for label, base, kinds, key in cases:
        each = [compare(run, "rwml", base, kinds if len(kinds) > 1 else kinds[0], key) for run in args.runs]
        ci = pooled(args.runs, "rwml", base, kinds, key)
        cells = "; ".join(f"{c['after']:.3f} − {c['before']:.3f} = {c['diff']:+.3f} [{c['lo']:+.3f}, "
                          f"{c['hi']:+.3f}] ({c['up']} up, {c['down']} down, p {c['p']:.3f})" for c in each)
        rows.append(f"| {label} | {dict(ROWS)[base]} | {cells} | {ci['diff']:+.3f} [{ci['lo']:+.3f}, "
                    f"{ci['hi']:+.3f}] | {stats.verdict(ci, stats.half_width(ci))}; sign-flip over "
                    f"{ci['seeds']} seeds p {ci['p']:.3f} |")
    text = "\n".join(rows) + (f"\n\nExact match but (a); seeds pooled: the mean of {len(args.runs)} seeds' "
                              "differences, a t-interval over them, never narrower than the bootstrap over "
                              "seeds, then games (that bootstrap alone from "
                              f"{stats.MIN_BOOT_SEEDS} seeds) and the sign-flip test over seeds; each seed's "
                              f"CI over games ({stats.N_BOOT:,} draws), its sign-flip test over games (p). "
                              f"{stats.RULE}.\n")
    # each run's closing verdict as today's train.py words it, from its files (run_log.txt: the run's own)
    text += "".join(f"\n{run.name}: {verdict.gain_lines(run, start='warm-up')[-1]}\n" for run in args.runs)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        sys.exit(f"error: {e}")
