"""Nothing reused that its inputs did not make, nothing dropped without a word: the caches' keys cover the
code and the settings that make what they hold; a cut or foreign input is one line (or made again, said);
settings that cannot go together are refused before anything slow. No model: keys, files and fakes."""
import dataclasses
import json
import shutil
from pathlib import Path

import pytest

import envs
import train
import caches
from stages import runs
from readout import verdict
from stages.settings import WorldModelArgs
import engine
from harness import common
from stages import plumbing
from harness.common import ROOT, names, read_jsonl
from envs import UserError
import reports

TRIP = dict(task="put a mug in the fridge", history=[dict(observation="You are in the kitchen.")],
            action="open fridge 1", next_obs="You open the fridge 1.")


# the modules the agent's play, the filter and the scoring run through (the hand list of 68ef7d6 had four)
PLAY_PATH = ("train.py", "rwml.py", "envs.py", "reward.py", "engine/__init__.py", "harness/common.py",
             "stages/plumbing.py", "worlds/textworld.py", "choose/__init__.py", "stages/runs.py",
             "caches/__init__.py")


def test_the_code_key_covers_every_module_on_the_play_path(tmp_path, monkeypatch):
    """An edit to any module train.py imports (one more past step in rwml.play, say) changes the
    held-out set's key, so a new run plays it again (on 68ef7d6 only four named files counted)."""
    for f in ROOT.glob("*.py"):
        shutil.copy(f, tmp_path / f.name)
    for d in {p.parent.name for p in ROOT.glob("*/__init__.py")}:
        shutil.copytree(ROOT / d, tmp_path / d, ignore=shutil.ignore_patterns("__pycache__"))
    for module in (caches, runs):
        monkeypatch.setattr(module, "code_sha", lambda: common.code_sha(root=tmp_path))
    cfg = train.Settings(split="valid_unseen", num_games=1)

    def keys():  # the held-out (and warm-up play) set's, the filter's, the "before" scores'
        return (caches.heldout_key(cfg), runs.filter_cache(cfg, [TRIP], tmp_path / "filter")[0],
                runs.before_made_by(cfg, None, dict(triplets=[TRIP])))
    first = keys()
    assert keys() == first and common.code_sha(root=tmp_path) == common.code_sha()
    for name in PLAY_PATH:
        text = (tmp_path / name).read_text()
        (tmp_path / name).write_text(text + "\n# edited\n")
        assert all(a != b for a, b in zip(keys(), first)), name
        (tmp_path / name).write_text(text)
    assert keys() == first
    (tmp_path / "lab_note.py").write_text("x = 1\n")  # a file train.py never imports is no part of it
    assert keys() == first


CHANGED = dict(embedder="other/embedder", tau_d=0.33, rouge_gate=0.5, reward_metric="rouge",
               reward_binary=False, wm_reasoning=True, max_completion_length=9)


def test_before_is_scored_again_when_a_scoring_setting_changes(tmp_path, capsys, monkeypatch):
    """Every setting of the world model's answer and its reward (WorldModelArgs: on 68ef7d6
    --no-reward-binary and --reward-metric were left out) is in the "before" key; a reused "before" is said;
    a cut summary or per-triplet file is said and scored again (on 68ef7d6: a JSONDecodeError)."""
    assert set(CHANGED) == {f.name for f in dataclasses.fields(WorldModelArgs)}  # a new one: add it here
    assert set(CHANGED) <= set(names(train.Settings, "score"))
    held = dict(triplets=[dict(game="g", rollout=0, step=0, action="open drawer 1")], file="h.jsonl")
    cfg = train.Settings()
    made = runs.before_made_by(cfg, None, held)
    for name, value in CHANGED.items():
        assert runs.before_made_by(dataclasses.replace(cfg, **{name: value}), None, held) != made, name
    scored = []

    def score(cfg, model, tok, trips, reward_fn):  # as rwml.evaluate_heldout
        scored.append(1)
        return dict(n=len(trips), wm_accuracy=0.5, triplets=[dict(t, rewards=[0.5]) for t in trips])

    def before(cfg):
        n = len(scored)
        runs.scores_before(cfg, tmp_path, dict(explore=held), None, lambda: (None, None), None)
        return len(scored) > n, capsys.readouterr().out

    monkeypatch.setattr(runs.rwml, "evaluate_heldout", score)
    assert before(cfg)[0]
    again, said = before(cfg)
    assert not again and f'reusing the "before" scores {tmp_path}/wm_eval_before_*.json' in said
    for name, value in CHANGED.items():
        assert before(dataclasses.replace(cfg, **{name: value}))[0], name
        assert before(cfg)[0]
    summary = tmp_path / "wm_eval_before_explore.json"
    summary.write_text(summary.read_text()[:20])
    again, said = before(cfg)
    assert again and f'scoring "before" again ({summary} is damaged' in said
    (rows := tmp_path / "wm_eval_before_explore.triplets.jsonl").write_text("")
    again, said = before(cfg)
    assert again and f'scoring "before" again ({rows} is not its 1 rows (cut or edited))' in said
    again, said = before(dataclasses.replace(cfg, reward_binary=False))
    assert again and "was made by another model, triplets, settings or code" in said


