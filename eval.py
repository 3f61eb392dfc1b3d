"""Evaluation (METHOD.md §8).

    python eval.py agent --split valid_seen --num-games 10 --max-turns 30 --seeds 3 --out results.json
    python eval.py agent --adapter runs/rwml/adapter ...      # a peft adapter on top of the base model
    python eval.py agent --env tau2 --domain retail --num-tasks 10 --seeds 3 --out tau2.json
    python eval.py wm --transitions FILE [--adapter DIR] --out wm.json   # + wm.triplets.jsonl, every triplet
    python eval.py wm --transitions FILE --baseline template --out rule.json   # a content-free baseline
    python eval.py calibrate --transitions FILE --out calibrate.json
    python eval.py weights --adapter DIR --out weights.json
    python eval.py report runs/base runs/rwml ... --out results.md

agent: ALFWorld success rate on valid_seen (in distribution) or valid_unseen (out of distribution), with
the paper's action-quality shares, per task type, mean and std over seeds (the paper: 3 runs); tau2-bench:
average reward, pass^k and the invalid tool-call rates (the agent's, and telecom's customer's apart).
wm: world-model accuracy on held-out triplets (share with r_WM = 1, mean cosine, exact match), base
model or base + adapter, or a content-free baseline (`--baseline template|nothing|copy`); overall, per
observation kind and on the targets the template rule misses; use triplets of games never trained on
(valid_seen: the dev split, for choosing settings; valid_unseen: the test split, for reporting).
calibrate: for candidate tau_d, the base model's mean reward and the share of GRPO groups whose rewards
are all equal (no learning signal), from sampled world-model predictions on real triplets.
weights: the paper's weight-change measure of an adapter against its base model (merged), per layer and
per module type.
report: the JSON results found in run folders -> one Markdown table laid out like the paper's Table 1,
plus a tau2-bench table (average reward per domain and over the three) and PNG plots (reward curves,
success by arm).

Every value and path is checked before anything loads. `agent` writes each finished episode to
<out>.episodes.jsonl as it finishes: rerunning the same command after an interruption plays only the rest
(the file goes once <out> is written).
"""
from __future__ import annotations

import contextlib
import json
import math
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm.auto import tqdm

import envs
import rwml
from envs import UserError
from reward import calibrate
from plumbing import (check_adapter, check_at_least, check_context, check_seeds, check_writable,
                      commands_help, parse_config, read_jsonl, read_transitions, run_cli, sample_triplets,
                      wm_prompt_fits, write_atomic, write_eval, write_jsonl)
from train import AgentConfig, ModelConfig, WorldModelConfig, check_choices, make_reward

COMMANDS = {  # name -> its line in `eval.py --help`
    "agent": "success rate of the model (+ adapter) playing held-out games, over seeds",
    "wm": "world-model accuracy on held-out triplets (or of a content-free --baseline)",
    "calibrate": "for candidate tau_d: mean reward and share of all-equal GRPO groups",
    "weights": "the paper's weight-change measure of an adapter against its base model",
    "report": "run folders -> one Markdown table laid out like the paper's Table 1, and plots",
    "sanity": "the table of sanity.sh's held-out scores (runs/sanity)",
    "agent-table": "the table and curve of agent_sanity.sh (runs/agent_sanity)",
}


@dataclass
class AgentEvalConfig(AgentConfig, ModelConfig):
    """The agent's fields of train.Config, with the paper's evaluation protocol as defaults."""
    split: str | None = None  # ALFWorld: valid_seen (ID, the default), valid_unseen (OOD), or both: a,b;
    #                           tau2: test
    num_games: int | None = None  # per split; None = the whole split (140 seen, 134 unseen)
    num_tasks: int | None = None  # tau2: None = the whole split (test: retail 40, telecom 40, airline 20)
    max_turns: int = 30
    max_new_tokens: int = 128
    num_envs: int = 10
    temperature: float = 0.7
    top_p: float = 1.0
    seeds: int = 3  # independent runs of every game; reported as mean and std (seed draws games and sampling)
    policy: str = "model"  # or random: a uniform admissible command each turn (a baseline; no model loads)
    out: str = "results.json"


@dataclass
class WMEvalConfig(WorldModelConfig, ModelConfig):
    """The world model's fields of train.Config, on a transitions file."""
    transitions: str | None = None  # held-out transitions.jsonl
    #                                 (from `train.py collect --split valid_unseen`)
    eval_max_triplets: int = 48  # held-out triplets scored, a seeded sample (0 = all);
    #                              train.py's field and default
    baseline: str | None = None  # wm: score a content-free rule instead of a model: template | nothing | copy
    max_completion_length: int = rwml.GRPOConfig.max_completion_length
    temperature: float = rwml.GRPOConfig.temperature
    num_generations: int = 4  # calibrate: predictions per prompt (a GRPO group)
    out: str = "wm.json"


@dataclass
class WeightsConfig:
    adapter: str | None = None  # the peft adapter to measure
    model: str = rwml.BUNDLED_MODEL  # its base model
    rel: float = 1e-3  # a parameter changed iff |w' - w| > rel * max(|w|, |w'|) (the paper: 1e-3)
    out: str = "weights.json"


@dataclass
class ReportConfig:
    out: str = "results.md"  # the table; the plots go next to it (<out>_rewards.png, <out>_success.png)
    plots: bool = True


@dataclass
class AgentTableConfig:
    out: str = "agent_sanity.md"  # the table; the curve goes next to it (<out stem>_curve.png)


@dataclass
class SanityConfig:
    split: str = "valid_unseen"  # whose held-out scores to tabulate: valid_unseen (test) or valid_seen (dev)
    out: str = "sanity.md"


EVAL_MIN = dict(seeds=1, max_turns=1, history_len=0, max_new_tokens=1, num_envs=1, num_workers=0, num_games=1,
                num_tasks=1, eval_max_triplets=0, max_completion_length=1, eval_samples=0, num_generations=1)


def check_eval_config(cfg) -> None:
    """Every value of an evaluation's config in its range, before anything loads (as train.check_config)."""
    def bad(name, why):
        raise UserError(f"--{name.replace('_', '-')} {getattr(cfg, name)!r}: {why}")

    check_choices(cfg)
    check_seeds(cfg)
    check_at_least(cfg, EVAL_MIN)
    if getattr(cfg, "temperature", 0) < 0:
        bad("temperature", "must be 0 or more (0 = greedy)")
    if not 0 < getattr(cfg, "top_p", 1) <= 1:
        bad("top_p", "must be in (0, 1]")
    if not 0 < getattr(cfg, "tau_d", 1) <= 2:
        bad("tau_d", "must be in (0, 2] (a cosine distance)")
    if getattr(cfg, "rel", 0) < 0:
        bad("rel", "must be 0 or more")
    if isinstance(cfg, AgentEvalConfig):
        envs.check_action_mode(cfg.env, "choose" if cfg.policy == "random" else cfg.action_mode)
        if cfg.split is not None and not [sp for sp in cfg.split.split(",") if sp.strip()]:
            bad("split", "names no split; e.g. valid_seen, or valid_seen,valid_unseen")


