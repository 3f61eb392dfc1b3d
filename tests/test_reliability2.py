"""Files that are present but damaged, run folders that are reused or shared, resumes with other
settings, bad data and values -- each one line (a UserError), nothing lost."""
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import engine
import envs
from harness import cli
from stages import plumbing
from stages import runs
import eval as evaluate
import train
from worlds import tau2
from stages.plumbing import read_jsonl
from reward import SimToRealReward
import reports

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def nothing_slow(monkeypatch):
    """Loading a model or an embedder, game workers or the filter fail the test: the check must come first."""
    def slow(*_, **__):
        pytest.fail("slow work started before the input was checked")

    for owner, name in ((engine, "load_model"), (train, "make_reward"), (train, "filter_triplets"),
                        (envs, "EnvPool"), (evaluate, "make_reward")):
        monkeypatch.setattr(owner, name, slow)


def one_line(e) -> str:
    message = str(e.value)
    assert "\n" not in message, message
    return message


# --------------------------------------------------------------------------- damaged adapters and checkpoints

def damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2] if how == "truncated" else os.urandom(len(data)))


@pytest.fixture(scope="module")
def adapter(tiny_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapter") / "adapter"
    engine.add_lora(engine.load_model(tiny_model)[0], r=2, alpha=4).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("how", ["garbage", "truncated"])
@pytest.mark.parametrize("command", ["policy", "eval"])
def test_a_damaged_adapter_is_one_line_naming_the_file(how, command, adapter, tiny_model, tmp_path,
                                                       nothing_slow):
    bad = tmp_path / "adapter"
    shutil.copytree(adapter, bad)
    damage(bad / "adapter_model.safetensors", how)
    argv = ["--model", tiny_model, "--adapter", str(bad), "--num-games", "1"]
    with pytest.raises(envs.UserError) as e:
        if command == "policy":
            train.main(["policy", "--init", "rwml", *argv, "--out", str(tmp_path / "run")])
        else:
            evaluate.main(["agent", *argv, "--seeds", "1", "--out", str(tmp_path / "r.json")])
    assert one_line(e).startswith(f"{bad / 'adapter_model.safetensors'} is damaged (")
    assert "save the adapter again, or give another --adapter" in str(e.value)


WM_ARGS = ["--no-easy-filter", "--no-warmup", "--prompts-per-step", "2", "--num-generations", "2",
           "--max-completion-length", "6", "--micro-batch-size", "2", "--save-steps", "1"]


@pytest.fixture(scope="module")
def wm_run(tiny_model, transitions, tmp_path_factory):
    """A finished 2-step wm run (a checkpoint at step 2) and its command line, for copies to damage."""
    out = tmp_path_factory.mktemp("wm_run") / "run"
    argv = ["wm", "--model", tiny_model, "--transitions", transitions, *WM_ARGS, "--max-steps", "2"]
    train.main(argv + ["--out", str(out)])
    return out, argv


def copy_run(wm_run, tmp_path) -> tuple[Path, list[str]]:
    out = tmp_path / "run"
    shutil.copytree(wm_run[0], out)
    return out, wm_run[1] + ["--out", str(out)]


@pytest.mark.parametrize("name, how", [("trainer_state.pt", "truncated"), ("trainer_state.pt", "garbage"),
                                       ("adapter_model.safetensors", "truncated"),
                                       ("adapter_model.safetensors", "garbage")])
def test_resume_from_a_damaged_checkpoint_names_the_file_and_what_to_delete(name, how, wm_run, tmp_path,
                                                                            nothing_slow):
    out, argv = copy_run(wm_run, tmp_path)
    damage(out / "checkpoint" / name, how)
    with pytest.raises(envs.UserError) as e:
        train.main(argv + ["--resume", "--max-steps", "3"])
    assert one_line(e).startswith(f"cannot resume: {out / 'checkpoint' / name} is damaged (")
    assert f"delete {out / 'checkpoint'} to start the run over" in str(e.value)


def test_resume_falls_back_to_the_last_whole_checkpoint(wm_run, tmp_path):
    """A damaged checkpoint.tmp is never swapped in over a whole checkpoint; a damaged checkpoint gives way to
    a whole checkpoint.old (the earlier versions' swap)."""
    out, argv = copy_run(wm_run, tmp_path)
    shutil.copytree(out / "checkpoint", out / "checkpoint.tmp")
    damage(out / "checkpoint.tmp" / "trainer_state.pt", "garbage")
    assert runs.swap_checkpoint(out / "checkpoint")
    assert runs.checkpoint_problem(out / "checkpoint") is None
    assert not (out / "checkpoint.tmp").exists()
    shutil.copytree(out / "checkpoint", out / "checkpoint.old")
    damage(out / "checkpoint" / "adapter_model.safetensors", "truncated")
    train.main(argv + ["--resume", "--max-steps", "3"])
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3]
    assert sorted(p.name for p in out.glob("checkpoint*")) == ["checkpoint"]


