"""The agent table with its intervals (issue 37): `python lab/agent_stats.py RUNS [--out TABLE.md]`.

Reads what lab/stage2_test.sh writes: random/sampled.json, base/{greedy,sampled}.json and per seed
seedN/policy/{greedy,sampled}.json (eval.py agent results, every episode inside; other folders:
--random, --base, --policy, as lab/stage2_dev.sh passes them; a greedy file may be missing; `--arm NAME=GLOB
--file F`: several arms of one evaluation each, as lab/agent_sanity.sh writes them). Every arm
plays the same games; a game's success is the mean over its episodes. Rates: one run's with a 95 % CI
from a bootstrap over games (a game's episodes move together), several seeds' by the two-level bootstrap
(seeds, then games). Differences are paired on games (lab/stats.py); "holds" only where the CI excludes 0.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import stats  # noqa: E402


def per_game(path: Path, split: str | None = None) -> dict[str, float]:
    """game -> mean success of its episodes (of the comma-separated splits only, when given)."""
    wins = defaultdict(list)
    for e in json.loads(path.read_text())["episodes"]:
        if split is None or e["split"] in split.split(","):
            wins[f"{e['split']}/{e['game']}"].append(float(e["won"]))
    return {g: sum(w) / len(w) for g, w in wins.items()}


def episodes(path: Path) -> int:
    return len(json.loads(path.read_text())["episodes"])


def pct(x: float) -> str:
    return f"{100 * x:.1f}"


def rate(runs: list[dict], games: list[str]) -> str:
    """The mean over seeds of the per-game mean success, with its CI; each seed's value when several."""
    zero = [0.0] * len(games)
    ci = stats.two_level_bootstrap([([r[g] for g in games], zero, games) for r in runs])
    seeds = f" ({' / '.join(pct(v) for v in ci['per_seed'])})" if len(runs) > 1 else ""
    return f"{pct(ci['diff'])} [{pct(ci['lo'])}, {pct(ci['hi'])}]{seeds}"


def said(c: dict) -> tuple[str, str]:
    """A comparison's cells: the difference in points with its CI; the verdict with what it could detect."""
    return (f"{100 * c['diff']:+.1f} [{100 * c['lo']:+.1f}, {100 * c['hi']:+.1f}]",
            f"{stats.verdict(c).replace('holds', 'holds (CI excludes 0)')}; could detect >= "
            f"{100 * c['could_detect']:.1f} points")


def compare(xs: list[dict], ys: list[dict], games: list[str]) -> dict:
    """x - y paired on games; x over its seeds (y: one run, or one per seed of x)."""
    ys = ys if len(ys) == len(xs) else ys * len(xs)
    runs = [([x[g] for g in games], [y[g] for g in games], games) for x, y in zip(xs, ys)]
    ci = stats.two_level_bootstrap(runs)
    pooled = ([v for a, _, _ in runs for v in a], [v for _, b, _ in runs for v in b],
              [g for _, _, units in runs for g in units])
    ci["could_detect"] = stats.detectable(*pooled)
    return ci


