"""The world-model evaluation protocol: held-out games disjoint from train games, the content-free
baselines on the real engine and the real embedder, per-triplet outputs, the sanity table."""
import json
import re

import pytest

import envs
from harness.common import read_jsonl
import eval as ev
from stages import runs
from readout import verdict
import train
from envs import UserError
from reward import SimToRealReward, reward_control
import reports


@pytest.fixture(scope="module")
def reward_fn():
    return SimToRealReward(tau_d=0.1)


@pytest.fixture(scope="module")
def purposeful():
    """Expert-walkthrough triplets of 4 valid_unseen games (the real engine), no wrong first command."""
    return envs.walkthrough_triplets("valid_unseen", 4, history_len=1, seed=0, wrong_first=False)


def test_heldout_games_are_disjoint_from_train_games():
    cfg = train.Settings()
    runs.check_heldout(cfg)  # the defaults: train games vs the test split
    held = {envs.game_id(g) for g in envs.list_games(cfg.heldout_split, cfg.heldout_games, 0)}
    for seed in range(3):
        games = {envs.game_id(g) for g in train.split_games(train.Settings(seed=seed))}
        assert not games & held and len(games) == cfg.num_games
    assert cfg.heldout_split == "valid_unseen"  # the default run reports on the test split
    with pytest.raises(UserError, match="shares 16 games with the train games"):
        runs.check_heldout(train.Settings(heldout_split="train", heldout_games=16))
    with pytest.raises(UserError, match="--heldout-split valid_seen shares"):
        runs.check_heldout(train.Settings(split="valid_seen", heldout_split="valid_seen"))


def test_the_heldout_seed_draws_the_heldout_games(tiny_model, tmp_path, monkeypatch):
    """--heldout-seed 0 (the default) keeps the 20 games every run so far scored; another seed draws others,
    and both the walkthrough (purposeful) and the explore set are of its games."""
    seen = {envs.game_id(g) for g in envs.list_games("valid_unseen", 20, 0)}
    assert train.Settings().heldout_seed == 0
    import engine

    monkeypatch.setattr(engine, "MODEL_CACHE", tmp_path / "cache")
    cfg = train.Settings(model=tiny_model, heldout_games=2, heldout_seed=123, max_turns=2,
                         eval_max_triplets=0)
    sets = train.heldout_triplets(cfg, tmp_path, lambda: engine.load_model(tiny_model))
    want = {envs.game_id(g) for g in envs.list_games("valid_unseen", 2, 123)}
    for kind in ("explore", "purposeful"):
        assert {t["game"] for t in sets[kind]["triplets"]} == want and not want & seen, kind


def test_template_rule_writes_the_games_sentences():
    t = envs.template_prediction
    assert t("go to cabinet 3") == "You arrive at cabinet 3. The cabinet 3 is closed."
    assert t("go to countertop 1") == "You arrive at countertop 1. On the countertop 1, you see nothing."
    assert t("open fridge 1") == "You open the fridge 1. The fridge 1 is open. In it, you see nothing."
    assert t("close drawer 2") == "You close the drawer 2."
    assert t("take mug 1 from countertop 2") == "You pick up the mug 1 from the countertop 2."
    assert t("move mug 1 to coffeemachine 1") == "You move the mug 1 to the coffeemachine 1."
    assert t("heat apple 1 with microwave 1") == "You heat the apple 1 using the microwave 1."
    assert t("use desklamp 1") == "You turn on the desklamp 1."
    for free in ("I think I should look for a mug", "", "go", "take mug 1", "fly away"):
        assert t(free) == "Nothing happens."


def test_unseen_objects_are_those_the_prompt_never_names():
    t = dict(task="put a mug in the fridge", action="go to countertop 1",
             history=[dict(observation="You arrive at sinkbasin 1. On the sinkbasin 1, you see a knife 2.",
                           action="take knife 2 from sinkbasin 1"),
                      dict(observation="You pick up the knife 2.")],
             next_obs="You arrive at countertop 1. On the countertop 1, you see a knife 21, a mug 1, "
                      "and a knife 2.")
    # "knife 2" was named; "knife 21" is another object
    assert envs.unseen_objects(t) == ["knife 21", "mug 1"]
    assert envs.unseen_objects(dict(t, next_obs="You arrive at countertop 1. "
                                                "On the countertop 1, you see nothing.")) == []
    assert envs.unseen_objects(dict(t, next_obs="Nothing happens.")) == []


