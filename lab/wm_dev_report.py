"""The world model's lever table on the dev split (valid_seen): each warm-up and its RWML, scored greedily
on the same 96 + 96 held-out triplets, beside the content-free template rule; every comparison paired by
triplet with a 95 % CI over games, the items that changed each way and the exact test (verdict.compare,
verdict.said).

    python lab/wm_dev_report.py runs/wm_dev [--base lab/results/recipe_dev] [--out runs/wm_dev/table.md]
    python lab/wm_dev_report.py lab/results/wm_dev/lever_runs --out lab/results/wm_dev/levers.md

Arms: `<run>/seed0/eval/{warmup_<filter>,<recipe>}_<kind>.triplets.jsonl` (lab/wm_dev.sh; its lab/results
copy: `<run>/eval/`, the rule's files in `<run>/`), and the baseline
(`mixed`: the default run's recipe, 56 warm-up triplets, 3 epochs) from the committed recipe_dev files.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "lab")]
from readout import verdict  # noqa: E402
from harness.common import read_jsonl  # noqa: E402
from envs import UserError  # noqa: E402

KINDS = verdict.HELDOUT_KINDS


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--base", type=Path, default=ROOT / "lab/results/recipe_dev")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    ev, rule = args.run / "seed0" / "eval", args.run / "valid_seen"
    if not ev.is_dir() and (args.run / "eval").is_dir():  # the committed copy (lab/results/wm_dev/lever_runs)
        ev, rule = args.run / "eval", args.run
    if not ev.is_dir() or not all((rule / f"template_{k}.triplets.jsonl").is_file() for k in KINDS):
        raise UserError(f"{args.run} holds no seed0/eval or valid_seen/template_*.triplets.jsonl: give the "
                        "OUT of lab/wm_dev.sh")
    recipes = sorted({p.name.rsplit("_", 1)[0] for p in ev.glob("*_explore.triplets.jsonl")
                      if not p.name.startswith("warmup_")})
    tmp = Path(tempfile.mkdtemp())
    arms = {"mixed": (args.base / "seed0/eval/warmup_mixed", args.base / "seed0/eval/mixed")}
    arms |= {r: (ev / f"warmup_{r}", ev / r) for r in recipes}
    for kind in KINDS:
        shutil.copy(rule / f"template_{kind}.triplets.jsonl", tmp / f"wm_eval_template_{kind}.triplets.jsonl")
        for name, (warm, rwml) in arms.items():
            shutil.copy(f"{warm}_{kind}.triplets.jsonl", tmp / f"wm_eval_w{name}_{kind}.triplets.jsonl")
            shutil.copy(f"{rwml}_{kind}.triplets.jsonl", tmp / f"wm_eval_r{name}_{kind}.triplets.jsonl")
    rows = ["| arm | kind | warm-up exact | RWML exact | template rule | RWML - rule (exact) | RWML - "
            "warm-up (exact) | vs `mixed`: RWML (exact) |", "|---|---|---|---|---|---|---|---|"]
    for name in arms:
        for kind in KINDS:
            c = verdict.compare(tmp, f"r{name}", "template", kind, "exact")
            g = verdict.compare(tmp, f"r{name}", f"w{name}", kind, "exact")
            v = verdict.compare(tmp, f"r{name}", "rmixed", kind, "exact") if name != "mixed" else None
            rows.append(f"| {name} | {kind} | {g['before']:.3f} | {g['after']:.3f} | {c['before']:.3f} | "
                        f"{verdict.said(c)} | {verdict.said(g)} | {verdict.said(v) if v else '-'} |")
    text = "\n".join(rows) + "\n"
    n = {k: len(read_jsonl(tmp / f"wm_eval_template_{k}.triplets.jsonl")) for k in KINDS}
    text += f"\nHeld-out triplets: {n} (valid_seen, greedy).\n"  # no folder of this machine in results
    print(text)
    if args.out:
        args.out.write_text(text)
    shutil.rmtree(tmp)


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        sys.exit(f"error: {e}")
