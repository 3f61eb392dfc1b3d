"""The action parser against hostile model output: it must never raise, and must say what it found."""
import pytest

from envs import MAX_ACTION_CHARS, is_inefficient, parse_action


def test_well_formed_reply_is_normalised():
    assert parse_action("<think>mugs live on counters</think>\n<action>  Go To   CounterTop 1 </action>") == \
        ("go to countertop 1", True)


@pytest.mark.parametrize("text", [
    "", None, "   \n\t ", "go to desk 1", "<think>only thinking</think>", "<action></action>",
    "<action>   </action>", "<action>go to desk 1", "go to desk 1</action>",
    "<ACTION>a</action><action>b</action>",
])
def test_malformed_replies_are_format_errors(text):
    command, ok = parse_action(text)
    assert ok is False
    assert isinstance(command, str)


def test_no_tags_falls_back_to_last_line():
    assert parse_action("I will look around.\nlook") == ("look", False)


def test_repeated_tags_take_the_first_block_but_flag_the_reply():
    assert parse_action("<action>go to desk 1</action> then <action>look</action>") == ("go to desk 1", False)


def test_nested_tags_are_stripped():
    command, ok = parse_action("<action><action>open drawer 1</action></action>")
    assert command == "open drawer 1"
    assert "<" not in command


def test_upper_case_tags_are_accepted():
    assert parse_action("<Action>look</ACTION>") == ("look", True)


def test_huge_reply_is_bounded_and_fast():
    command, ok = parse_action("<action>" + "x" * 5_000_000 + "</action>")
    assert ok is False and len(command) == MAX_ACTION_CHARS
    command, ok = parse_action("blah " * 1_000_000)
    assert len(command) <= MAX_ACTION_CHARS and ok is False


@pytest.mark.parametrize("text", ["\udcff\ud800<action>look\x00</action>",
                                  "<action>\u202egо to dеsk 1</action>", b"<action>look</action>",
                                  "\x00" * 100, "<action>🙂 take 🙂</action>"])
def test_non_utf8_ish_text_never_raises(text):
    command, ok = parse_action(text)
    assert isinstance(command, str)
    command.encode("utf-8")  # always encodable, whatever came in


def test_inefficient_actions():
    assert is_inefficient("look") and is_inefficient("examine desk 1") and is_inefficient("inventory")
    assert not is_inefficient("go to desk 1") and not is_inefficient("") and not is_inefficient("lookout")


def test_tau2_parser_never_raises_and_cleans_lone_surrogates():
    from worlds.tau2 import parse_tau2_action

    deep = '<tool_call>{"name": "x", "arguments": {"a": ' + "[" * 5000 + "]" * 5000 + "}}</tool_call>"
    assert parse_tau2_action(deep) == dict(kind="tool", name="", arguments={}, well_formed=False,
                                           raw=deep[len("<tool_call>"):-len("</tool_call>")])
    assert parse_tau2_action(None)["kind"] == "reply" and parse_tau2_action(42)["content"] == "42"
    # JSON escapes decode to lone surrogates, which crash the tokenizer on the next turn
    a = parse_tau2_action('<tool_call>{"name": "get\\ud800", "arguments": {"id\\udc00": ["\\ud800x"]}}'
                          '</tool_call>')
    assert a == dict(kind="tool", name="get?", arguments={"id?": ["?x"]}, well_formed=True)
    assert parse_tau2_action("<think>a</think>hi\ud800<THINK>b</think>") == dict(kind="reply", content="hi?",
                                                                                  well_formed=False)


def test_a_lone_surrogate_in_a_transitions_file_passes_the_context_check(tiny_model, tmp_path):
    """Valid JSON can hold a lone surrogate ("\\ud800"); the context check measured prompts with str.encode,
    which raised UnicodeEncodeError where the triplet had trained and scored before."""
    import json

    from stages import plumbing
    import train

    t = dict(task="put a mug in the sink", history=[{"observation": "You are in a room."}], action="look",
             next_obs="You see a mug\ud800 1.")
    path = tmp_path / "transitions.jsonl"
    path.write_text(json.dumps(t) + "\n")  # ensure_ascii: the file holds the escape, as a user's would
    fits = plumbing.triplet_problem(train.Settings(model=tiny_model))
    assert fits is not None and fits(t) is None
    assert [x["next_obs"] for x in plumbing.read_transitions(str(path), fits=fits)] == [t["next_obs"]]


def test_a_transitions_file_with_a_lone_surrogate_trains(tiny_model, tmp_path):
    """The regression end to end: `wm` on such a file trains its step, as it did before the context check."""
    import json

    import train

    t = dict(task="put a mug in the sink", history=[{"observation": "You are in a room."}], action="look",
             next_obs="You see a mug\ud800 1.")
    path = tmp_path / "transitions.jsonl"
    path.write_text("".join(json.dumps(dict(t, action=f"look {i}")) + "\n" for i in range(4)))
    train.main(["wm", "--model", tiny_model, "--transitions", str(path), "--no-easy-filter", "--no-warmup",
                "--max-steps", "1", "--prompts-per-step", "2", "--num-generations", "2",
                "--max-completion-length", "4", "--filter-split", "0.25", "--out", str(tmp_path / "run")])
    assert (tmp_path / "run" / "adapter" / "adapter_config.json").is_file()
