"""stats.py on cases with known answers: the CIs, power's t quantiles, verdicts that do not hang on the RNG
seed, and the verdict's rule: a CI that excludes 0 holds only where the exact sign-flip test agrees."""
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lab"))
from readout import stats  # noqa: E402


def test_wilson_published_values():
    # Newcombe (1998), Table I / any Wilson calculator: 0/10 -> (0, 0.2775), 5/10 -> (0.2366, 0.7634)
    assert stats.wilson(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert stats.wilson(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert stats.wilson(10, 10) == pytest.approx((0.7225, 1.0), abs=1e-4)
    assert stats.wilson(0, 0) == (0.0, 1.0)


def test_constant_difference_has_a_zero_width_ci():
    a, b = [1, 1, 0, 1, 1, 0] * 6, [0, 1, 0, 0, 1, 0] * 6  # + 1/3 in every game of 6 items, 6 games
    units = [g for g in range(6) for _ in range(6)]
    ci = stats.paired_bootstrap(a, b, units, n_boot=300)
    assert ci["diff"] == pytest.approx(1 / 3) and ci["lo"] == pytest.approx(ci["hi"]) == pytest.approx(1 / 3)
    assert ci["p"] == pytest.approx(2 / 64)  # 6 games one way: only all-plus and all-minus are as far
    assert stats.half_width(ci) == 0.0 and stats.verdict(ci) == "holds"
    three = stats.over_seeds([(a, b, units)] * 3, n_boot=300)  # identical seeds: as wide as the bootstrap
    assert three["lo"] == pytest.approx(three["hi"]) == pytest.approx(1 / 3) and len(three["per_seed"]) == 3
    assert three["p"] == pytest.approx(2 / 8) and three["seeds"] == 3
    assert stats.verdict(three) == ("no difference detected (the CI excludes 0, the exact test over seeds "
                                    "does not: p 0.250)")


def test_seeded_bootstrap_is_reproducible_and_paired():
    rng = random.Random(1)
    a = [rng.random() < 0.6 for _ in range(120)]
    b = [rng.random() < 0.4 for _ in range(120)]
    units = [i // 6 for i in range(120)]
    one, again = stats.paired_bootstrap(a, b, units, seed=3), stats.paired_bootstrap(a, b, units, seed=3)
    assert one == again and one["units"] == 20
    assert one["diff"] == pytest.approx((sum(a) - sum(b)) / 120) and one["lo"] < one["diff"] < one["hi"]
    assert stats.paired_bootstrap(a, a, units)["hi"] == 0.0  # an arm against itself
    with pytest.raises(ValueError):
        stats.paired_bootstrap(a, b[:-1], units)


def test_coverage_on_a_simulated_case():
    """Games with their own effect (sd 0.3), item noise: the 95 % CI covers the true 0.1 in ~95 % of draws."""
    rng, hits, draws = random.Random(0), 0, 80
    for d in range(draws):
        a, b, units = [], [], []
        for g in range(25):
            effect = 0.1 + rng.gauss(0, 0.3)
            for _ in range(4):
                base = rng.gauss(0, 1)
                a.append(base + effect + rng.gauss(0, 0.5))
                b.append(base)
                units.append(g)
        ci = stats.paired_bootstrap(a, b, units, n_boot=300, seed=d)
        hits += ci["lo"] <= 0.1 <= ci["hi"]
    assert 0.85 <= hits / draws <= 1.0


def test_half_width_and_verdict():
    """Beside a difference not detected, the CI's half-width, named so (the old "could
    detect" was a power figure at the observed effect)."""
    rng = random.Random(2)
    a = [rng.gauss(0, 1) for _ in range(200)]
    b = [x - 0.01 + rng.gauss(0, 1) for x in a]
    units = [i // 10 for i in range(200)]
    ci = stats.paired_bootstrap(a, b, units)
    half = stats.half_width(ci)
    assert half == pytest.approx((ci["hi"] - ci["lo"]) / 2) and 0 < half < 1
    assert stats.verdict(ci, half) == f"no difference detected; CI half-width {half:.3f}"
    assert stats.half_width(stats.paired_bootstrap([1.0], [0.0], ["g"])) == float("inf")  # one game


def test_the_half_width_counts_the_spread_between_seeds():
    """Two seeds of opposite sign (+0.3 and -0.3 on every game). Pooling the seeds' items
    per game gave a paired sd of 0 beside a CI of +-0.3; the half-width is the two-level CI's own."""
    import agent_stats

    games = [f"g{i}" for i in range(20)]
    up, down = {g: 0.3 for g in games}, {g: 0.0 for g in games}
    ci = agent_stats.compare([up, down], [down, up], games)  # seed 1: +0.3, seed 2: -0.3
    half = 12.706 * 0.3  # t(0.975, 1) standard errors of the two seeds' mean (sd 0.424, se 0.3)
    assert ci["diff"] == 0.0 and ci["lo"] == pytest.approx(-half, abs=1e-3)
    assert ci["half_width"] == pytest.approx(half, abs=1e-3)  # the pooled figure: 0.000
    assert stats.verdict(ci) == "no difference detected"


def test_power_uses_student_t_with_the_seeds_degrees_of_freedom(capsys):
    """3 seeds per arm are a two-sample t test at 2 (3 - 1) = 4 df, not the normal: the
    committed agent_sanity spread (sd 15.6 points) detects >= 47 points with 3 seeds (the normal said 36)."""
    import power
    from scipy.stats import t

    assert power.quantiles(3) == pytest.approx(t.ppf(0.975, 4) + t.ppf(0.8, 4))
    assert power.quantiles(3) == pytest.approx(3.717, abs=1e-3)
    assert power.quantiles(1000) == pytest.approx(stats.Z(0.975) + stats.Z(0.8), abs=0.01)
    assert power.smallest(0.156 ** 2, 3) == pytest.approx(3.717 * 0.156 * (2 / 3) ** 0.5, abs=1e-3)
    for delta in (0.35, 0.15, 0.069):
        n = power.seeds_needed(delta, 0.0196, 0.24, 140)
        var = 0.0196 + 0.24 * 0.76 / 140
        assert n >= 2 * power.quantiles(n) ** 2 * var / delta ** 2  # enough
        assert n == 2 or n - 1 < 2 * power.quantiles(n - 1) ** 2 * var / delta ** 2  # the smallest
    power.main([str(Path(__file__).resolve().parents[1] / "lab" / "results" / "agent_sanity")])
    out = capsys.readouterr().out
    assert "3 seeds per arm detect (80 % power, t at 4 df) differences >= 47 points" in out


def test_a_ci_over_games_holds_only_where_the_sign_flip_test_agrees():
    """The review's cases: 4 or 5 of 20 games move one way and none the other. The bootstrap CI excludes 0
    (it said "holds"), but the exact sign-flip test over games gives p 0.125 / 0.062: no difference
    detected, and the line says why. Six games reach p 0.031 and hold; the same games down are "reversed"."""
    units = list(range(20))
    for moved, p in ((4, 0.125), (5, 0.0625), (6, 0.03125)):
        a, b = [1.0] * moved + [0.0] * (20 - moved), [0.0] * 20
        up, down = stats.paired_bootstrap(a, b, units), stats.paired_bootstrap(b, a, units)
        assert up["lo"] > 0 and up["p"] == pytest.approx(p) and down["hi"] < 0
        if p < 0.05:
            assert (stats.verdict(up), stats.verdict(down)) == ("holds", "reversed")
        else:
            assert stats.verdict(up) == stats.verdict(down) == (
                f"no difference detected (the CI excludes 0, the exact test over games does not: p {p:.3f})")
    assert stats.verdict(dict(lo=0.01, hi=0.2)) == "no difference detected (the CI excludes 0, no exact test)"


def test_two_seeds_give_a_t_interval_and_a_sign_flip_over_seeds():
    """Two seeds each +0.1 / +0.05 on 20 games: pooled, a bootstrap over seeds said "holds"; over seeds the
    t-interval at 1 df is wide and the sign-flip test over 2 seeds cannot go below p 0.5."""
    units = [g for g in range(20) for _ in range(10)]
    runs = [([1.0 if i % 10 < k else 0.0 for i in range(200)], [0.0] * 200, units) for k in (1, 2)]
    ci = stats.over_seeds(runs)
    assert ci["per_seed"] == pytest.approx([0.1, 0.2]) and ci["seeds"] == 2 and ci["p"] == 0.5
    assert ci["lo"] == pytest.approx(0.15 - 12.706 * 0.05, abs=1e-3)
    assert stats.verdict(ci) == "no difference detected"
    assert "2 seeds (+0.100, +0.200; t-interval, at least the bootstrap's); sign-flip over seeds p 0.500" \
        in stats.said(ci)
    a, b = [1.0 if i % 10 < 5 else 0.0 for i in range(200)], [1.0 if i % 20 < 10 else 0.0 for i in range(200)]
    noisy = [(a, b, units)] * 2  # two identical seeds of noisy games: the t-interval alone would be [0, 0]
    wide = stats.over_seeds(noisy)
    assert wide["diff"] == pytest.approx(0.0, abs=1e-9) and wide["lo"] < -0.05 and wide["hi"] > 0.05
    assert "bootstrap over seeds" in stats.said(stats.over_seeds(runs * 3))  # 6 seeds: the bootstrap


def test_no_item_changed_says_so_with_the_bound_it_leaves():
    """0 of 96 triplets changed: not "CI half-width 0.000" but the share 0 changes in 96 leave open."""
    units = [i // 5 for i in range(96)]
    c = stats.paired_bootstrap([1.0] * 50 + [0.0] * 46, [1.0] * 50 + [0.0] * 46, units)
    assert stats.verdict(c) == "no item changed (0 of 96: a difference up to +-0.038 is not excluded)"
    assert stats.unchanged_bound(96) == pytest.approx(1 - 0.025 ** (1 / 96))


def test_the_strict_rescore_verdict_does_not_hang_on_the_bootstrap_seed(monkeypatch):
    """Purposeful RWML − WM SFT under exact match (lab/rescore.py's re-score of the committed
    stage1_test_table) "held" at 2,000 draws in 6 of 20 RNG seeds: its lower bound is 0 (the replicates pile
    up there). At N_BOOT draws every one of 20 seeds prints the same verdict, "(borderline)"; every cell of
    the committed tables: lab/rng_check.py (recorded in lab/results/strict_rescore/README.md)."""
    import rescore

    data = rescore.read_archive(Path(__file__).resolve().parents[1] / "lab" / "results" / "stage1_test_table"
                                / "sanity_valid_unseen_triplets.tar.xz")
    seeds = sorted({s for s, _, _ in data if s.startswith("seed")})
    found = set()
    for rng_seed in range(20):
        monkeypatch.setattr(stats, "RNG_SEED", rng_seed)
        found.add(stats.verdict(rescore.paired(data, seeds, "rwml", "wm_sft", "purposeful", "exact")))
    assert len(found) == 1 and "holds" not in found.pop()


def test_the_agent_table_pairs_arms_on_games(tmp_path):
    """lab/agent_stats.py on eval.py-shaped results of known success: per-game means, every arm on the same
    games, policy RL − base paired over seeds and games, and a difference no CI can separate from 0."""
    import json

    import agent_stats

    def write(path, wins):  # wins: game -> list of 0/1, one per episode
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dict(episodes=[dict(split="test", game=g, won=w, seed=i)
                                                  for g, ws in wins.items() for i, w in enumerate(ws)])))

    games = [f"g{i}" for i in range(10)]
    write(tmp_path / "random" / "sampled.json", {g: [0, 1] * 10 for g in games})  # 50 %
    for name in ("greedy", "sampled"):
        write(tmp_path / "base" / f"{name}.json", {g: [0] * (4 if name == "sampled" else 1) for g in games})
        for s in (1, 2):
            write(tmp_path / f"seed{s}" / "policy" / f"{name}.json",
                  {g: [1] * (4 if name == "sampled" else 1) for g in games})
    lines, data = agent_stats.table(tmp_path)
    found = {(c["comparison"], c["evaluation"]): c for c in data["comparisons"]}
    rl_base = found[("policy RL − base", "sampled")]
    assert rl_base["diff"] == 1.0 and rl_base["lo"] == 1.0  # 2 seeds: the sign-flip over seeds, p 0.5
    assert ("no difference detected (the CI excludes 0, the exact test over seeds does not: p 0.500)"
            in lines[-5])
    assert found[("base − random", "sampled")]["diff"] == -0.5
    assert any(line.startswith("| random (uniform admissible) | 50.0 [50.0, 50.0]") for line in lines)
    _, named = agent_stats.table(tmp_path, name="warm-up")  # another arm in the --policy folders
    assert ("warm-up − base", "sampled") in {(c["comparison"], c["evaluation"]) for c in named["comparisons"]}
    write(tmp_path / "base" / "greedy.json", {g: [0] for g in games[:5]})  # another set of games: refused
    from envs import UserError

    with pytest.raises(UserError, match=r"base/greedy.json plays other games than .*base/sampled.json \(5 "
                                        r"missing, e.g. test/g5\): every arm must play the same games"):
        agent_stats.table(tmp_path)


def test_the_committed_agent_and_textworld_tables_are_what_their_files_give():
    """The issue-37 tables in lab/results/ recomputed from the per-episode and per-triplet files committed
    beside them (seeded bootstraps): a number edited by hand, or a file replaced, fails here."""
    import agent_stats
    import rescore

    res = Path(__file__).resolve().parents[1] / "lab" / "results"
    for study in ("stage2_test", "stage2_test_6steps"):
        lines, _ = agent_stats.table(res / study)
        assert lines == (res / study / f"{study}.md").read_text().splitlines(), study
    dev = (res / "stage2_dev" / "stage2_dev.md").read_text().split("## after ")
    for n, section in ((3, dev[1]), (6, dev[2])):
        lines, _ = agent_stats.table(res / "stage2_dev", policy=f"seed*/step{n}", split="dev")
        assert lines == section.strip().splitlines()[1:], n
    arms = {"RWML": "rwml", "policy RL": "seed*/policy", "RWML + policy RL": "seed*/rwml_policy",
            "WM SFT + policy RL": "seed*/wm_sft_policy",
            "policy RL, seeds 1-2 (not the recipe's)": "seed[12]/policy",
            "WM SFT + policy RL, seeds 1-2": "seed[12]/wm_sft_policy"}
    lines, _ = agent_stats.arms_table(res / "agent_sanity", arms, random="random20")
    assert lines == (res / "agent_sanity" / "agent_stats_test.md").read_text().splitlines()
    wm = (res / "tw_wm_test" / "tw_wm_test.md").read_text().splitlines()
    assert "\n".join(rescore.evals_report(res / "tw_wm_test" / "eval_test")).splitlines()[1:] == wm[1:]


def test_the_sign_flip_test_leaves_out_games_that_did_not_change():
    """exact_tests enumerates the units whose summed difference is not 0 (a 0 has the same |sum| with either
    sign): adding unchanged games changes no p, and 12 changed games among 40 are enumerated exactly."""
    a, b = [1.0, 1.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0, 0.0]
    base = stats.exact_tests(a, b, ["g1", "g2", "g3", "g4", "g5"])
    padded = stats.exact_tests(a + [1.0] * 30, b + [1.0] * 30, ["g1", "g2", "g3", "g4", "g5"]
                               + [f"z{i}" for i in range(30)])
    assert base == padded and base["p"] == 12 / 32  # |sum| >= 3 in 12 of the 32 sign patterns


def test_the_over_seeds_report_holds_only_over_enough_seeds(tmp_path, capsys):
    """lab/over_seeds_report.py on folders of known scores: the real reward right where both controls are
    wrong on every seed holds over 6 seeds (p 2 / 64) and not over 4 (p 0.125, the smallest 4 seeds allow);
    a control against itself (a coin run read as the real run) never holds."""
    import itertools
    import json

    import over_seeds_report

    def write(folder, right):  # 20 games, one triplet each, per line's kinds
        folder.mkdir(parents=True)
        for kind, arm in itertools.product(("train", "explore", "purposeful", "state"),
                                           ("rwml", "before", "template", "rule_copy", "tracker")):
            rows = [dict(game=f"g{g}", rollout=0, step=0, action="look", rewards=[float(right)],
                         exact=[right]) for g in range(20)]
            (folder / f"wm_eval_{arm}_{kind}.triplets.jsonl").write_text(
                "".join(json.dumps(r) + "\n" for r in rows))

    for s in range(6):
        write(tmp_path / "real" / f"seed{s}", True)
        write(tmp_path / "same" / f"seed{s}", False)  # a coin run read as the real one: coin vs coin
        for ctrl in ("coin", "template"):
            write(tmp_path / "real" / f"{ctrl}{s}", False)
            write(tmp_path / "same" / f"{ctrl}{s}", False)
    six = "\n".join(over_seeds_report.table([tmp_path / "real" / f"seed{s}" for s in range(6)]))
    assert six.count("| holds |") == 6 and "6 seeds (+1.000" in six
    four = "\n".join(over_seeds_report.table([tmp_path / "real" / f"seed{s}" for s in range(4)]))
    assert "| holds |" not in four and "sign-flip over seeds p 0.125" in four
    same = "\n".join(over_seeds_report.table([tmp_path / "same" / f"seed{s}" for s in range(6)]))
    assert "| holds |" not in same and "no item changed" in same
    assert "the real reward − GRPO with a coin for a reward, 18 of 18;" in six  # each seed alone: holds
    assert "the real reward − GRPO with a coin for a reward, 0 of 18;" in same
    for s in range(6):  # PLAN.md's checks against the coin run: a second coin as wrong as the first, and a
        write(tmp_path / "real" / f"coinb{s}", False)  # "flipped sign" right everywhere (a check that fails)
        write(tmp_path / "real" / f"flip{s}", True)
    over_seeds_report.main([str(tmp_path / "real" / f"seed{s}") for s in range(6)])
    checks = capsys.readouterr().out.split("## Checks that must be able to fail")[1]
    assert checks.count("| a second coin − GRPO with a coin for a reward |") == 3
    assert checks.count("| holds |") == 3  # the flipped sign's three: this check fails here, as it must
    assert "GRPO's sign flipped − GRPO with a coin for a reward: +1.000" in checks
    found = checks.split("## Levels beside the baselines")[1]  # each arm's level read from its own folder
    for name, level in (("RWML, the real reward", "1.000"), ("GRPO with a coin for a reward", "0.000")):
        assert f"| {name} | {' '.join([level] * 6)} | {level} [{level}, {level}] |" in found, name


def test_the_committed_over_seeds_table_is_what_its_files_give():
    """lab/results/over_seeds/over_seeds.md recomputed from the per-triplet files committed beside it
    (seeded bootstraps), every seed's real run, controls and checks: a number edited by hand, or a run's
    file replaced, fails here."""
    import over_seeds_report

    res = Path(__file__).resolve().parents[1] / "lab" / "results" / "over_seeds"
    runs = [res / f"seed{s}" for s in range(71, 77)]
    assert over_seeds_report.report(runs) == (res / "over_seeds.md").read_text()


def test_a_second_coin_is_the_matched_coin_arms(tmp_path):
    """lab/coin_again.py: `--reward-control coin` flips the coin of seed + COIN_STREAM, the matched COIN
    arm's, not the coin run's own (the over-seeds study's null check: two coin runs that differ only in their
    coins)."""
    import subprocess

    code = "\n".join([
        "import sys; sys.path.insert(0, 'lab')", "from pathlib import Path", "import reward, train",
        "cfg, coin = train.Settings(reward_control='coin', seed=3), reward.coin_reward",
        "first = reward.reward_control(cfg, [], None, Path('.'))[1](['x'] * 64)",
        "import coin_again", "assert coin_again.STREAM == train.COIN_STREAM",
        "second = reward.reward_control(cfg, [], None, Path('.'))[1](['x'] * 64)",
        "assert second == coin(3 + train.COIN_STREAM)(['x'] * 64) != first"])
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-500:]


def test_the_counted_sign_flip_is_scipys_exact_one():
    """sign_flip counts the sums of integer differences (and of k samples' means, scaled); it gives the p of
    scipy's exact permutation test, which enumerates every assignment."""
    from scipy.stats import permutation_test

    rng = random.Random(5)
    for n in (2, 5, 9, 12):
        for scale in (1, 4):
            d = [rng.choice([-3, -2, -1, 1, 2, 3]) / scale for _ in range(n)]
            want = permutation_test((d,), sum, permutation_type="samples", n_resamples=float("inf")).pvalue
            assert stats.sign_flip(d) == pytest.approx(want, abs=1e-12), (d, want)
    assert stats.sign_flip([1.0] * 20) == pytest.approx(2 / 2 ** 20)  # 20 games one way, at once
