"""How many seeds and games an agent comparison needs: `python lab/power.py [RUNS]`.

From the laptop comparison's measured spread (RUNS = lab/results/agent_sanity: per arm and seed the success
over its dev + test games, greedy): the seed-to-seed variance of an arm's success splits into a binomial part,
p (1 - p) / games, and what training adds, sigma_t^2 = var - binomial. Two arms of n seeds each, trained from
their own seeds, are compared by a two-sample t test on their n + n success rates (2 (n - 1) degrees of
freedom: the variance is estimated from the seeds, so with 3 seeds Student's t, not the normal): they differ
by delta with 80 % power at two-sided 5 % when n >= 2 (t_0.975 + t_0.8)^2 (sigma_t^2 + p (1 - p) / games) /
delta^2, t at 2 (n - 1) df (the smallest such n); more games shrink only the binomial part. Printed for the
laptop table's differences and the paper's RWML + policy RL − policy RL on ALFWorld (87.9 − 81.0 = 6.9
points).
"""
from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

from scipy.stats import t as student_t

ROOT = Path(__file__).resolve().parents[1]
ARMS = ("policy", "rwml_policy", "wm_sft_policy")


def spread(root: Path) -> dict:
    """Pooled within-arm variance over seeds, mean success, games per run."""
    runs = {a: [json.loads(p.read_text()) for p in sorted(root.glob(f"seed*/{a}/eval_agent.json"))]
            for a in ARMS}
    rates = {a: [r["success_rate"] for r in rs] for a, rs in runs.items() if len(rs) > 1}
    var = statistics.fmean(statistics.variance(v) for v in rates.values())
    p = statistics.fmean(x for v in rates.values() for x in v)
    games = len(next(iter(runs.values()))[0]["episodes"])
    return dict(var=var, p=p, games=games, binomial=p * (1 - p) / games, rates=rates)


def quantiles(n: int, power: float = 0.8, alpha: float = 0.05) -> float:
    """t_{1 - alpha/2} + t_power at 2 (n - 1) degrees of freedom: two arms of n seeds each."""
    df = 2 * (n - 1)
    return float(student_t.ppf(1 - alpha / 2, df) + student_t.ppf(power, df))


def smallest(var: float, n: int, power: float = 0.8) -> float:
    """The smallest difference two arms of n seeds each detect (80 % power, two-sided 5 %), from the
    seed-to-seed variance of one arm's success: (t_0.975 + t_0.8) x sqrt(2 var / n), t at 2 (n - 1) df."""
    return quantiles(n, power) * math.sqrt(2 * var / n)


def seeds_needed(delta: float, sigma_t2: float, p: float, games: int, power: float = 0.8) -> int:
    """The smallest n (seeds per arm) with n >= 2 (t_0.975 + t_0.8)^2 var / delta^2 at 2 (n - 1) df."""
    var = sigma_t2 + p * (1 - p) / games
    n = 2
    while n < 2 * quantiles(n, power) ** 2 * var / delta ** 2:
        n += 1
    return n


def main(argv=None):
    root = Path((argv or sys.argv[1:] or [ROOT / "lab" / "results" / "agent_sanity"])[0])
    s = spread(root)
    sigma_t2 = max(s["var"] - s["binomial"], 0.0)
    print(f"{root}: arms {', '.join(f'{a} {[round(x, 3) for x in v]}' for a, v in s['rates'].items())}")
    print(f"seed-to-seed sd {math.sqrt(s['var']):.3f} over {s['games']} games (mean success {s['p']:.3f}): "
          f"binomial {math.sqrt(s['binomial']):.3f}, training {math.sqrt(sigma_t2):.3f}")
    print(f"3 seeds per arm detect (80 % power, t at 4 df) differences >= {100 * smallest(s['var'], 3):.0f} "
          "points")
    print(f"{'difference':>10} {'games':>6} {'seeds per arm':>14}")
    for delta in (0.35, 0.15, 0.069):
        for games in (40, 140, 1000):
            print(f"{100 * delta:>9.1f}p {games:>6} {seeds_needed(delta, sigma_t2, s['p'], games):>14}")


if __name__ == "__main__":
    main()
