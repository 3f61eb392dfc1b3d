"""Bad input gets one clear line and a non-zero exit, never a traceback."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import cli
from stages import plumbing
from stages import runs
import train
from stages.settings import ModelArgs, RunArgs
from envs import UserError

ROOT = Path(__file__).resolve().parent.parent


def run(*args, env=None):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})


@pytest.mark.parametrize("args, env, message", [
    (["eval.py", "agent", "--num-games", "1"], {"ALFWORLD_DATA": "/nonexistent"}, "ALFWorld data not found"),
    (["train.py", "collect", "--num-games", "1"], {"ALFWORLD_DATA": "/nonexistent"},
     "ALFWorld data not found"),
    (["eval.py", "agent", "--split", "valid_sen"], None, "unknown split 'valid_sen'"),
    (["eval.py", "agent", "--num-games", "1", "--model", "./no/such/model"], None, "model path not found"),
    (["train.py", "collect", "--num-games", "-3"], None, "at least 1"),
    (["eval.py", "agent", "--seeds", "0"], None, "--seeds 0: must be at least 1"),
    (["train.py", "collect", "--num-game", "3"], None, "did you mean --num-games"),
    (["train.py", "colect"], None, "did you mean 'collect'"),
    (["eval.py", "agent", "--num-games", "three"], None, "invalid int value"),
    (["eval.py"], None, "usage"),
])
def test_bad_input_one_line(args, env, message):
    r = run(*args, env=env)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip() and "gemm_4bit" not in x]
    assert message in lines[-1], r.stderr
    assert len([x for x in lines if "error" in x]) == 1, r.stderr


def test_config_file_typo(tmp_path):
    cfg = tmp_path / "cfg.json"
    cfg.write_text('{"num_games": 2, "rollouts_per_gme": 3}')
    r = run("train.py", "collect", "--config", str(cfg))
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "did you mean 'rollouts_per_game'" in r.stderr


def help_text(main, argv, capsys) -> str:
    """What `main(argv)` prints for --help, which must exit 0; wrapped lines joined."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_help_lists_the_stages_and_every_field_under_some_stage(capsys):
    import train

    top = help_text(train.main, ["--help"], capsys)
    assert all(f"{stage} {line}" in top for stage, (line, _) in train.STAGES.items())
    shown = " ".join(help_text(train.main, [stage, "--help"], capsys) for stage in train.STAGES)
    for f in train.dataclasses.fields(train.Settings):
        flag = "--" + f.name.replace("_", "-")
        assert flag + " " in shown or flag + ", --no-" in shown, flag


def test_stage_help_shows_the_fields_it_reads(capsys):
    import train

    collect = help_text(train.main, ["collect", "--help"], capsys)
    assert "--num-games" in collect and "--explore-prob" in collect
    assert "--filter-seed" not in collect and "--beta" not in collect and "--games-per-step" not in collect
    policy = help_text(train.main, ["policy", "--help"], capsys)
    assert "--games-per-step" in policy and "--filter-seed" not in policy and "--easy-share" not in policy
    wm = help_text(train.main, ["wm", "--help"], capsys)
    assert "(None = seed): runs with other seeds can then share one filter and one warm-up (default None)" \
        in wm


def test_each_stage_help_shows_exactly_the_settings_its_groups_declare(capsys):
    """What a stage reads is derived from the setting groups STAGES names, and its --help shows exactly
    those flags (the warning for a flag it does not read comes from the same sets)."""
    import re

    for stage, (_, groups) in train.STAGES.items():
        text = help_text_raw(train.main, [stage, "--help"], capsys)
        shown = set(re.findall(r"^  --([a-z0-9-]+)", text, re.M))
        assert shown - {"config", "help"} == {n.replace("_", "-") for n in cli.fields_of(*groups)}, stage
    reads = {s: cli.fields_of(*groups) for s, (_, groups) in train.STAGES.items()}
    assert "env" in reads["wm"] and "env" in reads["export"]  # they take its defaults (tau_d, the cap)
    assert {s for s in reads if "adapter" in reads[s]} == {"collect", "policy"}


