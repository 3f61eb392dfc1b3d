"""The over-seeds study: each seed's default run against its controls, GRPO with a coin for
a reward (coin<seed>) and GRPO whose reward pays for the template rule's sentence (template<seed>), both on
the seed's own data, filter, warm-up and "before" scores (lab/over_seeds.sh).

    python lab/over_seeds_report.py OUT/seed61 OUT/seed62 ... [--out over_seeds.md]

RWML's per-triplet scores of the real run minus the control's, paired by triplet: (a) the sim-to-real reward
on RWML's own training prompts, (b) held-out exact match, explore and purposeful pooled, (f) held-out state
probes, exact match. Each seed's cell: its CI over games and sign-flip p over games. Over seeds
(stats.over_seeds): each seed's value, the CI, the exact sign-flip test over seeds; "holds" only where the CI
excludes 0 and p < 0.05, which needs at least 6 seeds (with k seeds the smallest p is 2 / 2^k). Then PLAN.md's
checks, each against the coin run: a second coin (coinb<seed>) must pass no line, GRPO's sign flipped
(flip<seed>) must not hold on (a). Last, the levels the differences stand beside: each arm's exact match on
(b) and (f), with the seed's warm-up, the content-free rule, rule + copy and the state tracker.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "lab")]
from fresh_seeds_report import sides  # noqa: E402
from readout import stats  # noqa: E402
from envs import UserError  # noqa: E402

CONTROLS = (("coin", "GRPO with a coin for a reward"), ("template", "GRPO rewarded for the rule's sentence"))
# PLAN.md's checks, each against the coin run: a second coin (lab/coin_again.py) must pass no line, GRPO's
# sign flipped (lab/flipped_sign.py) must not hold on (a)
CHECKS = (("coinb", "a second coin"), ("flip", "GRPO's sign flipped"))
LINES = (("(a) the reward on RWML's training prompts", ("train",), "rewards"),
         ("(b) held-out exact match, explore + purposeful", ("explore", "purposeful"), "exact"),
         ("(f) held-out state probes, exact match", ("state",), "exact"))


def sibling(run: Path, arm: str) -> Path:
    """The folder of `arm` (coin, template, ...) beside a seed's real run: OUT/seed71 -> OUT/coin71."""
    return run.with_name(arm + run.name.removeprefix("seed"))


def table(runs: list[Path], arms=(("seed", "the real reward"),), controls=CONTROLS) -> list[str]:
    """Each arm's RWML minus each control's, per seed and over seeds; runs: OUT/seed<N>."""
    seeds = " | ".join(r.name for r in runs)
    rows = [f"| line | arm − control | {seeds} | over {len(runs)} seeds | verdict |",
            "|---" * (len(runs) + 4) + "|"]
    words, one_run = [], {}  # one_run: each seed's cell read alone, by the rule over games
    for (arm, arm_name), (ctrl, name) in itertools.product(arms, controls):
        pair = [[sibling(r, x) for r in runs] for x in (arm, ctrl)]
        scored = (a / "wm_eval_rwml_train.triplets.jsonl" for a in pair[0] + pair[1])
        if missing := [str(f.parent) for f in scored if not f.is_file()]:
            raise UserError(f"{', '.join(missing)}: no finished run; run lab/over_seeds.sh")
        for label, kinds, key in LINES:
            each = [sides(r, "rwml", a, "rwml", kinds, key) for r, a in zip(*pair)]
            cells = [stats.paired_bootstrap(*e) for e in each]
            one_run.setdefault(f"{arm_name} − {name}", []).extend(
                stats.verdict(c) in ("holds", "reversed") for c in cells)
            ci = stats.over_seeds(each)
            v = stats.verdict(ci)
            rows.append(f"| {label} | {arm_name} − {name} | " + " | ".join(
                f"{c['diff']:+.3f} [{c['lo']:+.3f}, {c['hi']:+.3f}] p {c['p']:.3f}" for c in cells)
                + f" | {ci['diff']:+.3f} [{ci['lo']:+.3f}, {ci['hi']:+.3f}] p {ci['p']:.3f} | {v} |")
            words.append(f"{label}, {arm_name} − {name}: {stats.said(ci)}")
    return rows + ["", "Verdict over seeds, in words:", ""] + [f"- {w}" for w in words] + [
        "", "Seeds' cells that one run's rule (CI and sign-flip over games) calls holds or reversed: "
        + "; ".join(f"{k}, {sum(v)} of {len(v)}" for k, v in one_run.items()) + "."]


# the levels the differences stand beside: each arm's RWML, the seed's warm-up, and eval.py's baselines on the
# same held-out triplets (the content-free rule, rule + copy, and the prompt-only state tracker, the ceiling)
LEVELS = (("seed", "rwml", "RWML, the real reward"), ("coin", "rwml", CONTROLS[0][1]),
          ("template", "rwml", CONTROLS[1][1]), ("coinb", "rwml", CHECKS[0][1]),
          ("flip", "rwml", CHECKS[1][1]),
          ("seed", "before", "the warm-up (before GRPO)"), ("seed", "template", "the content-free rule"),
          ("seed", "rule_copy", "rule + copy"), ("seed", "tracker", "the state tracker"))


def levels(runs: list[Path]) -> list[str]:
    """Exact match on (b) and (f) per arm: each seed's rate and the mean over seeds with its 95 % CI (the
    rate against 0, bootstrapped over seeds, then games, as the differences are). Description only."""
    head = [f"{label[:3]} {what}" for label, _, _ in LINES[1:] for what in ("each seed", "over seeds")]
    rows = ["| exact match | " + " | ".join(head) + " |", "|---" * 5 + "|"]
    for folder, arm, name in LEVELS:
        folders = [sibling(r, folder) for r in runs]
        every = [k for _, ks, _ in LINES[1:] for k in ks]
        scored = [f / f"wm_eval_{arm}_{k}.triplets.jsonl" for f in folders for k in every]
        if missing := [str(f) for f in scored if not f.is_file()]:
            raise UserError(f"{', '.join(missing)}: not scored; run lab/over_seeds.sh")
        cells = []
        for _, kinds, key in LINES[1:]:
            rates = [sides(f, arm, f, arm, kinds, key) for f in folders]
            # the rate against 0 (as lab/agent_stats.py): per_seed is each seed's rate; CI over seeds, games
            ci = stats.over_seeds([(a, [0.0] * len(a), games) for a, _, games in rates])
            cells += [" ".join(f"{v:.3f}" for v in ci["per_seed"]),
                      f"{ci['diff']:.3f} [{ci['lo']:.3f}, {ci['hi']:.3f}]"]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return rows


def report(runs: list[Path]) -> str:
    """The table, the rule, PLAN.md's checks (they must be able to fail), then the levels: --out's text."""
    text = "\n".join(table(runs)) + f"\n\n{stats.RULE}.\n"
    checks = table(runs, CHECKS, CONTROLS[:1])
    text += "\n## Checks that must be able to fail\n\n" + "\n".join(checks) + "\n"
    return text + ("\n## Levels beside the baselines (description only)\n\n" + "\n".join(levels(runs))
                   + "\n")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", type=Path, nargs="+", help="the seeds' real runs, OUT/seed<N>")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    text = report(args.runs)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        sys.exit(f"error: {e}")
