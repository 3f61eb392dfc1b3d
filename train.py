"""RWML training entry point: one typed config, one function per stage.

    python train.py                      # the whole pipeline on the bundled defaults (stage `all`)
    python train.py collect --num-games 50 --rollouts-per-game 3 --max-turns 30 --out runs/collect

Every field of `Config` is a flag (`num_games` -> `--num-games`) and a key of an optional JSON file
(`--config cfg.json`); precedence: defaults < file < flags. Stages in the paper's order:
  collect   the base model plays ALFWorld train games; every turn -> a triplet (METHOD.md §2)
  filter    "too easy" subsampling (METHOD.md §4)                      -- arrives with issue #3
  wm        world-model GRPO with the embedding reward (METHOD.md §3, §5) -- arrives with issue #3
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import sys
import time
import types
import typing
from dataclasses import dataclass
from pathlib import Path

import envs
import rwml
from envs import UserError

STAGES = ("all", "collect")


@dataclass
class Config:
    # model
    model: str = "bundled:SmolLM2-135M-Instruct"  # any HF causal-LM id or local folder
    adapter: str | None = None  # a peft adapter folder to put on top of the model
    seed: int = 0
    # data collection (METHOD.md §2): the base model plays train games at temperature 1.0
    split: str = "train"
    num_games: int = 4  # the paper plays every train game (3553); small default for a CPU sanity run
    rollouts_per_game: int = 3  # the paper's R for ALFWorld
    max_turns: int = 30  # environment step budget per episode, as in the paper
    history_len: int = 2  # H: previous (observation, action) pairs shown to the agent and kept per triplet
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 128  # agent reply: <think>...</think><action>...</action>
    batch_size: int = 12  # episodes generated together (all 4 x 3 default episodes in one batch)
    num_workers: int = 2  # game processes (0 = play in this process)
    # output
    out: str = "runs/rwml"


def parse_config(cls, argv: list[str], prog: str, positional: dict | None = None):
    """Flags from a dataclass's fields; JSON file via --config; a typo gets a one-line error with a hint."""
    hints = typing.get_type_hints(cls)
    p = argparse.ArgumentParser(prog=prog, argument_default=argparse.SUPPRESS, allow_abbrev=False)
    for name, kw in (positional or {}).items():
        p.add_argument(name, **kw)
    p.add_argument("--config", help="JSON file with any of the fields below")
    for f in dataclasses.fields(cls):
        typ = hints[f.name]
        if isinstance(typ, types.UnionType):  # `str | None` -> str
            typ = next(t for t in typing.get_args(typ) if t is not type(None))
        flag = "--" + f.name.replace("_", "-")
        if typ is bool:
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, help=f"(default {f.default})")
        else:
            p.add_argument(flag, dest=f.name, type=typ, metavar=typ.__name__.upper(), help=f"(default {f.default})")
    args, unknown = p.parse_known_args(argv)
    known = [f.name for f in dataclasses.fields(cls)]
    for u in unknown:
        close = difflib.get_close_matches(u.split("=")[0].lstrip("-").replace("-", "_"), known, n=1)
        hint = f"; did you mean --{close[0].replace('_', '-')}?" if close else f"; see {prog} --help"
        raise UserError(f"unknown argument {u!r}{hint}")
    values = {}
    if getattr(args, "config", None):
        try:
            values = json.loads(Path(args.config).read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read config file {args.config}: {e}") from None
        values = {k.replace("-", "_"): v for k, v in values.items()}
        for k in values:
            if k not in known:
                close = difflib.get_close_matches(k, known, n=1)
                raise UserError(f"unknown key {k!r} in {args.config}" + (f"; did you mean {close[0]!r}?" if close else ""))
    values.update({k: v for k, v in vars(args).items() if k in known})
    rest = {k: v for k, v in vars(args).items() if k not in known and k != "config"}
    return cls(**values), rest


# ----------------------------------------------------------------------------- files that survive interrupts

def read_jsonl(path: Path) -> list[dict]:
    """Records of a JSON-lines file; a last line cut short by an interrupt is dropped."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def write_atomic(path: Path, text: str) -> None:
    """Write to a temporary file, then rename: readers see the old or the new file, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- stage: collect

def collect(cfg: Config, out: Path) -> Path:
    """The base model plays `num_games` train games `rollouts_per_game` times; one triplet per turn.

    Turns go to `transitions.jsonl` as they happen, finished episodes to `episodes.jsonl`. Rerunning
    the same command continues: finished episodes are kept, an unfinished one is played again.
    """
    import torch

    games = envs.list_games(cfg.split, cfg.num_games, cfg.seed)  # bad data or split fails before the model loads
    if cfg.rollouts_per_game < 1:
        raise UserError(f"--rollouts-per-game must be at least 1, got {cfg.rollouts_per_game}")
    out.mkdir(parents=True, exist_ok=True)
    job = {k: getattr(cfg, k) for k in ("model", "adapter", "seed", "split", "num_games", "rollouts_per_game",
                                        "max_turns", "history_len", "temperature", "top_p", "max_new_tokens")}
    meta = out / "collect.json"
    if meta.exists() and json.loads(meta.read_text()) != job:
        old = json.loads(meta.read_text())
        diff = ", ".join(f"{k} {old.get(k)!r} -> {v!r}" for k, v in job.items() if old.get(k) != v)
        raise UserError(f"{out} holds a collection made with other settings ({diff}); use another --out")
    write_atomic(meta, json.dumps(job, indent=2))

    transitions, episodes_file = out / "transitions.jsonl", out / "episodes.jsonl"
    finished = {(e["game"], e["rollout"]) for e in read_jsonl(episodes_file)}
    kept = [t for t in read_jsonl(transitions) if (t["game"], t["rollout"]) in finished]
    write_atomic(transitions, "".join(json.dumps(t) + "\n" for t in kept))
    write_atomic(episodes_file, "".join(json.dumps(e) + "\n" for e in read_jsonl(episodes_file)))
    todo = [dict(game=g, rollout=r) for g in games for r in range(cfg.rollouts_per_game)
            if (envs.game_id(g), r) not in finished]
    print(f"collect: {len(games)} {cfg.split} games x {cfg.rollouts_per_game} rollouts; "
          f"{len(finished)} episodes already done, {len(todo)} to play -> {transitions}")
    if todo:
        torch.manual_seed(cfg.seed + len(finished))  # a resumed run does not replay the same samples
        with envs.EnvPool(cfg.num_workers, cfg.max_turns) as pool:
            model, tok = rwml.load_model(cfg.model, cfg.adapter)
            with open(transitions, "a") as ft, open(episodes_file, "a") as fe:
                def write(f, rec):
                    f.write(json.dumps(rec) + "\n")
                    f.flush()

                rwml.play(model, tok, pool, todo, history_len=cfg.history_len, max_turns=cfg.max_turns,
                          temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
                          batch_size=cfg.batch_size, on_turn=lambda t: write(ft, t),
                          on_episode=lambda e: write(fe, e), desc="collect")
    eps, trips = read_jsonl(episodes_file), read_jsonl(transitions)
    n = max(len(trips), 1)
    print(f"collect: {len(trips)} triplets from {len(eps)} episodes; success {sum(e['won'] for e in eps)}/{len(eps)}, "
          f"valid actions {sum(t['valid'] for t in trips) / n:.1%}, well-formed replies "
          f"{sum(t['format_ok'] for t in trips) / n:.1%}")
    return transitions


# ----------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    stage = argv[0] if argv and not argv[0].startswith("-") else "all"
    if stage not in STAGES:
        close = difflib.get_close_matches(stage, STAGES, n=1)
        raise UserError(f"unknown stage {stage!r}; choose one of {', '.join(STAGES)}"
                        + (f" (did you mean {close[0]!r}?)" if close else ""))
    cfg, _ = parse_config(Config, argv[1:] if argv and argv[0] == stage else argv, prog=f"train.py {stage}")
    out = Path(cfg.out)
    t0 = time.time()
    if stage == "collect":
        collect(cfg, out)
    else:  # all
        collect(cfg, out / "collect")
        print("all: the stages after collection (filter, wm) are not implemented yet (issue #3); "
              f"stopping after collection ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit("interrupted: rerun the same command to continue where it stopped")
