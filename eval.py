"""Evaluation (METHOD.md §8): the agent's success, the world model's accuracy, the weight change.

    python eval.py agent --split valid_seen --num-games 10 --seeds 3 [--adapter DIR] --out res.json
    python eval.py wm --transitions FILE [--adapter DIR | --baseline template] --out wm.json
    python eval.py weights --adapter DIR --out weights.json

agent: success and the paper's action-quality shares per task type, mean and std over seeds
(tau2, `--env tau2 --domain retail --num-tasks N`: average reward, pass^k); each episode goes to
<out>.episodes.jsonl once played: a rerun plays only the rest. wm: r_WM = 1 share, mean cosine,
exact match, per observation kind, beyond the template rule. weights: the weight-change share.
"""
from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import engine
import envs
import rwml
from reward import make_reward
from stages.settings import (AdapterArgs, FilterArgs, ModelArgs, PlayArgs, RWMLArgs, SamplingArgs,
                              WorldArgs, WorldModelArgs)
from harness.cli import check_fields, commands_help, parse_config, run_cli
from harness.common import again, arg, names, stored_config, write_atomic
from envs import UserError
from stages.plumbing import (check_adapter, check_cache, check_context, check_play, check_writable,
                             episode_log, finished_episodes, random_policy, read_transitions,
                             recorded, sample_triplets, triplet_problem, triplets_env, write_eval)

COMMANDS = dict(  # name -> its line in `eval.py --help`
    agent="success rate of the model (+ adapter) playing held-out games, over seeds",
    wm="world-model accuracy on held-out triplets (or of a content-free --baseline)",
    weights="the paper's weight-change measure of an adapter against its base model")
ADAPTER_HELP = "a peft adapter on top of the base model"


@dataclass
class AgentEvalConfig(PlayArgs, WorldArgs):
    """The agent's settings of train.py, with the paper's evaluation protocol as defaults."""
    _argument_group_name = "eval.py agent: the model, the games, the protocol"
    model: str = again(ModelArgs, "model")
    adapter: str | None = again(AdapterArgs, "adapter", help=ADAPTER_HELP)
    env: str = again(ModelArgs, "env")
    seed: int = again(ModelArgs, "seed")
    split: str | None = again(PlayArgs, "split", None, "ALFWorld: valid_seen (ID, the default), "
                              "valid_unseen (OOD) or both: a,b; elsewhere its class's eval_split")
    num_games: int | None = again(PlayArgs, "num_games", None, "per split; None = the whole split "
                                  "(140 seen, 134 unseen)")
    num_tasks: int | None = again(WorldArgs, "num_tasks", None, "tau2: None = the whole split "
                                  "(test: retail 40, telecom 40, airline 20)")
    max_turns: int = again(PlayArgs, "max_turns", 30)
    max_new_tokens: int = again(PlayArgs, "max_new_tokens", 128)
    num_envs: int = again(WorldArgs, "num_envs", 10)
    temperature: float = again(SamplingArgs, "temperature", 0.7, "the agent's (0 = greedy)")
    top_p: float = again(SamplingArgs, "top_p")
    seeds: int = arg(3, "runs of every game; mean and std over them (seed: games, draws)", min=1)
    policy: str = arg("model", "or random: a uniform admissible command each turn (a baseline; "
                               "no model loads)", choices=("model", "random"), part_of="episodes")
    sampled: bool = arg(False, "choose mode: draw at --temperature (stage 2's policy), --seeds "
                               "episodes per game; off: greedy, one per game", part_of="episodes")
    out: str = arg("results.json", "the result file (its episodes inside)")


@dataclass
class WMEvalConfig(WorldModelArgs):
    """The world model's settings of train.py, on a transitions file."""
    _argument_group_name = "eval.py wm: the model and the held-out triplets"
    model: str = again(ModelArgs, "model")
    adapter: str | None = again(AdapterArgs, "adapter", help=ADAPTER_HELP)
    seed: int = again(ModelArgs, "seed")
    transitions: str | None = again(FilterArgs, "transitions", help="held-out transitions.jsonl "
                                    "(from `train.py collect --split valid_unseen`)")
    eval_max_triplets: int = again(RWMLArgs, "eval_max_triplets", help="held-out triplets scored, "
                                   "a seeded sample (0 = all)")
    eval_samples: int = again(RWMLArgs, "eval_samples")
    temperature: float = again(SamplingArgs, "temperature", help="the predictions' (train.py's)")
    baseline: str | None = arg(None, "a content-free rule to score", choices=envs.BASELINES)
    out: str = arg("wm.json", "the result file (each triplet's outputs: wm.triplets.jsonl)")