def help_text_raw(main, argv, capsys) -> str:
    with pytest.raises(SystemExit):
        main(argv)
    return capsys.readouterr().out


def test_hidden_fields_still_parse():
    import train

    cfg, _ = cli.parse_config(train.Settings, ["--beta", "0.5"], prog="train.py collect",
                              shown=cli.fields_of(*train.STAGES["collect"][1]))
    assert cfg.beta == 0.5


def test_none_sets_an_optional_field_to_none():
    import train

    argv = ["--eval-split", "none", "--num-games", "None", "--filter-seed", "3"]
    cfg, _ = cli.parse_config(train.Settings, argv, prog="train.py")
    assert cfg.eval_split is None and cfg.num_games is None and cfg.filter_seed == 3
    with pytest.raises(SystemExit):  # anything else is still an int, or argparse's one-line error
        cli.parse_config(train.Settings, ["--filter-seed", "nothing"], prog="train.py")


def test_a_yaml_config_and_the_flags_over_it(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("num_games: 5\nlearning_rate: 0.001\nwarmup: false\n")
    cfg, _ = cli.parse_config(train.Settings, ["--config", str(config), "--num-games", "7"], prog="train.py")
    assert (cfg.num_games, cfg.learning_rate, cfg.warmup) == (7, 0.001, False)


def test_eval_help_lists_the_commands(capsys):
    import eval as ev

    text = help_text(ev.main, ["--help"], capsys)
    assert all(f"{name} {line}" in text for name, line in ev.COMMANDS.items())


def test_bad_files_one_line(tmp_path):
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "latin1.jsonl").write_bytes(b'{"task": "caf\xe9"}\n')
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text('{"peft_type": "LORA", "r": ')
    for args, file, message in [(["train.py", "collect", "--config"], "list.json", "not a JSON object"),
                                (["eval.py", "wm", "--transitions"], "latin1.jsonl", "is not UTF-8 text"),
                                (["eval.py", "agent", "--adapter"], "adapter", "not a readable peft")]:
        r = run(*args, str(tmp_path / file))
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        lines = [x for x in r.stderr.splitlines() if x.strip() and "gemm_4bit" not in x]
        assert message in lines[-1] and lines[-1].startswith("error: "), r.stderr
        assert len([x for x in lines if "error" in x]) == 1, r.stderr


@pytest.mark.parametrize("tracker", ["tensorboard", "wandb"])
def test_a_missing_tracker_package_is_one_line_before_anything_loads(tracker, tmp_path, monkeypatch):
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == tracker else find(name, *a))
    with pytest.raises(UserError, match=f"--report-to {tracker} needs the {tracker} package: pip install -r "
                                        "requirements-trackers.txt"):
        train.main(["wm", "--report-to", tracker, "--model", str(tmp_path / "no-model"),
                    "--out", str(tmp_path / "r")])


def test_log_row_sends_train_and_eval_numbers_to_either_tracker(tmp_path):
    """TensorBoard's add_scalar or a wandb run's log: train/<key>, eval/<key> (TRL's prefixes and names), no
    strings."""
    calls = []

    class Board:  # the two methods of SummaryWriter that log_row uses
        def add_scalar(self, key, value, step):
            calls.append(("tb", key, value, step))

    class Run:  # the one method of a wandb run that log_row uses
        def log(self, scalars, step):
            calls.append(("wandb", scalars, step))

    row = dict(step=3, reward_mean=0.5, eval_success=0.25, sample="text")
    with open(tmp_path / "metrics.jsonl", "w") as f:
        train.log_row(f, Board(), row)
        train.log_row(f, Run(), row)
    assert calls == [("tb", "train/reward", 0.5, 3), ("tb", "eval/success", 0.25, 3),  # TRL's name only
                     ("wandb", {"eval/success": 0.25, "train/reward": 0.5}, 3)]
    # TRL's name in the file too
    assert train.read_jsonl(tmp_path / "metrics.jsonl") == [dict(step=3, reward=0.5, eval_success=0.25,
                                                                 sample="text")] * 2


