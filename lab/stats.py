"""Intervals and paired comparisons for the lab's tables (issue 37 item 1); the standard library only.

- `wilson(k, n)`: the 95 % Wilson score interval of one rate (one run).
- `paired_bootstrap(a, b, units)`: the difference of two arms' mean outcomes on the same items (triplets or
  episodes), with a percentile bootstrap CI that resamples units (games): the items of a game move together.
- `two_level_bootstrap(runs)`: the same over several seeds: each replicate draws seeds with replacement, then
  games with replacement (one draw of games shared by the drawn seeds: our seeds play the same games).
- `detectable(...)`: the smallest difference a table could detect: (z_{1-alpha/2} + z_{power}) x the paired
  sd over units / sqrt(units), two-sided 5 %, 80 % power (not the CI's half-width).
- `verdict(ci, smallest)`: "holds" only where the CI excludes 0, else "no difference detected"; no data
  (None: no items to compare) says so.
"""
from __future__ import annotations

import math
import random
import statistics
from collections import defaultdict

Z = statistics.NormalDist().inv_cdf


def wilson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of k successes in n trials (Wilson 1927); (0, 1) when n is 0."""
    if n <= 0:
        return 0.0, 1.0
    z, p = Z(0.5 + level / 2), k / n
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, (centre - half) / (1 + z * z / n)), min(1.0, (centre + half) / (1 + z * z / n))


def _by_unit(a, b, units) -> dict:
    """unit -> [sum of a - b, items] over paired items."""
    if not len(a) == len(b) == len(units):
        raise ValueError(f"paired outcomes need equal lengths, got {len(a)}, {len(b)}, {len(units)}")
    out = defaultdict(lambda: [0.0, 0])
    for x, y, u in zip(a, b, units):
        out[u][0] += x - y
        out[u][1] += 1
    return dict(out)


def _percentile(values: list[float], level: float) -> tuple[float, float]:
    v = sorted(values)
    lo, hi = (1 - level) / 2, (1 + level) / 2
    return v[int(lo * (len(v) - 1))], v[math.ceil(hi * (len(v) - 1))]


def paired_bootstrap(a, b, units, n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> dict:
    """mean(a) - mean(b) over paired items, with a bootstrap CI over units: dict(diff, lo, hi, units)."""
    return two_level_bootstrap([(a, b, units)], n_boot, seed, level)


def two_level_bootstrap(runs, n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> dict:
    """runs: one (a, b, units) per seed. The mean over seeds of each seed's paired difference, with a CI from
    resampling seeds, then games: dict(diff, lo, hi, per_seed, units)."""
    seeds = [_by_unit(*r) for r in runs]
    names = sorted({u for s in seeds for u in s})

    def estimate(drawn_seeds, drawn_units):
        per = []
        for s in drawn_seeds:
            d = [s[u] for u in drawn_units if u in s]
            if d:
                per.append(sum(x for x, _ in d) / sum(n for _, n in d))
        return sum(per) / len(per) if per else 0.0

    rng = random.Random(seed)
    reps = [estimate([seeds[rng.randrange(len(seeds))] for _ in seeds] if len(seeds) > 1 else seeds,
                     [names[rng.randrange(len(names))] for _ in names]) for _ in range(n_boot)]
    lo, hi = _percentile(reps, level)
    per_seed = [estimate([s], names) for s in seeds]
    return dict(diff=sum(per_seed) / len(per_seed), lo=lo, hi=hi, per_seed=per_seed, units=len(names))


def detectable(a, b, units, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest true difference this table detects with the given power (two-sided alpha): from the sd of
    the per-unit mean differences, (z_{1-alpha/2} + z_power) x sd / sqrt(units)."""
    per = [x / n for x, n in _by_unit(a, b, units).values()]
    if len(per) < 2:
        return math.inf
    return (Z(1 - alpha / 2) + Z(power)) * statistics.stdev(per) / math.sqrt(len(per))


NO_DATA = "no data (nothing to compare)"


def verdict(ci: dict | None, smallest: float | None = None) -> str:
    """"holds (CI excludes 0)" or "no difference detected", with what the table could detect; NO_DATA for a
    comparison without items (None, or a CI without bounds)."""
    if not isinstance(ci, dict) or not all(isinstance(ci.get(k), (int, float)) for k in ("lo", "hi")):
        return NO_DATA
    if ci["lo"] > 0 or ci["hi"] < 0:
        return "holds" if ci["lo"] > 0 else "reversed"
    return "no difference detected" + (f"; could detect >= {smallest:.3f}" if smallest is not None else "")