@dataclass
class WeightsConfig:
    _argument_group_name = "eval.py weights"
    adapter: str | None = again(AdapterArgs, "adapter", help="the peft adapter to measure")
    model: str = again(ModelArgs, "model", help="its base model")
    rel: float = arg(1e-3, "a parameter changed iff |w' - w| > rel * max(|w|, |w'|) (the paper: "
                           "1e-3)", check=lambda v: v >= 0, why="must be 0 or more")
    out: str = arg("weights.json", "the result file")


def check_agent(cfg: AgentEvalConfig) -> None:
    """What `eval.py agent` needs of its settings together, before anything loads."""
    if cfg.policy == "random" and cfg.env == "tau2":
        raise UserError("--policy random draws among a turn's admissible commands, and tau2 has no "
                        "such list; use --policy model with --env tau2")
    check_play(cfg)
    if cfg.split is not None and not cfg.split.replace(",", "").strip():
        raise UserError(f"--split {cfg.split!r}: names no split; e.g. valid_seen,valid_unseen")


def wm_accuracy(cfg: WMEvalConfig) -> dict:
    """`eval.py wm`: rwml.evaluate_wm on a transitions file, the base model or base + adapter."""
    import torch

    cfg = with_env_defaults(cfg)
    trips = read_transitions(cfg.transitions, triplet_problem(cfg))
    trips = sample_triplets(trips, cfg.eval_max_triplets, 0)  # seed 0: every run scores the same
    reward_fn = make_reward(cfg)
    info = dict(transitions=cfg.transitions, split=collection_split(cfg.transitions),
                config=asdict(cfg))
    if cfg.baseline:
        return dict(baseline_wm(cfg.baseline, trips, reward_fn), **info)
    model, tok = engine.load_model(cfg.model, cfg.adapter)
    torch.manual_seed(cfg.seed)  # as train.py's before / after evaluation
    result = rwml.evaluate_wm(model, tok, trips, reward_fn, reasoning=cfg.wm_reasoning,
                              max_new_tokens=cfg.max_completion_length, samples=cfg.eval_samples,
                              temperature=cfg.temperature)
    return dict(result, model=cfg.adapter or cfg.model, **info)


def collection_split(transitions: str, key: str = "split", default=None):
    """The split (or `key`) a transitions file was collected with, from its collect.json."""
    meta = Path(transitions).with_name("collect.json")
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return json.loads(meta.read_text()).get(key, default)
    return default


def with_env_defaults(cfg: WMEvalConfig) -> WMEvalConfig:
    """Unset tau_d and cap: the triplets' environment's (absent: alfworld), as train.py's."""
    env = envs.env_class(triplets_env(cfg.transitions) or "alfworld")
    unset = {k: getattr(env, k) for k in envs.ENV_DEFAULTS if getattr(cfg, k) is None}
    return replace(cfg, **unset)


# -------------------------------- the world model beside the content-free baselines, held out
HELDOUT_KINDS = ("explore", "purposeful")  # the collection policy's triplets; the walkthroughs'


def baseline_wm(name: str, triplets: list[dict], reward_fn) -> dict:
    """A content-free baseline (`envs.baseline_prediction`) scored as a model is."""
    preds = [f"<next_state>{envs.baseline_prediction(name, t)}</next_state>" for t in triplets]
    return dict(envs.score_wm(triplets, preds, reward_fn), samples=0, temperature=0.0, model=name)


def baselines_line(cfg, out: Path, kind: str, trips: list[dict], file: str, reward_fn) -> dict:
    """The model-free baselines' scores on a held-out set: wm_eval_<rule>_<kind>.json, one line."""
    rules = {name: baseline_wm(name, trips, reward_fn) for name in envs.BASELINES}
    for name, r in rules.items():
        write_eval(out / f"wm_eval_{name}_{kind}.json",
                   dict(r, split=cfg.heldout_split, transitions=file))
    each = (f"{envs.BASELINES[n]} {r['wm_accuracy']:.3f} / {r['exact_match']:.3f}"
            for n, r in rules.items())
    print(f"{kind} ({file}): model-free baselines, reward / exact match: " + ", ".join(each))
    return rules


