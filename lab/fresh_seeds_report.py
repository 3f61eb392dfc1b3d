"""Issues 53 and 56 on valid_unseen: the default run's closing comparisons on fresh seeds, each seed's value
and the seeds pooled (a two-level bootstrap: seeds, then games; two seeds: the seed part rests on two values).
Exact match, paired by triplet (runs.compare on each seed; stats.two_level_bootstrap over them).

    python lab/fresh_seeds_report.py RUN [RUN ...] [--out table.md]

Each RUN is a `python train.py` folder (or its lab/results copy) holding wm_eval_<arm>_<kind>.triplets.jsonl
for rwml, before (the warm-up), template (the rule) and coin (the matched COIN arm). A coin run
(--reward-control coin) reads the same way: its "RWML" was trained on a coin, its matched arm on another coin.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]
import train  # noqa: E402
from integrations.runs import compare, triplet_key  # noqa: E402
from support import stats  # noqa: E402
from support.common import UserError, read_jsonl  # noqa: E402

ROWS = (("template", "the template rule"), ("before", "the warm-up"), ("coin", "the matched COIN arm"))


def pooled(runs: list[Path], arm: str, base: str, kind: str) -> dict:
    """arm - base over the seeds (runs), each seed's triplets paired by key, games as units."""
    sides = []
    for run in runs:
        x, y = (read_jsonl(run / f"wm_eval_{w}_{kind}.triplets.jsonl") for w in (arm, base))
        by_key = {json.dumps(triplet_key(r)): r for r in x}
        pairs = [(by_key[json.dumps(triplet_key(r))], r) for r in y]
        a, b = ([sum(map(float, r["exact"])) / len(r["exact"]) for r in side] for side in zip(*pairs))
        sides.append((a, b, [str(r["game"]) for _, r in pairs]))
    return stats.two_level_bootstrap(sides)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", type=Path, nargs="+")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    for run in args.runs:
        missing = [f"wm_eval_{a}_{k}" for a in ("rwml", *dict(ROWS)) for k in train.HELDOUT_KINDS
                   if not (run / f"wm_eval_{a}_{k}.triplets.jsonl").is_file()]
        if missing:
            raise UserError(f"{run} lacks {', '.join(missing)}: give folders of `python train.py` runs")
    names = " / ".join(r.name for r in args.runs)
    rows = [f"| kind | RWML − | exact match: each seed ({names}) | seeds pooled [95 % CI] | verdict |",
            "|---|---|---|---|---|"]
    for kind in train.HELDOUT_KINDS:
        for base, label in ROWS:
            each = [compare(run, "rwml", base, kind, "exact") for run in args.runs]
            ci = pooled(args.runs, "rwml", base, kind)
            cells = "; ".join(f"{c['after']:.3f} − {c['before']:.3f} = {c['diff']:+.3f} [{c['lo']:+.3f}, "
                              f"{c['hi']:+.3f}] ({c['up']} up, {c['down']} down)" for c in each)
            rows.append(f"| {kind} | {label} | {cells} | {ci['diff']:+.3f} [{ci['lo']:+.3f}, "
                        f"{ci['hi']:+.3f}] | {stats.verdict(ci, stats.half_width(ci))} |")
    text = "\n".join(rows) + (f"\n\nSeeds pooled: {len(args.runs)} seeds, then games "
                              f"({stats.N_BOOT:,} draws); each seed's CI over games.\n")
    # each run's closing verdict as today's train.py words it, from its files (run_log.txt: the run's own)
    text += "".join(f"\n{run.name}: {train.gain_lines(run, start='warm-up')[-1]}\n" for run in args.runs)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        sys.exit(f"error: {e}")
