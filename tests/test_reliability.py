"""Issue #14: what a hostile but fair user does to a run -- hostile model output, kill -9, dead or hung
game workers, Ctrl-C, bad files, full disks -- and what must survive it."""
import json
import random
import re
import time

import pytest

import envs
from reward import parse_next_state

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
