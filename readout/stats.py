"""Intervals and paired comparisons for what `python train.py` prints and the lab's tables. Two arms
on the same items of one run: `paired_bootstrap`, a CI resampling games (a game's items move
together) beside the exact sign-flip test over games; over seeds, `over_seeds` (a bootstrap only
from MIN_BOOT_SEEDS seeds: with fewer it is far too narrow). `verdict`: "holds" / "reversed" only
where the CI excludes 0 and the exact test agrees: a CI alone moves on 4-5 games that an exact test
cannot tell from chance (2 x 0.5^5 = 0.062)."""
from __future__ import annotations

import math
import statistics
from collections import defaultdict

import numpy as np

Z = statistics.NormalDist().inv_cdf
ALPHA = 0.05  # the exact test's level, two-sided; the CIs are 95 %
N_BOOT = 200_000  # replicates of every printed CI (2,000 left verdicts to the RNG seed)
CHUNK = 25_000  # replicates drawn at a time (memory: a few MB per 10 units)
RNG_SEED = 0  # the bootstrap's RNG seed where none is given (lab/rng_check.py varies it)
MC_Z = Z(0.995)  # a bound's Monte-Carlo error: 2.576 sd of the count of replicates below it (99 %)
MIN_BOOT_SEEDS = 5  # below this many seeds the CI over seeds is Student's t, not a bootstrap


