"""The verdict `python train.py` ends with, on the dev split, for the real RWML and for three
broken world models it must fail: a rule-copier (every prediction the content-free template rule's
sentence), a coin for a reward, GRPO's advantage sign flipped. RWML - COIN pairs each arm with
recipe_dev's `coin`, trained from the same warm-up on the same prompts with the same seed (for the `coin`
arm itself that is the same run: its difference is 0 by construction, not a test). No training: the
committed greedy predictions of lab/results/recipe_dev (valid_seen, seed 0: `mixed` is the recipe
`python train.py` runs, `coin` and `flip` its broken twins from the same warm-up), the template rule scored
here on the same triplets.

    python lab/verdict_controls.py [--recipe-dev lab/results/recipe_dev] [--out lab/results/wm_dev/controls]
    python lab/verdict_controls.py --ceiling [--out lab/results/wm_dev/ceiling.md]
    python lab/verdict_controls.py --from-files [--out lab/results/wm_dev/controls]

--from-files: verdicts.md and verdicts.json again from the per-triplet files a first run left in each
<out>/<arm>/ (no model, no reward: today's statistics on the same predictions); each arm's lines.txt, what the
first run printed, stays as it is.

--ceiling: how much room the held-out sets leave above the rule. The purposeful triplets (walkthroughs) of
the 20 valid_seen games, built at history lengths H 1, 2, 4, 8: how many of the rule's exact-match misses
have their answer in the prompt (the prompt-only state tracker, envs.track_state, reproduces it), the only
ones a model can get right without guessing.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "lab")]
import envs  # noqa: E402
import eval as evaluation  # noqa: E402
from readout import verdict  # noqa: E402
from harness.common import read_jsonl, write_jsonl  # noqa: E402
from envs import UserError  # noqa: E402
from stages.plumbing import sample_triplets  # noqa: E402
from reward import SimToRealReward  # noqa: E402

# arm -> recipe_dev's eval stem, or how its predictions are made here: the rule's sentence; the real next
# observation (an oracle: the verdict can pass); the rule's sentence but the real next observation where the
# rule misses and the prompt holds the answer (the best a model can do without guessing objects it was
# never shown)
ARMS = dict(rwml="mixed", coin="coin", flip="flip", rule_copier=None, oracle=None, rule_plus_prompt=None)


def ceiling(out: Path, split: str = "valid_seen", games: int = 20) -> None:
    rows = ["| H | triplets | rule exact | rule misses | misses whose answer the prompt holds | best "
            "non-guessing exact |", "|---|---|---|---|---|---|"]
    for h in (1, 2, 4, 8):
        trips = envs.walkthrough_triplets(split, games, history_len=h, seed=0, wrong_first=False)
        miss = [t for t in trips
                if not envs.exact_match(envs.template_prediction(t["action"]), t["next_obs"])]
        shown = [t for t in miss if envs.probe_exact(envs.track_state(t), t["next_obs"])]
        n = len(trips)
        rows.append(f"| {h} | {n} | {(n - len(miss)) / n:.3f} | {len(miss)} | {len(shown)} | "
                    f"{(n - len(miss) + len(shown)) / n:.3f} |")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(rows) + "\n")
    print("\n".join(rows))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe-dev", type=Path, default=ROOT / "lab/results/recipe_dev")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--ceiling", action="store_true", help="the room above the rule by history length")
    ap.add_argument("--from-files", action="store_true",
                    help="only verdicts.md / .json again, from the per-triplet files already in --out")
    args = ap.parse_args(argv)
    if args.ceiling:
        return ceiling(args.out or ROOT / "lab/results/wm_dev/ceiling.md")
    args.out = args.out or ROOT / "lab/results/wm_dev/controls"
    if args.from_files:
        return write_verdicts(args.out, {arm: verdict.gain_lines(args.out / arm, start="warm-up")
                                         for arm in ARMS})
    ev, held = args.recipe_dev / "seed0" / "eval", args.recipe_dev / "valid_seen"
    if not ev.is_dir() or not held.is_dir():
        raise UserError(f"{args.recipe_dev} holds no seed0/eval or valid_seen: give --recipe-dev the folder "
                        "of lab/recipe_dev.sh's results")
    reward_fn = SimToRealReward(tau_d=0.01, rouge_gate=0.9)  # ALFWorld's, as recipe_dev scored
    sets = {k: sample_triplets(read_jsonl(held / f"heldout_{k}" / "transitions.jsonl"), 96)
            for k in verdict.HELDOUT_KINDS}
    sets["train"] = read_jsonl(args.recipe_dev / "seed0" / "filter_mixed" / "kept.jsonl")
    rule = {k: evaluation.baseline_wm("template", t, reward_fn)["triplets"] for k, t in sets.items()}

    def made(arm: str, kind: str) -> list[dict]:  # the predictions of an arm made here, scored as a model's
        trips = sets[kind]
        preds = [t["next_obs"] if arm == "oracle" or (arm == "rule_plus_prompt" and not r["template_hit"]
                                                      and not r["unseen_objects"]) else r["predictions"][0]
                 for t, r in zip(trips, rule[kind])]
        return envs.score_wm(trips, [f"<next_state>{p}</next_state>" for p in preds], reward_fn)["triplets"]
    found = {}
    for arm, stem in ARMS.items():
        run = args.out / arm
        run.mkdir(parents=True, exist_ok=True)
        for kind in sets:
            shutil.copy(ev / f"warmup_mixed_{kind}.triplets.jsonl",
                        run / f"wm_eval_before_{kind}.triplets.jsonl")
            write_jsonl(run / f"wm_eval_template_{kind}.triplets.jsonl", rule[kind])
            if kind != "train":  # the matched COIN arm: recipe_dev's coin (the same warm-up, prompts, seed)
                shutil.copy(ev / f"coin_{kind}.triplets.jsonl", run / f"wm_eval_coin_{kind}.triplets.jsonl")
            after = read_jsonl(ev / f"{stem}_{kind}.triplets.jsonl") if stem else made(arm, kind)
            write_jsonl(run / f"wm_eval_rwml_{kind}.triplets.jsonl", after)
        found[arm] = verdict.gain_lines(run, start="warm-up")
        (run / "lines.txt").write_text("\n".join(found[arm]) + "\n")
    write_verdicts(args.out, found)


def write_verdicts(out: Path, found: dict) -> None:
    """verdicts.md (each arm's lines) and verdicts.json (each arm's closing verdict); arm -> its lines."""
    report = []
    for arm, lines in found.items():
        stem = ARMS[arm]
        report.append(f"## {arm}" + (f" (recipe_dev `{stem}`)" if stem else " (made here, see ARMS)")
                      + "\n\n" + "\n".join(f"    {x}" for x in lines) + "\n")
        print(f"{arm}: {lines[-1]}")
    (out / "verdicts.md").write_text("\n".join(report))
    (out / "verdicts.json").write_text(json.dumps({arm: lines[-1] for arm, lines in found.items()},
                                                  indent=2) + "\n")


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        sys.exit(f"error: {e}")
