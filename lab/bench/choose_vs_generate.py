"""The agent's cost per step, choose mode vs generate mode, side by side in one run:

    python lab/bench/choose_vs_generate.py [--env textworld] [--num-games 4] [--max-turns 6] [--repeats 2]
                                           [--adapter DIR]

One model, the same games and step budget; the modes alternate (`repeats` rounds, after a warm-up round).
choose: every admissible command scored on one prefill (`choose.choose_actions`); generate: a sampled ReAct
reply of <= `--max-new-tokens` tokens. Prints seconds per step, their ratio, invalid and format-error rates.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: the project's modules

import engine  # noqa: E402
import rwml  # noqa: E402
import envs  # noqa: E402


def play_once(model, tok, env, games: list, mode: str, max_new_tokens: int) -> dict:
    t = time.perf_counter()
    eps = rwml.play(model, tok, env, [dict(game=g) for g in games], history_len=1, temperature=1.0,
                    max_new_tokens=max_new_tokens, num_envs=len(games), actor=envs.load(rwml.ACTORS[mode]),
                    desc=mode)
    steps = sum(e["steps"] for e in eps) or 1
    return dict(seconds_per_step=(time.perf_counter() - t) / steps, steps=steps,
                invalid=sum(e["invalid"] for e in eps) / steps,
                format_errors=sum(e["format_errors"] for e in eps) / steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--env", default="textworld", choices=("alfworld", "textworld"))
    p.add_argument("--model", default=engine.BUNDLED_MODEL)
    p.add_argument("--adapter", default=None)
    p.add_argument("--num-games", type=int, default=4)
    p.add_argument("--max-turns", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=64)  # train.py's agent default
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=None, help="also write the numbers as JSON here")
    a = p.parse_args()
    games = envs.games(a.env, "test" if a.env == "textworld" else "valid_seen", a.num_games, 0)
    model, tok = engine.load_model(a.model, a.adapter)
    runs = {"choose": [], "generate": []}
    with envs.make(a.env, num_workers=0, max_turns=a.max_turns) as env:
        for r in range(a.repeats + 1):
            for mode in (("choose", "generate") if r % 2 == 0 else ("generate", "choose")):
                res = play_once(model, tok, env, games, mode, a.max_new_tokens)
                if r > 0:  # round 0: warm-up (first loads, allocator)
                    runs[mode].append(res)
    summary = {m: dict(seconds_per_step=statistics.median(x["seconds_per_step"] for x in rs),
                       steps=sum(x["steps"] for x in rs),
                       invalid_action_rate=statistics.fmean(x["invalid"] for x in rs),
                       format_error_rate=statistics.fmean(x["format_errors"] for x in rs))
               for m, rs in runs.items()}
    ratio = summary["generate"]["seconds_per_step"] / summary["choose"]["seconds_per_step"]
    for m, s in summary.items():
        print(f"{m:>8}: {s['seconds_per_step']:.2f} s per episode step "
              f"(median of {a.repeats}; {s['steps']} steps), "
              f"invalid actions {s['invalid_action_rate']:.0%}, format errors {s['format_error_rate']:.0%}")
    print(f"generate / choose: {ratio:.2f}x the time per step ({a.env}, {a.num_games} games in flight, "
          f"{a.max_turns} steps, replies <= {a.max_new_tokens} tokens)")
    if a.out:
        Path(a.out).write_text(json.dumps(dict(vars(a), **summary, generate_over_choose=ratio), indent=2))


if __name__ == "__main__":
    main()