def wm_accuracy(cfg: WMEvalConfig) -> dict:
    """`eval.py wm`: rwml.evaluate_wm on a transitions file, the base model or base + adapter."""
    import torch

    # the draw is fixed (not the run's seed), as train.py's held-out set: every seed scores the same triplets
    trips = sample_triplets(read_transitions(cfg.transitions, wm_prompt_fits(cfg)), cfg.eval_max_triplets, 0)
    reward_fn = make_reward(cfg)
    info = dict(transitions=cfg.transitions, split=collection_split(cfg.transitions), config=asdict(cfg))
    if cfg.baseline:
        return dict(rwml.baseline_wm(cfg.baseline, trips, reward_fn), **info)
    model, tok = rwml.load_model(cfg.model, cfg.adapter)
    torch.manual_seed(cfg.seed)  # as train.py's before / after evaluation
    result = rwml.evaluate_wm(model, tok, trips, reward_fn, max_new_tokens=cfg.max_completion_length,
                              reasoning=cfg.wm_reasoning, samples=cfg.eval_samples,
                              temperature=cfg.temperature)
    return dict(result, model=cfg.adapter or cfg.model, **info)


def collection_split(transitions: str) -> str | None:
    """The split a transitions file was collected on, from the collect.json beside it (None if unknown)."""
    meta = Path(transitions).with_name("collect.json")
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return json.loads(meta.read_text()).get("split")
    return None


def calibrate_tau(cfg: WMEvalConfig) -> dict:
    """Sample num_generations world-model predictions per triplet at temperature 1, then tabulate."""
    import torch

    trips = sample_triplets(read_transitions(cfg.transitions, wm_prompt_fits(cfg)),
                            cfg.eval_max_triplets or 32, cfg.seed)
    reward_fn = make_reward(cfg)
    model, tok = rwml.load_model(cfg.model, cfg.adapter)
    torch.manual_seed(cfg.seed)
    groups, k = [], cfg.num_generations
    for i in tqdm(range(0, len(trips), 4), desc="calibrate", unit="batch", dynamic_ncols=True):
        texts = rwml.sample_predictions(model, tok, trips[i:i + 4], reasoning=cfg.wm_reasoning, n=k,
                                        max_new_tokens=cfg.max_completion_length).texts
        groups += [texts[j:j + k] for j in range(0, len(texts), k)]
    rows = calibrate(reward_fn, groups, [t["next_obs"] for t in trips])
    return dict(rows=rows, n=len(trips), num_generations=cfg.num_generations, config=asdict(cfg))


def _mean_std(xs: list[float]) -> tuple[float, float]:
    return (statistics.fmean(xs), statistics.pstdev(xs)) if xs else (0.0, 0.0)


def agent_metrics(episodes: list[dict]) -> dict:
    """Success and action-quality rates of episode summaries (as `rwml.play` returns them)."""
    steps = sum(e["steps"] for e in episodes) or 1
    invalid = sum(e["invalid"] for e in episodes)
    inefficient = sum(e["inefficient"] for e in episodes)
    return dict(success_rate=sum(e["won"] for e in episodes) / max(len(episodes), 1),
                invalid_action_rate=invalid / steps,  # invalid command or format error, per action
                format_error_rate=sum(e["format_errors"] for e in episodes) / steps,
                inefficient_action_rate=inefficient / steps,  # look / examine / inventory / help
                invalid_or_inefficient_rate=(invalid + inefficient) / steps,  # the paper's combined share
                mean_steps=sum(e["steps"] for e in episodes) / max(len(episodes), 1),
                num_episodes=len(episodes))


def _summarize(episodes: list[dict], seeds: int) -> dict:
    result = agent_metrics(episodes)
    per_seed = [agent_metrics([e for e in episodes if e["seed"] == s]) for s in range(seeds)]
    for key in ("success_rate", "invalid_action_rate", "inefficient_action_rate", "mean_steps"):
        result[key + "_std"] = _mean_std([m[key] for m in per_seed])[1]  # spread over seeds
    by_type = defaultdict(list)
    for e in episodes:
        by_type[e["task_type"]].append(e)
    result["per_task_type"] = {t: agent_metrics(by_type[t]) for t in envs.TASK_TYPES if t in by_type}
    result["per_seed"] = per_seed
    return result


EPISODE_JOB = ("model", "adapter", "env", "domain", "user_model", "split", "num_games", "num_tasks", "seed",
               "max_turns", "history_len", "temperature", "top_p", "max_new_tokens", "action_mode", "policy",
               "world_size", "nb_objects", "quest_length")


def episodes_file(cfg: AgentEvalConfig) -> Path:
    return Path(cfg.out + ".episodes.jsonl")


def finished_episodes(cfg: AgentEvalConfig) -> dict[tuple, dict]:
    """The episodes an interrupted run of this evaluation finished, by (split, seed, game), from
    <out>.episodes.jsonl, whose first line holds the settings (other settings: none are reused)."""
    path, job = episodes_file(cfg), {k: getattr(cfg, k) for k in EPISODE_JOB}
    rows = read_jsonl(path)
    done = rows[1:] if rows and rows[0] == dict(job=job) else []
    if len(rows) > 1 and not done:
        print(f"eval: {path} holds episodes played with other settings; playing all anew")
    if done:
        print(f"eval: {len(done)} episodes already played (from {path}); playing the rest")
    return {(e.get("split"), e["seed"], e["game"]): e for e in done}