def test_template_rule_scores_what_it_should_on_a_fixed_set(purposeful, reward_fn):
    """On real walkthroughs, every event the action spells out is hit (take, move, heat, cool, clean, use); an
    arrival or an opening is hit only when there is nothing to list; "Nothing happens." is never predicted."""
    r = ev.baseline_wm("template", purposeful, reward_fn)
    rows = r["triplets"]
    assert len(rows) == len(purposeful) == r["n"]
    for row, trip in zip(rows, purposeful):
        exact = envs.template_prediction(trip["action"]) == trip["next_obs"]
        if row["kind"] in ("take", "move", "heat", "cool", "clean", "toggle"):
            assert exact and row["rewards"] == [1.0]
        if exact:
            assert row["template_hit"]
        if row["kind"] == "arrive" and "you see a" in trip["next_obs"]:
            assert not exact
    assert r["per_kind"]["beyond_template"]["wm_accuracy"] == 0.0  # by definition
    assert r["per_kind"]["within_template"]["wm_accuracy"] == 1.0
    # what the rule misses is, almost always, what the prompt does not determine (the state
    # tracker cannot reproduce it): content to guess
    unseen, beyond = r["per_kind"]["beyond_template_unseen"]["n"], r["per_kind"]["beyond_template"]["n"]
    assert 0 < unseen <= beyond and unseen >= 0.7 * beyond
    held = [envs.probe_exact(envs.track_state(t), t["next_obs"]) for t in purposeful]
    assert [(r["tracker_hit"], not r["unseen_objects"]) for r in rows] == [(h, h) for h in held]
    assert 0.3 < r["wm_accuracy"] < 1.0  # object lists are beyond it
    # no walkthrough step fails
    assert ev.baseline_wm("nothing", purposeful, reward_fn)["wm_accuracy"] == 0.0
    copy = ev.baseline_wm("copy", purposeful, reward_fn)
    assert copy["triplets"][1]["predictions"] == [purposeful[1]["history"][-1]["observation"]]


def test_every_wm_evaluation_writes_its_triplets(tmp_path, transitions, capsys):
    """eval.py wm: the summary names the file and split it scored; beside it, one row per triplet with its
    predictions, rewards and cosines, which reproduce the summary."""
    ev.main(["wm", "--transitions", transitions, "--baseline", "template",
             "--out", str(tmp_path / "rule.json")])
    summary = json.loads((tmp_path / "rule.json").read_text())
    rows = [json.loads(x) for x in (tmp_path / "rule.triplets.jsonl").read_text().splitlines()]
    assert summary["triplets_file"] == "rule.triplets.jsonl" and "triplets" not in summary
    assert len(rows) == summary["n"] == len(train.read_jsonl(train.Path(transitions)))
    assert sum(r["rewards"][0] for r in rows) / len(rows) == pytest.approx(summary["wm_accuracy"])
    assert set(rows[0]) >= {"game", "step", "action", "target", "kind", "template_hit", "predictions",
                            "rewards", "cosines"}
    assert f"{transitions} (split unknown), template:" in capsys.readouterr().out
    with pytest.raises(UserError, match="unknown --baseline 'oracle'"):
        ev.main(["wm", "--transitions", transitions, "--baseline", "oracle",
                 "--out", str(tmp_path / "x.json")])


def test_walkthrough_collection_needs_no_model(tmp_path, capsys):
    out = tmp_path / "purposeful"
    train.main(["collect", "--walkthrough", "--split", "valid_unseen", "--num-games", "2",
                "--model", "/nonexistent", "--out", str(out)])
    trips = train.read_jsonl(out / "transitions.jsonl")
    assert trips and all(t["valid"] for t in trips) and trips[-1]["won"]
    assert json.loads((out / "collect.json").read_text())["split"] == "valid_unseen"
    assert ev.collection_split(str(out / "transitions.jsonl")) == "valid_unseen"


def _wm(acc, change, beyond, kinds):
    return dict(wm_accuracy=acc, mean_cosine=0.8, n=40, split="valid_unseen", transitions="h.jsonl",
                config=dict(eval_samples=4, temperature=1.0, tau_d=0.1),
                per_kind=dict(change=dict(wm_accuracy=change), beyond_template=dict(wm_accuracy=beyond, n=12),
                              beyond_template_unseen=dict(n=10),
                              within_template=dict(wm_accuracy=1.0 - beyond)),
                per_observation_kind={k: dict(wm_accuracy=v, n=n) for k, (v, n) in kinds.items()})


