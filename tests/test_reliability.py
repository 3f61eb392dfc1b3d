"""What a hostile but fair user does to a run -- hostile model output, kill -9, dead or hung
game workers, Ctrl-C, bad files, full disks -- and what must survive it."""
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

import engine
import envs
from stages import plumbing
from stages import runs
import train
from worlds import tau2
from stages.plumbing import read_jsonl
from envs import parse_next_state

# ----------------------------------------------------------------------------- the parsers, fuzzed

PIECES = ["<action>", "</action>", "<ACTION>", "</Action>", "< action >", "</ action>", "<think>",
          "</think>", "<THINK>", "<tool_call>", "</tool_call>", "<TOOL_CALL>", "<reply>", "</reply>",
          "<Reply>", "<next_state>", "</next_state>", "<NEXT_STATE>", "</Next_State>", "<", ">", "/",
          "{", "}", "[", "]", '"', ":", ",", "\\", '"name"', '"arguments"', '{"name": "', '", "arguments": {',
          '"\\ud800"', "\\udc00", "\\u0000", "\\ud83d\\ude00", "\ud800", "\udfff", "\x00", "\n", "\r\n", "\t",
          " ", "\u2028", "\u202e", "\ufeff", "🙂", "İ", "\u212a", "ſ", "null", "true", "1e999", "NaN",
          "-Infinity", "9" * 5000, "go to desk 1", "Nothing happens."]


def hostile(rng: random.Random) -> str:
    """A short string stitched from tags, JSON pieces, escapes, surrogates and random code points."""
    if rng.random() < 0.05:  # a tool call with deeply nested arguments
        depth = rng.randint(1, 3000)
        return '<tool_call>{"name": "x", "arguments": {"a": ' + "[" * depth + "]" * depth + "}}</tool_call>"
    parts = [rng.choice(PIECES) if rng.random() < 0.75 else chr(rng.randint(0, 0x10FFFF))
             for _ in range(rng.randint(0, 40))]
    return "".join(parts)


