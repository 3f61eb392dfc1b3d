"""The command line of train.py, eval.py and the lab's scripts: transformers' HfArgumentParser reads
flags and a JSON or YAML --config file into a settings class declared once (`common.arg`);
`check_fields` enforces it before anything slow; an unknown name gets a did-you-mean or TRL's name
mapped to ours; every error is one line (`run_cli`)."""
from __future__ import annotations

import argparse
import copy
import dataclasses
import errno
import json
import math
import re
import signal
import sys
import types
import typing
from pathlib import Path

import yaml
from transformers import HfArgumentParser

from harness.common import clip
from envs import RERUN, UserError, closest, did_you_mean


class _Parser(HfArgumentParser):
    """HfArgumentParser with this project's habits: --help sections, `none` for an Optional, `--x /
    --no-x` for every bool, settings outside `shown` hidden, flags named dashed."""

    def __init__(self, cls, shown=None, **kwargs):
        self.cls, self.shown, self.sections = cls, shown, {}
        super().__init__(cls, formatter_class=argparse.HelpFormatter, allow_abbrev=False, **kwargs)

    def _add_dataclass_arguments(self, dtype):
        for klass in dtype.__mro__:  # the sections in the order of the class's bases
            if title := vars(klass).get("_argument_group_name"):
                self.sections[klass] = self.add_argument_group(title)
        super()._add_dataclass_arguments(dtype)

    def _parse_dataclass_field(self, parser, field):
        declared = (k for k in self.cls.__mro__ if field.name in vars(k).get("__annotations__", ()))
        parser, typ = self.sections.get(next(declared), parser), field.type
        optional = isinstance(typ, types.UnionType)  # `int | None`: an int, or `none`
        typ = next(t for t in typing.get_args(typ) if t is not type(None)) if optional else typ
        text = f"{field.metadata.get('help', '')} (default {field.default})".replace("%", "%%")
        text = text.strip() if self.shown is None or field.name in self.shown else argparse.SUPPRESS
        flag = "--" + field.name.replace("_", "-")  # what --help and errors name
        if typ is bool:  # HfArgumentParser's bool takes a value and has --no-x only if True
            action = parser.add_argument(*dict.fromkeys([flag, f"--{field.name}"]), help=text,
                                         dest=field.name, action=argparse.BooleanOptionalAction)
            action.option_strings = [flag, "--no-" + flag[2:]]
            return
        choices = field.metadata.get("choices")
        metavar = "{" + ",".join(choices) + "}" if choices else typ.__name__.upper()
        f = copy.copy(field)
        f.type = _or_none(typ) if optional else typ
        f.metadata = dict(help=text, metavar=metavar + "|none" * optional)
        HfArgumentParser._parse_dataclass_field(parser, f)  # also takes --name_x
        self._actions[-1].option_strings = [flag]


_UNSET = object()  # a setting no flag gave


def parse_config(cls, argv: list[str], prog: str, positional: dict | None = None, shown=None,
                 description: str | None = None, unread=None, settle=None):
    """`cls` from flags and a --config file (defaults < file < flags), and the positionals;
    `unread(name)`: a flag outside `shown`'s warning; `settle(cfg, given)`."""
    p = _Parser(cls, shown, prog=prog, description=description,
                usage=" ".join([prog, *(n.upper() for n in positional or {}), "[flags]"]))
    for name, kw in (positional or {}).items():
        p.add_argument(name, **kw)
    p.add_argument("--config", metavar="FILE",
                   help="a JSON or YAML file of any settings below (flags win)")
    known = [f.name for f in dataclasses.fields(cls)]
    args, unknown = p.parse_known_args(argv, argparse.Namespace(**dict.fromkeys(known, _UNSET)))
    if unknown:
        hint = unknown_name(unknown[0].split("=")[0][:100], known, prog)
        raise UserError(f"unknown argument {clip(unknown[0])!r}{hint}")
    typed = {k: v for k, v in vars(args).items() if k in known and v is not _UNSET}
    values = read_config(args.config, cls, prog) if args.config else {}
    for k in typed if unread else ():
        if k not in shown:  # typed, not read by this command (a --config file may hold any)
            print(unread(k), file=sys.stderr)
    cfg = cls(**values | typed)
    return (settle(cfg, set(values) | set(typed)) if settle else cfg), {
        k: v for k, v in vars(args).items() if k not in known and k != "config"}