def test_a_cut_config_json_stops_a_resume(tmp_path):
    """On 68ef7d6 a cut config.json switched the resume check off: a run went on at another learning rate."""
    (tmp_path / "config.json").write_text(plumbing.config_json(train.Settings())[:40])
    with pytest.raises(UserError, match=f"cannot resume: {tmp_path / 'config.json'}.* is damaged; restore "
                                        f"it, or delete {tmp_path / 'checkpoint'}"):
        runs.check_settings(train.Settings(learning_rate=0.5), tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(UserError, match="is missing"):
        runs.check_settings(train.Settings(learning_rate=0.5), tmp_path)


def filtered(tmp_path, cfg, kept):
    out = tmp_path / "filter"
    job = runs.filter_cache(cfg, [dict(TRIP, step=i) for i in range(6)], out)[0]
    runs.save_filter(out, job, dict(num_kept=len(kept)), kept)
    (out / "warmup_adapter").mkdir(exist_ok=True)
    return out


def test_a_no_warmup_filter_reuses_no_mixed_only_kept_set(tmp_path):
    """A warm-up job's mixed-only kept set (4 of 6) is not the kept set without the warm-up (all 6); on
    68ef7d6 a --no-warmup job reused it. Without mixed_only the two are the same set: reused."""
    trips = [dict(TRIP, step=i) for i in range(6)]
    out = filtered(tmp_path, train.Settings(), trips[:4])
    assert runs.filter_cache(train.Settings(warmup=False), trips, out)[1] is None
    out = filtered(tmp_path, train.Settings(mixed_only=False), trips[:4])
    assert runs.filter_cache(train.Settings(warmup=False, mixed_only=False), trips, out)[1] is not None


def test_a_cut_kept_set_or_filter_json_is_said_and_filtered_again(tmp_path, capsys):
    trips = [dict(TRIP, step=i) for i in range(6)]
    cfg = train.Settings(warmup=False)
    out = filtered(tmp_path, cfg, trips)
    assert runs.filter_cache(cfg, trips, out)[1][0] == trips
    lines = (out / "kept.jsonl").read_text().splitlines(keepends=True)
    (out / "kept.jsonl").write_text("".join(lines[:2] + [lines[2][:10] + "\n"] + lines[3:]))
    capsys.readouterr()
    assert runs.filter_cache(cfg, trips, out)[1] is None  # on 68ef7d6: 5 of the 6, without a word
    assert f"{out / 'kept.jsonl'} holds 5 of the 6 triplets" in capsys.readouterr().out
    (out / "filter.json").write_text((out / "filter.json").read_text()[:30])
    assert runs.filter_cache(cfg, trips, out)[1] is None  # on 68ef7d6: a JSONDecodeError
    assert f"{out / 'filter.json'} is damaged" in capsys.readouterr().out


def test_a_cut_line_in_a_collection_plays_its_episode_again(tmp_path, capsys):
    """A line cut in a run folder's transitions.jsonl (its held-out set, say) dropped that turn for good on
    68ef7d6 (6 -> 4 triplets, the file rewritten without them); the episode is now played again, said."""
    cfg = train.Settings(split="valid_unseen", num_games=2, max_turns=3)
    games = runs.split_games(cfg)
    runs.collection_todo(cfg, tmp_path, games)
    turns = [dict(TRIP, game=envs.game_name(g), rollout=0, step=s) for g in games for s in range(3)]
    (tmp_path / "transitions.jsonl").write_text("".join(
        json.dumps(t)[:20 if i == 1 else None] + "\n" for i, t in enumerate(turns)))
    (tmp_path / "episodes.jsonl").write_text("".join(
        json.dumps(dict(game=envs.game_name(g), rollout=0, steps=3, won=False)) + "\n" for g in games))
    todo, done = runs.collection_todo(cfg, tmp_path, games)
    assert todo == [dict(game=games[0], rollout=0)] and done == 1
    assert "misses turns of 1 finished episodes (lines cut or edited); playing them again" in \
        capsys.readouterr().out


def test_a_cut_walkthrough_set_is_written_again(tmp_path, capsys):
    cfg = train.Settings(split="valid_unseen", num_games=1, walkthrough=True)
    path = runs.walkthroughs(cfg, tmp_path, games := runs.split_games(cfg))
    whole = path.read_text()
    assert runs.walkthroughs(cfg, tmp_path, games) == path and "reusing" in capsys.readouterr().out
    path.write_text("".join(x[:15] if i == 1 else x for i, x in enumerate(whole.splitlines(True))))
    runs.walkthroughs(cfg, tmp_path, games)
    assert "(cut or edited); writing the walkthrough triplets again" in capsys.readouterr().out
    assert path.read_text() == whole


def test_history_len_0_gives_no_past_steps():
    """`past[-0:]` is the whole past: on 68ef7d6 --history-len 0 gave walkthrough triplets all of it."""
    for h in (0, 1, 2):
        trips = envs.walkthrough_triplets("valid_unseen", 1, history_len=h)
        assert [len(t["history"]) for t in trips] == [min(t["step"], h) + 1 for t in trips]


@pytest.mark.parametrize("text,match", [
    ("not json\n" + json.dumps(TRIP) + "\n", "line 1: not JSON"),
    (json.dumps(dict(TRIP, env="textworld")) + "\n", "holds textworld triplets, and this run is alfworld's"),
    (json.dumps(dict(step=1)) + "\n", "line 1: task is missing"),
    ("", "holds no triplets")], ids=["not-json", "other-env", "not-a-triplet", "empty"])
def test_warmup_transitions_are_checked_before_the_model_loads(text, match, tmp_path, transitions):
    """On 68ef7d6 non-JSON lines were dropped, another environment's triplets taken in, a non-triplet a
    KeyError after the model loaded, an empty file used as none."""
    (more := tmp_path / "more.jsonl").write_text(text)
    cfg = train.Settings(transitions=transitions, warmup_transitions=str(more))
    with pytest.raises(UserError, match=match):
        runs.stage_inputs(cfg, "filter", None)


def write_rows(folder, name, rows):
    (folder / f"wm_eval_{name}.triplets.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("bad", [dict(rewards=["x"]), dict(rewards=[]), dict(game=None),
                                 dict(template_hit=None)], ids=["text", "empty", "no-game", "no-hit"])