PROBE_ARMS = ("template", "rule_copy", "tracker")


def probe_line(out: Path, start) -> str:
    """The state probes by type: start -> RWML, beside the rule, rule + copy, the tracker."""
    got = {a: json.loads((out / f"wm_eval_{a}_state.json").read_text())
           for a in ("before", "rwml", *PROBE_ARMS)}

    def cell(p: str | None) -> str:
        r = {a: (g["per_probe"][p] if p else g) for a, g in got.items()}
        arms = ", ".join(f"{r[a]['exact_match']:.2f}" for a in PROBE_ARMS)
        return (f"{p or 'all'} ({r['rwml']['n']}) {r['before']['exact_match']:.2f} -> "
                f"{r['rwml']['exact_match']:.2f} | {arms}")
    name = "the warm-up" if start else "the base model"
    return (f"state probes, exact match by type: {name} -> RWML | the rule, rule + copy, the "
            "tracker: " + "; ".join(cell(p) for p in [*got["rwml"].get("per_probe", {}), None]))


def before_after_line(before: dict, after: dict) -> str:
    change_b, change_a = before["per_kind"]["change"], after["per_kind"]["change"]
    beyond_b, beyond_a = before["per_kind"]["beyond_template"], after["per_kind"]["beyond_template"]
    return (f"world-model accuracy {before['wm_accuracy']:.3f} -> {after['wm_accuracy']:.3f} "
            f'({before["n"]} triplets); without "Nothing happens." {change_b["wm_accuracy"]:.3f} '
            f"-> {change_a['wm_accuracy']:.3f} ({change_b['n']}); beyond the template rule "
            f"{beyond_b['wm_accuracy']:.3f} -> {beyond_a['wm_accuracy']:.3f} ({beyond_b['n']}); "
            f"mean cosine {before['mean_cosine']:.3f} -> {after['mean_cosine']:.3f}; strict: exact "
            f"match {before['exact_match']:.3f} -> {after['exact_match']:.3f}, item F1 "
            f"{_f1(before)} -> {_f1(after)} ({before['item_n']} listing targets)")


def _f1(r: dict) -> str:
    return "-" if r.get("item_f1") is None else f"{r['item_f1']:.3f}"


# ----------------------------------------------------------------------------- the agent
def agent_metrics(episodes: list[dict]) -> dict:
    """Success and action-quality rates of episode summaries (as `rwml.play` returns them)."""
    steps, invalid = sum(e["steps"] for e in episodes) or 1, sum(e["invalid"] for e in episodes)
    inefficient = sum(e["inefficient"] for e in episodes)
    return dict(success_rate=sum(e["won"] for e in episodes) / max(len(episodes), 1),
                invalid_action_rate=invalid / steps,  # invalid command or format error, per action
                format_error_rate=sum(e["format_errors"] for e in episodes) / steps,
                inefficient_action_rate=inefficient / steps,  # look / examine / inventory / help
                invalid_or_inefficient_rate=(invalid + inefficient) / steps,  # the paper's share
                mean_steps=sum(e["steps"] for e in episodes) / max(len(episodes), 1),
                num_episodes=len(episodes))


def _summarize(episodes: list[dict], seeds: int) -> dict:
    result = agent_metrics(episodes)
    per_seed = [agent_metrics([e for e in episodes if e["seed"] == s]) for s in range(seeds)]
    for key in ("success_rate", "invalid_action_rate", "inefficient_action_rate", "mean_steps"):
        result[key + "_std"] = statistics.pstdev([m[key] for m in per_seed])  # spread over seeds
    types = {e["task_type"] for e in episodes}
    result["per_task_type"] = {t: agent_metrics([e for e in episodes if e["task_type"] == t])
                               for t in envs.TASK_TYPES if t in types}
    result["per_seed"] = per_seed
    return result


