"""The agent table with its intervals: `python lab/agent_stats.py RUNS [--out TABLE.md]`.

Reads what lab/stage2_test.sh writes: random/sampled.json, base/{greedy,sampled}.json and per seed
seedN/policy/{greedy,sampled}.json (eval.py agent results, every episode inside; other folders:
--random, --base, --policy, as lab/stage2_dev.sh passes them; a greedy file may be missing; `--arm NAME=GLOB
--file F`: several arms of one evaluation each, as lab/agent_sanity.sh writes them). Every arm
plays the same games; a game's success is the mean over its episodes. Rates: one run's with a 95 % CI
from a bootstrap over games (a game's episodes move together), several seeds' over seeds (Student's t for
2-4 seeds, never narrower than the bootstrap's; a bootstrap over seeds, then games, from 5). Differences are
paired on games (stats.py); "holds" only where the CI excludes 0 and the exact sign-flip test (over games;
over seeds for several) agrees (stats.verdict; 200,000 draws: a table takes 5-15 s).
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "lab")]
from readout import stats  # noqa: E402
from envs import UserError  # noqa: E402

REWRITE = ("write it again with `eval.py agent --out FILE` (lab/stage2_test.sh's layout), or give another "
           "folder")


def read_episodes(path: Path) -> list[dict]:
    """An `eval.py agent` result's episodes, each with its split, game and won; else one line naming the file,
    the record and the fix."""
    if not path.is_file():
        raise UserError(f"{path} is missing; {REWRITE}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # cut, damaged, not UTF-8
        raise UserError(f"{path} does not read as JSON ({(str(e).splitlines() or [''])[0]}); {REWRITE}") \
            from None
    episodes = data.get("episodes") if isinstance(data, dict) else None
    if not isinstance(episodes, list):
        raise UserError(f"{path} holds no `episodes` list, so it is no result of `eval.py agent`; {REWRITE}")
    if not episodes:
        raise UserError(f"{path} holds no episodes (an empty `episodes` list); {REWRITE}")
    for n, e in enumerate(episodes, 1):
        problem = ("not a JSON object" if not isinstance(e, dict) else next(
            (f"{k} is missing or not text" for k in ("split", "game") if not isinstance(e.get(k), str)), None)
            or (None if isinstance(e.get("won"), bool) or e.get("won") in (0, 1)
                else "won is missing or not true / false"))
        if problem:
            raise UserError(f"{path}, episode {n}: {problem}; {REWRITE}")
    return episodes


def per_game(path: Path, split: str | None = None) -> dict[str, float]:
    """game -> mean success of its episodes (of the comma-separated splits only, when given)."""
    wins = defaultdict(list)
    episodes = read_episodes(path)
    for e in episodes:
        if split is None or e["split"] in split.split(","):
            wins[f"{e['split']}/{e['game']}"].append(float(e["won"]))
    if not wins:
        splits = ", ".join(sorted({e["split"] for e in episodes}))
        raise UserError(f"{path} holds no episode of split {split} (its splits: {splits}); pass --split "
                        "with one of them")
    return {g: sum(w) / len(w) for g, w in wins.items()}


def episodes(path: Path) -> int:
    return len(read_episodes(path))


def same_games(results: dict[Path, dict[str, float]], games: list[str], first: Path) -> None:
    """Every arm plays the games of `first`: else one line naming the file that differs and how."""
    for path, r in results.items():
        if sorted(r) != games:
            missing, extra = sorted(set(games) - set(r)), sorted(set(r) - set(games))
            raise UserError(
                f"{path} plays other games than {first} ("
                + "; ".join(f"{len(x)} {what}, e.g. {x[0]}"
                            for x, what in ((missing, "missing"), (extra, "extra")) if x)
                + "): every arm must play the same games; evaluate them with the same --split, --num-games "
                "and eval seed")


def pct(x: float) -> str:
    return f"{100 * x:.1f}"


def rate(runs: list[dict], games: list[str]) -> str:
    """The mean over seeds of the per-game mean success, with its CI; each seed's value when several."""
    zero = [0.0] * len(games)
    ci = stats.over_seeds([([r[g] for g in games], zero, games) for r in runs])
    seeds = f" ({' / '.join(pct(v) for v in ci['per_seed'])})" if len(runs) > 1 else ""
    return f"{pct(ci['diff'])} [{pct(ci['lo'])}, {pct(ci['hi'])}]{seeds}"


OVER = ("over seeds: Student's t for 2-4 seeds, never narrower than the bootstrap's; a bootstrap over seeds, "
        "then games, from 5")
RULE = stats.RULE[0].upper() + stats.RULE[1:].replace("CI half-width", "CI half-width (points)") + "."


def said(c: dict) -> tuple[str, str]:
    """A comparison's cells: the difference in points with its CI; the verdict with the CI's half-width."""
    return (f"{100 * c['diff']:+.1f} [{100 * c['lo']:+.1f}, {100 * c['hi']:+.1f}]",
            f"{stats.verdict(c)}; CI half-width "
            f"{100 * c['half_width']:.1f} points")


def compare(xs: list[dict], ys: list[dict], games: list[str]) -> dict:
    """x - y paired on games; x over its seeds (y: one run, or one per seed of x)."""
    ys = ys if len(ys) == len(xs) else ys * len(xs)
    runs = [([x[g] for g in games], [y[g] for g in games], games) for x, y in zip(xs, ys)]
    ci = stats.over_seeds(runs)
    ci["half_width"] = stats.half_width(ci)  # the CI over seeds, then games
    return ci