def wilson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of k successes in n trials (scipy's); (0, 1) when n is 0."""
    from scipy.stats import binomtest
    ci = binomtest(k, n).proportion_ci(level, method="wilson") if n > 0 else None
    return (float(ci.low), float(ci.high)) if ci else (0.0, 1.0)


def _by_unit(a, b, units) -> dict:
    """unit -> [sum of a - b, items] over paired items."""
    if not len(a) == len(b) == len(units):
        raise ValueError(
            f"paired outcomes need equal lengths, got {len(a)}, {len(b)}, {len(units)}")
    out = defaultdict(lambda: [0.0, 0])
    for x, y, u in zip(a, b, units):
        out[u][0] += x - y
        out[u][1] += 1
    return dict(out)


def mc_margin(n: int, level: float = 0.95) -> float:
    """A percentile bound's Monte-Carlo error in replicates: 2.576 sd of Binomial(n, q) (99 %)."""
    q = (1 - level) / 2
    return MC_Z * math.sqrt(n * q * (1 - q))


def sign_flip(d) -> float:
    """The two-sided p of a sign-flip test on values d: exact (scaled integers, or up to 2^20
    signs), else N_BOOT random signs. Zeros are left out: either sign gives the same |sum|."""
    from scipy.stats import permutation_test
    d = np.array([x for x in d if x != 0], dtype=float)
    if len(d) < 2:  # nothing changed, or one value: every assignment gives the same |sum|
        return 1.0
    for m in range(1, 17):  # sums of items scored 0 / 1 (or k samples' means): integers once scaled
        if np.allclose(d * m, np.round(d * m), rtol=0, atol=1e-9):
            return _sign_flip_counts(np.round(d * m).astype(int))
    res = permutation_test((d,), np.sum, permutation_type="samples", alternative="two-sided",
                           n_resamples=np.inf if len(d) <= 20 else N_BOOT, random_state=RNG_SEED)
    return float(res.pvalue)


def _sign_flip_counts(d: np.ndarray) -> float:
    """The exact two-sided sign-flip p of non-zero integers d, by counting the 2^n sums (a
    convolution per value: milliseconds, where enumerating 2^20 assignments took seconds)."""
    size = int(np.abs(d).sum())
    counts = np.zeros(2 * size + 1)  # index: a sum + size; |a sum| <= size, so np.roll never wraps
    counts[size] = 1.0
    for x in np.abs(d):
        counts = np.roll(counts, x) + np.roll(counts, -x)
    return float(counts[np.abs(np.arange(-size, size + 1)) >= abs(d.sum())].sum() / 2 ** len(d))


def paired_bootstrap(a, b, units, n_boot: int = N_BOOT, seed: int | None = None,
                     level: float = 0.95) -> dict:
    """mean(a) - mean(b) over paired items of one run: a bootstrap CI over units, the exact
    sign-flip p over units, items up / down, and the replicates' counts `verdict` reads."""
    return dict(_bootstrap([(a, b, units)], n_boot, seed, level), **exact_tests(a, b, units),
                n=len(a), test="games")


def over_seeds(runs, n_boot: int = N_BOOT, seed: int | None = None, level: float = 0.95) -> dict:
    """runs: a paired (a, b, units) per seed: the mean of the seeds' differences, a t-interval
    widened to the bootstrap's (alone from MIN_BOOT_SEEDS seeds), p over seeds."""
    if len(runs) == 1:
        return paired_bootstrap(*runs[0], n_boot=n_boot, seed=seed, level=level)
    from scipy.stats import t
    each = [_estimate([_by_unit(*r)], sorted(set(r[2]))) for r in runs]
    k, mean = len(each), sum(each) / len(each)
    out = _bootstrap(runs, n_boot, seed, level)
    # Student's t at k - 1 df (2 seeds: 12.7 standard errors), never narrower than the bootstrap:
    # seeds that agree give a t-interval of width 0, which games' noise still widens
    if k < MIN_BOOT_SEEDS:
        half = t.ppf((1 + level) / 2, k - 1) * statistics.stdev(each) / math.sqrt(k)
        out = dict(lo=min(mean - half, out["lo"]), hi=max(mean + half, out["hi"]),
                   units=out["units"], level=level)
    pairs = [(x, y) for a, b, _ in runs for x, y in zip(a, b)]
    return dict(out, diff=mean, per_seed=each, seeds=k, p=sign_flip(each), test="seeds",
                n=len(pairs), up=sum(x > y for x, y in pairs), down=sum(x < y for x, y in pairs))


def _estimate(seeds: list[dict], names: list[str]) -> float:
    """The mean over seeds of each seed's paired difference on the given units (those it has)."""
    per = []
    for s in seeds:
        d = [s[u] for u in names if u in s]
        if d:
            per.append(sum(x for x, _ in d) / sum(n for _, n in d))
    return sum(per) / len(per) if per else 0.0


def _bootstrap(runs, n_boot: int, seed: int | None, level: float) -> dict:
    """A CI from resampling seeds (when several), then games (RNG seed `seed`, else RNG_SEED), and
    the replicates below / at most / at least / above 0, which `verdict` reads."""
    seeds = [_by_unit(*r) for r in runs]
    names = sorted({u for s in seeds for u in s})
    total = np.array([[s.get(n, (0, 0))[0] for n in names] for s in seeds], float)  # seed x unit
    items = np.array([[s.get(n, (0, 0))[1] for n in names] for s in seeds], float)
    rng = np.random.default_rng(RNG_SEED if seed is None else seed)
    reps = np.concatenate([_replicates(total, items, min(CHUNK, n_boot - start), rng)
                           for start in range(0, n_boot, CHUNK)])
    reps.sort()
    last = len(reps) - 1  # the percentile interval: the lower rank rounded down, the upper up
    lo = float(reps[int((1 - level) / 2 * last)])
    hi = float(reps[math.ceil((1 + level) / 2 * last)])
    each = [_estimate([s], names) for s in seeds]
    return dict(diff=sum(each) / len(each), lo=lo, hi=hi, per_seed=each, units=len(names),
                sd=float(reps.std(ddof=1)) if n_boot > 1 else 0.0, n_boot=n_boot, level=level,
                below_0=int((reps < 0).sum()), at_most_0=int((reps <= 0).sum()),
                at_least_0=int((reps >= 0).sum()), above_0=int((reps > 0).sum()))


def _replicates(total: np.ndarray, items: np.ndarray, n: int, rng) -> np.ndarray:
    """n replicates of the mean over seeds of each seed's difference: seeds drawn (when several),
    then units (one draw for all); a seed with no drawn unit is left out, none is 0."""
    k, u = total.shape
    drawn_seeds = rng.integers(k, size=(n, k)) if k > 1 else np.zeros((n, 1), dtype=int)
    drawn_units = rng.integers(max(u, 1), size=(n, u))  # no units: no draw, every replicate 0
    counts = np.bincount((drawn_units + u * np.arange(n)[:, None]).ravel(),
                         minlength=n * u).reshape(n, u).astype(float)  # replicate x unit: draws
    num, den = counts @ total.T, counts @ items.T  # replicate x seed
    per_seed = np.divide(num, den, out=np.full_like(num, np.nan), where=den > 0)
    taken = np.take_along_axis(per_seed, drawn_seeds, axis=1)  # replicate x drawn seed
    present = ~np.isnan(taken)
    mean = np.where(present, taken, 0.0).sum(axis=1) / np.maximum(present.sum(axis=1), 1)
    return np.where(present.any(axis=1), mean, 0.0)


def half_width(ci: dict) -> float:
    """(hi - lo) / 2, beside a difference a table did not detect; infinite below 2 units."""
    return math.inf if ci.get("units", 0) < 2 else (ci["hi"] - ci["lo"]) / 2


def exact_tests(a, b, units) -> dict:
    """Items up / down (a above / below b), and p: the two-sided sign-flip test over units on their
    summed differences (items of a game are not independent: no test on items alone)."""
    p = sign_flip([s for s, _ in _by_unit(a, b, units).values()])
    return dict(up=sum(x > y for x, y in zip(a, b)), down=sum(x < y for x, y in zip(a, b)), p=p)


def unchanged_bound(n: int, level: float = 0.95) -> float:
    """The largest share of n items that may change while none is seen to: the upper
    Clopper-Pearson bound of 0 in n (about 3.7 / n), the +- of a difference where all agree."""
    from scipy.stats import binomtest
    return float(binomtest(0, n).proportion_ci(level, method="exact").high) if n else 1.0


NO_DATA = "no data (nothing to compare)"
RULE = ('verdict: "holds" ("reversed") only where the 95 % CI excludes 0 and the exact sign-flip '
        'test (over games in one run, over seeds across seeds) agrees, p < 0.05; else "no '
        'difference detected"; where no item changed, the change 0 changes leave open; stats.py')
COUNTS = ("below_0", "at_most_0", "at_least_0", "above_0")


def _ci_side(ci: dict) -> int:
    """+1 where the CI's lower bound is above 0, -1 where the upper is below 0, else 0; a
    bootstrap's by more than its Monte-Carlo error (fewer than n q - mc_margin(n) at most 0)."""
    if all(isinstance(ci.get(k), int) for k in ("n_boot", *COUNTS)):
        n, level = ci["n_boot"], ci.get("level", 0.95)
        edge = n * (1 - level) / 2 - mc_margin(n, level)
        return 1 if ci["at_most_0"] < edge else -1 if ci["at_least_0"] < edge else 0
    return 1 if ci["lo"] > 0 else -1 if ci["hi"] < 0 else 0


def verdict(ci: dict | None, half: float | None = None) -> str:
    """"holds" ("reversed") where the CI excludes 0 above (below) and ci["p"] < ALPHA; where no item
    changed, what 0 changes leave open; else "no difference detected" (why)."""
    bounds = ("lo", "hi")
    if not isinstance(ci, dict) or not all(isinstance(ci.get(k), (int, float)) for k in bounds):
        return NO_DATA
    if ci.get("up") == 0 and ci.get("down") == 0 and ci.get("n"):
        bound = unchanged_bound(ci["n"])
        return f"no item changed (0 of {ci['n']}: a difference up to +-{bound:.3f} is not excluded)"
    side, p = _ci_side(ci), ci.get("p")
    if side and p is not None and p < ALPHA:
        return "holds" if side > 0 else "reversed"
    test = ci.get("test", "games")
    why = ("" if not side else " (the CI excludes 0, no exact test)" if p is None else
           f" (the CI excludes 0, the exact test over {test} does not: p {p:.3f})")
    width = f"; CI half-width {half:.3f}" if half is not None else ""
    return "no difference detected" + why + width


def said(c: dict) -> str:
    """A comparison in words: estimate, 95 % CI, verdict, items changed each way, the exact test."""
    if not c.get("n"):
        return "no items"
    head = f"{c['diff']:+.3f} [{c['lo']:+.3f}, {c['hi']:+.3f}] {verdict(c)}"
    if c.get("test") == "seeds":
        how = ("t-interval, at least the bootstrap's" if c["seeds"] < MIN_BOOT_SEEDS else
               "bootstrap over seeds, then games")
        per = ", ".join(f"{d:+.3f}" for d in c["per_seed"])
        return f"{head}; {c['seeds']} seeds ({per}; {how}); sign-flip over seeds p {c['p']:.3f}"
    if not c["up"] and not c["down"]:
        return f"{head}, {c['units']} games"
    return (f"{head}; {c['up']} up, {c['down']} down over {c['units']} games (sign-flip over games "
            f"p {c['p']:.3f})")
