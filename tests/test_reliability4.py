"""A stage that takes triplets takes their environment (and with it tau_d and the cap), a held-out cache
entry is used only whole, the random policy records no model it never loaded, and the unread-flag warning
says what each stage reads -- each one line, or right."""
import json
import sys
from pathlib import Path

import pytest

import eval as evaluate
import caches
from stages import runs
import envs
import train
from envs import UserError
from stages.plumbing import read_jsonl
from test_reliability2 import nothing_slow, one_line  # noqa: F401 (a fixture)

TW = envs.env_class("textworld")


def with_env(transitions: str, path: Path, env=None, at=None) -> Path:
    """The walkthrough triplets as `env`'s (every line, or only line `at`, 0-based)."""
    lines = Path(transitions).read_text().splitlines()
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [dict(json.loads(x), env=env) if at in (None, i) else json.loads(x) for i, x in enumerate(lines)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def tw_triplets(transitions, tmp_path) -> Path:
    """TextWorld triplets and, beside them, the collect.json `train.py collect --env textworld` writes."""
    path = with_env(transitions, tmp_path / "tw" / "transitions.jsonl", "textworld")
    (path.parent / "collect.json").write_text(json.dumps(dict(env="textworld", split="train")))
    return path


@pytest.fixture
def settled(monkeypatch):
    """The settings each train.main call hands its stage (nothing runs)."""
    seen = []
    monkeypatch.setattr(train, "run_stage", lambda stage, cfg, *a, **k: seen.append(cfg))
    return seen


# ------------------------------------------------------------------- the environment comes from the triplets

@pytest.mark.parametrize("stage", ["wm", "wm-sft", "filter", "export"])
def test_a_triplet_stage_takes_tau_d_and_the_cap_of_its_triplets_environment(stage, tw_triplets, tiny_model,
                                                                              tmp_path, settled, capsys):
    argv = [stage, "--model", tiny_model, "--transitions", str(tw_triplets), "--out", str(tmp_path / "run")]
    train.main(argv)
    train.main(argv + ["--env", "textworld"])  # given and agreeing: the same
    train.main(argv + ["--tau-d", "0.3", "--max-completion-length", "100"])  # given: kept
    assert [(c.env, c.tau_d, c.rouge_gate, c.max_completion_length) for c in settled] == [
        ("textworld", TW.tau_d, TW.rouge_gate, TW.max_completion_length)] * 2 + [("textworld", 0.3, 0.0, 100)]
    alf = envs.env_class("alfworld")  # else this test would show nothing:
    assert TW.tau_d != alf.tau_d and TW.rouge_gate != alf.rouge_gate
    assert "--env is not read" not in capsys.readouterr().err  # these stages read it


def test_export_carries_the_triplets_tau_d_to_verl(tw_triplets, tiny_model, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    out = tmp_path / "verl"
    train.main(["export", "--model", tiny_model, "--transitions", str(tw_triplets), "--out", str(out)])
    for split in ("train", "test"):
        rows = pq.read_table(out / f"{split}.parquet").to_pylist()
        assert {(r["extra_info"]["tau_d"], r["extra_info"]["rouge_gate"]) for r in rows} == {(TW.tau_d,
                                                                                              TW.rouge_gate)}
        assert {r["data_source"] for r in rows} == {"rwml_textworld"}


def test_a_given_env_that_disagrees_with_the_triplets_is_one_line(tw_triplets, tiny_model, tmp_path,
                                                                  nothing_slow):  # noqa: F811
    for stage in ("wm", "export"):
        with pytest.raises(UserError) as e:
            train.main([stage, "--env", "alfworld", "--model", tiny_model, "--transitions", str(tw_triplets),
                        "--out", str(tmp_path / "run")])
        assert one_line(e) == (f"--env alfworld disagrees with --transitions {tw_triplets}, whose triplets "
                               "are textworld's; leave --env out (a stage that takes triplets takes theirs) "
                               "or give alfworld triplets")
    assert not (tmp_path / "run").exists()


def test_a_transitions_file_that_mixes_environments_is_one_line(transitions, tiny_model, tmp_path,
                                                                nothing_slow):  # noqa: F811
    mixed = with_env(transitions, tmp_path / "mixed.jsonl", "textworld", at=4)
    message = (f"--transitions {mixed} mixes environments (alfworld from line 1, textworld from line 5); a "
               "run's reward threshold and cap are one environment's: give the triplets of one")
    for stage in ("wm", "wm-sft", "filter", "export"):
        with pytest.raises(UserError) as e:
            train.main([stage, "--model", tiny_model, "--transitions", str(mixed), "--out", str(tmp_path)])
        assert one_line(e) == message
    with pytest.raises(UserError) as e:
        evaluate.main(["wm", "--baseline", "template", "--transitions", str(mixed),
                       "--out", str(tmp_path / "wm.json")])
    assert one_line(e) == message


def test_the_learning_curves_triplets_are_the_runs_environment(tw_triplets, transitions, tiny_model, tmp_path,
                                                               nothing_slow):  # noqa: F811
    with pytest.raises(UserError) as e:
        train.main(["wm", "--model", tiny_model, "--transitions", str(tw_triplets), "--eval-steps", "1",
                    "--eval-transitions", transitions, "--out", str(tmp_path / "run")])
    assert one_line(e) == (f"--eval-transitions {transitions} holds alfworld triplets, --transitions "
                           "textworld ones; the learning curve scores the run's environment: give held-out "
                           "textworld triplets")


def test_eval_wm_scores_at_the_triplets_tau_d_and_names_a_collect_json_that_disagrees(tw_triplets, tmp_path,
                                                                                      capsys):
    """collect.json's env a list was a TypeError (before --tau-d 0 was checked)."""
    out = tmp_path / "wm.json"
    evaluate.main(["wm", "--baseline", "template", "--transitions", str(tw_triplets), "--out", str(out)])
    config = json.loads(out.read_text())["config"]
    assert (config["tau_d"], config["rouge_gate"], config["max_completion_length"]) == (
        TW.tau_d, TW.rouge_gate, TW.max_completion_length)
    meta = tw_triplets.parent / "collect.json"
    for named in (["textworld"], "alfworld", {"a": 1}):
        meta.write_text(json.dumps(dict(env=named)))
        with pytest.raises(UserError) as e:
            evaluate.main(["wm", "--baseline", "copy", "--transitions", str(tw_triplets), "--out", str(out)])
        assert one_line(e) == (f"{meta} names env {json.dumps(named)}, but the triplets of {tw_triplets} are "
                               f"textworld's; fix or delete {meta} (its collection's settings)")
        with pytest.raises(UserError) as e:  # a value that cannot be is named first
            evaluate.main(["wm", "--tau-d", "0", "--transitions", str(tw_triplets), "--out", str(out)])
        assert one_line(e) == "--tau-d 0.0: must be in (0, 2] (a cosine distance)"


# ------------------------------------------------------------------------ the held-out cache, used only whole

@pytest.fixture
def heldout(tiny_model, tmp_path, monkeypatch):
    """train.cached_collect with a stand-in collection (2 triplets, 1 episode; one copied in is finished, as
    collect's): (play(out) -> its triplets, the folders it played in, the cache entry)."""
    import engine

    monkeypatch.setattr(engine, "MODEL_CACHE", tmp_path / "cache")
    cfg = train.Settings(model=tiny_model, split="valid_unseen", num_games=1, seed=0)
    plays = []

    def collect(cfg, out, load, games=None):
        if (out / "transitions.jsonl").exists():
            return out / "transitions.jsonl"
        plays.append(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "collect.json").write_text(json.dumps(runs.collect_job(cfg)))
        (out / "transitions.jsonl").write_text("".join(json.dumps(dict(game="g", rollout=0, step=i)) + "\n"
                                                       for i in range(2)))
        (out / "episodes.jsonl").write_text(json.dumps(dict(game="g", rollout=0)) + "\n")
        return out / "transitions.jsonl"

    monkeypatch.setattr(train, "collect", collect)

    def play(name: str) -> list[dict]:
        return read_jsonl(train.cached_collect(cfg, tmp_path / name, None))

    entry = tmp_path / "cache" / "heldout" / caches.heldout_key(cfg)
    return play, plays, entry


def damage(entry: Path, how: str) -> None:
    if how == "a line cut":
        lines = (entry / "transitions.jsonl").read_text().splitlines(keepends=True)
        (entry / "transitions.jsonl").write_text("".join(lines[1:]))
    elif how == "collect.json damaged":
        (entry / "collect.json").write_text('{"model": "x", "se')
    elif how == "transitions.jsonl empty":
        (entry / "transitions.jsonl").write_text("")


@pytest.mark.parametrize("how", ["a line cut", "collect.json damaged", "transitions.jsonl empty"])
def test_a_damaged_heldout_cache_entry_is_played_again_never_copied(how, heldout, tmp_path, capsys):
    play, plays, entry = heldout
    assert len(play("first")) == 2 and len(plays) == 1
    assert len(play("second")) == 2 and len(plays) == 1  # reused whole
    damage(entry, how)
    capsys.readouterr()
    assert len(play("third")) == 2 and len(plays) == 2  # played again, not copied
    out = capsys.readouterr().out
    assert f"collect: the cached set {entry} is not whole (" in out and "playing it again" in out
    assert len(play("fourth")) == 2 and len(plays) == 2  # the entry replaced, whole again
    first, fourth = (tmp_path / name / "collect.json" for name in ("first", "fourth"))
    assert fourth.read_text() == first.read_text()


# ---------------------------------------------------------------- the random policy loads and samples nothing

def test_the_random_policy_warns_of_model_settings_and_records_none(tmp_path, capsys):
    out = tmp_path / "results.json"
    evaluate.main(["agent", "--policy", "random", "--model", "nosuch/model", "--temperature", "0.3",
                   "--split", "valid_seen", "--num-games", "1", "--max-turns", "2", "--seeds", "1",
                   "--num-workers", "0", "--out", str(out)])
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("warning:")]
    assert err == ["warning: --policy random plays a uniform admissible command, with no model: --model, "
                   "--temperature not used (recorded as null)"]
    config = json.loads(out.read_text())["config"]
    assert config["policy"] == "random" and config["model"] is None and config["temperature"] is None
    assert config["max_turns"] == 2 and config["out"] == "<path>"


# ----------------------------------------------------------------- the unread-flag warning, derived and right

def test_an_adapter_no_stage_of_the_command_reads_is_warned_in_one_line(tw_triplets, tiny_model, tmp_path,
                                                                         capsys, nothing_slow):  # noqa: F811
    """`train.py wm --adapter runs/wm1/adapter` started from the warm-up without a word."""
    with pytest.raises(UserError, match="--learning-rate 0.0: must be above 0"):
        train.main(["wm", "--adapter", "runs/wm1/adapter", "--model", tiny_model, "--transitions",
                    str(tw_triplets), "--learning-rate", "0", "--out", str(tmp_path / "run")])
    assert capsys.readouterr().err.splitlines() == [
        "warning: --adapter is not read by `wm`; it is read by collect, policy (train.py wm --help lists the "
        "flags `wm` reads)"]


@pytest.mark.parametrize("stage", ["wm", "export"])
def test_env_is_not_called_unread_where_the_stage_takes_its_defaults(stage, tw_triplets, tiny_model, tmp_path,
                                                                     capsys, nothing_slow):  # noqa: F811
    with pytest.raises(UserError, match="--seed -1: must be between 0 and"):
        train.main([stage, "--env", "textworld", "--model", tiny_model, "--transitions", str(tw_triplets),
                    "--seed", "-1", "--out", str(tmp_path / "run")])
    assert "--env" not in capsys.readouterr().err


def test_the_cli_entry_points_still_exit_with_one_line(tw_triplets, tmp_path):
    """The same cases through the real command line: one line on stderr, exit status 1."""
    import subprocess

    r = subprocess.run([sys.executable, "train.py", "wm", "--env", "alfworld", "--transitions",
                        str(tw_triplets), "--out", str(tmp_path / "run")], cwd=Path(train.__file__).parent,
                       capture_output=True, text=True, timeout=300)  # 80cec84 trained here instead (15 min)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1].startswith("error: --env alfworld disagrees")