def test_a_malformed_per_triplet_row_is_one_line(bad, tmp_path):
    """On 68ef7d6: ValueError, ZeroDivisionError, KeyError from the verdict's inputs."""
    rows = [dict(game=f"g{i}", rollout=0, step=0, action="a", rewards=[1.0], exact=[1.0], template_hit=True,
                 unseen_objects=False) for i in range(3)]
    write_rows(tmp_path, "before_explore", rows)
    broken = {k: v for k, v in dict(rows[1], **bad).items() if v is not None}
    write_rows(tmp_path, "rwml_explore", [rows[0], broken, rows[2]])
    with pytest.raises(UserError, match=rf"{tmp_path}/wm_eval_rwml_explore.triplets.jsonl, row 2: not a "
                                        r"score .* rerun the `python train.py` that wrote them"):
        verdict.compare(tmp_path, "rwml", "before", "explore", "rewards",
                        rows=lambda t: not t["template_hit"])


def test_the_mismatch_error_names_the_files_and_python_train_py(tmp_path):
    rows = [dict(game="g", rollout=0, step=i, action="a", rewards=[1.0]) for i in range(2)]
    write_rows(tmp_path, "before_explore", rows)
    write_rows(tmp_path, "rwml_explore", rows[:1])
    with pytest.raises(UserError, match=r"wm_eval_rwml_explore.triplets.jsonl and wm_eval_before_explore"
                                        r".triplets.jsonl are not scores .* `python train.py`"):
        verdict.compare(tmp_path, "rwml", "before", "explore", "rewards")


