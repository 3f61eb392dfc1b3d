"""Support (skip on a first read): intervals and paired comparisons, for what `python train.py` prints and for
the lab's tables; numpy, and scipy.stats where it has the test. One rate: `wilson`. Two arms on the same items
(triplets, episodes): `paired_bootstrap`, a percentile CI that resamples games (a game's items move together),
and over seeds `two_level_bootstrap` (seeds, then games); `exact_tests` beside them (a sign-flip test over
games, McNemar's); `half_width`; `verdict`: "holds" only where the CI excludes 0 by more than its Monte-Carlo
error, so that another RNG seed prints the same verdict.
"""
from __future__ import annotations

import math
import statistics
from collections import defaultdict

import numpy as np

Z = statistics.NormalDist().inv_cdf
N_BOOT = 200_000  # replicates of every printed CI (2,000 left verdicts to the RNG seed: issue 47 item 6)
CHUNK = 25_000  # replicates drawn at a time (memory: a few MB per 10 units)
RNG_SEED = 0  # the bootstrap's RNG seed where none is given (lab/rng_check.py varies it)
MC_Z = Z(0.995)  # a bound's Monte-Carlo error: 2.576 sd of the count of replicates below it (99 %)


def wilson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of k successes in n trials (Wilson 1927; scipy.stats); (0, 1) when n is 0."""
    from scipy.stats import binomtest

    ci = binomtest(k, n).proportion_ci(level, method="wilson") if n > 0 else None
    return (float(ci.low), float(ci.high)) if ci else (0.0, 1.0)


def _by_unit(a, b, units) -> dict:
    """unit -> [sum of a - b, items] over paired items."""
    if not len(a) == len(b) == len(units):
        raise ValueError(f"paired outcomes need equal lengths, got {len(a)}, {len(b)}, {len(units)}")
    out = defaultdict(lambda: [0.0, 0])
    for x, y, u in zip(a, b, units):
        out[u][0] += x - y
        out[u][1] += 1
    return dict(out)


def _percentile(v, level: float) -> tuple[float, float]:
    """The percentile interval of sorted values (the lower rank rounded down, the upper up)."""
    lo, hi = (1 - level) / 2, (1 + level) / 2
    return float(v[int(lo * (len(v) - 1))]), float(v[math.ceil(hi * (len(v) - 1))])


def mc_margin(n: int, level: float = 0.95) -> float:
    """The Monte-Carlo error, in replicates, of the count that places a percentile bound: the count of n
    replicates below the true q-quantile is Binomial(n, q), q = (1 - level) / 2; 2.576 sd (99 %)."""
    q = (1 - level) / 2
    return MC_Z * math.sqrt(n * q * (1 - q))


def paired_bootstrap(a, b, units, n_boot: int = N_BOOT, seed: int | None = None, level: float = 0.95) -> dict:
    """mean(a) - mean(b) over paired items, with a bootstrap CI over units: dict(diff, lo, hi, units, ...)."""
    return two_level_bootstrap([(a, b, units)], n_boot, seed, level)


def _estimate(seeds: list[dict], names: list[str]) -> float:
    """The mean over seeds of each seed's paired difference on the given units (those it has)."""
    per = []
    for s in seeds:
        d = [s[u] for u in names if u in s]
        if d:
            per.append(sum(x for x, _ in d) / sum(n for _, n in d))
    return sum(per) / len(per) if per else 0.0


def two_level_bootstrap(runs, n_boot: int = N_BOOT, seed: int | None = None, level: float = 0.95) -> dict:
    """runs: one (a, b, units) per seed. The mean over seeds of each seed's paired difference, with a CI from
    resampling seeds (when there are several), then games (RNG seed `seed`, default RNG_SEED): dict(diff,
    lo, hi, per_seed, units, sd: the replicates' sd, n_boot, level, and the replicates below / at most /
    at least / above 0, which `verdict` reads)."""
    seeds = [_by_unit(*r) for r in runs]
    names = sorted({u for s in seeds for u in s})
    total = np.array([[s.get(n, (0.0, 0))[0] for n in names] for s in seeds], dtype=float)  # seed x unit
    items = np.array([[s.get(n, (0.0, 0))[1] for n in names] for s in seeds], dtype=float)
    rng = np.random.default_rng(RNG_SEED if seed is None else seed)
    reps = np.concatenate([_replicates(total, items, min(CHUNK, n_boot - start), rng)
                           for start in range(0, n_boot, CHUNK)])
    reps.sort()
    lo, hi = _percentile(reps, level)
    each = [_estimate([s], names) for s in seeds]
    return dict(diff=sum(each) / len(each), lo=lo, hi=hi, per_seed=each, units=len(names),
                sd=float(reps.std(ddof=1)) if n_boot > 1 else 0.0, n_boot=n_boot, level=level,
                below_0=int(np.count_nonzero(reps < 0)), at_most_0=int(np.count_nonzero(reps <= 0)),
                at_least_0=int(np.count_nonzero(reps >= 0)), above_0=int(np.count_nonzero(reps > 0)))