def test_a_damaged_warmup_adapter_is_made_again_not_reused(tiny_model, transitions, tmp_path, capsys):
    cfg = train.Settings(model=tiny_model, easy_filter=False, mixed_only=False, sft_epochs=1)
    trips, load = plumbing.read_transitions(transitions), lambda: engine.load_model(tiny_model)
    _, warm = train.filter_triplets(cfg, trips, tmp_path, load, None)
    damage(warm / "adapter_model.safetensors", "truncated")
    capsys.readouterr()
    _, warm = train.filter_triplets(cfg, trips, tmp_path, load, None)
    assert ("reusing" not in capsys.readouterr().out
            and engine.file_problem(warm / "adapter_model.safetensors") is None)


# ----------------------------------------------------------------------------- --resume: the same run

@pytest.mark.parametrize("extra, diff", [
    (["--lora-r", "8"], "--lora-r 16 -> 8"),
    (["--transitions", "{other}", "--learning-rate", "0.5"], "--learning-rate 0.0001 -> 0.5, "
                                                              "--transitions '{transitions}' -> '{other}'"),
])
def test_resume_with_other_training_settings_is_refused_in_one_line(extra, diff, wm_run, transitions,
                                                                    tmp_path, nothing_slow):
    out, argv = copy_run(wm_run, tmp_path)
    other = tmp_path / "other.jsonl"
    shutil.copy(transitions, other)
    fill = dict(other=str(other), transitions=transitions)
    config = (out / "config.json").read_text()
    with pytest.raises(envs.UserError) as e:
        train.main(argv + ["--resume"] + [a.format(**fill) for a in extra])
    assert one_line(e) == (f"cannot resume: {out} was trained with other settings ({diff.format(**fill)}); "
                           "resume with its settings, or use another --out")
    assert (out / "config.json").read_text() == config  # not overwritten


def test_resume_takes_other_values_of_fields_that_do_not_change_training(wm_run, tmp_path):
    out, argv = copy_run(wm_run, tmp_path)
    train.main(argv + ["--resume", "--max-steps", "3", "--save-steps", "2", "--log-completions-steps", "3",
                       "--num-workers", "0", "--eval-max-triplets", "4"])
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3]


def test_policy_resume_on_a_wm_run_is_refused(wm_run, tiny_model, tmp_path, nothing_slow):
    out, _ = copy_run(wm_run, tmp_path)
    with pytest.raises(envs.UserError) as e:
        train.main(["policy", "--model", tiny_model, "--num-games", "1", "--resume", "--out", str(out)])
    assert one_line(e) == f"cannot resume: {out} holds a wm run, not a policy run; use another --out"


# ----------------------------------------------------------------------------- one run per --out

