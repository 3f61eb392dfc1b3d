"""Fresh held-out games for a study: `python lab/heldout_seed.py [--split S] [--games 20] [--from 1]`.

Every run before the verdicts' rework scored the same 20 games of each eval split (`--heldout-seed 0`), about
15 times, and their item-level errors chose levers: they are seen. This prints those games, then the first
held-out seed from `--from` whose games share none with them (a rule fixed before any result: the study
takes that seed, whatever its games are like), with its games. lab/results/seen_games.md is its output.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import envs  # noqa: E402

SEEN_SEEDS = (0,)  # the held-out seeds every study used so far


def fresh_seed(split: str, games: int, start: int, seen: set[str]) -> tuple[int, list[str]]:
    """The first seed >= start whose `games` games of `split` are none of `seen`."""
    for seed in range(start, start + 100_000):
        drawn = [envs.game_id(g) for g in envs.list_games(split, games, seed)]
        if not seen & set(drawn):
            return seed, drawn
    raise SystemExit(f"no seed in {start}..{start + 99_999} draws {games} games of {split} none of them seen")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--split", default="valid_unseen")
    p.add_argument("--games", type=int, default=20)
    p.add_argument("--from", dest="start", type=int, default=1)
    p.add_argument("--seen", default=",".join(map(str, SEEN_SEEDS)),
                   help="held-out seeds whose games are seen (comma-separated; a study adds its own)")
    a = p.parse_args(argv)
    seen_seeds = [int(x) for x in a.seen.split(",") if x]
    seen = {envs.game_id(g) for s in seen_seeds for g in envs.list_games(a.split, a.games, s)}
    seed, drawn = fresh_seed(a.split, a.games, a.start, seen)
    total = len(envs.list_games(a.split))
    used = ", ".join(map(str, seen_seeds))
    print(f"# {a.split}: {len(seen)} seen games (--heldout-seed {used}) of {total}\n")
    print("\n".join(f"- {g}" for g in sorted(seen)))
    print(f"\n# the first fresh held-out seed from {a.start}: --heldout-seed {seed} ({a.games} games, "
          "none seen)\n")
    print("\n".join(f"- {g}" for g in drawn))


if __name__ == "__main__":
    main()
