"""Lab: tau_d's calibration (was `eval.py calibrate`), `python lab/calibrate.py --transitions FILE --out F`.
For candidate tau_d: the mean reward of the model's (+ adapter's) world-model predictions on real triplets,
num_generations per triplet, and the share of GRPO groups whose rewards are all equal (no learning signal)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo's modules

import json
from dataclasses import asdict, dataclass

from tqdm.auto import tqdm

import engine
import rwml
from harness.cli import check_fields, parse_config, run_cli
from harness.common import arg, write_atomic
from eval import WMEvalConfig, with_env_defaults
from stages.plumbing import check_adapter, check_context, check_writable, read_transitions, sample_triplets
from repo_path import repo_path, stored_config
from envs import parse_next_state
from reward import SimToRealReward, make_reward
from stages.plumbing import triplet_problem


@dataclass
class CalibrateConfig(WMEvalConfig):
    num_generations: int = arg(4, "predictions per prompt (a GRPO group)", min=1)


def calibrate(reward: SimToRealReward, predictions: list[list[str]], targets: list[str],
              taus=(0.05, 0.1, 0.15, 0.2, 0.3, 0.4)) -> list[dict]:
    """Per candidate tau_d: the mean reward and the share of GRPO groups whose rewards are all equal; first,
    the share of predictions with a parseable <next_state> and their mean cosine."""
    flat = [p for group in predictions for p in group]
    flat_targets = [t for group, t in zip(predictions, targets) for _ in group]
    preds = [parse_next_state(p) for p in flat]
    sims = reward.similarity(preds, flat_targets)
    rows = [dict(tau_d=None, format_rate=sum(p is not None for p in preds) / max(len(preds), 1),
                 mean_cosine=sum(sims) / max(len(sims), 1))]
    for tau in taus:
        r = [1.0 if p and 1.0 - s < tau else 0.0 for p, s in zip(preds, sims)]
        flat_r = iter(r)
        groups = [[next(flat_r) for _ in g] for g in predictions]
        rows.append(dict(tau_d=tau, mean_reward=sum(r) / max(len(r), 1),
                         frac_groups_all_equal=sum(len(set(g)) <= 1 for g in groups) / max(len(groups), 1)))
    return rows


def calibrate_tau(cfg: CalibrateConfig) -> dict:
    import torch

    cfg = with_env_defaults(cfg)
    trips = sample_triplets(read_transitions(cfg.transitions, triplet_problem(cfg)),
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
    return dict(rows=rows, n=len(trips), num_generations=cfg.num_generations,
                config=stored_config(asdict(cfg)))  # its paths relative to the repository, or <path>


def main(argv: list[str] | None = None) -> None:
    cfg, _ = parse_config(CalibrateConfig, sys.argv[1:] if argv is None else argv, prog="lab/calibrate.py")
    cfg = with_env_defaults(cfg)
    check_fields(cfg)
    check_context(cfg)
    check_adapter(cfg.adapter)
    out = Path(cfg.out)
    check_writable(out, folder=False)
    result = calibrate_tau(cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, json.dumps(result, indent=2))
    print(f"{'tau_d':>6} {'mean reward':>12} {'groups all equal':>17}   ({result['n']} triplets x "
          f"{result['num_generations']} predictions) -> {repo_path(out, None)}")
    first, *rows = result["rows"]
    for r in rows:
        print(f"{r['tau_d']:>6.2f} {r['mean_reward']:>12.3f} {r['frac_groups_all_equal']:>17.3f}")
    print(f"predictions with a <next_state>: {first['format_rate']:.3f}, "
          f"mean cosine {first['mean_cosine']:.3f}")


if __name__ == "__main__":
    run_cli(main)