def test_sanity_table_reports_baselines_and_the_spread_over_independent_seeds(tmp_path):
    held = tmp_path / "valid_unseen"  # sanity.sh's layout: training per seed, scores per held-out split
    (held / "baselines").mkdir(parents=True)
    kinds = dict(arrive=(0.5, 30), take=(1.0, 4))
    for kind in verdict.HELDOUT_KINDS:
        (held / "baselines" / f"template_{kind}.json").write_text(json.dumps(_wm(0.85, 0.8, 0.0, kinds)))
    for s, (w, r) in enumerate([(0.40, 0.50), (0.30, 0.25), (0.35, 0.45)]):
        d = tmp_path / f"seed{s}"
        (d / "rwml").mkdir(parents=True)
        (d / "rwml" / "config.json").write_text(json.dumps(dict(beta=0.1, stratify_prompts=False, out="x",
                                                                num_generations=4)))
        # per step: 1 of the arrival group's 4 predictions and 2 of the "Nothing happens." group's say it
        rows = [dict(reward=x, frac_reward_zero_std=0.5, nothing_share=x,
                     target_kinds=["arrive", "nothing_happens"],
                     group_rewards=[0.5, 0.25 if s else 1.0], group_nothing=[1, 2] if x < 0.25 else [0, 3],
                     group_nothing_advantage=[-0.5, 1.0]) for x in (0.1, 0.2, 0.3, 0.4)]
        (d / "rwml" / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
        (held / d.name).mkdir()
        for kind in verdict.HELDOUT_KINDS:
            (held / d.name / f"eval_warmup_{kind}.json").write_text(json.dumps(_wm(w, w, w, kinds)))
            (held / d.name / f"eval_rwml_{kind}.json").write_text(json.dumps(_wm(r, r, r, kinds)))
    text = reports.sanity_report(tmp_path)
    explore = text.split("### purposeful")[0]
    assert "| template rule | 0.850 | 1.000 | 0.800 | 0.000 | 0.800 |" in explore
    assert "12 beyond the template rule (10 of them list objects the prompt never names)" in explore
    assert "| warm-up | 0.350 ± 0.050 (0.400 / 0.300 / 0.350)" in explore
    assert ("| **RWML − warm-up** (paired) | +0.050 ± 0.087 (+0.100 / -0.050 / +0.100) | "
            "-0.050 ± 0.087") in explore
    assert ("| arrive | 30 | 0.500 | 0.500 | 0.500 |" in explore
            and "Too few to quote as a rate: take 4." in explore)
    # the drift columns: on its targets 2/4 -> 3/4, on the others 1/4 -> 0/4; advantage +4 (up) / -2 (down)
    assert ("| 0 | 0.10 -> 0.40 | 0.10 -> 0.40 | 0.50 -> 0.75 | 0.25 -> 0.00 | 0.50 | 0.00 of 4 | "
            "+4.0 / -2.0 | – |") in text
    assert ("| 1 | 0.10 -> 0.40 | 0.10 -> 0.40 | 0.50 -> 0.75 | 0.25 -> 0.00 | 0.50 | 0.50 of 8 | "
            "+4.0 / -2.0 | – |") in text
    assert "RWML, --" not in text and "easy filter" not in text  # an arm or a table with no runs has no row
    strat = tmp_path / "seed0" / "rwml_strat"  # VARIANTS="strat=--stratify-prompts" VARIANT_SEEDS=0
    strat.mkdir()
    (strat / "config.json").write_text(json.dumps(dict(beta=0.1, stratify_prompts=True, out="y",
                                                       num_generations=4)))
    (strat / "metrics.jsonl").write_text(json.dumps(dict(
        reward=0.3, frac_reward_zero_std=0.25, nothing_share=0.2, target_kinds=["nothing_happens"],
        group_rewards=[0.5])) + "\n")
    for kind in verdict.HELDOUT_KINDS:
        (held / "seed0" / f"eval_rwml_strat_{kind}.json").write_text(json.dumps(_wm(0.6, 0.6, 0.6, kinds)))
    assert not (tmp_path / "curve.png").exists()
    for s in range(3):  # the runs' --eval-steps rows: the curve, per seed and mean ± sd
        with open(tmp_path / f"seed{s}" / "rwml" / "metrics.jsonl", "a") as f:
            f.write("".join(json.dumps(dict(step=k, eval_wm_accuracy=0.1 * k + s / 10)) + "\n"
                            for k in (0, 2, 4)))
    text = reports.sanity_report(tmp_path, png=tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 1000 and "curve.png" in text
    assert "| + RWML, --stratify-prompts | 0.600 ± 0.000 (0.600)" in text  # labelled by the flags that differ
    assert "| **RWML, --stratify-prompts − warm-up** (paired) | +0.200 ± 0.000 (+0.200)" in text
    # eval rows are not steps
    assert "| 0 | 0.10 -> 0.40 | 0.10 -> 0.40 | 0.50 -> 0.75 | 0.25 -> 0.00 | 0.50 | 0.00 of 4 |" in text
    assert ("| 0 (--stratify-prompts) | 0.30 -> 0.30 | 0.20 -> 0.20 | – | – | 0.25 | 1.00 of 1 | "
            "– | – |") in text
    kl = tmp_path / "seed1" / "rwml_kl"  # VARIANTS="kl=--beta 1.0" VARIANT_SEEDS=1
    kl.mkdir()
    (kl / "config.json").write_text(json.dumps(dict(beta=1.0, stratify_prompts=False, out="z")))
    (kl / "metrics.jsonl").write_text(json.dumps(dict(reward=0.2, frac_reward_zero_std=0.5,
                                                      nothing_share=0.1, target_kinds=["arrive"],
                                                      group_rewards=[0.5])) + "\n")
    for kind in verdict.HELDOUT_KINDS:
        (held / "seed1" / f"eval_rwml_kl_{kind}.json").write_text(json.dumps(_wm(0.45, 0.45, 0.45, kinds)))
    # the easy filter's target mix: 2 of 5 collected, 1 of 3 in the RWML split
    f = tmp_path / "seed0" / "filter"
    f.mkdir()
    (f / "filter.json").write_text(json.dumps(dict(num_triplets=5, num_filter_split=2, tau_easy=0.5)))
    (f / "easiness.jsonl").write_text("".join(
        json.dumps(dict(next_obs=o, easiness=e, kept=k)) + "\n" for o, e, k in (
            ("Nothing happens.", 1.0, False), ("You arrive at shelf 1.", 0.25, True),
            ("You close the drawer 1.", 0.75, True))))
    (tmp_path / "seed0" / "collect").mkdir()
    (tmp_path / "seed0" / "collect" / "transitions.jsonl").write_text("".join(
        json.dumps(dict(next_obs=o)) + "\n" for o in ("Nothing happens.", "Nothing happens.",
                                                      "You arrive at shelf 1.", "You close the drawer 1.",
                                                      "You arrive at desk 1.")))
    text = reports.sanity_report(tmp_path)
    assert "| + RWML, --beta 1.0 | 0.450 ± 0.000 (0.450)" in text
    assert "| 1 (--beta 1.0) | 0.20 -> 0.20 | 0.10 -> 0.10 | – | – | 0.50 | 0.00 of 1 | – | – |" in text
    assert "| 0 | 2 of 5 (40%) | 1 of 2 (50%) | 1 of 3 (33%) | 0 of 2 (0%) | 1.00 | 0.50 | 0.5 |" in text
    with pytest.raises(UserError, match="run sanity.sh first"):
        reports.sanity_report(tmp_path / "seed0")


def test_the_sanity_heading_states_the_tau_d_its_runs_used(tmp_path):
    """The table's heading named the tau_d of the first score it read (a baseline's), so a
    folder whose arms were scored (and RWML trained) at another tau_d was headed with the wrong one; it now
    reads every score's config and every reward-trained run's config.json."""
    held = tmp_path / "valid_unseen"
    (held / "baselines").mkdir(parents=True)
    kinds = dict(arrive=(0.5, 30))

    def score(tau_d, acc=0.4):
        r = _wm(acc, acc, acc, kinds)
        r["config"]["tau_d"] = tau_d
        return json.dumps(r)
    for kind in verdict.HELDOUT_KINDS:
        (held / "baselines" / f"template_{kind}.json").write_text(score(0.1, 0.85))  # kept from an older run
    for s in range(2):
        d = tmp_path / f"seed{s}"
        (d / "rwml").mkdir(parents=True)
        (d / "rwml" / "config.json").write_text(json.dumps(dict(beta=0.1, tau_d=0.01, out="x")))
        (d / "rwml" / "metrics.jsonl").write_text(json.dumps(dict(reward=0.2)) + "\n")
        (held / d.name).mkdir()
        for kind in verdict.HELDOUT_KINDS:
            for arm in ("warmup", "rwml"):
                (held / d.name / f"eval_{arm}_{kind}.json").write_text(score(0.01))
    text = reports.sanity_report(tmp_path)
    assert ("reward 1 iff 1 - cos < tau_d 0.1 (template rule); 0.01 (warm-up, + RWML) (each score's config: "
            "the rows were scored at different tau_d)") in text
    assert "Trained (RWML's reward) at tau_d 0.01 (every run's config.json)." in text
    for kind in verdict.HELDOUT_KINDS:  # all at one tau_d: one value
        (held / "baselines" / f"template_{kind}.json").write_text(score(0.01, 0.85))
    text = reports.sanity_report(tmp_path)
    assert "reward 1 iff 1 - cos < tau_d 0.01 (every score's config);" in text and "tau_d 0.1" not in text


def test_the_default_stage_all_runs_end_to_end(tiny_model, tmp_path, capsys):
    """`python train.py` (stage all), small: train and held-out collections, filter and warm-up, RWML, the
    held-out accuracy before -> after beside the baselines and the strict metrics, with per-triplet files."""
    argv = ["--model", tiny_model, "--num-games", "2", "--max-turns", "3", "--heldout-games", "1",
            "--eval-max-triplets", "3", "--eval-samples", "1", "--max-steps", "1", "--warmup-games", "1",
            "--num-generations", "2", "--prompts-per-step", "2", "--max-completion-length", "8",
            "--out", str(tmp_path / "run"), "--coin-control"]  # the COIN arm: the lab's option
    assert not train.Settings().coin_control  # off by default: one arm decides nothing
    train.main(argv)
    out = capsys.readouterr().out
    verdict.main([str(tmp_path / "run")])  # `python -m readout RUN`: the paired differences, the verdict
    read = capsys.readouterr().out
    for kind in verdict.HELDOUT_KINDS:
        for label in ("before", "rwml", "template"):
            summary = json.loads((tmp_path / "run" / f"wm_eval_{label}_{kind}.json").read_text())
            assert {"wm_accuracy", "exact_match", "item_f1", "item_n"} <= summary.keys()
            assert (tmp_path / "run" / f"wm_eval_{label}_{kind}.triplets.jsonl").is_file()
        assert f"{kind}: world-model accuracy" in out
        assert (tmp_path / "run" / f"wm_eval_coin_{kind}.triplets.jsonl").is_file()  # the matched COIN arm
        assert f"(e) held-out {kind}, RWML " in read
    assert "strict: exact match" in out and (tmp_path / "run" / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "run" / "coin_control" / "adapter" / "adapter_config.json").is_file()
    filtered = json.loads((tmp_path / "run" / "filter" / "filter.json").read_text())
    walk, play, probes = (read_jsonl(tmp_path / "run" / d / "transitions.jsonl")  # the warm-up's more games
                          for d in ("warmup_walk", "warmup_play", "warmup_state"))
    assert walk and play and probes and all(t["probe"] in envs.PROBES for t in probes)
    assert filtered["more_warmup_triplets"] == len(walk) + len(play) + len(probes)
    grpo_probes = read_jsonl(tmp_path / "run" / "collect_state" / "transitions.jsonl")  # GRPO's train games
    assert grpo_probes and filtered["num_triplets"] == len(grpo_probes) + len(
        read_jsonl(tmp_path / "run" / "collect" / "transitions.jsonl"))
    for label in ("before", "rwml", *ev.PROBE_ARMS):  # the state probes, scored by type
        assert json.loads((tmp_path / "run" / f"wm_eval_{label}_state.json").read_text())["per_probe"]
    assert "state probes, exact match by type: the warm-up -> RWML | the rule, rule + copy, the tracker: " \
        in out
    assert "(f) state probes (" in read and "; on the state probes (exact match RWML " in read
    said = out.splitlines()  # the last line: how to read the verdict, after the time and the cost line
    assert said[-1].endswith(f"python -m readout {tmp_path / 'run'}") and said[-2].startswith("cost: ")
    assert " min -> " in said[-3] and read.splitlines()[-1].startswith("verdict: ") and "(a) " not in out
    check_gain_lines(tmp_path / "run", read)
    train.main(argv)  # `python train.py` again: it continues the finished run (on c290165: "cannot resume")
    again = capsys.readouterr().out
    assert "resumed from" in again and again.splitlines()[-1] == said[-1]
    assert f'eval: reusing the "before" scores {tmp_path / "run"}/wm_eval_before_*.json' in again  # said


def test_the_gain_lines_are_the_per_triplet_files_numbers(tmp_path):
    """(a) and (b) on files of known numbers: 10 games, the after side right where the before side was wrong
    on 6 of 10 train triplets (a gain that holds), held-out triplets unchanged but for one game (no
    difference detected), exact match below the reward; swapped files give the reversed verdict."""
    def write(name, rows):
        (tmp_path / f"wm_eval_{name}.triplets.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def rows(values):  # one triplet per game, two predictions each
        return [dict(game=f"g{i}", step=0, rewards=list(v), exact=[min(x, 0.0) for x in v])
                for i, v in enumerate(values)]

    write("before_train", rows([(0.0, 0.0)] * 6 + [(1.0, 1.0)] * 4))
    write("rwml_train", rows([(1.0, 1.0)] * 6 + [(1.0, 1.0)] * 4))
    for kind in verdict.HELDOUT_KINDS:
        write(f"before_{kind}", rows([(0.0, 1.0)] * 10))
        write(f"rwml_{kind}", rows([(1.0, 1.0)] + [(0.0, 1.0)] * 9))
    lines = verdict.gain_lines(tmp_path, start="warm-up")
    assert lines[0].startswith("(a) the sim-to-real reward on RWML's own 10 training prompts (10 games): "
                               "the warm-up 0.400 -> RWML 1.000, +0.600 [+0.300, +0.900] holds"), lines[0]
    assert "reward +0.050 [+0.000, +0.150] no difference detected" in lines[1]
    assert ("exact match +0.000 [+0.000, +0.000] no item changed (0 of 10: a difference up to +-0.308 is not "
            "excluded), 10 games") in lines[1]
    for name in ("train", *verdict.HELDOUT_KINDS):  # a broken run: after worse than before
        a, b = (tmp_path / f"wm_eval_{w}_{name}.triplets.jsonl" for w in ("before", "rwml"))
        a_text, b_text = a.read_text(), b.read_text()
        a.write_text(b_text)
        b.write_text(a_text)
    assert "-0.600 [-0.900, -0.300] reversed" in verdict.gain_lines(tmp_path, start="warm-up")[0]


def write_rows(folder, name, rows):
    (folder / f"wm_eval_{name}.triplets.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def held_rows(exact, hit, unseen):  # one greedy prediction per triplet, two triplets per game
    return [dict(game=f"g{i // 2}", rollout=0, step=i % 2, action=f"a{i}", rewards=[float(e)], exact=[e],
                 template_hit=h, tracker_hit=not u, unseen_objects=u)
            for i, (e, h, u) in enumerate(zip(exact, hit, unseen))]


def test_before_and_after_are_paired_by_triplet_not_by_row(tmp_path):
    """The files of one held-out set in another row order give the same numbers (on 61e63ba the pairing was
    by position: a reordered file changed the result); files of other triplets are refused in one line."""
    n = 20
    before = held_rows([False] * n, [True] * n, [False] * n)
    after = held_rows([True] * 12 + [False] * 8, [True] * n, [False] * n)
    for name, rows in (("before_train", before), ("rwml_train", after)):
        write_rows(tmp_path, name, rows)
    for kind in verdict.HELDOUT_KINDS:
        write_rows(tmp_path, f"before_{kind}", before)
        write_rows(tmp_path, f"rwml_{kind}", after[::-1])  # the same triplets, the other way round
    lines = verdict.gain_lines(tmp_path, start="warm-up")
    assert "+0.600 [" in lines[0] and "12 up, 0 down" in lines[0]
    assert all("reward +0.600 [" in x and "exact match +0.600 [" in x for x in lines[1:3])
    write_rows(tmp_path, "rwml_explore", [dict(r, action="other") for r in after])
    with pytest.raises(UserError, match="not scores of the same triplets"):
        verdict.gain_lines(tmp_path, start="warm-up")


def test_the_verdict_fails_for_a_rule_copier_and_passes_above_the_rule(tmp_path):
    """(c) RWML - the template rule and (d) the rule's misses split by whether the prompt holds the answer;
    the last line says in words whether the run shows a world model above the rule: a copy of the rule
    (difference 0) does not, a model right on the rule's hits and on the misses whose answer the prompt holds
    does; the exact tests count the items that changed each way."""
    n = 40
    hit = [i % 4 != 0 for i in range(n)]  # the rule hits 3 of 4
    unseen = [i % 8 == 0 for i in range(n)]  # half its misses the prompt does not determine
    rule = held_rows(hit, hit, unseen)
    for kind in ("train", *verdict.HELDOUT_KINDS):
        write_rows(tmp_path, f"before_{kind}", held_rows([False] * n, hit, unseen))
        write_rows(tmp_path, f"template_{kind}", rule)
        write_rows(tmp_path, f"rwml_{kind}", rule)  # the rule-copier
    lines = verdict.gain_lines(tmp_path, start="warm-up")
    assert [x[:3] for x in lines] == ["(a)", "(b)", "(b)", "(b)", "(c)", "(c)", "(d)", "(d)", "ver"]
    assert ("the template rule 0.750 (exact match): +0.000 [+0.000, +0.000] no item changed (0 of 40"
            in lines[4])
    assert ("the rule's misses whose answer the prompt holds (the state tracker reproduces it) "
            "(5): RWML - the warm-up, exact match +0.000") in lines[6]
    assert "the others, which the prompt does not determine (5)" in lines[6]
    assert "; this run shows no world model above the content-free template rule" in lines[-1]
    better = held_rows([h or not u for h, u in zip(hit, unseen)], hit, unseen)  # + the prompt's misses
    for kind in verdict.HELDOUT_KINDS:
        write_rows(tmp_path, f"rwml_{kind}", better)
    lines = verdict.gain_lines(tmp_path, start="warm-up")
    assert "the template rule 0.750 (exact match): +0.125 [" in lines[4] and "5 up, 0 down" in lines[4]
    # 5 games one way: the CI excludes 0, but 2 x 0.5^5 = 0.062 is no exact result, so no world model
    assert "the exact test over games does not: p 0.062" in lines[4]
    assert "; this run shows no world model above the content-free template rule" in lines[-1]
    for kind in verdict.HELDOUT_KINDS:  # right on every miss: 10 games one way, p 2 x 0.5^10
        write_rows(tmp_path, f"rwml_{kind}", held_rows([True] * n, hit, unseen))
    lines = verdict.gain_lines(tmp_path, start="warm-up")
    assert "+0.250 [" in lines[4] and "holds; 10 up, 0 down over 20 games (sign-flip over games p 0.002)" \
        in lines[4]
    assert "; this run shows a world model above the content-free template rule" in lines[-1]


def test_a_cached_before_is_reused_only_when_what_made_it_is_the_same(tmp_path):
    """`all` reuses wm_eval_before_* only when the model it starts from (the warm-up's bytes), the triplets
    and the scoring are those of this run (on 61e63ba any file of that name was reused)."""
    warm = tmp_path / "warm"
    warm.mkdir()
    (warm / "adapter_model.safetensors").write_bytes(b"one")
    held = dict(triplets=[dict(game="g", rollout=0, step=0, action="open drawer 1")])
    cfg = train.Settings()
    made = runs.before_made_by(cfg, warm, held)
    assert made == runs.before_made_by(cfg, warm, dict(held))
    (warm / "adapter_model.safetensors").write_bytes(b"two")
    assert runs.before_made_by(cfg, warm, held) != made
    (warm / "adapter_model.safetensors").write_bytes(b"one")
    for other in (dict(cfg=train.Settings(tau_d=0.2)), dict(cfg=train.Settings(eval_samples=4)),
                  dict(held=dict(triplets=[dict(held["triplets"][0], step=1)]))):
        assert runs.before_made_by(other.get("cfg", cfg), warm, other.get("held", held)) != made, other


def check_gain_lines(run, out: str) -> None:
    """The run's last lines (a) and (b) are what its per-triplet files give: each triplet's mean over its
    predictions, before (the warm-up) and after (RWML), paired; the CI over games recomputed here by hand."""
    import random
    import statistics

    def pairs(kind, key):
        b, a = ([json.loads(x) for x in (run / f"wm_eval_{w}_{kind}.triplets.jsonl").read_text().splitlines()]
                for w in ("before", "rwml"))
        assert [(x["game"], x["step"]) for x in b] == [(x["game"], x["step"]) for x in a]
        return [(x["game"], statistics.fmean(map(float, x[key])), statistics.fmean(map(float, y[key])))
                for x, y in zip(b, a)]

    def diff(ps):  # mean of after - before over triplets
        return sum(a - b for _, b, a in ps) / len(ps)

    def ci(ps):  # the percentile bootstrap over games, by hand
        games = sorted({g for g, _, _ in ps})
        rng, reps = random.Random(1), []
        for _ in range(4000):
            drawn = [rng.choice(games) for _ in games]
            reps.append(diff([p for g in drawn for p in ps if p[0] == g]))
        reps.sort()
        return reps[100], reps[3899]

    a = pairs("train", "rewards")
    line = next(x for x in out.splitlines() if x.startswith("(a) "))
    assert f"on RWML's own {len(a)} training prompts ({len({g for g, _, _ in a})} games)" in line
    before, after = statistics.fmean(b for _, b, _ in a), statistics.fmean(x for _, _, x in a)
    assert f"{before:.3f} -> RWML {after:.3f}" in line
    assert f"{diff(a):+.3f} [" in line
    for kind in verdict.HELDOUT_KINDS:
        line = next(x for x in out.splitlines() if x.startswith(f"(b) held-out {kind}"))
        for key, label in (("rewards", "reward"), ("exact", "exact match")):
            ps = pairs(kind, key)
            found = re.search(rf"{label} ([+-][\d.]+) \[([+-][\d.]+), ([+-][\d.]+)\]", line)
            assert float(found[1]) == round(diff(ps), 3)
            lo, hi = ci(ps)
            assert abs(float(found[2]) - lo) <= 0.03 and abs(float(found[3]) - hi) <= 0.03  # other draws


def test_the_heldout_explore_set_is_played_once_then_reused(tiny_model, tmp_path, monkeypatch, capsys):
    """The held-out explore collection (seed 0, the same for every run) is played by the first run and copied
    from $RWML_CACHE/heldout by the next; a setting that changes it (the step budget) plays it again."""
    import dataclasses

    import engine

    monkeypatch.setattr(engine, "MODEL_CACHE", tmp_path / "cache")
    loads = []

    def load():
        loads.append(1)
        return engine.load_model(tiny_model)

    cfg = train.Settings(model=tiny_model, heldout_games=1, max_turns=2, eval_max_triplets=0)
    first = train.heldout_triplets(cfg, tmp_path / "a", load)
    assert len(loads) == 1 and "reused" not in capsys.readouterr().out
    second = train.heldout_triplets(cfg, tmp_path / "b", load)
    assert len(loads) == 1 and "reused the held-out explore triplets" in capsys.readouterr().out
    assert first["explore"]["triplets"] == second["explore"]["triplets"]
    assert (tmp_path / "a" / "heldout" / "episodes.jsonl").read_bytes() == \
        (tmp_path / "b" / "heldout" / "episodes.jsonl").read_bytes()
    train.heldout_triplets(dataclasses.replace(cfg, max_turns=3), tmp_path / "c", load)
    assert len(loads) == 2 and len(list((tmp_path / "cache" / "heldout").iterdir())) == 2


def test_the_verdict_says_whether_the_reward_beat_self_training(tmp_path):
    """The verdict's first half says what one run can: whether training raised (a), the sim-to-real
    reward on RWML's own training prompts, and held-out exact match, both kinds pooled, each with its CI, and
    in every case that one run cannot show the reward did it rather than GRPO with any reward (a
    coin run passed both on seed 52: lab/results/fresh_seeds). The (e) lines (the matched COIN arm,
    `--coin-control`) are shown when the arm was scored and decide nothing."""
    n = 40
    hit, unseen = [i % 4 != 0 for i in range(n)], [False] * n
    for kind in ("train", *verdict.HELDOUT_KINDS):
        write_rows(tmp_path, f"before_{kind}", held_rows([False] * n, hit, unseen))
        write_rows(tmp_path, f"template_{kind}", held_rows(hit, hit, unseen))
    write_rows(tmp_path, "rwml_train", held_rows([False] * n, hit, unseen))  # the reward did not rise
    for kind in verdict.HELDOUT_KINDS:
        write_rows(tmp_path, f"rwml_{kind}", held_rows(hit, hit, unseen))  # held-out accuracy rose
    lines = verdict.gain_lines(tmp_path, start="warm-up")
    assert "(b) held-out, both kinds pooled (80 triplets), exact match: +0.750 [" in lines[3]
    assert lines[-1].startswith("verdict: training raised held-out accuracy ((b) both kinds pooled, exact "
                                "match +0.750 [")
    assert "the reward where RWML trained: not shown ((a) +0.000 [" in lines[-1]
    cannot = "not shown, and one run cannot show, that the reward did it rather than GRPO with any reward"
    assert cannot in lines[-1]
    write_rows(tmp_path, "rwml_train", held_rows(hit, hit, unseen))  # now the reward rose where it trained
    lines = verdict.gain_lines(tmp_path, start="warm-up")
    assert lines[-1].startswith("verdict: training raised the reward where RWML trained ((a) +0.750 [")
    assert "and held-out accuracy ((b) both kinds pooled" in lines[-1] and cannot in lines[-1]
    assert not any(x.startswith("(e)") for x in lines)
    for kind in verdict.HELDOUT_KINDS:  # learned where it trained, not held out
        write_rows(tmp_path, f"rwml_{kind}", held_rows([False] * n, hit, unseen))
        write_rows(tmp_path, f"coin_{kind}", held_rows([False] * n, hit, unseen))
    lines = verdict.gain_lines(tmp_path, start="warm-up")
    assert lines[-1].startswith("verdict: training raised the reward where RWML trained ((a) +0.750 [")
    assert "held-out accuracy: not shown ((b) both kinds pooled, exact match +0.000 [" in lines[-1]
    assert [x[:3] for x in lines].count("(e)") == 2  # the matched COIN arm's lines, scored: shown
    for kind in ("train", *verdict.HELDOUT_KINDS):  # nothing moved
        write_rows(tmp_path, f"rwml_{kind}", held_rows([False] * n, hit, unseen))
    assert verdict.gain_lines(tmp_path, start="warm-up")[-1].startswith(
        "verdict: not shown that training raised the reward where RWML trained ((a) +0.000 [")
    cfg = train.Settings(reward_control="coin")
    run = reward_control(cfg, [], None, tmp_path)[1]
    ctrl = reward_control(cfg, [], None, tmp_path, coin_seed=cfg.seed + train.COIN_STREAM)[1]
    assert run(["x"] * 64) != ctrl(["x"] * 64)


def test_the_template_control_pays_for_the_rules_sentence_not_the_games(purposeful, reward_fn, tmp_path):
    """--reward-control template: GRPO's targets become the template rule's sentences, so its reward pays a
    model that writes the grammar and knows no state; the real reward pays the game's own observation."""
    cfg = train.Settings(reward_control="template")
    trips, fn = reward_control(cfg, purposeful, reward_fn, tmp_path)
    assert fn is reward_fn and len(trips) == len(purposeful)
    listing = next(t for t in purposeful if "you see a" in t["next_obs"].lower())  # the rule cannot list it
    rule = envs.template_prediction(listing["action"])
    ctrl = next(t for t in trips if (t["game"], t["step"]) == (listing["game"], listing["step"]))
    assert ctrl["next_obs"] == rule != listing["next_obs"]
    said = [f"<next_state>{x}</next_state>" for x in (rule, listing["next_obs"])]
    assert fn(said, [ctrl["next_obs"]] * 2) == [1.0, 0.0]  # the rule's sentence paid, the truth not
    assert fn(said, [listing["next_obs"]] * 2) == [0.0, 1.0]