def evaluate_agent(cfg: AgentEvalConfig) -> dict:
    """Every game (tau2: task) of the split(s), `seeds` times, in one batched `rwml.play`."""
    import torch

    is_tau2 = cfg.env == "tau2"
    mode = "random" if cfg.policy == "random" else cfg.action_mode
    if mode == "choose" and cfg.seeds > 1 and not cfg.sampled:  # greedy: every seed plays the same
        print(f"eval: --action-mode choose evaluates greedily, so every seed plays the same "
              f"episodes; 1 seed, not {cfg.seeds}")
        cfg = replace(cfg, seeds=1)
    split = cfg.split or envs.env_class(cfg.env).eval_split
    splits = [s.strip() for s in split.split(",") if s.strip()]
    num = cfg.num_tasks if is_tau2 else cfg.num_games
    sizes = (cfg.world_size, cfg.nb_objects, cfg.quest_length)
    games = {sp: envs.games(cfg.env, sp, num, cfg.seed, cfg.domain, sizes) for sp in splits}
    t0 = time.time()
    key = ["episodes", "collect", *(f"collect:{e}" for e in envs.ENVIRONMENTS)]  # and more
    log, job = Path(cfg.out + ".episodes.jsonl"), {k: recorded(cfg)[k] for k in names(cfg, *key)}
    done = finished_episodes(log, job)  # an interrupted run's
    # a game's episodes side by side: they start in one state, scored once (choose.choose_actions)
    every = [dict(game=g, split=sp, seed=s)
             for sp in splits for g in games[sp] for s in range(cfg.seeds)]
    key = lambda ep: (ep["split"], ep["seed"], envs.game_name(ep["game"]))  # noqa: E731
    todo = [ep for ep in every if key(ep) not in done]
    if todo:
        with envs.make(cfg.env, domain=cfg.domain, num_workers=cfg.num_workers,
                       max_turns=cfg.max_turns, at_once=min(cfg.num_envs, len(todo)),
                       user_model=cfg.user_model) as env:
            # after make: game workers fork without it; the random policy needs none
            model, tok = (engine.load_model(cfg.model, cfg.adapter) if mode != "random"
                          else (None, None))
            seed = cfg.seed + len(done)
            torch.manual_seed(seed)
            with episode_log(log, job, done) as on_episode:
                played = rwml.play(  # all seeds and splits in one call: bigger batches
                    model, tok, env, todo, history_len=cfg.history_len, top_p=cfg.top_p,
                    temperature=0.0 if mode == "choose" and not cfg.sampled else cfg.temperature,
                    max_new_tokens=cfg.max_new_tokens, num_envs=cfg.num_envs, seed=seed,
                    desc=f"eval {cfg.domain if is_tau2 else ','.join(splits)}",
                    actor=envs.load(rwml.ACTORS[mode]), on_episode=on_episode)
        done.update(((e["split"], e["seed"], e["game"]), e) for e in played)
    episodes = [done[key(ep)] for ep in every]
    if is_tau2:
        metrics = envs.load("worlds.tau2:tau2_metrics")  # tau2-bench's, loaded by name
        result = dict(metrics(episodes, games[splits[0]], cfg.seeds), env="tau2", domain=cfg.domain)
    else:
        result = _summarize(episodes, cfg.seeds)
        result["per_split"] = {
            sp: dict(_summarize([e for e in episodes if e["split"] == sp], cfg.seeds),
                     num_games=len(games[sp])) for sp in splits}
    result.update(split=",".join(splits), num_games=sum(map(len, games.values())),
                  seconds=round(time.time() - t0, 1), config=recorded(cfg), episodes=episodes)
    return result