def test_report_reads_a_coin_control_run(tmp_path):
    """`lab/reports.py report` on a `python train.py --coin-control` folder: the COIN arm is a control, not
    a second result of the run (on 68ef7d6: "more than one world-model result")."""
    def wm(acc):
        return dict(wm_accuracy=acc, mean_cosine=0.8, n=4, per_kind=dict(change=dict(wm_accuracy=acc)))
    for kind in verdict.HELDOUT_KINDS:
        for arm, acc in (("before", 0.25), ("rwml", 0.5), ("coin", 0.75), ("template", 0.5)):
            (tmp_path / f"wm_eval_{arm}_{kind}.json").write_text(json.dumps(wm(acc)))
    run = reports.read_run(tmp_path)
    assert {k: (b["wm_accuracy"], a["wm_accuracy"]) for k, (b, a) in run["wm"].items()} == dict(
        explore=(0.25, 0.5), purposeful=(0.25, 0.5))


def test_settings_that_cannot_go_together_are_refused_first(monkeypatch):
    monkeypatch.setattr(engine, "load_model", lambda *_, **__: pytest.fail("the model loaded first"))
    with pytest.raises(UserError, match="--coin-control True: .*--reward-control coin.*leave one"):
        runs.check_stage(train.Settings(coin_control=True, reward_control="coin"), "all")
    with pytest.raises(UserError, match=r"--warmup-games 100000: the train split holds \d+ games, 16 of them "
                                        r"GRPO's \(--num-games\); use at most \d+"):
        runs.check_stage(train.Settings(warmup_games=100000), "all")  # on 68ef7d6: after the collections
    with pytest.raises(UserError, match="--warmup-games 4 collects .* --no-warmup has none"):
        runs.settle_env("all", train.Settings(warmup_games=4, warmup=False), {"warmup_games", "warmup"})
    runs.settle_env("all", train.Settings(warmup=False), {"warmup"})  # the default count: nothing given


def test_the_warmup_games_are_never_grpo_games():
    """Seed 2's draw held one of GRPO's train games on 68ef7d6; it is replaced, the other draws stay."""
    for seed in range(4):
        cfg = train.Settings(seed=seed)
        warm, grpo = runs.warmup_games(cfg), runs.split_games(cfg)
        assert len(set(warm)) == cfg.warmup_games and not set(warm) & set(grpo)
        drawn = envs.list_games("train", cfg.warmup_games, seed + runs.WARMUP_STREAM)
        assert (warm == drawn) == (not set(drawn) & set(grpo)), seed
    assert set(envs.list_games("train", 32, 2 + runs.WARMUP_STREAM)) & set(runs.split_games(
        train.Settings(seed=2)))  # the clash this test is about


def fake_collect(cfg, out, load, games=None):
    """train.collect without a model: a one-turn episode per game, as collection_todo and play write them."""
    todo, _ = runs.collection_todo(cfg, out, games or runs.split_games(cfg))
    with open(out / "transitions.jsonl", "a") as ft, open(out / "episodes.jsonl", "a") as fe:
        for ep in todo:
            ft.write(json.dumps(dict(TRIP, game=envs.game_name(ep["game"]), rollout=0, step=0)) + "\n")
            fe.write(json.dumps(dict(game=envs.game_name(ep["game"]), rollout=0, steps=1)) + "\n")
    return out / "transitions.jsonl"


def test_heldout_leftovers_go_and_other_heldout_games_replace_the_set(tmp_path, monkeypatch, capsys):
    """A killed run's .tmp / .damaged copies are removed; --heldout-games (free on resume) gives the run
    folder's held-out set of other games in its place, said (on 68ef7d6: refused after rewriting the
    purposeful set)."""
    monkeypatch.setattr(engine, "MODEL_CACHE", tmp_path / "cache")
    for name in ("0123abcd.999999999.tmp", "0123abcd.999999999.damaged"):
        (tmp_path / "cache" / "heldout" / name).mkdir(parents=True)
    cfg = train.Settings(split="valid_unseen", num_games=1, seed=0, rollouts_per_game=1)
    out = tmp_path / "run" / "heldout"
    out.mkdir(parents=True)
    monkeypatch.setattr(train, "collect", fake_collect)
    train.cached_collect(cfg, out, None)
    assert sorted(p.suffix for p in (tmp_path / "cache" / "heldout").iterdir()) == [""]
    assert len(read_jsonl(out / "transitions.jsonl")) == 1
    train.cached_collect(dataclasses.replace(cfg, num_games=2), out, None)
    assert "holds the held-out explore triplets of other settings; collecting these in their place" in \
        capsys.readouterr().out
    assert len(read_jsonl(out / "transitions.jsonl")) == 2
    assert Path(out / "collect.json").is_file()
