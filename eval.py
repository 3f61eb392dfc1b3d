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
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm.auto import tqdm

import engine
import envs
import rwml
import worlds
from envs import UserError
from plumbing import (check_adapter, check_at_least, check_context, check_seeds, check_writable,
                      commands_help, parse_config, read_jsonl, read_transitions, run_cli, sample_triplets,
                      wm_prompt_fits, write_atomic, write_eval, write_jsonl)
from reward import calibrate
from train import AgentConfig, ModelConfig, WorldModelConfig, check_choices, make_reward

COMMANDS = {  # name -> its line in `eval.py --help`
    "agent": "success rate of the model (+ adapter) playing held-out games, over seeds",
    "wm": "world-model accuracy on held-out triplets (or of a content-free --baseline)",
    "calibrate": "for candidate tau_d: mean reward and share of all-equal GRPO groups",
    "weights": "the paper's weight-change measure of an adapter against its base model",
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
    model: str = engine.BUNDLED_MODEL  # its base model
    rel: float = 1e-3  # a parameter changed iff |w' - w| > rel * max(|w|, |w'|) (the paper: 1e-3)
    out: str = "weights.json"


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
    model, tok = engine.load_model(cfg.model, cfg.adapter)
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
    model, tok = engine.load_model(cfg.model, cfg.adapter)
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
                pass_hat_k={k: worlds.pass_hat_k(trials, k) for k in range(1, seeds + 1)},
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
            model, tok = engine.load_model(cfg.model, cfg.adapter) if mode != "random" else (None, None)
            user = engine.load_model(cfg.user_model) if cfg.user_model else (None, None)
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

    model, _ = engine.load_model(cfg.model, device="cpu")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    merged = PeftModel.from_pretrained(model, cfg.adapter).merge_and_unload()
    result = weight_change(before, dict(merged.named_parameters()), cfg.rel)
    return dict(result, adapter=cfg.adapter, model=cfg.model)


ID_SPLIT, OOD_SPLIT = "valid_seen", "valid_unseen"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        commands_help("eval.py", COMMANDS, "COMMAND", "`eval.py COMMAND --help`: that command's flags")
    if not argv or argv[0] not in COMMANDS:
        raise UserError(f"usage: python eval.py {{{','.join(COMMANDS)}}} [flags]; see python eval.py --help")
    command = argv[0]
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
