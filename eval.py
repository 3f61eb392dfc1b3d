"""Evaluation (METHOD.md §8).

    python eval.py agent --split valid_seen --num-games 10 --max-turns 30 --seeds 3 --out results.json
    python eval.py agent --adapter runs/rwml/wm/adapter ...   # a peft adapter on top of the base model

agent: ALFWorld success rate on valid_seen (in distribution) or valid_unseen (out of distribution), with
the paper's action-quality shares, per task type, mean and std over seeds (the paper: 3 runs).
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import envs
import rwml
from envs import UserError
from train import parse_config, write_atomic

COMMANDS = ("agent",)


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
    batch_size: int = 10
    num_workers: int = 2
    out: str = "results.json"


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
                             top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size,
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
    cfg, _ = parse_config(AgentEvalConfig, argv[1:], prog="eval.py agent")
    result = evaluate_agent(cfg)
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, json.dumps(result, indent=2))
    print(f"{cfg.split}: success {result['success_rate']:.1%} (std {result['success_rate_std']:.1%} over "
          f"{cfg.seeds} seeds), invalid actions {result['invalid_action_rate']:.1%}, inefficient "
          f"{result['inefficient_action_rate']:.1%}, mean steps {result['mean_steps']:.1f}, "
          f"{result['num_episodes']} episodes in {result['seconds']:.0f} s -> {out}")


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit("interrupted")
