"""Issue #14: what a hostile but fair user does to a run -- hostile model output, kill -9, dead or hung
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

import envs
import rwml
import train
from reward import parse_next_state
from train import read_jsonl

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
    a = envs.parse_tau2_action(text)
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

def main():
    with envs.EnvPool(2) as pool:
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
    proc = subprocess.Popen([sys.executable, "-c", POOL_SCRIPT.format(root=str(ROOT))], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
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


def test_ctrl_c_is_one_line_and_the_workers_exit():
    proc, pids = start_pool_process()
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal signals the whole foreground process group
    _, err = proc.communicate(timeout=60)
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
    with envs.EnvPool(num_workers=2) as pool:
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
    return train.Config(model=tiny_model, prompts_per_step=2, num_generations=2, max_completion_length=6,
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

    trips, load = train.read_transitions(transitions), lambda: rwml.load_model(tiny_model)
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
    model = rwml.add_lora(rwml.load_model(tiny_model)[0], r=2, alpha=4)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    lora = [p for n, p in model.named_parameters() if "lora_B" in n]

    def save(path, step):
        with torch.no_grad():
            for p in lora:
                p.fill_(step)
        train.save_checkpoint(path, model, opt, dict(step=step))

    def load(path):  # the step, checked against the weights: both from one save
        step = train.load_checkpoint(path, model, opt)["step"]
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
    trips, load = train.read_transitions(transitions), lambda: rwml.load_model(tiny_model)
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