@contextlib.contextmanager
def episode_log(cfg: AgentEvalConfig, done: dict):
    """on_episode for `play`: each finished episode goes to <out>.episodes.jsonl at once. The file is first
    rewritten with the settings and the `done` episodes (so no line cut short by an interrupt remains)."""
    path = episodes_file(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [dict(job={k: getattr(cfg, k) for k in EPISODE_JOB})] + list(done.values())
    write_jsonl(path, rows, default=str)
    with open(path, "a") as f:
        def write(summary):
            f.write(json.dumps(summary, default=str) + "\n")
            f.flush()
        yield write


def tau2_metrics(episodes: list[dict], tasks: list, seeds: int) -> dict:
    """tau2-bench: average official reward over seeds (mean and std), pass^k for k = 1..seeds, the share
    of invalid tool calls (unknown tool or bad arguments) per call, the agent's and the customer's (telecom's
    phone) apart, format errors per agent action."""
    per_seed = [statistics.fmean(e["reward"] for e in episodes if e["seed"] == s) for s in range(seeds)]
    trials = [(sum(e["won"] for e in episodes if e["game"] == t.id), seeds) for t in tasks]
    calls, steps = sum(e["tool_calls"] for e in episodes), sum(e["steps"] for e in episodes) or 1
    user_calls = sum(e["user_tool_calls"] for e in episodes)
    return dict(average_reward=statistics.fmean(per_seed), average_reward_std=_mean_std(per_seed)[1],
                pass_hat_k={k: envs.pass_hat_k(trials, k) for k in range(1, seeds + 1)},
                invalid_tool_call_rate=sum(e["invalid"] for e in episodes) / max(calls, 1), tool_calls=calls,
                user_invalid_tool_call_rate=sum(e["user_invalid"] for e in episodes) / max(user_calls, 1),
                user_tool_calls=user_calls,
                format_error_rate=sum(e["format_errors"] for e in episodes) / steps,
                mean_steps=steps / len(episodes), num_tasks=len(tasks), num_episodes=len(episodes),
                per_seed_reward=per_seed)


def evaluate_agent(cfg: AgentEvalConfig) -> dict:
    """Every game (tau2: task) of the split(s), `seeds` times, all in one batched `rwml.play`; then ALFWorld's
    success and action quality (per split and task type) or tau2's average reward and pass^k."""
    import dataclasses

    import torch

    tau2 = cfg.env == "tau2"
    mode = "random" if cfg.policy == "random" else cfg.action_mode
    if mode == "choose" and cfg.seeds > 1:  # greedy on deterministic games: every seed plays the same
        print(f"eval: --action-mode choose evaluates greedily, so every seed plays the same episodes; "
              f"1 seed, not {cfg.seeds}")
        cfg = dataclasses.replace(cfg, seeds=1)
    splits = [s.strip() for s in (cfg.split or ("valid_seen" if cfg.env == "alfworld" else "test")).split(",")
              if s.strip()]
    games = {sp: envs.games(cfg.env, sp, cfg.num_tasks if tau2 else cfg.num_games, cfg.seed, cfg.domain,
                            (cfg.world_size, cfg.nb_objects, cfg.quest_length)) for sp in splits}
    t0 = time.time()
    done = finished_episodes(cfg)
    every = [dict(game=g, split=sp, seed=s) for s in range(cfg.seeds) for sp in splits for g in games[sp]]
    key = lambda ep: (ep["split"], ep["seed"], envs.game_name(ep["game"]))  # noqa: E731
    todo = [ep for ep in every if key(ep) not in done]
    if todo:
        with envs.make(cfg.env, domain=cfg.domain, num_workers=cfg.num_workers, max_turns=cfg.max_turns,
                       at_once=min(cfg.num_envs, len(todo))) as env:
            # after make: game workers fork without it; the random policy needs none
            model, tok = rwml.load_model(cfg.model, cfg.adapter) if mode != "random" else (None, None)
            user = rwml.load_model(cfg.user_model) if cfg.user_model else (None, None)
            torch.manual_seed(cfg.seed + len(done))
            # all seeds and splits in one call: bigger generation batches; each episode keeps its split, seed
            with episode_log(cfg, done) as on_episode:
                played = rwml.play(
                    model, tok, env, todo, history_len=cfg.history_len, top_p=cfg.top_p,
                    temperature=0.0 if mode == "choose" else cfg.temperature,  # choose: greedy at evaluation
                    max_new_tokens=cfg.max_new_tokens, num_envs=cfg.num_envs, on_episode=on_episode,
                    user_model=user[0], user_tokenizer=user[1],
                    desc=f"eval {cfg.domain if tau2 else ','.join(splits)}",
                    action_mode=mode, seed=cfg.seed + len(done))
        done.update(((e["split"], e["seed"], e["game"]), e) for e in played)
    episodes = [done[key(ep)] for ep in every]
    if tau2:
        result = dict(tau2_metrics(episodes, games[splits[0]], cfg.seeds), env="tau2", domain=cfg.domain)
    else:
        result = _summarize(episodes, cfg.seeds)
        result["per_split"] = {sp: dict(_summarize([e for e in episodes if e["split"] == sp], cfg.seeds),
                                        num_games=len(games[sp])) for sp in splits}
    result.update(split=",".join(splits), num_games=sum(map(len, games.values())),
                  seconds=round(time.time() - t0, 1), config=asdict(cfg), episodes=episodes)
    return result


# ----------------------------------------------------------------------------- weight change (METHOD.md §8)

MODULE_TYPES = (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"), ("o_proj", "o"), ("mlp", "mlp"))


def module_type(name: str) -> str:
    return next((t for key, t in MODULE_TYPES if key in name), "other")


def weight_change(before: dict, after: dict, rel: float = 1e-3) -> dict:
    """Share of parameters with |w' - w| > rel * max(|w|, |w'|): overall, per module type (q/k/v/o/mlp/
    other) and per layer (the index in `layers.N.`; "other" for embeddings, final norm, head)."""
    import re

    import torch

    total, per_module, per_layer = [0, 0], defaultdict(lambda: [0, 0]), defaultdict(lambda: [0, 0])
    for name, w in before.items():
        if name not in after:
            raise UserError(f"parameter {name} is missing after merging; is the adapter for this base model?")
        w, w2 = w.float(), after[name].float()
        changed = int(((w2 - w).abs() > rel * torch.maximum(w.abs(), w2.abs())).sum())
        m = re.search(r"layers\.(\d+)\.", name)
        for counts in (total, per_module[module_type(name)], per_layer[m.group(1) if m else "other"]):
            counts[0] += changed
            counts[1] += w.numel()

    def share(c):
        return dict(changed_share=c[0] / max(c[1], 1), changed=c[0], total=c[1])

    layers = sorted(per_layer, key=lambda k: (k == "other", int(k) if k.isdigit() else 0))
    kinds = [t for _, t in MODULE_TYPES] + ["other"]
    return dict(share(total), rel=rel, per_module={k: share(per_module[k]) for k in kinds if k in per_module},
                per_layer={k: share(per_layer[k]) for k in layers})


def evaluate_weights(cfg: WeightsConfig) -> dict:
    """Merge the adapter into a full-precision copy of its base and compare every parameter."""
    if not cfg.adapter:
        raise UserError("--adapter DIR is required: the adapter/ folder of a run")
    check_adapter(cfg.adapter)
    from peft import PeftModel

    model, _ = rwml.load_model(cfg.model, device="cpu")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    merged = PeftModel.from_pretrained(model, cfg.adapter).merge_and_unload()
    result = weight_change(before, dict(merged.named_parameters()), cfg.rel)
    return dict(result, adapter=cfg.adapter, model=cfg.model)


# ----------------------------------------------------------------------------- report (METHOD.md §9's table)

ID_SPLIT, OOD_SPLIT = "valid_seen", "valid_unseen"


def read_run(folder: Path) -> dict:
    """The results found in a run folder, recognised by their keys: agent evaluations (per split), a
    world-model evaluation, a weight-change measure; and the training curve (metrics.jsonl)."""
    run = dict(name=folder.name, splits={}, tau2={}, wm=None, weights=None,
               curve=read_jsonl(folder / "metrics.jsonl"))
    for n, row in enumerate(run["curve"], 1):
        problem = ("not a JSON object" if not isinstance(row, dict)
                   else _numbers_problem(row, ("step", "reward_mean")))
        if problem:
            raise UserError(f"{folder / 'metrics.jsonl'}, record {n}: {problem}; fix or remove that file")
    for f in sorted(folder.glob("*.json")):
        try:
            data = json.loads(f.read_text(encoding="utf-8-sig"))
        except (OSError, ValueError) as e:  # damaged results are named, not taken for "no results"
            raise UserError(f"{f} does not read as JSON ({(str(e).splitlines() or [''])[0]}); "
                            "fix or remove it") from None
        if not isinstance(data, dict):
            continue
        if "success_rate" in data and "split" in data:
            kind, parts = "eval.py agent", data.get("per_split") or {str(data["split"]): data}
            problem = _numbers_problem(parts, ()) or next(
                (p for p in (_numbers_problem(x, AGENT_KEYS) for x in parts.values()) if p), None)
        elif data.get("env") == "tau2" and "average_reward" in data:
            kind = "eval.py agent --env tau2"
            problem = _numbers_problem(data, TAU2_KEYS) or (
                None if isinstance(data.get("domain"), str) else "domain is missing or not text")
        elif "wm_accuracy" in data and "per_kind" in data:
            kind, problem = "eval.py wm", _numbers_problem(data, ("wm_accuracy",))
        elif "changed_share" in data and "per_module" in data:
            kind, problem = "eval.py weights", _numbers_problem(data, ("changed_share",))
        else:
            continue
        if problem:  # a traceback in the table otherwise (KeyError, TypeError), far from the file
            raise UserError(f"{f}: {problem}, so it is no result of `{kind}`; write it again, or remove it")
        if kind == "eval.py agent":
            run["splits"].update(parts)
        elif kind == "eval.py wm":
            run["wm"] = data
        elif kind == "eval.py weights":
            run["weights"] = data
        else:
            run["tau2"][data["domain"]] = data
    return run


AGENT_KEYS = ("success_rate", "num_episodes", "mean_steps", "invalid_action_rate")
TAU2_KEYS = ("average_reward", "num_tasks", "num_episodes", "tool_calls", "invalid_tool_call_rate")


def _numbers_problem(data, keys) -> str | None:
    """What keeps a result from the tables (`keys` missing or not numbers; a *_std not a number), or None."""
    if not isinstance(data, dict):
        return "not a JSON object"
    is_num = lambda v: (isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
                        and math.isfinite(v))
    bad = next((k for k in keys if not is_num(data.get(k))), None) or next(
        (k for k in data if k.endswith("_std") and not is_num(data[k])), None)
    return None if bad is None else f"{bad} is missing or not a number"


def report_table(runs: list[dict]) -> str:
    """Markdown, laid out like the paper's Table 1: success (%) in distribution, out of distribution and
    their average (over all episodes of both), mean ± std over seeds; then the action quality, world-model
    accuracy and the share of parameters changed."""
    def pct(x, std=None):
        return "–" if x is None else f"{100 * x:.1f}" + ("" if std is None else f" ± {100 * std:.1f}")

    lines = ["| arm | ALFWorld ID | OOD | AVG | invalid actions (%) | WM accuracy (%) | params changed (%) "
             "| episodes |",
             "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        sp = r["splits"]
        ide, ood = sp.get(ID_SPLIT), sp.get(OOD_SPLIT)
        both = [x for x in (ide, ood) if x]
        n = sum(x["num_episodes"] for x in both)
        avg = sum(x["success_rate"] * x["num_episodes"] for x in both) / n if n else None
        steps = sum(x["mean_steps"] * x["num_episodes"] for x in both)
        invalid = (sum(x["invalid_action_rate"] * x["mean_steps"] * x["num_episodes"] for x in both) / steps
                   if steps else None)
        lines.append("| " + " | ".join([
            r["name"], pct(ide and ide["success_rate"], ide and ide.get("success_rate_std")),
            pct(ood and ood["success_rate"], ood and ood.get("success_rate_std")), pct(avg), pct(invalid),
            pct(r["wm"] and r["wm"]["wm_accuracy"]),
            "–" if not r["weights"] else f"{100 * r['weights']['changed_share']:.2f}",
            str(n) if n else "–"]) + " |")
    return "\n".join(lines) + "\n"


TAU2_TABLE_DOMAINS = ("retail", "telecom", "airline")  # the paper's column order


def tau2_table(runs: list[dict]) -> str:
    """Markdown, the tau2-bench columns of the paper's Table 1: average reward (%) per domain, mean ± std
    over seeds; AVG, when all three domains are there, over all their tasks (so weighted by tasks, as the
    paper's AVG is: retail 40, telecom 40, airline 20 test tasks); the agent's invalid tool calls."""
    def pct(x, std=None):
        return "–" if x is None else f"{100 * x:.1f}" + ("" if std is None else f" ± {100 * std:.1f}")

    lines = ["| arm | tau2 retail | telecom | airline | AVG | invalid tool calls (%) | conversations |",
             "|---|---|---|---|---|---|---|"]
    for r in runs:
        got = [r["tau2"][d] for d in TAU2_TABLE_DOMAINS if d in r["tau2"]]
        tasks = sum(x["num_tasks"] for x in got)
        avg = sum(x["average_reward"] * x["num_tasks"] for x in got) / tasks if len(got) == 3 else None
        calls = sum(x["tool_calls"] for x in got)
        invalid = sum(x["invalid_tool_call_rate"] * x["tool_calls"] for x in got) / calls if calls else None
        cells = [pct(x and x["average_reward"], x and x.get("average_reward_std"))
                 for x in (r["tau2"].get(d) for d in TAU2_TABLE_DOMAINS)]
        n = sum(x["num_episodes"] for x in got)
        lines.append("| " + " | ".join([r["name"], *cells, pct(avg), pct(invalid), str(n or "–")]) + " |")
    return "\n".join(lines) + "\n"


def report_plots(runs: list[dict], stem: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    curves = [r for r in runs if r["curve"]]
    if curves:
        fig, ax = plt.subplots(figsize=(6.5, 3.5))
        for r in curves:
            ax.plot([x["step"] for x in r["curve"]], [x["reward_mean"] for x in r["curve"]], marker=".",
                    label=r["name"])
        ax.set(xlabel="optimizer step", ylabel="mean reward", title="training reward per step",
               ylim=(-0.02, 1.02))
        ax.legend(fontsize=7, loc="best")
        fig.tight_layout()
        written.append(stem.with_name(stem.name + "_rewards.png"))
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    evaluated = [r for r in runs if r["splits"]]
    if evaluated:
        fig, ax = plt.subplots(figsize=(6.5, 3.5))
        x = range(len(evaluated))
        for k, (split, label) in enumerate(((ID_SPLIT, "ID (valid_seen)"),
                                            (OOD_SPLIT, "OOD (valid_unseen)"))):
            vals = [100 * r["splits"].get(split, {}).get("success_rate", 0.0) for r in evaluated]
            errs = [100 * r["splits"].get(split, {}).get("success_rate_std", 0.0) for r in evaluated]
            ax.bar([i + (k - 0.5) * 0.4 for i in x], vals, 0.4, yerr=errs, capsize=3, label=label)
        ax.set_xticks(list(x), [r["name"] for r in evaluated], rotation=30, ha="right", fontsize=7)
        ax.set(ylabel="success (%)", title="ALFWorld success by arm", ylim=(0, 100))
        ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(stem.with_name(stem.name + "_success.png"))
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written


def report(cfg: ReportConfig, folders: list[str]) -> str:
    missing = [f for f in folders if not Path(f).is_dir()]
    if missing:
        raise UserError(f"not a run folder: {missing[0]}")
    runs = [read_run(Path(f)) for f in folders]
    if not any(r["splits"] or r["tau2"] or r["wm"] or r["weights"] for r in runs):
        raise UserError("no results in these folders: put the JSON of `eval.py agent`, `eval.py wm` or "
                        "`eval.py weights` into each run folder first")
    alfworld = any(r["splits"] or r["wm"] or r["weights"] for r in runs)
    tau2 = any(r["tau2"] for r in runs)
    text = "\n".join(([report_table(runs)] if alfworld else []) + ([tau2_table(runs)] if tau2 else []))
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if cfg.plots:
        for png in report_plots(runs, out.with_suffix("")):
            text += f"\n![{png.stem}]({png.name})\n"
    write_atomic(out, text)
    return text


# ----------------------------------------------------------------------------- the sanity table (sanity.sh)

SANITY_ARMS = (("warmup", "warm-up"), ("rwml", "+ RWML"), ("wm_sft", "+ WM SFT"), ("coin", "+ COIN"))
SANITY_BASELINES = (("template", "template rule"), ("nothing", "always \"Nothing happens.\""),
                    ("copy", "copy the observation"), ("base", "base model"))
SANITY_COLUMNS = (("all targets", lambda r: r["wm_accuracy"]),
                  ("the template rule's targets",
                   lambda r: r["per_kind"].get("within_template", {}).get("wm_accuracy")),
                  ("not \"Nothing happens.\"", lambda r: r["per_kind"]["change"]["wm_accuracy"]),
                  ("beyond the template rule", lambda r: r["per_kind"]["beyond_template"]["wm_accuracy"]),
                  ("mean cosine", lambda r: r["mean_cosine"]))
MIN_RATE_N = 10  # a kind with fewer held-out triplets is listed, not quoted as a rate


def _spread(xs: list[float], fmt: str = ".3f") -> str:
    """"mean ± sd (a / b / c)" over seeds (sample sd)."""
    xs = [x for x in xs if x is not None]  # None: a value older result files do not have
    if not xs:
        return "–"
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.fmean(xs):{fmt}} ± {sd:.3f} ({' / '.join(f'{x:{fmt}}' for x in xs)})"


def variant_arms(seeds: list[Path]) -> list[tuple[str, str]]:
    """sanity.sh's VARIANTS: RWML runs with other flags (seed*/rwml_<name>), each labelled by the flags in
    which its config differs from the same seed's RWML run."""
    from plumbing import RESUME_FREE

    def flag(key: str, value) -> str:
        name = key.replace("_", "-")
        if isinstance(value, bool):
            return f"--{name}" if value else f"--no-{name}"
        return f"--{name} {'none' if value is None else value}"

    arms = []
    for name in sorted({d.name for s in seeds for d in s.glob("rwml_*") if d.is_dir()}):
        label = name[len("rwml_"):]
        for s in seeds:
            mine, rwml_cfg = s / name / "config.json", s / "rwml" / "config.json"
            if mine.is_file() and rwml_cfg.is_file():
                a, b = json.loads(mine.read_text()), json.loads(rwml_cfg.read_text())
                label = " ".join(flag(k, v) for k, v in a.items()
                                 if k not in RESUME_FREE and b.get(k) != v) or label
                break
        arms.append((name, f"+ RWML, {label}"))
    return arms


def nothing_rates(rows: list[dict], G: int) -> tuple[float | None, float | None, float, float]:
    """From a GRPO run's metrics rows: the share of "Nothing happens." predictions on "Nothing happens."
    targets and on the other targets, and the advantage those predictions got, summed over the run, in
    groups whose target is "Nothing happens." (> 0: pushed up) and in the others (< 0: pushed down)."""
    on = {True: [0.0, 0], False: [0.0, 0]}
    push = {True: 0.0, False: 0.0}
    for r in rows:
        for k, n, a in zip(r.get("target_kinds", []), r.get("group_nothing", []),
                           r.get("group_nothing_advantage", [])):
            nh = k == "nothing_happens"
            on[nh][0] += n
            on[nh][1] += G
            push[nh] += a
    rate = {nh: (x / n if n else None) for nh, (x, n) in on.items()}
    return rate[True], rate[False], push[True], push[False]


def filter_rows(seeds: list[Path]) -> list[str]:
    """The easy filter against the target mix, per seed: how many triplets, and how many of them have a
    "Nothing happens." target, in the collection, the warm-up's split, the RWML split and what the filter
    kept; the warm-up's mean easiness of those targets and of the rest."""
    lines = []
    for d in seeds:
        meta, rows = d / "filter" / "filter.json", read_jsonl(d / "filter" / "easiness.jsonl") \
            if (d / "filter" / "easiness.jsonl").is_file() else []
        if not rows or not meta.is_file():
            continue
        info = json.loads(meta.read_text())
        nh = [envs.observation_kind(r["next_obs"]) == "nothing_happens" for r in rows]
        n_all, n_split = info["num_triplets"], info["num_filter_split"]
        coll = d / "collect" / "transitions.jsonl"
        nh_all = sum(envs.observation_kind(t["next_obs"]) == "nothing_happens" for t in read_jsonl(coll)) \
            if coll.is_file() else None

        def share(k: int | None, n: int) -> str:
            return "–" if k is None else f"{k} of {n} ({k / max(n, 1):.0%})"

        def mean(xs):
            return f"{statistics.fmean(xs):.2f}" if xs else "–"

        kept = [h for h, r in zip(nh, rows) if r["kept"]]
        lines.append(f"| {d.name[4:]} | {share(nh_all, n_all)} | "
                     f"{share(None if nh_all is None else nh_all - sum(nh), n_split)} | "
                     f"{share(sum(nh), len(nh))} | {share(sum(kept), len(kept))} | "
                     f"{mean([r['easiness'] for h, r in zip(nh, rows) if h])} | "
                     f"{mean([r['easiness'] for h, r in zip(nh, rows) if not h])} | {info.get('tau_easy')} |")
    if not lines:
        return []
    return ["### the easy filter and the target mix", "",
            "Per seed: triplets with a \"Nothing happens.\" target in the collection, in the warm-up's split "
            "(its SFT data), in the RWML split and among the triplets the easy filter kept; the warm-up's "
            "easiness (its mean reward over K predictions) of those targets and of the others; tau_easy.", "",
            "| seed | collected | warm-up split | RWML split | kept | easiness, \"Nothing happens.\" | "
            "easiness, other | tau_easy |", "|---|---|---|---|---|---|---|---|", *lines, ""]


def sanity_report(folder: Path, split: str = "valid_unseen", png: Path | None = None) -> str:
    """The tables of `sanity.sh`, from its run folder: per held-out kind, the content-free baselines, the
    base model, and per arm the mean ± sd over the independent seeds (each seed's value in brackets), the
    paired RWML - warm-up gain, accuracy per observation kind; then the training diagnostics: the easy
    filter's target mix and the "Nothing happens." predictions step by step (the drift, README). `png`: the
    GRPO arms' held-out curves (their --eval-steps rows) per seed and mean ± sd."""
    from train import HELDOUT_KINDS

    seeds = sorted(folder.glob("seed*"), key=lambda p: int(p.name[4:]))
    if not seeds:
        raise UserError(f"no seed*/ folders in {folder}: run sanity.sh first")
    held = folder / split  # the held-out sets of this split and every score on them
    variants = variant_arms(seeds)
    all_arms = (*SANITY_ARMS[:2], *variants, *SANITY_ARMS[2:])

    def read(path: Path):
        return json.loads(path.read_text()) if path.is_file() else None

    lines = []
    for kind in HELDOUT_KINDS:
        base = {b: read(held / "baselines" / f"{b}_{kind}.json") for b, _ in SANITY_BASELINES}
        arms = {a: [r for d in seeds if (r := read(held / d.name / f"eval_{a}_{kind}.json"))]
                for a, _ in all_arms}
        first = next((r for r in [*base.values(), *(x for v in arms.values() for x in v)] if r), None)
        if first is None:
            continue
        cfg = first.get("config", {})
        beyond_n = first["per_kind"]["beyond_template"]["n"]
        unseen_n = first["per_kind"].get("beyond_template_unseen", {}).get("n")
        lines += [f"### {kind} triplets: {first['n']} of `{first.get('split') or '?'}` "
                  f"(`{first.get('transitions')}`), {beyond_n} beyond the template rule"
                  + (f" ({unseen_n} of them list objects the prompt never names)" if unseen_n is not None
                     else ""), "",
                  f"{cfg.get('eval_samples', 0) or 1} predictions per triplet sampled at T "
                  f"{cfg.get('temperature', 0)} (the rules: one), reward 1 iff 1 - cos < tau_d "
                  f"{cfg.get('tau_d')}; the share of predictions with reward 1. Arms: mean ± sd over "
                  f"{len(seeds)} independent seeds (each seed's value in brackets).", "",
                  "| | " + " | ".join(c for c, _ in SANITY_COLUMNS) + " |",
                  "|---|" + "---|" * len(SANITY_COLUMNS)]
        for b, name in SANITY_BASELINES:
            if base[b]:
                lines.append(f"| {name} | " + " | ".join(_spread([get(base[b])]).split(" ±")[0]
                                                         for _, get in SANITY_COLUMNS)
                             + " |")
        for a, name in all_arms:
            if arms[a]:
                lines.append(f"| {name} | " + " | ".join(_spread([get(r) for r in arms[a]])
                                                         for _, get in SANITY_COLUMNS)
                             + " |")
        for a, name in (("rwml", "RWML"), *((v, n.replace("+ RWML", "RWML")) for v, n in variants)):
            pairs = [(r, w) for d in seeds if (r := read(held / d.name / f"eval_{a}_{kind}.json"))
                     and (w := read(held / d.name / f"eval_warmup_{kind}.json"))]
            if pairs:
                lines.append(f"| **{name} − warm-up** (paired) | " + " | ".join(
                    _spread([get(r) - get(w) for r, w in pairs if None not in (get(r), get(w))], "+.3f")
                    for _, get in SANITY_COLUMNS) + " |")
        kinds = sorted(first["per_observation_kind"], key=lambda k: -first["per_observation_kind"][k]["n"])
        few = [f"{k} {first['per_observation_kind'][k]['n']}" for k in kinds
               if first["per_observation_kind"][k]["n"] < MIN_RATE_N]
        cols = [(b, n) for b, n in SANITY_BASELINES[:1] if base[b]] + [(a, n) for a, n in all_arms if arms[a]]
        lines += ["", f"By observation kind (kinds with at least {MIN_RATE_N} triplets; mean over seeds):",
                  "", "| kind | n | " + " | ".join(n for _, n in cols) + " |",
                  "|---|---|" + "---|" * len(cols)]
        for k in kinds:
            n = first["per_observation_kind"][k]["n"]
            if n < MIN_RATE_N:
                continue
            vals = []
            for c, _ in cols:
                rs = [base[c]] if c in base else arms[c]
                vals.append(
                    f"{statistics.fmean(r['per_observation_kind'][k]['wm_accuracy'] for r in rs):.3f}")
            lines.append(f"| {k} | {n} | " + " | ".join(vals) + " |")
        lines += (["", f"Too few to quote as a rate: {', '.join(few)}."] if few else []) + [""]
    lines += filter_rows(seeds)
    lines += ["### training", "", "Mean per step, first quarter -> last quarter of the steps: the reward; "
              "the share of predictions that are \"Nothing happens.\", over all targets, over the "
              "\"Nothing happens.\" targets and over the others; then over the whole run: the share of "
              "groups whose rewards are all equal (no gradient), of the mixed groups (those that carry the "
              "gradient) the share whose target is \"Nothing happens.\", and the advantage summed over the "
              "\"Nothing happens.\" predictions in \"Nothing happens.\"-target groups (which push it up) and "
              "in the other groups (which push it down).", "",
              "| seed | RWML reward | predicted \"Nothing happens.\" | on its targets | on other targets | "
              "all-equal groups | mixed groups with a \"Nothing happens.\" target | advantage to it: its "
              "targets / others | COIN reward |", "|---|---|---|---|---|---|---|---|---|"]

    def quarter_rows(rows):
        q = max(1, len(rows) // 4)
        return rows[:q], rows[-q:]

    def quarters(rows, key):
        rows = [r for r in rows if key in r]
        if not rows:
            return "–"
        head, tail = (statistics.fmean(r[key] for r in part) for part in quarter_rows(rows))
        return f"{head:.2f} -> {tail:.2f}"

    def mixed_nothing(rows):
        mixed = [k for r in rows for k, g in zip(r.get("target_kinds", []), r.get("group_rewards", []))
                 if 0 < g < 1]
        return (f"{sum(k == 'nothing_happens' for k in mixed) / len(mixed):.2f} of {len(mixed)}" if mixed
                else "–")

    # "Nothing happens." predictions on its targets and on the others, first -> last quarter
    def drift(rows, G):
        rows = [r for r in rows if "group_nothing" in r]
        if not rows:
            return "–", "–", "–"
        (h_on, h_off, *_), (t_on, t_off, *_) = (nothing_rates(part, G) for part in quarter_rows(rows))
        _, _, up, down = nothing_rates(rows, G)

        def fmt(a, b):
            return f"{'–' if a is None else f'{a:.2f}'} -> {'–' if b is None else f'{b:.2f}'}"
        return fmt(h_on, t_on), fmt(h_off, t_off), f"{up:+.1f} / {down:+.1f}"

    for d in seeds:
        coin = read_jsonl(d / "coin" / "metrics.jsonl")
        for arm, name in (("rwml", "+ RWML"), *variants):
            rw = read_jsonl(d / arm / "metrics.jsonl")
            if arm != "rwml" and not rw:
                continue
            G = (read(d / arm / "config.json") or {}).get("num_generations", 4)
            # not the step-0 eval row
            zs = [r["frac_reward_zero_std"] for r in rw if "frac_reward_zero_std" in r]
            zero = f"{statistics.fmean(zs):.2f}" if zs else "–"
            label = "" if arm == "rwml" else f" ({name[len('+ RWML, '):]})"
            on, off, push = drift(rw, G)
            lines.append(f"| {d.name[4:]}{label} | {quarters(rw, 'reward_mean')} | "
                         f"{quarters(rw, 'nothing_share')} | {on} | {off} | {zero} | {mixed_nothing(rw)} | "
                         f"{push} | {quarters(coin, 'reward_mean') if arm == 'rwml' else '–'} |")
    if png is not None:
        curves = {name: [[(r["step"], r["eval_wm_accuracy"]) for r in read_jsonl(d / arm / "metrics.jsonl")
                          if "eval_wm_accuracy" in r] for d in seeds]
                  for arm, name in all_arms if arm.startswith("rwml") or arm == "coin"}
        if plot_curves(curves, png, xlabel="GRPO step", ylabel="held-out world-model accuracy",
                       title=f"RWML and its controls: accuracy on held-out {split} triplets during training"):
            lines += ["", f"Held-out accuracy against step (the runs' --eval-steps rows): {png.name}"]
    return "\n".join(lines) + "\n"


# -------------------------------------------------------------------------- the agent table (agent_sanity.sh)

AGENT_ARMS = (("base", "base"), ("rwml", "RWML"), ("policy", "policy RL"),
              ("rwml_policy", "RWML + policy RL"), ("wm_sft_policy", "WM SFT + policy RL"))


def agent_report(folder: Path, png: Path | None = None) -> str:
    """The table of `agent_sanity.sh`, from its run folder: greedy success (%) on the dev and test games per
    arm, and on both splits pooled (stage-2 arms: mean ± sd over the seed*/ folders, each seed listed), the
    random-admissible baseline, and the dev curve (`png`; step 0 is the start's evaluation: base, RWML or
    WM SFT). A stage-2 arm's dev score is its final `eval.py agent` evaluation when that played the dev
    games, else the curve's last point."""
    seeds = sorted(folder.glob("seed*/"), key=lambda d: int(d.name[4:]) if d.name[4:].isdigit() else -1)
    if not seeds:
        raise UserError(f"no seed*/ folders in {folder}: run agent_sanity.sh first")
    def pct(xs: list[float]) -> str:  # one value as it is; over seeds "mean ± sd (each seed)"
        xs = [100 * x for x in xs]
        if len(xs) < 2:
            return f"{xs[0]:.1f}" if xs else "–"
        return (f"{statistics.fmean(xs):.1f} ± {statistics.stdev(xs):.1f} "
                f"({' / '.join(f'{x:.0f}' for x in xs)})")

    def per_split(f: Path) -> dict:
        return json.loads(f.read_text())["per_split"] if f.is_file() else {}

    def split_rate(f: Path, split: str):
        return per_split(f).get(split, {}).get("success_rate")

    def pooled(f: Path):  # success over every dev and test episode together
        r = per_split(f)
        if not ("dev" in r and "test" in r):
            return None
        n = r["dev"]["num_episodes"] + r["test"]["num_episodes"]
        return sum(r[sp]["success_rate"] * r[sp]["num_episodes"] for sp in ("dev", "test")) / n

    def curve(d: Path, start: Path) -> list[dict]:
        """Dev success against step: step 0 the start's evaluation, the last step the run's final one (both on
        the table's games), any --eval-steps rows of the run in between (on its --eval-games)."""
        rows = read_jsonl(d / "metrics.jsonl") if (d / "metrics.jsonl").is_file() else []
        last = max((r["step"] for r in rows if "step" in r), default=None)
        final = split_rate(d / "eval_agent.json", "dev")
        between = [r for r in rows if "eval_success" in r and (final is None or r["step"] < last)]
        points = between + ([dict(step=last, eval_success=final)] if final is not None and last else [])
        first = split_rate(start / "eval_agent.json", "dev")
        return ([dict(step=0, eval_success=first)] if points and points[0]["step"] > 0 and first is not None
                else []) + points

    def episodes(f: Path) -> int:
        return per_split(f).get("test", {}).get("num_episodes", 0)

    lines = ["| arm | dev success (%) | test success (%) | dev + test (%) | test episodes | seeds |",
             "|---|---|---|---|---|---|"]
    random_f = folder / "random" / "eval_agent.json"
    if random_f.is_file():
        r = per_split(random_f)
        lines.append(f"| uniform random admissible | {100 * r['dev']['success_rate']:.1f} ± "
                     f"{100 * r['dev']['success_rate_std']:.1f} | {100 * r['test']['success_rate']:.1f} ± "
                     f"{100 * r['test']['success_rate_std']:.1f} | {100 * pooled(random_f):.1f} | "
                     f"{episodes(random_f)} | {r['test']['num_episodes'] // r['test']['num_games']} |")
    curves, start = {}, dict(policy="base", rwml_policy="rwml", wm_sft_policy="wm_sft")
    for key, name in AGENT_ARMS:
        if key in ("base", "rwml"):  # one greedy evaluation: nothing to replicate
            f = folder / key / "eval_agent.json"
            cells = [pct([] if x is None else [x])
                     for x in (split_rate(f, "dev"), split_rate(f, "test"), pooled(f))]
            lines.append(f"| {name} | {' | '.join(cells)} | {episodes(f)} | – |")
            continue
        runs = [d / key for d in seeds]
        curves[name] = [curve(d, folder / start[key]) for d in runs]
        # the final evaluation's, where it played dev
        dev = [c[-1]["eval_success"] for c in curves[name] if c]
        done = [d for d in runs if (d / "eval_agent.json").is_file()]
        test = [split_rate(d / "eval_agent.json", "test") for d in done]
        both = [x for d in done if (x := pooled(d / "eval_agent.json")) is not None]
        lines.append(f"| {name} | {pct(dev)} | {pct(test)} | {pct(both)} | "
                     f"{episodes(done[0] / 'eval_agent.json') if done else 0} | "
                     f"{', '.join(d.parent.name[4:] for d in done) or '–'} |")
    if png is not None:
        plot_curves({name: [[(r["step"], 100 * r["eval_success"]) for r in c] for c in cs]
                     for name, cs in curves.items()},
                    png, xlabel="stage-2 step", ylabel="dev success (%), greedy",
                    title="stage 2 on TextWorld (choose mode): held-out dev games")
    return "\n".join(lines) + "\n"


def plot_curves(curves: dict[str, list[list[tuple[int, float]]]], png: Path, *, xlabel: str, ylabel: str,
                title: str) -> bool:
    """Held-out score against step, per arm: each seed's curve (thin) and, at the steps every seed has, their
    mean ± sd (bold, shaded). Returns whether there was anything to draw."""
    if not any(any(c) for cs in curves.values() for c in cs):
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for i, (name, cs) in enumerate(curves.items()):
        cs, color = [dict(c) for c in cs if c], f"C{i}"
        if not cs:
            continue
        for c in cs:
            ax.plot(list(c), list(c.values()), color=color, alpha=0.35, lw=0.8, marker="o", ms=2)
        steps = sorted(set.intersection(*(set(c) for c in cs)))
        mean = [statistics.fmean(c[x] for c in cs) for x in steps]
        sd = [statistics.stdev(c[x] for c in cs) if len(cs) > 1 else 0.0 for x in steps]
        ax.plot(steps, mean, color=color, lw=2, marker="o", ms=4,
                label=f"{name} (mean ± sd of {len(cs)} seeds)")
        ax.fill_between(steps, [m - d for m, d in zip(mean, sd)], [m + d for m, d in zip(mean, sd)],
                        color=color, alpha=0.15, lw=0)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.title.set_fontsize(9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        commands_help("eval.py", COMMANDS, "COMMAND", "`eval.py COMMAND --help`: that command's flags")
    if not argv or argv[0] not in COMMANDS:
        raise UserError(f"usage: python eval.py {{{','.join(COMMANDS)}}} [flags]; see python eval.py --help")
    command = argv[0]
    if command == "sanity":
        cfg, rest = parse_config(SanityConfig, argv[1:], prog="eval.py sanity",
                                 positional={"run": dict(help="the run folder of sanity.sh (runs/sanity)")})
        check_writable(Path(cfg.out), folder=False)
        text = sanity_report(Path(rest["run"]), cfg.split,
                             Path(cfg.out).with_name(Path(cfg.out).stem + "_curve.png"))
        Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(Path(cfg.out), text)
        print(text + f"-> {cfg.out}")
        return
    if command == "agent-table":
        cfg, rest = parse_config(AgentTableConfig, argv[1:], prog="eval.py agent-table",
                                 positional={"run": dict(help="the run folder of agent_sanity.sh "
                                                              "(runs/agent_sanity)")})
        out = Path(cfg.out)
        check_writable(out, folder=False)
        text = agent_report(Path(rest["run"]), out.with_name(out.stem + "_curve.png"))
        out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out, text)
        print(text + f"-> {out} (+ {out.stem}_curve.png)")
        return
    if command == "report":
        cfg, rest = parse_config(ReportConfig, argv[1:], prog="eval.py report",
                                 positional={"runs": dict(nargs="+",
                                                          help="run folders, one row each, in this order")})
        check_writable(Path(cfg.out), folder=False)
        print(report(cfg, rest["runs"]) + f"-> {cfg.out}")
        return
    config_cls = dict(agent=AgentEvalConfig, weights=WeightsConfig).get(command, WMEvalConfig)
    cfg, _ = parse_config(config_cls, argv[1:], prog=f"eval.py {command}")
    check_eval_config(cfg)
    check_context(cfg)
    check_adapter(cfg.adapter)
    out = Path(cfg.out)
    check_writable(out, folder=False)
    run = dict(agent=evaluate_agent, wm=wm_accuracy, calibrate=calibrate_tau, weights=evaluate_weights)
    if command == "wm" and cfg.baseline and cfg.baseline not in envs.BASELINES:
        raise UserError(f"unknown --baseline {cfg.baseline!r}; choose one of {', '.join(envs.BASELINES)}")
    result = run[command](cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    (write_eval if command == "wm" else lambda p, r: write_atomic(p, json.dumps(r, indent=2)))(out, result)
    if command == "agent":
        episodes_file(cfg).unlink(missing_ok=True)  # all in `out` now
    if command == "wm":
        beyond = result["per_kind"]["beyond_template"]
        print(f"{cfg.transitions} ({result['split'] or 'split unknown'}), {cfg.baseline or result['model']}: "
              f"wm_accuracy {result['wm_accuracy']:.3f}, "
              f"beyond the template rule {beyond['wm_accuracy']:.3f} "
              f"({beyond['n']} triplets), mean_cosine {result['mean_cosine']:.3f}, exact_match "
              f"{result['exact_match']:.3f}, format {result['format_rate']:.3f}, n {result['n']} -> {out} "
              f"(+ {out.stem}.triplets.jsonl)")
        return
    if command == "weights":
        print(f"parameters changed: {result['changed_share']:.4%} of {result['total']:,}; per module: "
              + ", ".join(f"{k} {v['changed_share']:.2%}" for k, v in result["per_module"].items())
              + f" -> {out}")
        return
    if command == "calibrate":
        print(f"{'tau_d':>6} {'mean reward':>12} {'groups all equal':>17}   ({result['n']} triplets x "
              f"{result['num_generations']} predictions) -> {out}")
        first, *rows = result["rows"]
        for r in rows:
            print(f"{r['tau_d']:>6.2f} {r['mean_reward']:>12.3f} {r['frac_groups_all_equal']:>17.3f}")
        print(f"predictions with a <next_state>: {first['format_rate']:.3f}, "
              f"mean cosine {first['mean_cosine']:.3f}")
        return
    if result.get("env") == "tau2":
        print(f"tau2 {result['domain']} ({result['split']}, {result['num_tasks']} tasks x {cfg.seeds} "
              "seeds): average reward "
              f"{result['average_reward']:.3f} (std {result['average_reward_std']:.3f}), "
              + ", ".join(f"pass^{k} {v:.3f}" for k, v in result["pass_hat_k"].items())
              + f", invalid tool calls {result['invalid_tool_call_rate']:.1%} of {result['tool_calls']}"
              + (f", customer's invalid tool calls {result['user_invalid_tool_call_rate']:.1%} of "
                 f"{result['user_tool_calls']}" if result["domain"] == "telecom" else "")
              + f", format errors {result['format_error_rate']:.1%}, {result['num_episodes']} conversations "
              f"in {result['seconds']:.0f} s -> {out}")
        return
    for sp, r in result["per_split"].items():
        if len(result["per_split"]) > 1:
            print(f"  {sp}: success {r['success_rate']:.1%} (std {r['success_rate_std']:.1%}), "
                  f"invalid actions {r['invalid_action_rate']:.1%}, {r['num_episodes']} episodes")
    print(f"{result['split']}: success {result['success_rate']:.1%} (std {result['success_rate_std']:.1%} "
          f"over {result['config']['seeds']} seeds), invalid actions {result['invalid_action_rate']:.1%}, "
          f"inefficient {result['inefficient_action_rate']:.1%}, mean steps {result['mean_steps']:.1f}, "
          f"{result['num_episodes']} episodes in {result['seconds']:.0f} s -> {out}")


if __name__ == "__main__":
    run_cli(main)
