"""Evaluation (METHOD.md §8).

    python eval.py agent --split valid_seen --num-games 10 --max-turns 30 --seeds 3 --out results.json
    python eval.py agent --adapter runs/rwml/adapter ...      # a peft adapter on top of the base model
    python eval.py wm --transitions FILE [--adapter DIR] --out wm.json
    python eval.py calibrate --transitions FILE --out calibrate.json

agent: ALFWorld success rate on valid_seen (in distribution) or valid_unseen (out of distribution), with
the paper's action-quality shares, per task type, mean and std over seeds (the paper: 3 runs).
wm: world-model accuracy on held-out triplets (share with r_WM = 1, mean cosine, exact match), base
model or base + adapter; use triplets collected on games never trained on (valid_seen / valid_unseen).
calibrate: for candidate tau_d, the base model's mean reward and the share of GRPO groups whose rewards
are all equal (no learning signal), from sampled world-model predictions on real triplets.
"""
from __future__ import annotations

import json
import random
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
from reward import BUNDLED_EMBEDDER, SimToRealReward, calibrate
from train import parse_config, read_transitions, run_cli, write_atomic

COMMANDS = ("agent", "wm", "calibrate")


@dataclass
class AgentEvalConfig:
    model: str = rwml.BUNDLED_MODEL
    adapter: str | None = None
    split: str = "valid_seen"  # valid_seen = in distribution, valid_unseen = out of distribution
    num_games: int | None = None  # None = the whole split (140 seen, 134 unseen)
    seeds: int = 3  # independent runs of every game; reported as mean and std
    seed: int = 0  # draws the game subset and the sampling
    max_turns: int = 30
    history_len: int = 2
    temperature: float = 0.7
    top_p: float = 1.0
    max_new_tokens: int = 128
    num_envs: int = 10  # episodes played (and generated for) together
    num_workers: int = 2
    out: str = "results.json"


@dataclass
class WMEvalConfig:
    transitions: str | None = None  # held-out transitions.jsonl (from `train.py collect --split valid_seen`)
    model: str = rwml.BUNDLED_MODEL
    adapter: str | None = None
    embedder: str = BUNDLED_EMBEDDER
    tau_d: float = 0.1
    max_triplets: int = 0  # 0 = all; else a seeded sample
    max_completion_length: int = 96
    wm_reasoning: bool = True  # as in train.Config
    num_generations: int = 4  # calibrate: predictions per prompt (a GRPO group)
    seed: int = 0
    out: str = "wm.json"


def _sample(trips: list[dict], n: int, seed: int) -> list[dict]:
    if not n or n >= len(trips):
        return trips
    return [trips[i] for i in sorted(random.Random(seed).sample(range(len(trips)), n))]


def evaluate_wm(cfg: WMEvalConfig) -> dict:
    trips = _sample(read_transitions(cfg.transitions), cfg.max_triplets, cfg.seed)
    reward_fn = SimToRealReward(cfg.embedder, cfg.tau_d)
    model, tok = rwml.load_model(cfg.model, cfg.adapter)
    result = rwml.evaluate_wm(model, tok, trips, reward_fn, max_new_tokens=cfg.max_completion_length,
                              reasoning=cfg.wm_reasoning)
    return dict(result, transitions=cfg.transitions, config=asdict(cfg))


def calibrate_tau(cfg: WMEvalConfig) -> dict:
    """Sample num_generations world-model predictions per triplet at temperature 1, then tabulate."""
    import torch

    trips = _sample(read_transitions(cfg.transitions), cfg.max_triplets or 32, cfg.seed)
    reward_fn = SimToRealReward(cfg.embedder, cfg.tau_d)
    model, tok = rwml.load_model(cfg.model, cfg.adapter)
    torch.manual_seed(cfg.seed)
    groups = []
    for i in tqdm(range(0, len(trips), 4), desc="calibrate", unit="batch", dynamic_ncols=True):
        roll = rwml.sample_group(model, tok, [rwml.wm_prompt(t, cfg.wm_reasoning) for t in trips[i:i + 4]],
                                 num_generations=cfg.num_generations, max_completion_length=cfg.max_completion_length,
                                 prefix=rwml.WM_PREFIX if cfg.wm_reasoning else "")
        texts = roll["texts"]
        groups += [texts[j:j + cfg.num_generations] for j in range(0, len(texts), cfg.num_generations)]
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