# ----------------------------------------------------------------------------- weight change
MODULE_TYPES = (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"), ("o_proj", "o"), ("mlp", "mlp"))


def weight_change(before: dict, after: dict, rel: float = 1e-3) -> dict:
    """Share of parameters with |w' - w| > rel * max(|w|, |w'|): overall, per module type
    (q/k/v/o/mlp/other) and per layer (`layers.N.`; "other": embeddings, final norm, head)."""
    import re

    import torch

    total, per_module, per_layer = [0, 0], defaultdict(lambda: [0, 0]), defaultdict(lambda: [0, 0])
    for name, w in before.items():
        if name not in after:
            raise UserError(f"parameter {name} is missing after merging; is the adapter for this "
                            "base model?")
        w, w2 = w.float(), after[name].float()
        changed = int(((w2 - w).abs() > rel * torch.maximum(w.abs(), w2.abs())).sum())
        m = re.search(r"layers\.(\d+)\.", name)
        kind = next((t for key, t in MODULE_TYPES if key in name), "other")
        for counts in (total, per_module[kind], per_layer[m.group(1) if m else "other"]):
            counts[0] += changed
            counts[1] += w.numel()

    def share(c):
        return dict(changed_share=c[0] / max(c[1], 1), changed=c[0], total=c[1])

    layers = sorted(per_layer, key=lambda k: (k == "other", int(k) if k.isdigit() else 0))
    kinds = [k for k in [t for _, t in MODULE_TYPES] + ["other"] if k in per_module]
    return dict(share(total), rel=rel, per_module={k: share(per_module[k]) for k in kinds},
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


def summary(r: dict, cfg, out: Path) -> str:
    """The line `eval.py` prints at its end."""
    if "wm_accuracy" in r:
        beyond, f1 = r["per_kind"]["beyond_template"], r["item_f1"]
        return (f"{cfg.transitions} ({r['split'] or 'split unknown'}), "
                f"{cfg.baseline or r['model']}: wm_accuracy {r['wm_accuracy']:.3f}, beyond the "
                f"template rule {beyond['wm_accuracy']:.3f} ({beyond['n']} triplets), mean_cosine "
                f"{r['mean_cosine']:.3f}; strict: exact_match {r['exact_match']:.3f}, item_f1 "
                f"{'-' if f1 is None else f'{f1:.3f}'} ({r['item_n']} listing targets); format "
                f"{r['format_rate']:.3f}, n {r['n']} -> {out} (+ {out.stem}.triplets.jsonl)")
    if "changed_share" in r:
        modules = ", ".join(f"{k} {v['changed_share']:.2%}" for k, v in r["per_module"].items())
        return (f"parameters changed: {r['changed_share']:.4%} of {r['total']:,}; per module: "
                f"{modules} -> {out}")
    if r.get("env") == "tau2":
        return envs.load("worlds.tau2:tau2_summary")(r, cfg.seeds) + f" -> {out}"
    splits = [f"  {sp}: success {x['success_rate']:.1%} (std {x['success_rate_std']:.1%}), "
              f"invalid actions {x['invalid_action_rate']:.1%}, {x['num_episodes']} episodes\n"
              for sp, x in r["per_split"].items() if len(r["per_split"]) > 1]
    return "".join(splits) + (
        f"{r['split']}: success {r['success_rate']:.1%} (std {r['success_rate_std']:.1%} "
        f"over {r['config']['seeds']} seeds), invalid actions {r['invalid_action_rate']:.1%}, "
        f"inefficient {r['inefficient_action_rate']:.1%}, mean steps {r['mean_steps']:.1f}, "
        f"{r['num_episodes']} episodes in {r['seconds']:.0f} s -> {out}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        commands_help("eval.py", COMMANDS, "COMMAND", "`eval.py COMMAND --help`: its flags")
    if not argv or argv[0] not in COMMANDS:
        raise UserError(f"usage: python eval.py {{{','.join(COMMANDS)}}} [flags]; see --help")
    command = argv[0]
    config_cls = dict(agent=AgentEvalConfig, wm=WMEvalConfig, weights=WeightsConfig)[command]
    cfg, _ = parse_config(config_cls, argv[1:], prog=f"eval.py {command}",
                          settle=random_policy if command == "agent" else None)
    check_fields(cfg)
    cfg = with_env_defaults(cfg) if command == "wm" else cfg
    check_cache(cfg)
    if command == "agent":
        check_agent(cfg)
    check_context(cfg)
    check_adapter(cfg.adapter)
    out = Path(cfg.out)
    check_writable(out, folder=False)
    result = dict(agent=evaluate_agent, wm=wm_accuracy, weights=evaluate_weights)[command](cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    if command == "wm":
        write_eval(out, result)  # + each triplet's outputs beside it
    else:  # paths relative to the repository, or <path>
        write_atomic(out, json.dumps(stored_config(result), indent=2))
    if command == "agent":
        Path(cfg.out + ".episodes.jsonl").unlink(missing_ok=True)  # all in `out` now
    print(summary(result, cfg, out))


if __name__ == "__main__":
    run_cli(main)
