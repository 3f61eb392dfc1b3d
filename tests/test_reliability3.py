"""A trainer switch (train.py, lab/trl_grpo.py) never overwrites a run, a resume logs no held-out episode
twice, and a lock folder, a cut collect.json, a deep --config, --use-vllm without vLLM and a triplet's
unknown env are one line each."""
import importlib.util
import json
import shutil
from pathlib import Path

import pytest

import envs
from stages import plumbing
import train
import trl_grpo
from stages.plumbing import read_jsonl
from test_reliability2 import WM_ARGS, nothing_slow, one_line, wm_run  # noqa: F401 (fixtures)


def test_a_finished_run_of_our_trainer_is_not_overwritten_by_trl(wm_run, tmp_path, nothing_slow):  # noqa: F811
    out = tmp_path / "run"
    shutil.copytree(wm_run[0], out)
    before = {p.name: p.read_bytes() for p in (out / "metrics.jsonl", out / "config.json")}
    for extra in ([], ["--resume"]):
        with pytest.raises(envs.UserError) as e:
            trl_grpo.main([*wm_run[1][1:], *extra, "--out", str(out)])
        assert one_line(e) == (f"{out} holds a run of train.py ({out / 'checkpoint'}), which TRL cannot "
                               "continue; use another --out")
    assert before == {p.name: p.read_bytes() for p in (out / "metrics.jsonl", out / "config.json")}


@pytest.mark.parametrize("stage", ["wm", "policy"])
def test_a_run_of_trl_is_not_overwritten_by_our_trainer(stage, tiny_model, transitions, tmp_path,
                                                        nothing_slow):  # noqa: F811
    out = tmp_path / "run"  # what a finished lab/trl_grpo.py leaves: TRL's checkpoint, the adapter, logs
    (out / "trl" / "checkpoint-2").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    argv = ["wm", "--transitions", transitions, *WM_ARGS] if stage == "wm" else ["policy", "--num-games", "1"]
    for extra in ([], ["--resume"]):
        with pytest.raises(envs.UserError) as e:
            train.main([*argv, "--model", tiny_model, *extra, "--out", str(out)])
        assert one_line(e) == (f"{out} holds a run of TRL's GRPOTrainer ({out / 'trl' / 'checkpoint-2'}), "
                               "which train.py cannot continue; use another --out")
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'


class Killed(BaseException):
    """kill -9 at this point: nothing after it runs."""


def test_a_resumed_policy_run_logs_each_held_out_episode_once(tiny_model, tmp_path, monkeypatch):
    """Killed after step 2's held-out evaluation, before its checkpoint: the resumed run replays step 2, whose
    episodes must replace, not follow, those the killed run logged."""
    argv = ["policy", "--env", "textworld", "--action-mode", "choose", "--model", tiny_model,
            "--num-games", "2", "--games-per-step", "1", "--num-generations", "2", "--max-turns", "2",
            "--max-steps", "2", "--num-workers", "0", "--eval-steps", "1", "--eval-games", "1",
            "--save-steps", "1", "--out", str(tmp_path)]
    saves, save = [], train.save_checkpoint

    def killed_at_the_second(*args):
        saves.append(1)
        if len(saves) == 2:
            raise Killed
        save(*args)

    monkeypatch.setattr(train, "save_checkpoint", killed_at_the_second)
    with pytest.raises(Killed):
        train.main(argv)
    assert [e["step"] for e in read_jsonl(tmp_path / "eval_episodes.jsonl")] == [1, 2]
    monkeypatch.setattr(train, "save_checkpoint", save)
    train.main(argv + ["--resume"])
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]
    assert [e["step"] for e in read_jsonl(tmp_path / "eval_episodes.jsonl")] == [1, 2]


# -------------------------------------------------------------------------------- one line, before the model

def test_a_lock_that_is_a_folder_is_one_line(tiny_model, transitions, tmp_path, nothing_slow):  # noqa: F811
    (tmp_path / "run" / ".lock").mkdir(parents=True)
    with pytest.raises(envs.UserError) as e:
        train.main(["wm", "--model", tiny_model, "--transitions", transitions, *WM_ARGS,
                    "--out", str(tmp_path / "run")])
    assert one_line(e).startswith(f"cannot open the run lock {tmp_path / 'run' / '.lock'} (Is a directory); "
                                  "remove it")


@pytest.mark.parametrize("content", ['{"model": "x", "se', "[1, 2]", "\udcff"])
@pytest.mark.parametrize("walkthrough", [False, True])
def test_a_damaged_collect_json_is_one_line_naming_it(content, walkthrough, tiny_model, tmp_path,
                                                      nothing_slow):  # noqa: F811
    out = tmp_path / "run"
    out.mkdir()
    (out / "collect.json").write_bytes(content.encode("utf-8", "surrogateescape"))
    (out / "transitions.jsonl").write_text("")
    with pytest.raises(envs.UserError) as e:
        train.main(["collect", "--model", tiny_model, "--num-games", "1", "--out", str(out)]
                   + ["--walkthrough"] * walkthrough)
    assert one_line(e).startswith(f"{out / 'collect.json'} is damaged (")
    assert f"delete it to go on collecting in {out} with these settings, or use another --out" in str(e.value)


def test_a_config_nested_past_the_recursion_limit_is_one_line(tmp_path, nothing_slow):  # noqa: F811
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(envs.UserError) as e:
        train.main(["wm", "--config", str(deep)])
    assert one_line(e) == f"cannot read config file {deep}: nested too deeply"


def test_use_vllm_without_vllm_is_one_line_before_the_model_loads(tiny_model, transitions, tmp_path,
                                                                  nothing_slow, monkeypatch):  # noqa: F811
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else find(name, *a))
    with pytest.raises(envs.UserError) as e:
        trl_grpo.main(["--use-vllm", "--model", tiny_model, "--transitions", transitions, "--no-easy-filter",
                       "--no-warmup", "--out", str(tmp_path / "run")])
    assert one_line(e) == "--use-vllm needs vLLM, which is not installed: pip install vllm, or leave it out"


@pytest.mark.parametrize("env, shown", [("minecraft", '"minecraft"'), (5, "5"), (["tau2"], '["tau2"]'),
                                        (None, "null")])
def test_a_triplet_of_an_unknown_env_is_one_line_naming_the_file_and_line(env, shown, transitions, tmp_path,
                                                                          tiny_model, nothing_slow):  # noqa: F811
    lines = Path(transitions).read_text().splitlines()
    bad = tmp_path / "bad.jsonl"
    lines[2] = json.dumps(dict(json.loads(lines[2]), env=env))
    bad.write_text("\n".join(lines) + "\n")
    message = f"{bad}, line 3: env {shown} is not one of alfworld, "
    with pytest.raises(envs.UserError) as e:
        fits = plumbing.triplet_problem(train.Settings(model=tiny_model))
        plumbing.read_transitions(str(bad), fits)
    assert one_line(e).startswith(message)
    with pytest.raises(envs.UserError) as e:
        train.main(["wm", "--model", tiny_model, "--transitions", str(bad), *WM_ARGS,
                    "--out", str(tmp_path / "run")])
    assert one_line(e).startswith(message)
