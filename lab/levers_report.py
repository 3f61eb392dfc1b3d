"""The levers on the dev split: each lever's `python train.py --heldout-split valid_seen` run against the
default's, on the same held-out triplets (exact match, paired by triplet, 95 % CI over games): the warm-up,
RWML, the template rule, RWML - rule, RWML - warm-up, RWML - the default's RWML; the warm-up's SFT cost.

    python lab/levers_report.py DEFAULT_RUN LEVER_RUN [LEVER_RUN ...] [--out levers.md]

Each RUN is a train.py folder (or its lab/results copy) with wm_eval_{before,rwml,template}_<kind> files and
cost.json; the first is the default every lever is compared with.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]
from readout.verdict import compare  # noqa: E402
from readout import stats  # noqa: E402
from envs import UserError  # noqa: E402

KINDS = ("explore", "purposeful")


def short(c: dict) -> str:
    ci = f"{c['diff']:+.3f} [{c['lo']:+.3f}, {c['hi']:+.3f}]"
    v = stats.verdict(c)
    return (f"**{ci}**" if v == "holds" else f"{ci} {'reversed' if v.startswith('reversed') else 'n.d.'}") \
        + f" ({c['up']} up, {c['down']} down, p {c['p']:.3f})"


def minutes(run: Path, stage: str) -> str:
    s = json.loads((run / "cost.json").read_text())["stages"].get(stage)
    return f"{s['seconds'] / 60:.1f}" if s else "–"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    default, rows = a.runs[0], []
    for run in a.runs:
        for kind in KINDS:
            with tempfile.TemporaryDirectory() as tmp:  # the default's RWML beside this run's arms
                t = Path(tmp)
                for arm in ("before", "rwml", "template"):
                    shutil.copy(run / f"wm_eval_{arm}_{kind}.triplets.jsonl", t)
                shutil.copy(default / f"wm_eval_rwml_{kind}.triplets.jsonl",
                            t / f"wm_eval_default_{kind}.triplets.jsonl")
                rule, gain = (compare(t, "rwml", b, kind, "exact") for b in ("template", "before"))
                try:
                    vs = compare(t, "rwml", "default", kind, "exact")
                except UserError:  # H 2's explore set: the collection policy sees 2 turns, plays other turns
                    vs = None
            rows.append(f"| {run.name} | {kind} | {gain['before']:.3f} | {gain['after']:.3f} "
                        f"| {rule['before']:.3f} | {short(rule)} | {short(gain)} "
                        f"| {'–' if run == default else short(vs) if vs else 'other triplets'} "
                        f"| {minutes(run, 'filter sft')} | {minutes(run, 'warm-up collect')} |")
    text = "\n".join([
        "| arm | kind | warm-up | RWML | template rule | RWML − rule | RWML − warm-up "
        "| RWML − default's RWML | warm-up SFT (min) | warm-up collect (min) |",
        "|---|---|---|---|---|---|---|---|---|---|", *rows, "",
        "Exact match on the held-out triplets, paired by triplet, 95 % CI over games "
        "(stats.paired_bootstrap) and the sign-flip test over games (p); **bold**: holds (both agree); "
        "n.d.: no difference detected; other triplets: the arm's held-out set is not the default's (no "
        "pairing). Minutes from each run's cost.json (never alone)."])
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
