"""Do the committed tables' verdicts depend on the bootstrap's RNG seed?

    python lab/rng_check.py [--seeds 20]

Recomputes every table of lab/results/ that prints a verdict from its committed per-item files (the commands
of tests/test_stats.py's committed-tables test, and strict_rescore's comparisons and per-kind table) once per
bootstrap RNG seed 0 .. SEEDS-1 (stats.py's RNG_SEED), and compares the tables with every number blanked:
what is left is the verdicts ("holds", "no difference detected ...", the per-kind marks). Prints, per table,
the rows whose verdict changed with the seed; none is the claim the study READMEs make.
"""
from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "lab")]
from readout import stats  # noqa: E402

RES = ROOT / "lab" / "results"
NUMBER = re.compile(r"[+\-−]?\d+(?:\.\d+)?")
SANITY_ARMS = {"RWML": "rwml", "policy RL": "seed*/policy", "RWML + policy RL": "seed*/rwml_policy",
               "WM SFT + policy RL": "seed*/wm_sft_policy",
               "policy RL, seeds 1-2 (not the recipe's)": "seed[12]/policy",
               "WM SFT + policy RL, seeds 1-2": "seed[12]/wm_sft_policy"}


def tables() -> dict:
    """name -> a function giving that table's lines (every input read once, before the seeds)."""
    import agent_stats
    import rescore

    data = rescore.read_archive(RES / "stage1_test_table" / "sanity_valid_unseen_triplets.tar.xz")
    seeds = sorted({s for s, _, _ in data if s.startswith("seed")})
    out = {"strict_rescore: comparisons": lambda: rescore.comparison_table(data, seeds)[0],
           "strict_rescore: per kind": lambda: rescore.kind_table(data, seeds)}
    for study in ("tw_wm_dev", "tw_wm_test"):
        folder = RES / study / f"eval_{study.rsplit('_', 1)[1]}"
        out[study] = lambda f=folder: rescore.evals_report(f)
    for study in ("stage2_test", "stage2_test_6steps"):
        out[study] = lambda s=study: agent_stats.table(RES / s)[0]
    for n in (3, 6):
        out[f"stage2_dev, {n} steps"] = lambda n=n: agent_stats.table(
            RES / "stage2_dev", policy=f"seed*/step{n}", split="dev")[0]
    out["stage2_dev, 6 − 3 steps"] = lambda: agent_stats.table(
        RES / "stage2_dev", base="seed20/step3", policy="seed*/step6", split="dev", name="6 steps")[0]
    out["warmup_agent"] = lambda: agent_stats.table(RES, random="stage2_test/random", base="stage2_test/base",
                                                    policy="warmup_agent/seed*", name="warm-up")[0]
    for split in ("test", "dev,test"):
        out[f"agent_sanity {split}"] = lambda s=split: agent_stats.arms_table(
            RES / "agent_sanity", SANITY_ARMS, random="random20", split=s)[0]
    return out


def verdicts(lines: list[str]) -> list[str]:
    return [NUMBER.sub("#", line) for line in lines if line.startswith("|")]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=20, help="bootstrap RNG seeds 0 .. SEEDS-1")
    args = p.parse_args(argv)
    t0, changed = time.time(), 0
    for name, make in tables().items():
        runs = []
        for seed in range(args.seeds):
            stats.RNG_SEED = seed
            runs.append(verdicts(make()))
        stats.RNG_SEED = 0
        rows = [i for i in range(len(runs[0])) if len({r[i] for r in runs}) > 1]
        changed += len(rows)
        print(f"{name}: {len(runs[0])} rows, {len(rows)} whose verdict depends on the RNG seed "
              f"(seeds 0-{args.seeds - 1})")
        for i in rows:
            print("\n".join(f"    {row}" for row in sorted({r[i] for r in runs})))
    print(f"{changed} rows in all; {time.time() - t0:.0f} s, {stats.N_BOOT:,} draws per CI")
    return changed


if __name__ == "__main__":
    sys.exit(1 if main() else 0)