def lock_is_free(out: Path) -> bool:
    fd = os.open(out / ".lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


HOLDER = """
import sys, time
sys.path.insert(0, {root!r})
import train
import envs
envs.EnvPool = lambda *a, **k: time.sleep(600)  # a collection that holds its folder, playing
train.main(["collect", "--model", {model!r}, "--num-games", "1", "--num-workers", "1", "--out", {out!r}])
"""


def test_a_second_run_on_one_out_is_one_line_and_the_lock_dies_with_the_first(tiny_model, tmp_path,
                                                                                nothing_slow):
    out = tmp_path / "collect"
    proc = subprocess.Popen([sys.executable, "-c",
                             HOLDER.format(root=str(ROOT), model=tiny_model, out=str(out))],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ((out / ".lock").is_file() and (out / ".lock").read_text() == str(proc.pid)):
            assert proc.poll() is None and time.monotonic() < deadline, \
                proc.stderr.read() if proc.poll() else ""
            time.sleep(0.05)
        with pytest.raises(envs.UserError) as e:
            train.main(["collect", "--model", tiny_model, "--num-games", "1", "--out", str(out)])
        assert one_line(e) == (f"another run is using {out} (pid {proc.pid}); wait for it to end, or use "
                               "another --out")
    finally:
        proc.kill()  # kill -9: no cleanup runs; the kernel drops the flock with the process
        proc.wait()
    assert lock_is_free(out)
    with pytest.raises(envs.UserError, match="split train has"):  # after the lock: main gives it back
        train.main(["collect", "--model", tiny_model, "--num-games", "100000", "--out", str(out)])
    assert lock_is_free(out)


# ----------------------------------------------------------------------------- bad data

@pytest.fixture
def long_prompt(transitions, tmp_path) -> Path:
    """Line 3's observation is 41 KB: its prompt alone is past the tiny model's 32768 positions."""
    lines = Path(transitions).read_text().splitlines()
    t = json.loads(lines[2])
    t["history"][-1]["observation"] = "You see a mug 1. " * 2400
    path = tmp_path / "long.jsonl"
    path.write_text("\n".join(lines[:2] + [json.dumps(t)] + lines[3:]) + "\n")
    return path


@pytest.mark.parametrize("argv", [["train.py", "wm", *WM_ARGS], ["train.py", "wm-sft"], ["eval.py", "wm"]])
def test_a_prompt_longer_than_the_context_is_refused_before_the_model_loads(argv, long_prompt, tiny_model,
                                                                             tmp_path, nothing_slow):
    main = train.main if argv[0] == "train.py" else evaluate.main
    out = str(tmp_path / ("run" if argv[0] == "train.py" else "wm.json"))
    with pytest.raises(envs.UserError) as e:
        main(argv[1:] + ["--model", tiny_model, "--transitions", str(long_prompt), "--out", out])
    message = one_line(e)
    assert (message.startswith(f"{long_prompt}, line 3: its world-model prompt (")
            and "context of 32768" in message)


def test_a_prompt_longer_than_the_context_stops_generation_and_sft_at_once(tiny_model):
    model, tok = engine.load_model(tiny_model)
    model.config.max_position_embeddings = 64  # a long observation, against a small context
    with pytest.raises(envs.UserError) as e:
        engine.sample_chat(model, tok, ["You see a mug 1. " * 4], max_new_tokens=16)
    assert (one_line(e).startswith("a prompt of ")
            and "exceed the model's context of 64 tokens" in str(e.value))
    model = engine.add_lora(model, r=2, alpha=4)
    with pytest.raises(envs.UserError,
                       match="an SFT prompt and answer of .* exceed the model's context of 64"):
        engine.sft(model, tok, ["You see a mug 1. " * 4], ["Nothing happens."], epochs=1)


def test_a_damaged_game_file_is_named(tmp_path):
    game = Path(envs.list_games("valid_seen", 1)[0])
    copy = tmp_path / game.parent.parent.name / game.parent.name
    shutil.copytree(game.parent, copy)
    damage(copy / "game.tw-pddl", "truncated")
    with envs.EnvPool(num_workers=1, game_cls=envs.Game) as pool, pytest.raises(envs.UserError) as e:
        pool.reset({0: str(copy / "game.tw-pddl")})
    assert one_line(e).startswith(f"game file {copy / 'game.tw-pddl'} does not load (")
    assert "it may be damaged" in str(e.value)
    with pytest.raises(envs.UserError, match="does not load"):  # in this process too
        envs.Game().reset(str(copy / "game.tw-pddl"))


def test_a_utf8_bom_is_accepted(transitions, tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + Path(transitions).read_bytes())
    assert plumbing.read_transitions(str(path)) == plumbing.read_transitions(transitions)
    config = tmp_path / "cfg.json"
    config.write_bytes(b"\xef\xbb\xbf" + b'{"num_games": 3}')
    cfg, _ = cli.parse_config(train.Settings, ["--config", str(config)], prog="train.py")
    assert cfg.num_games == 3


# ----------------------------------------------------------------------------- eval.py report

def agent_result(**kw):
    return dict(dict(success_rate=0.5, split="valid_seen", num_episodes=4, mean_steps=3.0,
                     invalid_action_rate=0.1),
                **kw)


@pytest.mark.parametrize("name, content, message", [
    ("results.json", agent_result(num_episodes=None),
     "results.json: num_episodes is missing or not a number, so it is no result of `eval.py agent`"),
    ("results.json", agent_result(success_rate_std="big"),
     "results.json: success_rate_std is missing or not"),
    ("tau2.json", dict(env="tau2", average_reward=0.5, domain="retail"), "tau2.json: num_tasks is missing"),
    ("wm.json", dict(wm_accuracy="high", per_kind={}), "wm.json: wm_accuracy is missing or not a number"),
    ("broken.json", '{"success_rate": 0.', "broken.json does not read as JSON ("),
    ("metrics.jsonl", '{"step": 1, "reward": 0.5}\n{"step": 2, "reward": "x"}\n',
     "metrics.jsonl, record 2: reward is missing or not a number"),
])
def test_report_errors_name_the_file(name, content, message, tmp_path):
    run = tmp_path / "arm"
    run.mkdir()
    (run / "ok.json").write_text(json.dumps(agent_result()))
    (run / name).write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(envs.UserError) as e:
        reports.main(["report", str(run), "--out", str(tmp_path / "r.md")])
    assert one_line(e).startswith(str(run / name)) and message in str(e.value)


# ----------------------------------------------------------------------------- values

@pytest.mark.parametrize("argv, message", [
    (["train.py", "collect", "--seed", "1180591620717411303424"],
     "--seed 1180591620717411303424: must be between 0 and 4294967295"),
    (["train.py", "wm", "--transitions", "{transitions}", "--filter-seed", "-1"],
     "--filter-seed -1: must be between 0"),
    (["eval.py", "agent", "--seed", "1180591620717411303424"],
     "--seed 1180591620717411303424: must be between 0"),
    (["train.py", "collect", "--model", "{model}", "--max-new-tokens", "100000"],
     "--max-new-tokens 100000: at least {model}'s whole context of 32768 tokens"),
    (["train.py", "wm", "--transitions", "{transitions}", "--model", "{model}",
      "--max-completion-length", "32768"],
     "--max-completion-length 32768: at least {model}'s whole context of 32768 tokens"),
    (["eval.py", "agent", "--model", "{model}", "--max-new-tokens", "100000"],
     "--max-new-tokens 100000: at least"),
    (["train.py", "collect", "--env", "tau2", "--num-tasks", "100000"],
     "tau2 retail split train has 74 tasks, asked for --num-tasks 100000"),
    (["eval.py", "agent", "--env", "tau2", "--num-tasks", "100000"], "tau2 retail split test has 40 tasks"),
])
def test_bad_values_are_one_line_before_anything_slow(argv, message, tiny_model, transitions, tmp_path,
                                                      nothing_slow, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fill = dict(model=tiny_model, transitions=transitions)
    argv, message = [a.format(**fill) for a in argv], message.format(**fill)
    with pytest.raises(envs.UserError) as e:
        (train.main if argv[0] == "train.py" else evaluate.main)(argv[1:])
    assert message in one_line(e)


def test_no_more_game_workers_than_games(tiny_model, tmp_path, monkeypatch):
    started = []

    class Started(Exception):
        pass

    def pool(num_workers, *_, **__):
        started.append(num_workers)
        raise Started

    monkeypatch.setattr(envs, "EnvPool", pool)
    with pytest.raises(Started):
        train.main(["collect", "--model", tiny_model, "--num-games", "1", "--num-workers", "24",
                    "--out", str(tmp_path / "c")])
    with pytest.raises(Started):
        evaluate.main(["agent", "--model", tiny_model, "--num-games", "2", "--seeds", "1",
                       "--num-workers", "24", "--out", str(tmp_path / "r.json")])
    assert started == [1, 2]


# ----------------------------------------------------------------------------- parsers, reward, SIGTERM

def test_the_reward_refuses_a_target_that_is_not_text():
    reward = SimToRealReward(metric="rouge")
    for target in (None, 42):
        with pytest.raises(envs.UserError) as e:
            reward(["<next_state>You see a mug.</next_state>"], [target])
        assert one_line(e).startswith(f"the reward's target 0 is {type(target).__name__}, not text")


def test_a_nested_reply_is_not_well_formed():
    a = tau2.parse_tau2_action("<reply><reply>hi</reply>")
    assert a == dict(kind="reply", content="hi", well_formed=False)
    assert tau2.parse_tau2_action("<reply>hi</reply>")["well_formed"]


def test_a_cut_action_keeps_no_trailing_space():
    for word in range(1, 7):  # one of these word lengths puts a space right at the cut
        long = ("a" * word + " ") * 200  # past MAX_ACTION_CHARS (200), so the command is cut
        for text in (f"<action>{long}</action>", f"<action>{long}</action><action>x</action>", long):
            command, ok = envs.parse_action(text)
            assert not ok and command and command == command.strip() and len(command) <= envs.MAX_ACTION_CHARS


def test_sigterm_during_training_keeps_every_logged_step(tiny_model, transitions, tmp_path):
    args = ["wm", "--model", tiny_model, "--transitions", transitions, *WM_ARGS, "--save-steps", "2",
            "--log-completions-steps", "1", "--out", str(tmp_path)]
    proc = subprocess.Popen([sys.executable, "train.py", *args, "--max-steps", "50"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600  # model, embedder and filter first, on a busy machine
    while (len(read_jsonl(tmp_path / "metrics.jsonl")) < 3 and proc.poll() is None
           and time.monotonic() < deadline):
        time.sleep(0.05)
    proc.terminate()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("interrupted: rerun the same command"), err
    logged = len(read_jsonl(tmp_path / "metrics.jsonl"))
    assert 3 <= logged < 50
    train.main(args + ["--max-steps", str(logged + 1), "--resume"])
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == list(range(1, logged + 2))


def test_the_first_failed_job_of_a_sanity_script_stops_the_others(tmp_path):
    """jobs.sh's in_parallel, under the scripts' `set -euo pipefail`: when a job fails, the jobs still
    running are stopped (a rerun must not race them on the same run folder) and the failure names its log;
    a job that bash runs by exec (one plain command, so no children) included."""
    script, late = tmp_path / "s.sh", tmp_path / "survived"
    script.write_text(f"""set -euo pipefail
LOGS={tmp_path}/logs JOBS=3
source {ROOT}/lab/jobs.sh
in_parallel "broken false" "shell sleep 4 && touch {late}_shell" \\
            "exec_d {sys.executable} -c 'import time; time.sleep(4); open(\\"{late}_exec\\", \\"w\\")'"
""")
    t0 = time.time()
    r = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "broken failed, see" in r.stdout and time.time() - t0 < 3.5, r
    time.sleep(5)
    assert not list(tmp_path.glob("survived*"))


def test_sft_interrupted_mid_epoch_continues_to_the_uninterrupted_weights(lora_model, tmp_path, monkeypatch):
    """The warm-up's SFT writes a resume file as it goes: killed inside an epoch, the rerun starts at the
    saved batch (not at the first) and ends on the very weights of a run never interrupted; the file is gone
    at the end. A resume that started afresh, or one that lost the shuffle's state, gives other weights."""
    import torch

    import engine
    prompts = [f"You see a mug {i}. " * (1 + i % 3) for i in range(24)]
    answers = [f"You pick up the mug {i}." for i in range(24)]

    def weights(model):
        return [p.detach().clone() for p in model.parameters() if p.requires_grad]

    model, tok = lora_model(seed=1)
    clean = engine.sft(model, tok, prompts, answers, epochs=3, batch_size=4, seed=3)
    want = weights(model)

    resume = tmp_path / "sft_resume.pt"
    model, tok = lora_model(seed=1)
    steps, real_step = [], torch.optim.AdamW.step

    def dies_at_step_9(self, *a, **kw):  # epoch 2's third batch, saved inside it; epoch 3 shuffles after
        steps.append(1)
        if len(steps) == 9:
            raise KeyboardInterrupt
        return real_step(self, *a, **kw)
    monkeypatch.setattr(torch.optim.AdamW, "step", dies_at_step_9)
    with pytest.raises(KeyboardInterrupt):
        engine.sft(model, tok, prompts, answers, epochs=3, batch_size=4, seed=3, resume_file=resume,
                   every_s=0)
    assert resume.is_file()
    monkeypatch.setattr(torch.optim.AdamW, "step", real_step)

    model, tok = lora_model(seed=1)  # a fresh process: the base and a new adapter, as a rerun loads them
    counted = []
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, *a, **kw: (counted.append(1),
                                                                           real_step(self, *a, **kw))[1])
    again = engine.sft(model, tok, prompts, answers, epochs=3, batch_size=4, seed=3, resume_file=resume)
    assert len(counted) == 18 - 8, "the rerun did not start at the saved batch"
    assert again == pytest.approx(clean)
    assert all(torch.equal(a, b) for a, b in zip(weights(model), want)), "not the uninterrupted weights"
    assert not resume.exists()