def table(root: Path, random: str = "random", base: str = "base", policy: str = "seed*/policy",
          split: str = "test", name: str = "policy RL") -> tuple[list[str], dict]:
    check_root(root)
    seeds = sorted(root.glob(f"{policy}/sampled.json"))
    if not seeds:
        raise UserError(f"no {policy}/sampled.json under {root}: give the folder lab/stage2_test.sh wrote "
                        "(random/, base/, seed*/policy/), or name its folders with --policy (--random, "
                        "--base)")
    files = {}  # path -> game -> success, every file read (and checked) before any bootstrap

    def runs(paths, k):
        files.update({p: per_game(p) for p in (q.with_name(f"{k}.json") for q in paths)
                      if p.is_file() or k == "sampled"})
        return [files[p] for p in (q.with_name(f"{k}.json") for q in paths) if p in files]
    first = root / base / "sampled.json"
    arms = {"random (uniform admissible)": dict(sampled=runs([root / random / "sampled.json"], "sampled")),
            "base model": {k: runs([first], k) for k in ("greedy", "sampled")},
            name: {k: runs(seeds, k) for k in ("greedy", "sampled")}}
    games = sorted(files[first])
    same_games(files, games, first)
    n = dict(random=episodes(root / random / "sampled.json") // len(games),
             sampled=episodes(root / base / "sampled.json") // len(games))
    lines = [f"TextWorld {split} games: {len(games)}, 8 steps, choose mode. Sampled: T 1, {n['sampled']} "
             f"episodes per game and model (random: {n['random']} per game); greedy: one episode per game. "
             "Success in %, 95 % "
             f"CI (bootstrap over games, {stats.N_BOOT:,} draws; {name}: {len(seeds)} seeds, each value in "
             f"brackets, {OVER}). {RULE}", "",
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
    check_root(root)
    files = {}  # path -> game -> success

    def load(glob, flag):
        paths = sorted(root.glob(f"{glob}/{file}"))
        if not paths:
            raise UserError(f"no {glob}/{file} under {root}: check {flag} (a folder glob under the root) and "
                            "--file")
        files.update({p: per_game(p, split) for p in paths})
        return [files[p] for p in paths]
    rnd, bas = load(random, "--random"), load(base, "--base")
    first = sorted(root.glob(f"{base}/{file}"))[0]
    games = sorted(files[first])
    runs = {name: load(glob, f"--arm {name}={glob}") for name, glob in arms.items()}
    same_games(files, games, first)
    lines = [f"TextWorld {split} games: {len(games)}; {file}. Success in %, 95 % CI (bootstrap over games; "
             f"{stats.N_BOOT:,} draws; several seeds: each value in brackets, {OVER}); differences in "
             f"points, paired on games. {RULE}", "",
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


def check_root(root: Path) -> None:
    if not root.is_dir():
        raise UserError(f"{root} is not a folder; give the folder of the evaluations (RUNS, e.g. "
                        "runs/stage2_test)")


def parse_arms(specs: list[str]) -> dict[str, str]:
    """--arm NAME=GLOB, ... -> {name: glob}; a spec without a name or a glob: one line."""
    arms = {}
    for spec in specs:
        name, eq, glob = spec.partition("=")
        if not (eq and name.strip() and glob.strip()):
            raise UserError(f"--arm {spec!r}: give NAME=GLOB, e.g. --arm 'policy RL=seed*/policy'")
        arms[name.strip()] = glob.strip()
    return arms


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("root", type=Path)
    p.add_argument("--out", type=Path, help="the table (Markdown); its numbers go beside it (.json)")
    p.add_argument("--random", default="random", help="the random policy's folder under root")
    p.add_argument("--base", default="base", help="the base model's folder under root")
    p.add_argument("--policy", default="seed*/policy", help="the policy runs' folders under root (a glob)")
    p.add_argument("--split", default="test", help="the games' split, for the table's first line")
    p.add_argument("--name", default="policy RL", help="the --policy arm's name in the tables (e.g. warm-up)")
    p.add_argument("--arm", action="append", metavar="NAME=GLOB",
                   help="instead of --policy: arms of one evaluation file (--file) each")
    p.add_argument("--file", default="eval_agent.json", help="the --arm folders' evaluation file")
    args = p.parse_args(argv)
    arms = parse_arms(args.arm) if args.arm else None
    if args.out:  # before any file is read: a table that cannot be written is known at once
        from stages.plumbing import check_writable

        if args.out.is_dir() or args.out.suffix == ".json":
            md = args.out / "agent_stats.md" if args.out.is_dir() else args.out.with_suffix(".md")
            raise UserError(f"--out {args.out}: give the table's file (Markdown; its numbers go beside it as "
                            f".json), e.g. --out {md}")
        check_writable(args.out, folder=False)
        check_writable(args.out.with_suffix(".json"), folder=False)
    if arms:
        lines, data = arms_table(args.root, arms, args.file, args.random, args.base, args.split)
    else:
        lines, data = table(args.root, args.random, args.base, args.policy, args.split, args.name)
    print("\n".join(lines))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")
        args.out.with_suffix(".json").write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    from harness.cli import run_cli  # bad input: one line ("error: ..."), exit status 1

    run_cli(main)
