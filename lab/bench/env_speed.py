"""Environment speed, side by side in one run: stock vs cached TextWorld engine, one worker vs two.

    python lab/bench/env_speed.py [--num-games 8] [--steps 20] [--repeats 3]

Every game plays "go to" its first room's receptacles, then its winning walkthrough; timed: steps and
repeated resets (each game's first load is warm-up). Run on an idle machine: two workers need both cores.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: the project's modules

import envs  # noqa: E402


def script(game: str, start: dict, length: int) -> list[str]:
    walk = json.load(open(game))["walkthrough"]
    goes = [c for c in start["admissible"] if c.startswith("go to ")]
    return [goes[i % len(goes)] for i in range(max(0, length - len(walk)))] + walk


def bench_engine(games: list[str], cache: bool, length: int, repeats: int) -> tuple[float, float]:
    """(steps/s, resets/s) of one in-process game playing every script `repeats` times."""
    envs.use_engine_cache(cache)
    game, steps, step_time, resets, reset_time = envs.Game(max_turns=10 * length), 0, 0.0, 0, 0.0
    for g in games:
        plan = script(g, game.reset(g), length)  # warm-up: load the game once
        for _ in range(repeats):
            t = time.perf_counter()
            game.reset(g)
            reset_time += time.perf_counter() - t
            resets += 1
            t = time.perf_counter()
            for command in plan:
                game.step(command)
            step_time += time.perf_counter() - t
            steps += len(plan)
    envs.use_engine_cache(False)
    return steps / step_time, resets / reset_time


def bench_pool(games: list[str], workers: int, length: int, repeats: int) -> float:
    """Steps/s of a worker pool stepping all games in lock step, as the agent loop does."""
    with envs.EnvPool(num_workers=workers, max_turns=10 * length, game_cls=envs.Game) as pool:
        starts = pool.reset(dict(enumerate(games)))
        plans = {s: script(games[s], starts[s], length) for s in starts}
        steps, elapsed = 0, 0.0
        for _ in range(repeats):
            pool.reset(dict(enumerate(games)))
            t = time.perf_counter()
            for i in range(length):
                batch = {s: p[i] for s, p in plans.items() if i < len(p)}
                pool.step(batch)
                steps += len(batch)
            elapsed += time.perf_counter() - t
    return steps / elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--split", default="valid_seen")
    p.add_argument("--num-games", type=int, default=8)
    p.add_argument("--steps", type=int, default=20, help="steps per game and repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds; min/median/max are reported")
    args = p.parse_args()
    games = envs.list_games(args.split, args.num_games, seed=0)
    rows = {k: [] for k in ("stock", "cached", "1 worker", "2 workers")}
    resets = {"stock": [], "cached": []}
    for r in range(args.rounds):  # alternate the arms so that drift in machine load hits both alike
        for cache, name in ((False, "stock"), (True, "cached")):
            sps, rps = bench_engine(games, cache, args.steps, args.repeats)
            rows[name].append(sps)
            resets[name].append(rps)
        for w, name in ((1, "1 worker"), (2, "2 workers")):
            rows[name].append(bench_pool(games, w, args.steps, args.repeats))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rows.items()),
              flush=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"\n{len(games)} {args.split} games, {args.steps} steps each, {args.repeats} repeats, "
          f"{args.rounds} rounds")
    print(f"{'arm':<22}{'steps/s (median)':>18}{'min':>9}{'max':>9}{'resets/s':>10}")
    for k, v in rows.items():
        rs = f"{statistics.median(resets[k]):>10.2f}" if k in resets else ""
        print(f"{k:<22}{med[k]:>18.1f}{min(v):>9.1f}{max(v):>9.1f}{rs}")
    print(f"cached / stock, steps:  {med['cached'] / med['stock']:.2f}x")
    print(f"cached / stock, resets: "
          f"{statistics.median(resets['cached']) / statistics.median(resets['stock']):.1f}x")
    print(f"2 workers / 1 worker:   {med['2 workers'] / med['1 worker']:.2f}x")


if __name__ == "__main__":
    try:
        main()
    except envs.UserError as e:
        raise SystemExit(f"error: {e}")