def read_config(path: str, cls, prog: str) -> dict:
    """A --config file's settings (JSON, or YAML: .yaml, .yml): fields of `cls`, of their types."""
    hints, known = typing.get_type_hints(cls), [f.name for f in dataclasses.fields(cls)]
    try:
        text = Path(path).read_text(encoding="utf-8-sig")  # -sig: a BOM is fine
        values = yaml.safe_load(text) if path.endswith((".yaml", ".yml")) else json.loads(text)
    except (OSError, ValueError, yaml.YAMLError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else str(e).splitlines()[0]
        raise UserError(f"cannot read config file {path}: {why}") from None
    if not isinstance(values, dict):
        raise UserError(f"{path} holds {json.dumps(values, default=str)[:40]}, not a JSON object "
                        'of fields such as {"num_games": 8}')
    values = {str(k).replace("-", "_"): v for k, v in values.items()}
    for k, v in values.items():
        if k not in known:
            close = closest(k[:100], known)
            hint = unknown_name(k, known, prog) if k in TRAINER_ALIASES else ""
            raise UserError(f"unknown key {clip(k)!r} in {path}"
                            + (hint or (f"; did you mean {close!r}?" if close else "")))
        if not _fits(hints[k], v):
            want = re.sub(r"<class '(\w+)'>", r"\1", str(hints[k]))
            want = re.sub(r"None(Type)?", "null", want)
            raise UserError(f"{k} in {path} must be {want}, got {clip(json.dumps(v, default=str))}")
    return values


def check_fields(cfg) -> None:
    """Every setting within its declaration (`common.arg`: choices, min, check) and every float
    finite, before anything slow runs; a value outside its choices gets a did-you-mean."""
    for f in dataclasses.fields(cfg):
        v, meta, flag = getattr(cfg, f.name), f.metadata, "--" + f.name.replace("_", "-")
        if v is None:
            continue  # a setting left out
        if (options := meta.get("choices")) and v not in options:
            raise UserError(f"unknown {flag} {v!r}; choose one of {', '.join(options)}"
                            + did_you_mean(v, options))
        if isinstance(v, float) and not math.isfinite(v):
            raise UserError(f"{flag} {v!r}: must be a finite number")
        if meta.get("min") is not None and v < meta["min"]:
            raise UserError(f"{flag} {v!r}: must be at least {meta['min']}")
        if meta.get("check") and not meta["check"](v):
            raise UserError(f"{flag} {v!r}: {meta['why']}")


def fields_of(*classes) -> set[str]:
    """The settings of setting groups: what a stage reads, its --help."""
    return {f.name for c in classes for f in dataclasses.fields(c)}


def resume_free(cfg) -> set[str]:
    """Settings that change no trained weight (`arg(resume_free=True)`): --resume takes others."""
    return {f.name for f in dataclasses.fields(cfg) if f.metadata.get("resume_free")}


def parse_stage(argv: list[str], stages: dict, cls):
    """`train.py [STAGE] [flags]`: the stage (default all), its `cls` and the names given (on the
    command line or in --config); `stages`: name -> (--help line, groups read)."""
    if argv[:1] in (["-h"], ["--help"]):
        commands_help("train.py", {k: v[0] for k, v in stages.items()}, "STAGE",
                      "without a stage: all.\n`train.py STAGE --help`: the flags that stage reads "
                      "(each also a key of a --config file)")
    stage = argv[0] if argv and not argv[0].startswith("-") else "all"
    if stage not in stages:
        raise UserError(f"unknown stage {stage!r}; choose one of {', '.join(stages)}"
                        + did_you_mean(stage, stages))
    reads = {s: fields_of(*groups) for s, (_, groups) in stages.items()}

    def unread(name: str) -> str:  # a flag typed on the command line that this stage does not read
        readers = [s for s in stages if name in reads[s]]
        return (f"warning: --{name.replace('_', '-')} is not read by `{stage}`; "
                + (f"it is read by {', '.join(readers)}" if readers else "no stage reads it")
                + f" (train.py {stage} --help lists the flags `{stage}` reads)")
    given = set()
    cfg, _ = parse_config(cls, argv[1:] if argv[:1] == [stage] else argv, prog=f"train.py {stage}",
                          shown=reads[stage], description=stages[stage][0], unread=unread,
                          settle=lambda cfg, names: given.update(names) or cfg)
    return stage, cfg, given


_NO_SCHEDULE = ("learning_rate", "no equivalent: the learning rate is constant (--warmup is the "
                "format warm-up adapter, not a schedule)")
TRAINER_ALIASES = {  # a TRL / transformers Trainer argument a user types -> (our field, what to do)
    "num_train_epochs": ("max_steps", "this project counts optimizer steps: --max-steps (the "
                         "filter's SFT copy: --sft-epochs)"),
    "logging_steps": ("log_completions_steps", "metrics are logged every step (metrics.jsonl); "
                      "whole groups every --log-completions-steps"),
    "per_device_train_batch_size": ("prompts_per_step", "a step's batch is --prompts-per-step "
                                    "prompts x --num-generations completions (--micro-batch-size: "
                                    "rows per forward)"),
    "gradient_accumulation_steps": ("micro_batch_size", "no equivalent: a step accumulates its "
                                    "micro-batches (--micro-batch-size) into one update"),
    "output_dir": ("out", "--out"), "model_name_or_path": ("model", "--model"),
    "resume_from_checkpoint": ("resume", "--resume (--out's checkpoint)"),
    "save_strategy": ("save_steps", "--save-steps N"),
    "eval_strategy": ("eval_steps", "--eval-steps N (0 = off)"),
    "evaluation_strategy": ("eval_steps", "--eval-steps N (0 = off)"),
    "save_total_limit": ("save_steps", "no equivalent: one checkpoint, replaced each --save-steps"),
    "lr_scheduler_type": ("learning_rate", "no equivalent: --learning-rate is constant"),
    "warmup_steps": _NO_SCHEDULE, "warmup_ratio": _NO_SCHEDULE,
}


def unknown_name(name: str, known: list[str], prog: str) -> str:
    """The hint after an unknown flag or key: TRL's name mapped to ours, else a did-you-mean."""
    name = name.lstrip("-").replace("-", "_")
    if name in TRAINER_ALIASES and TRAINER_ALIASES[name][0] in known:
        return f": not a flag here; TRL's {name}: {TRAINER_ALIASES[name][1]}"
    close = closest(name, known)
    return f"; did you mean --{close.replace('_', '-')}?" if close else f"; see {prog} --help"


def _or_none(typ):
    """argparse type of an `X | None` field: `none` is None, anything else an X."""
    def parse(text: str):
        return None if text.lower() == "none" else typ(text)
    parse.__name__ = typ.__name__  # argparse's "invalid int value: 'x'"
    return parse


def _fits(typ, value) -> bool:
    """Whether a config file's value has a field's type (`int | None`, float, str, bool)."""
    if isinstance(typ, types.UnionType):
        return any(_fits(t, value) for t in typing.get_args(typ))
    if typ in (int, float):  # a float field takes an int; neither takes a bool
        return isinstance(value, (int, typ)) and not isinstance(value, bool)
    return value is None if typ is type(None) else isinstance(value, typ)


def commands_help(prog: str, commands: dict, metavar: str, epilog: str) -> typing.NoReturn:
    """`prog --help`: its commands, one line each; exits 0 (argparse's SystemExit)."""
    table = "\n".join(f"  {name:<13}{line}" for name, line in commands.items())
    p = argparse.ArgumentParser(prog=prog, usage=f"{prog} {metavar} [flags]",
                                description=f"{metavar.lower()}s:\n{table}", epilog=epilog,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.parse_args(["--help"])
    raise AssertionError("argparse's --help exits")


def run_cli(main, on_interrupt: str = "interrupted") -> None:
    """A UserError (bad input), a full disk, Ctrl-C, SIGTERM: one line on stderr, exit status 1."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM ends a run as Ctrl-C does
    try:
        main()
    except UserError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit(on_interrupt)
    except Exception as e:
        full = getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
        if not (full or "No space left on device" in str(e)):
            raise
        sys.exit(f"error: out of disk space ({str(e).splitlines()[0]}); free some, then {RERUN}")