def evaluate_agent(cfg: AgentEvalConfig) -> dict:
    import torch

    if cfg.seeds < 1:
        raise UserError(f"--seeds must be at least 1, got {cfg.seeds}")
    games = envs.list_games(cfg.split, cfg.num_games, cfg.seed)
    t0 = time.time()
    with envs.EnvPool(cfg.num_workers, cfg.max_turns) as pool:
        model, tok = rwml.load_model(cfg.model, cfg.adapter)
        torch.manual_seed(cfg.seed)
        # all seeds in one call: bigger generation batches; each episode keeps its seed for the stats
        episodes = rwml.play(model, tok, pool, [dict(game=g, seed=s) for s in range(cfg.seeds) for g in games],
                             history_len=cfg.history_len, max_turns=cfg.max_turns, temperature=cfg.temperature,
                             top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens, num_envs=cfg.num_envs,
                             desc=f"eval {cfg.split}")
    per_seed = [agent_metrics([e for e in episodes if e["seed"] == s]) for s in range(cfg.seeds)]
    result = agent_metrics(episodes)
    for key in ("success_rate", "invalid_action_rate", "inefficient_action_rate", "mean_steps"):
        result[key + "_std"] = _mean_std([m[key] for m in per_seed])[1]  # spread over seeds
    by_type = defaultdict(list)
    for e in episodes:
        by_type[e["task_type"]].append(e)
    result["per_task_type"] = {t: agent_metrics(by_type[t]) for t in envs.TASK_TYPES if t in by_type}
    result.update(per_seed=per_seed, split=cfg.split, num_games=len(games), seconds=round(time.time() - t0, 1),
                  config=asdict(cfg), episodes=episodes)
    return result


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        raise UserError(f"usage: python eval.py {{{','.join(COMMANDS)}}} [flags]; see python eval.py agent --help")
    command = argv[0]
    cfg, _ = parse_config(AgentEvalConfig if command == "agent" else WMEvalConfig, argv[1:], prog=f"eval.py {command}")
    result = dict(agent=evaluate_agent, wm=evaluate_wm, calibrate=calibrate_tau)[command](cfg)
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, json.dumps(result, indent=2))
    if command == "wm":
        print(f"wm_accuracy {result['wm_accuracy']:.3f}, mean_cosine {result['mean_cosine']:.3f}, exact_match "
              f"{result['exact_match']:.3f}, format {result['format_rate']:.3f}, n {result['n']} -> {out}")
        return
    if command == "calibrate":
        print(f"{'tau_d':>6} {'mean reward':>12} {'groups all equal':>17}   ({result['n']} triplets x "
              f"{result['num_generations']} predictions) -> {out}")
        first, *rows = result["rows"]
        for r in rows:
            print(f"{r['tau_d']:>6.2f} {r['mean_reward']:>12.3f} {r['frac_groups_all_equal']:>17.3f}")
        print(f"predictions with a <next_state>: {first['format_rate']:.3f}, mean cosine {first['mean_cosine']:.3f}")
        return
    print(f"{cfg.split}: success {result['success_rate']:.1%} (std {result['success_rate_std']:.1%} over "
          f"{cfg.seeds} seeds), invalid actions {result['invalid_action_rate']:.1%}, inefficient "
          f"{result['inefficient_action_rate']:.1%}, mean steps {result['mean_steps']:.1f}, "
          f"{result['num_episodes']} episodes in {result['seconds']:.0f} s -> {out}")


if __name__ == "__main__":
    run_cli(main)