def huge(rng: random.Random, size: int = 1_000_000) -> list[str]:
    """1 MB inputs built to trip backtracking and scanning: repeated unclosed, closing and nested tags."""
    out = [tag * (size // len(tag)) for tag in ("<action>", "</action>", "<think>", "<tool_call>", "<reply>",
                                                  "<next_state>", "</next_state>", "<ACTION>x", "< action")]
    out += ["<next_state>" * (size // 24) + "</next_state>" * (size // 26),
            "<tool_call>" + "[" * (size - 30) + "</tool_call>",
            "<tool_call>" + "{" * (size - 30) + "</tool_call>",
            "<action>" + " " * size, "<" + " " * size + ">", "\ud800" * size, "🙂" * (size // 2), "x" * size,
            "<tool_call>" + '{"name": "' + "\\ud800" * (size // 8) + '", "arguments": {}}</tool_call>',
            "".join(rng.choice(PIECES[:30]) for _ in range(size // 8))[:size]]
    return out


def check_action(text):
    command, ok = envs.parse_action(text)
    assert isinstance(command, str) and isinstance(ok, bool) and len(command) <= envs.MAX_ACTION_CHARS
    command.encode("utf-8")


def check_tau2(text):
    a = tau2.parse_tau2_action(text)
    assert a["kind"] in ("tool", "reply") and isinstance(a["well_formed"], bool)
    if a["kind"] == "tool":
        assert isinstance(a["name"], str) and isinstance(a["arguments"], dict)
    json.dumps(a, ensure_ascii=False).encode("utf-8")  # no lone surrogate anywhere, keys and values included


def check_next_state(text):
    s = parse_next_state(text)
    assert s is None or (isinstance(s, str) and s and s == " ".join(s.split()))
    assert s is None or not re.search("</?next_state>", s, re.I)  # never keeps a tag


@pytest.mark.parametrize("check", [check_action, check_tau2, check_next_state])
def test_parsers_survive_10000_hostile_strings_and_1mb_inputs_in_linear_time(check):
    rng = random.Random(14)
    for _ in range(10_000):
        check(hostile(rng))
    for value in (None, 42, 3.5, b"<action>x</action>", ["<reply>x</reply>"], {"content": 1}, [{"a": 5}]):
        check(value)
    for text in huge(rng):
        t0 = time.thread_time()  # CPU time of this thread: other processes' load does not count
        check(text)
        assert time.thread_time() - t0 < 0.1, (check.__name__, text[:40])


# ----------------------------------------------------------------------------- game workers

ROOT = Path(__file__).resolve().parent.parent
POOL_SCRIPT = """
import sys, time
sys.path.insert(0, {root!r})
import envs, train
import envs

def main():
    with envs.EnvPool(2, game_cls=envs.Game) as pool:
        pool.reset({{0: envs.list_games("valid_seen", 1)[0]}})
        print(*[p.pid for p in pool.procs], flush=True)
        time.sleep(600)

train.run_cli(main, "interrupted")
"""


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(running(p) for p in pids)


def start_pool_process() -> tuple[subprocess.Popen, list[int]]:
    """A process that holds an EnvPool of 2 workers (a game loaded), in its own process group."""
    # SIGINT back to its default: a shell without job control (`cmd &`, some CI runners) starts background
    # jobs with SIGINT ignored, and Python then never raises KeyboardInterrupt; a terminal does not
    proc = subprocess.Popen([sys.executable, "-c", POOL_SCRIPT.format(root=str(ROOT))], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 2 and all(running(p) for p in pids), proc.stderr.read()
    return proc, pids


def test_workers_exit_when_their_parent_is_killed():
    proc, pids = start_pool_process()
    proc.kill()  # SIGKILL: no cleanup runs in the parent, as with kill -9 or the out-of-memory killer
    proc.wait()
    try:
        assert gone_within(pids, 5), "orphaned game workers"
    finally:
        for p in pids:
            if running(p):
                os.kill(p, signal.SIGKILL)


@pytest.mark.parametrize("sig, group",
                         [(signal.SIGINT, True), (signal.SIGTERM, False), (signal.SIGTERM, True)])
def test_ctrl_c_and_sigterm_are_one_line_and_the_workers_exit(sig, group):
    """Ctrl-C in a terminal signals the whole foreground process group; `kill PID` the process alone; a
    scheduler the whole group."""
    proc, pids = start_pool_process()
    (os.killpg if group else os.kill)(proc.pid, sig)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "interrupted", err
    assert gone_within(pids, 5)


@contextlib.contextmanager
def time_limit(seconds: int):
    """Fail instead of hanging forever."""
    def fail(*_):
        raise TimeoutError(f"still waiting after {seconds} s")

    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("sig, what", [(signal.SIGKILL, "died (signal 9)"),
                                       (signal.SIGSTOP, "no answer in 2 s")])
def test_a_dead_or_hung_worker_is_named_in_one_line(sig, what):
    game = envs.list_games("valid_seen", 1)[0]
    with envs.EnvPool(num_workers=2, game_cls=envs.Game) as pool:
        pool.reset({0: game, 1: game})  # loading a game takes seconds; a step, milliseconds
        pool.timeout = 2
        victim = pool.procs[1]
        os.kill(victim.pid, sig)  # SIGSTOP: as a hung engine
        try:
            with time_limit(30), pytest.raises(envs.UserError) as e:
                pool.step({0: "look", 1: "look"})
        finally:
            if sig == signal.SIGSTOP:
                os.kill(victim.pid, signal.SIGKILL)
    message = str(e.value)
    assert f"game worker 1 (pid {victim.pid})" in message and what in message, message
    assert "rerun the same command" in message and "\n" not in message


def test_game_reset_keeps_sys_argv(monkeypatch):
    envs.use_engine_cache(False)  # the stock engine translates the PDDL at every reset
    monkeypatch.setattr(sys, "argv", ["my_tool.py", "--flag"])
    game = envs.Game()
    for path in envs.list_games("valid_seen", 2, seed=5):  # textworld.start, then env.load
        game.reset(path)
        assert sys.argv == ["my_tool.py", "--flag"]


# ----------------------------------------------------------------------------- checkpoints and resume

def wm_config(tiny_model, **kw):
    return train.Settings(model=tiny_model, prompts_per_step=2, num_generations=2, max_completion_length=6,
                        micro_batch_size=2, log_completions_steps=1, **kw)


def parity_reward(completions, targets):
    return [float(sum(map(ord, c)) % 2) for c in completions]


def test_resume_logs_every_step_once(tiny_model, transitions, tmp_path):
    """Ctrl-C in step 4 of a run that saves every 2 steps: rows 1-3 are logged, the checkpoint is at step 2.
    The resumed run does steps 3 and 4 again; each step must be in the logs once."""
    calls = []

    def interrupted_in_step_4(completions, targets):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return parity_reward(completions, targets)

    trips, load = plumbing.read_transitions(transitions), lambda: engine.load_model(tiny_model)
    with pytest.raises(KeyboardInterrupt):
        train.train_wm(wm_config(tiny_model, max_steps=4, save_steps=2), trips, tmp_path, load,
                       interrupted_in_step_4)
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    train.train_wm(wm_config(tiny_model, max_steps=4, save_steps=2, resume=True), trips, tmp_path, load,
                   parity_reward)
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    assert [r["step"] for r in read_jsonl(tmp_path / "samples.jsonl")] == [1, 2, 3, 4]


class Crash(BaseException):
    """A process killed at this point: nothing after it runs (BaseException: no `except OSError` stops it)."""


@contextlib.contextmanager
def crash_at(k: int | None, counter: list):
    """Count file-system operations (renames, removals, new folders, opens); with `k`, crash at the k-th."""
    names = ("rename", "replace", "unlink", "rmdir", "mkdir", "open")
    originals = {name: getattr(os, name) for name in names}

    def counted(name):
        def op(*args, **kwargs):
            counter.append(name)
            if len(counter) - 1 == k:
                raise Crash(name)
            return originals[name](*args, **kwargs)
        return op

    try:
        for name in originals:
            setattr(os, name, counted(name))
        yield
    finally:
        for name, fn in originals.items():
            setattr(os, name, fn)


def test_a_save_stopped_at_any_point_loses_no_checkpoint(tiny_model, tmp_path):
    model = engine.add_lora(engine.load_model(tiny_model)[0], r=2, alpha=4)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    lora = [p for n, p in model.named_parameters() if "lora_B" in n]

    def save(path, step):
        with torch.no_grad():
            for p in lora:
                p.fill_(step)
        train.save_checkpoint(path, model, opt, dict(step=step))

    def load(path):  # the step, checked against the weights: both from one save
        step = runs.load_checkpoint(path, model, opt)["step"]
        assert all(torch.all(p == step) for p in lora)
        return step

    ops = []
    save(tmp_path / "count" / "checkpoint", 1)
    with crash_at(None, ops):
        save(tmp_path / "count" / "checkpoint", 2)
    assert len(ops) >= 10, ops
    for k in range(len(ops)):
        run = tmp_path / f"crash{k}"
        save(run / "checkpoint", 1)
        with crash_at(k, []), pytest.raises(Crash):
            save(run / "checkpoint", 2)
        assert load(run / "checkpoint") in (1, 2), k
        save(run / "checkpoint", 3)
        assert load(run / "checkpoint") == 3 and sorted(os.listdir(run)) == ["checkpoint"], k


def test_a_leftover_checkpoint_old_is_used_or_removed(tiny_model, transitions, tmp_path):
    """checkpoint.old, as the two-rename swap of earlier versions left it: it blocked every later save."""
    trips, load = plumbing.read_transitions(transitions), lambda: engine.load_model(tiny_model)
    train.train_wm(wm_config(tiny_model, max_steps=1, save_steps=1), trips, tmp_path, load, parity_reward)
    shutil.copytree(tmp_path / "checkpoint", tmp_path / "checkpoint.old")
    train.train_wm(wm_config(tiny_model, max_steps=2, save_steps=1, resume=True), trips, tmp_path, load,
                   parity_reward)
    assert not (tmp_path / "checkpoint.old").exists()
    (tmp_path / "checkpoint").rename(tmp_path / "checkpoint.old")  # killed between the two renames
    train.train_wm(wm_config(tiny_model, max_steps=3, save_steps=1, resume=True), trips, tmp_path, load,
                   parity_reward)
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert sorted(p.name for p in tmp_path.glob("checkpoint*")) == ["checkpoint"]


def test_kill_9_during_grpo_then_resume(tiny_model, transitions, tmp_path):
    """A real kill -9 at whatever point the run has reached after 3 logged steps (it saves every 2)."""
    args = ["wm", "--model", tiny_model, "--transitions", transitions, "--no-easy-filter", "--no-warmup",
            "--prompts-per-step", "2", "--num-generations", "2", "--max-completion-length", "6",
            "--micro-batch-size", "2", "--log-completions-steps", "1", "--save-steps", "2",
            "--out", str(tmp_path)]
    proc = subprocess.Popen([sys.executable, "train.py", *args, "--max-steps", "50"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while len(read_jsonl(tmp_path / "metrics.jsonl")) < 3 and proc.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
    logged = len(read_jsonl(tmp_path / "metrics.jsonl"))
    assert 3 <= logged < 50
    train.main(args + ["--max-steps", str(logged + 1), "--resume"])
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == list(range(1, logged + 2))
    assert [r["step"] for r in read_jsonl(tmp_path / "samples.jsonl")] == list(range(1, logged + 2))


# ----------------------------------------------------------------------------- bad input: one line, at once

@pytest.fixture
def nothing_slow(monkeypatch):
    """Loading a model or an embedder, starting game workers or the filter fails the test: every check
    must come before them."""
    def slow(*_, **__):
        pytest.fail("slow work started before the input was checked")

    import eval as evaluate

    for owner, name in ((engine, "load_model"), (train, "make_reward"), (train, "filter_triplets"),
                        (envs, "EnvPool"), (evaluate, "make_reward")):
        monkeypatch.setattr(owner, name, slow)


@pytest.fixture
def bad(tmp_path, transitions):
    """Bad files of every kind, by name."""
    lines = Path(transitions).read_text().splitlines()
    files = {"list.json": "[1, 2]", "null.json": "null", "two.json": '{"num_games": "two"}',
             "out5.json": '{"out": 5}', "latin1.jsonl": lines[0].replace("}", ', "x": "caf\xe9"}') + "\n",
             "first_list.jsonl": '["history", "action"]\n' + "\n".join(lines) + "\n",
             "no_task.jsonl": "\n".join(lines[:4] + [lines[4].replace('"task"', '"x"')] + lines[5:]) + "\n",
             "a_file": "", "adapter/adapter_config.json": '{"peft_type": "LORA", "r": '}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(text.encode("latin-1" if name == "latin1.jsonl" else "utf-8"))
    return tmp_path


AGENT = ["eval.py", "agent", "--num-games", "1", "--seeds", "1"]
WM = ["train.py", "wm", "--no-easy-filter", "--no-warmup"]


@pytest.mark.parametrize("argv, message", [
    # 5. output paths
    (AGENT + ["--out", "{bad}"], "is a folder; give a file name"),
    (AGENT + ["--out", "{bad}/a_file/results.json"], "{bad}/a_file is a file, not a folder"),
    (AGENT + ["--out", "/sys/rwml-test/results.json"], "cannot write there"),
    (["eval.py", "wm", "--transitions", "{transitions}", "--out", "{bad}"], "is a folder"),
    (["reports.py", "report", "{bad}", "--out", "{bad}/a_file/r.md"], "is a file, not a folder"),
    (["train.py", "collect", "--out", "{bad}/a_file"], "{bad}/a_file is a file, not a folder"),
    (WM + ["--transitions", "{transitions}", "--out", "{bad}/a_file/run"], "is a file, not a folder"),
    # 7. tracebacks
    (["train.py", "collect", "--config", "{bad}/list.json"], "holds [1, 2], not a JSON object"),
    (["train.py", "collect", "--config", "{bad}/null.json"], "holds null, not a JSON object"),
    (["train.py", "collect", "--config", "{bad}/two.json"],
     'num_games in {bad}/two.json must be int | null, got "two"'),
    (["eval.py", "agent", "--config", "{bad}/out5.json"], "out in {bad}/out5.json must be str, got 5"),
    (["eval.py", "wm", "--transitions", "{bad}/latin1.jsonl"], "latin1.jsonl is not UTF-8 text"),
    (["eval.py", "wm", "--transitions", "{bad}/first_list.jsonl"], "first_list.jsonl, line 1: a JSON list"),
    (["eval.py", "wm", "--transitions", "{bad}/no_task.jsonl"], "no_task.jsonl, line 5: task is missing"),
    (["train.py", "wm-sft", "--transitions", "{bad}/no_task.jsonl"], "no_task.jsonl, line 5: task is"),
    (AGENT + ["--adapter", "{bad}/adapter"], "adapter_config.json is not a readable peft adapter config"),
    (["train.py", "policy", "--init", "rwml", "--adapter", "{bad}/adapter"], "not a readable peft adapter"),
    (AGENT + ["--max-new-tokens", "0"], "--max-new-tokens 0: must be at least 1"),
    # a filter split (the warm-up's slice) or an exploration rate that leaves nothing to train on
    (["train.py", "--num-games", "1", "--max-turns", "2", "--filter-split", "0.9"], "leaves fewer than"),
    (["train.py", "--explore-prob", "1.5"], "--explore-prob 1.5: must be between 0 and 1"),
    (["train.py", "--heldout-games", "0"], "--heldout-games 0: must be at least 1"),
    # 8. bad values
    (AGENT + ["--temperature", "-1"], "--temperature -1.0: must be 0 or more"),
    (AGENT + ["--temperature", "nan"], "--temperature nan: must be a finite number"),
    (AGENT + ["--top-p", "5"], "--top-p 5.0: must be in (0, 1]"),
    (AGENT + ["--history-len", "-1"], "--history-len -1: must be at least 0"),
    (AGENT + ["--split", ","], "--split ',': names no split"),
    (["eval.py", "wm", "--transitions", "{transitions}", "--tau-d", "3"], "--tau-d 3.0: must be in (0, 2]"),
    (["train.py", "collect", "--env", "tau2", "--num-tasks", "0"], "--num-tasks 0: must be at least 1"),
    (WM + ["--transitions", "{transitions}", "--epsilon-high", "-1"], "--epsilon-high -1.0: must be 0"),
    (WM + ["--transitions", "{transitions}", "--filter-split", "1.5"], "--filter-split 1.5"),
    # 9. checks that came after slow work
    (WM + ["--transitions", "{transitions}", "--max-steps", "0"], "--max-steps 0: must be at least 1"),
    (AGENT + ["--max-turns", "0"], "--max-turns 0: must be at least 1"),
    (AGENT + ["--num-envs", "0"], "--num-envs 0: must be at least 1"),
    (AGENT + ["--env", "tau2", "--domain", "telcom"], "did you mean 'telecom'"),
    (["train.py", "policy", "--env", "tau2", "--domain", "telcom", "--split", "test"],
     "did you mean 'telecom'"),
    (["eval.py", "weights", "--adapter", "{bad}/no_such_adapter"], "no peft adapter at"),
])
def test_bad_input_is_one_line_before_anything_slow(argv, message, bad, transitions, nothing_slow,
                                                    monkeypatch):
    import eval as evaluate

    monkeypatch.chdir(bad)  # the default --out of a failing command lands here, not in the repository
    fill = dict(bad=str(bad), transitions=transitions)
    argv, message = [a.format(**fill) for a in argv], message.format(**fill)
    import reports

    main = dict(**{"train.py": train.main, "reports.py": reports.main}).get(argv[0], evaluate.main)
    files = sorted(bad.rglob("*"))
    with pytest.raises(envs.UserError) as e:
        main(argv[1:])
    assert message in str(e.value) and "\n" not in str(e.value)
    assert sorted(bad.rglob("*")) == files  # and it leaves nothing behind


def private_mount_prefix() -> list[str] | None:
    """`unshare` arguments for a private mount namespace in which this user may mount a tmpfs, or None."""
    for prefix in (["unshare", "-rm"], ["unshare", "-m"]):
        if shutil.which("unshare") and subprocess.run([*prefix, "sh", "-c", "mount -t tmpfs tmpfs /mnt"],
                                                      capture_output=True).returncode == 0:
            return prefix
    return None


@pytest.mark.parametrize("size", ["96k", "256k"])
def test_a_full_disk_is_one_line(size, tiny_model, transitions, tmp_path):
    """--out on a small disk: the run's first files fit, its checkpoint does not (96 KB: the adapter, which
    safetensors reports in its own words; 256 KB: the optimizer state, which torch.save reported as
    "unexpected pos")."""
    prefix = private_mount_prefix()
    if prefix is None:
        pytest.skip("cannot mount a small tmpfs here (unshare)")
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = f'mount -t tmpfs -o size={size} tmpfs "$0" && exec "$@"'
    args = [*WM[1:], "--model", tiny_model, "--transitions", transitions, "--max-steps", "2", "--lora-r",
            "16", "--save-steps", "1", "--num-generations", "2", "--max-completion-length", "6",
            "--out", f"{disk}/run"]
    r = subprocess.run([*prefix, "sh", "-c", mount, str(disk), sys.executable, "train.py", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: out of disk space") and "rerun the same command" in last, r.stderr


def test_eval_keeps_finished_episodes_when_a_worker_dies(tiny_model, tmp_path):
    """A game worker killed mid-evaluation: one line naming it; the episodes finished so far are kept, and
    the same command then plays only the rest."""
    import eval as evaluate

    out = tmp_path / "results.json"
    args = ["agent", "--model", tiny_model, "--split", "valid_seen", "--num-games", "3", "--seeds", "2",
            "--max-turns", "2", "--max-new-tokens", "4", "--num-envs", "1", "--num-workers", "2",
            "--out", str(out)]
    side = tmp_path / "results.json.episodes.jsonl"
    proc = subprocess.Popen([sys.executable, "eval.py", *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while len(read_jsonl(side)) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)  # until the first episode is written (the first line holds the settings)
    for worker in psutil.Process(proc.pid).children():
        worker.kill()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert re.match(r"error: game worker \d \(pid \d+\) died \(signal 9\)", last), err
    assert "rerun the same command" in last
    kept = read_jsonl(side)[1:]
    assert 1 <= len(kept) < 6 and not out.exists()
    evaluate.main(args)
    result = json.loads(out.read_text())
    assert result["num_episodes"] == 6 and all(e in result["episodes"] for e in kept)
    assert len({(e["seed"], e["game"]) for e in result["episodes"]}) == 6
    assert not side.exists()  # all in results.json now


# ----------------------------------------------------------------------------- collection, per episode

def test_collection_after_kill_9_keeps_every_finished_episode_and_says_what_it_dropped(tiny_model, tmp_path,
                                                                                          capsys):
    args = ["collect", "--model", tiny_model, "--num-games", "2", "--rollouts-per-game", "2", "--max-turns",
            "4", "--max-new-tokens", "4", "--num-envs", "1", "--num-workers", "1", "--out", str(tmp_path)]

    def files():
        eps = read_jsonl(tmp_path / "episodes.jsonl")
        done = {(e["game"], e["rollout"]) for e in eps}
        turns = read_jsonl(tmp_path / "transitions.jsonl")
        return eps, [t for t in turns if (t["game"], t["rollout"]) in done], \
            [t for t in turns if (t["game"], t["rollout"]) not in done]

    proc = subprocess.Popen([sys.executable, "train.py", *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while not (files()[0] and files()[2]) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)  # until one episode has finished and the next one has turns
    proc.kill()
    proc.wait()
    eps, kept, cut = files()
    assert eps and cut, "the kill came too late"
    capsys.readouterr()
    train.main(args)
    assert f"dropped {len(cut)} turns of 1 unfinished episodes" in capsys.readouterr().out
    eps2, trips2, _ = files()
    assert eps2[:len(eps)] == eps and trips2[:len(kept)] == kept  # nothing finished was lost or changed
    assert len(eps2) == 4 and len(trips2) == sum(e["steps"] for e in eps2)
    section = (ROOT / "README.md").read_text().split("## Commands")[1].split("\n## ")[0]
    section = " ".join(section.split())  # the README's line breaks fall anywhere
    assert "Interrupted runs continue with the same command; checkpoints are written whole." in section
