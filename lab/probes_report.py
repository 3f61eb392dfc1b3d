"""The held-out state probes (envs.state_probes) of a split's games: counts by probe type and by
game, what was dropped (the prompt-only tracker could not reproduce it), and the baselines by probe
type (the template rule, "rule + copy the last listing seen", the tracker): exact match (a
put_revisit listing as a set), item F1 over the targets that list items, n. Markdown on stdout.

    python lab/probes_report.py --split valid_seen --split valid_unseen --games 20 > probes.md
"""
import argparse
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import envs  # noqa: E402 -- after the repository is on the path

BASELINES = (("template", "template rule"), ("rule_copy", "rule + copy"), ("tracker", "tracker"))


def exact_reward(completions, targets):  # score_wm's reward slot: the strict metrics are reported
    from envs import parse_next_state

    return [float(envs.exact_match(parse_next_state(c), t)) for c, t in zip(completions, targets)]


exact_reward.similarity = lambda states, targets: [0.0] * len(targets)


def cell(r: dict) -> str:
    f1 = "-" if r["item_f1"] is None else f"{r['item_f1']:.3f}"
    return f"{r['exact_match']:.3f} / {f1} ({r['item_n']})"


def report(split: str, games: int, seed: int, history_len: int) -> list[str]:
    paths, dropped, start = envs.list_games(split, games, seed), [], time.time()
    probes = envs.state_probes(paths, history_len=history_len, seed=seed, dropped=dropped)
    minutes = (time.time() - start) / 60
    kept, lost = Counter(t["probe"] for t in probes), Counter(t["probe"] for t in dropped)
    per_game = Counter(t["game"] for t in probes)
    never = all(envs.track_state(t) is None for t in dropped)
    lines = [f"## {split}: {len(probes)} probes over {len(per_game)} of {len(paths)} games "
             f"(envs.list_games({split!r}, {games}, {seed}); H {history_len}; {minutes:.1f} min)",
             "", "Dropped (the tracker could not reproduce the engine from the window): "
             f"{len(dropped)}; of those, answered wrongly by it: {0 if never else 'some'}", "",
             "| probe | kept | dropped |", "|---|---|---|"]
    lines += [f"| {p} | {kept[p]} | {lost[p]} |" for p in envs.PROBES]
    lines += ["", f"Per game: min {min(per_game.values())}, max {max(per_game.values())}", "",
              "| game | " + " | ".join(envs.PROBES) + " | all |",
              "|---" * (len(envs.PROBES) + 2) + "|"]
    for game in sorted(per_game):
        c = Counter(t["probe"] for t in probes if t["game"] == game)
        lines.append(f"| {game} | " + " | ".join(str(c[p]) for p in envs.PROBES)
                     + f" | {per_game[game]} |")
    scored = {b: envs.score_wm(probes, [f"<next_state>{envs.baseline_prediction(b, t)}</next_state>"
                                        for t in probes], exact_reward) for b, _ in BASELINES}
    lines += ["", "Baselines by probe type: exact match / item F1 (n targets that list items)", "",
              "| probe | n | " + " | ".join(name for _, name in BASELINES) + " |", "|---" * 5 + "|"]
    for p in (*envs.PROBES, "all"):
        cells = [scored[b]["per_probe"][p] if p != "all" else scored[b] for b, _ in BASELINES]
        lines.append(f"| {p} | {cells[0]['n']} | " + " | ".join(map(cell, cells)) + " |")
    return lines + [""]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--split", action="append", choices=envs.SPLITS,
                    help="a split (repeat it); valid_seen and valid_unseen unless given")
    ap.add_argument("--games", type=int, default=20, help="games per split (envs.list_games)")
    ap.add_argument("--seed", type=int, default=0, help="the games' draw and the probes' choices")
    ap.add_argument("--history-len", type=int, default=2,
                    help="H: the (observation, action) pairs of a prompt")
    args = ap.parse_args(argv)
    for split in args.split or ("valid_seen", "valid_unseen"):
        print("\n".join(report(split, args.games, args.seed, args.history_len)), flush=True)


if __name__ == "__main__":
    main()