def test_a_typed_flag_the_stage_does_not_read_warns_in_one_line(tmp_path, capsys):
    cli.parse_stage(["collect", "--learning-rate", "3", "--num-games", "2"], train.STAGES, train.Settings)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: --learning-rate is not read by `collect`")
    config = tmp_path / "c.json"  # a config file may hold every field: no warning
    config.write_text('{"learning_rate": 3}')
    cli.parse_stage(["collect", "--config", str(config)], train.STAGES, train.Settings)
    assert capsys.readouterr().err == ""


def test_help_prints_choices_and_groups_flags_as_the_config_is_grouped(capsys):
    with pytest.raises(SystemExit):
        cli.parse_stage(["wm", "--help"], train.STAGES, train.Settings)
    out = capsys.readouterr().out
    assert "--loss-type {grpo,dapo,dr_grpo}" in out and "--reward-control {none,mis,coin,template}" in out
    assert "--loss-type STR" not in out and "--num_generations" not in out  # the dashed spelling alone
    sections = [line[:-1] for line in out.splitlines() if line.endswith(":") and not line.startswith(" ")]
    titles = {g._argument_group_name for g in train.STAGES["wm"][1]}
    assert titles <= set(sections) and len(sections) == len(titles) + 1  # + argparse's own "options"
    assert out.index(ModelArgs._argument_group_name) < out.index("\n  --out STR") < out.index(
        RunArgs._argument_group_name)


def test_every_field_of_every_config_has_help():
    import dataclasses

    import eval as ev

    for cls in (train.Settings, ev.AgentEvalConfig, ev.WMEvalConfig, ev.WeightsConfig):
        assert not [f.name for f in dataclasses.fields(cls) if not f.metadata.get("help", "").strip()], cls


@pytest.mark.parametrize("flag, says, not_says", [
    ("--num-train-epochs", "TRL's num_train_epochs: this project counts optimizer steps: --max-steps",
     "num-iterations"),
    ("--logging-steps", "metrics are logged every step", "did you mean"),
    ("--output-dir", "TRL's output_dir: --out", "did you mean"),
    ("--per-device-train-batch-size", "--prompts-per-step prompts x --num-generations", "did you mean")])
def test_trainer_names_are_answered_from_the_alias_table(flag, says, not_says):
    with pytest.raises(UserError) as e:
        cli.parse_stage(["wm", flag, "1"], train.STAGES, train.Settings)
    assert says in str(e.value) and not_says not in str(e.value)


def test_an_adapter_flag_naming_a_run_folder_points_to_its_adapter(tmp_path):
    (tmp_path / "wm1" / "adapter").mkdir(parents=True)
    (tmp_path / "wm1" / "adapter" / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    with pytest.raises(UserError, match=r"wm1 is a run folder.*give --adapter .*wm1/adapter"):
        plumbing.check_adapter(str(tmp_path / "wm1"))


def test_minor_cli_cases_one_line(tmp_path):  # random on tau2, a lone --eval-transitions, a huge --config
    import eval as ev

    with pytest.raises(UserError, match="--policy random draws among") as e:
        ev.check_agent(ev.AgentEvalConfig(policy="random", env="tau2"))
    assert "--action-mode" not in str(e.value)
    with pytest.raises(UserError, match="--eval-transitions .*add --eval-steps"):
        runs.check_stage(train.Settings(eval_transitions="held.jsonl"), "wm")
    config = tmp_path / "big.json"
    config.write_text('{"' + "k" * 1_000_000 + '": 1}')
    with pytest.raises(UserError) as e:
        cli.parse_config(train.Settings, ["--config", str(config)], prog="train.py")
    assert len(str(e.value)) < 300 and "1,000,000 characters" in str(e.value)