def table(root: Path, random: str = "random", base: str = "base", policy: str = "seed*/policy",
          split: str = "test", name: str = "policy RL") -> tuple[list[str], dict]:
    seeds = sorted(root.glob(f"{policy}/sampled.json"))
    if not seeds:
        raise SystemExit(f"no {root}/{policy}/sampled.json")

    def runs(paths, k):
        return [per_game(p) for p in (q.with_name(f"{k}.json") for q in paths) if p.is_file()]
    arms = {"random (uniform admissible)": dict(sampled=[per_game(root / random / "sampled.json")]),
            "base model": {k: runs([root / base / "sampled.json"], k) for k in ("greedy", "sampled")},
            name: {k: runs(seeds, k) for k in ("greedy", "sampled")}}
    games = sorted(arms["base model"]["sampled"][0])
    for arm in arms.values():
        for runs in arm.values():
            assert all(sorted(r) == games for r in runs), "every arm must play the same games"
    n = dict(random=episodes(root / random / "sampled.json") // len(games),
             sampled=episodes(root / base / "sampled.json") // len(games))
    lines = [f"TextWorld {split} games: {len(games)}, 8 steps, choose mode. Sampled: T 1, {n['sampled']} "
             f"episodes per game and model (random: {n['random']} per game); greedy: one episode per game. "
             "Success in %, 95 % "
             f"CI (bootstrap over games; over seeds, then games, for {name}: {len(seeds)} seeds, each "
             "value in brackets).", "",
             "| arm | sampled success | greedy success |", "|---|---|---|"]
    for name, arm in arms.items():
        lines.append(f"| {name} | {rate(arm['sampled'], games)} | "
                     f"{rate(arm['greedy'], games) if arm.get('greedy') else '—'} |")
    rnd, base = arms["random (uniform admissible)"]["sampled"], arms["base model"]
    pol = arms[name]
    rows = [(f"{name} − base", "sampled", pol["sampled"], base["sampled"]),
            (f"{name} − random", "sampled", pol["sampled"], rnd),
            ("base − random", "sampled", base["sampled"], rnd),
            (f"{name} − base", "greedy", pol["greedy"], base["greedy"]),
            (f"{name} − random", "greedy", pol["greedy"], rnd)]
    lines += ["", "| comparison (paired on games) | evaluation | difference, points [95 % CI] | each seed | "
              "verdict |", "|---|---|---|---|---|"]
    found = []
    for name, how, xs, ys in rows:
        if not (xs and ys):
            continue
        c = compare(xs, ys, games)
        found.append(dict(c, comparison=name, evaluation=how))
        diff, verdict = said(c)
        lines.append(f"| {name} | {how} | {diff} | {' / '.join(f'{100 * v:+.1f}' for v in c['per_seed'])} | "
                     f"{verdict} |")
    return lines, dict(games=games, comparisons=found)


def arms_table(root: Path, arms: dict[str, str], file: str = "eval_agent.json", random: str = "random",
               base: str = "base", split: str = "test") -> tuple[list[str], dict]:
    """Several arms with one evaluation each (lab/agent_sanity.sh's greedy eval_agent.json), arm name ->
    folder glob under root: each arm's rate with its CI, and its difference from the base and from random,
    paired on the games of `split`."""
    def load(glob):
        paths = sorted(root.glob(f"{glob}/{file}"))
        if not paths:
            raise SystemExit(f"no {root}/{glob}/{file}")
        return [per_game(p, split) for p in paths]
    rnd, bas = load(random), load(base)
    games = sorted(bas[0])
    runs = {name: load(glob) for name, glob in arms.items()}
    for r in [*rnd, *bas, *(x for rs in runs.values() for x in rs)]:
        assert sorted(r) == games, "every arm must play the same games"
    lines = [f"TextWorld {split} games: {len(games)}; {file}. Success in %, 95 % CI (bootstrap over games; "
             "over seeds, then games, for several seeds, each value in brackets); differences in points, "
             "paired on games.", "",
             "| arm | success | − base [95 % CI] | − random [95 % CI] | verdict (− base; − random) |",
             "|---|---|---|---|---|", f"| random (uniform admissible) | {rate(rnd, games)} | | | |",
             f"| base model | {rate(bas, games)} | | | |"]
    found = []
    for name, xs in runs.items():
        found += [dict(compare(xs, ys, games), comparison=f"{name} − {other}")
                  for other, ys in (("base", bas), ("random", rnd))]
        (to_base, v_base), (to_random, v_random) = said(found[-2]), said(found[-1])
        lines.append(f"| {name} | {rate(xs, games)} | {to_base} | {to_random} | {v_base}; {v_random} |")
    return lines, dict(games=games, comparisons=found)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("root", type=Path)
    p.add_argument("--out", type=Path)
    p.add_argument("--random", default="random", help="the random policy's folder under root")
    p.add_argument("--base", default="base", help="the base model's folder under root")
    p.add_argument("--policy", default="seed*/policy", help="the policy runs' folders under root (a glob)")
    p.add_argument("--split", default="test", help="the games' split, for the table's first line")
    p.add_argument("--name", default="policy RL", help="the --policy arm's name in the tables (e.g. warm-up)")
    p.add_argument("--arm", action="append", metavar="NAME=GLOB",
                   help="instead of --policy: arms of one evaluation file (--file) each")
    p.add_argument("--file", default="eval_agent.json", help="the --arm folders' evaluation file")
    args = p.parse_args(argv)
    if args.arm:
        lines, data = arms_table(args.root, dict(a.split("=", 1) for a in args.arm), args.file, args.random,
                                 args.base, args.split)
    else:
        lines, data = table(args.root, args.random, args.base, args.policy, args.split, args.name)
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
        args.out.with_suffix(".json").write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