def _replicates(total: np.ndarray, items: np.ndarray, n: int, rng) -> np.ndarray:
    """n bootstrap replicates of the mean over seeds of each seed's paired difference: seeds drawn with
    replacement (when there are several), then units (one draw shared by the drawn seeds); a seed without
    any drawn unit is left out, a replicate without any seed is 0. total, items: seed x unit sums, counts."""
    k, u = total.shape
    drawn_seeds = rng.integers(k, size=(n, k)) if k > 1 else np.zeros((n, 1), dtype=int)
    drawn_units = rng.integers(max(u, 1), size=(n, u))  # no units: no draw, every replicate 0
    counts = np.bincount((drawn_units + u * np.arange(n)[:, None]).ravel(),
                         minlength=n * u).reshape(n, u).astype(float)  # replicate x unit: times drawn
    num, den = counts @ total.T, counts @ items.T  # replicate x seed
    per_seed = np.divide(num, den, out=np.full_like(num, np.nan), where=den > 0)
    taken = np.take_along_axis(per_seed, drawn_seeds, axis=1)  # replicate x drawn seed
    present = ~np.isnan(taken)
    return np.where(present.any(axis=1),
                    np.where(present, taken, 0.0).sum(axis=1) / np.maximum(present.sum(axis=1), 1), 0.0)


def half_width(ci: dict) -> float:
    """The CI's half-width, (hi - lo) / 2: what a table gives beside a difference it did not detect (a CI
    over seeds and games where several seeds are pooled); infinite for fewer than 2 units."""
    return math.inf if ci.get("units", 0) < 2 else (ci["hi"] - ci["lo"]) / 2


def exact_tests(a, b, units) -> dict:
    """Items up / down (a above / below b), and the two-sided p of a sign-flip test over units (the sum of the
    units' summed differences; exact up to 2^20 assignments) and of McNemar's exact test on the items."""
    from scipy.stats import binomtest, permutation_test

    by = _by_unit(a, b, units)
    up, down = sum(x > y for x, y in zip(a, b)), sum(x < y for x, y in zip(a, b))
    # a unit whose sum is 0 gives the same |sum| with either sign: leaving it out changes no p, and keeps the
    # exact enumeration to the units that changed (2^20 assignments took ~5 s; most games change nothing)
    d = np.array([s for s, _ in by.values() if s != 0], dtype=float)
    if len(d) < 2:  # nothing changed, or one unit: every assignment gives the same |sum|
        p_games = 1.0
    else:
        res = permutation_test((d,), np.sum, permutation_type="samples", alternative="two-sided",
                               n_resamples=np.inf if len(d) <= 20 else N_BOOT, random_state=RNG_SEED)
        p_games = float(res.pvalue)
    p_items = float(binomtest(up, up + down, 0.5).pvalue) if up + down else 1.0
    return dict(up=up, down=down, p_games=p_games, p_items=p_items)


NO_DATA = "no data (nothing to compare)"


RULE = ("verdict: \"holds\" only where the CI excludes 0 by more than its Monte-Carlo error (the count of "
        "replicates on the far side of 0 below 2.5 % by more than 2.576 sd), \"(borderline)\" where a bound "
        "is 0 within that error; CI half-width: (hi - lo) / 2 of the same CI; stats.py")
COUNTS = ("below_0", "at_most_0", "at_least_0", "above_0")


def verdict(ci: dict | None, half: float | None = None) -> str:
    """"holds" where the CI's lower bound is above 0 by more than its Monte-Carlo error ("reversed": the
    upper bound below 0), "no difference detected (borderline)" where one bound is 0 within that error,
    else "no difference detected" (with the CI's half-width, when given); NO_DATA for a comparison
    without items (None, or no bounds).

    With n replicates and q = (1 - level) / 2, the lower bound is the replicate of rank about n q: it is
    above 0 when fewer than n q replicates are <= 0, below 0 when more than n q are < 0, and 0 itself in
    between (replicates piled up at 0). Each count is known to m = mc_margin(n) (2.576 sd): the bound holds
    when fewer than n q - m replicates are <= 0, and is 0 within its error when at most n q + m are < 0 and
    at least n q - m are <= 0 (the upper bound: the same with > and >=). Both bounds at 0 (a CI [0, 0]: no
    difference at all) is no borderline. A CI without these counts (not from two_level_bootstrap) is judged
    on its bounds alone."""
    if not isinstance(ci, dict) or not all(isinstance(ci.get(k), (int, float)) for k in ("lo", "hi")):
        return NO_DATA
    if all(isinstance(ci.get(k), int) for k in ("n_boot", *COUNTS)):
        n, level = ci["n_boot"], ci.get("level", 0.95)
        edge, m = n * (1 - level) / 2, mc_margin(n, level)
        if ci["at_most_0"] < edge - m:
            return "holds"
        if ci["at_least_0"] < edge - m:
            return "reversed"
        lo_at_0 = ci["below_0"] <= edge + m and ci["at_most_0"] >= edge - m
        hi_at_0 = ci["above_0"] <= edge + m and ci["at_least_0"] >= edge - m
        borderline = lo_at_0 != hi_at_0
    else:
        if ci["lo"] > 0 or ci["hi"] < 0:
            return "holds" if ci["lo"] > 0 else "reversed"
        borderline = False
    return ("no difference detected" + (" (borderline)" if borderline else "")
            + (f"; CI half-width {half:.3f}" if half is not None else ""))

