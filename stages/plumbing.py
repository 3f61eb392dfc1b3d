"""What train.py and eval.py both stand on (no checkpoint, no card): values checked before any model
loads (one-line errors), files that survive interrupts, eval.py's random policy and resumable logs,
train.py's metrics under TRL's names and trackers. A triplet's fit reads rwml.wm_texts' prompt."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import json
import os
import random
import sys
from pathlib import Path

import torch

import engine
import envs
import rwml
from harness.cli import check_fields
from harness.common import read_jsonl, stored_config, write_atomic, write_jsonl
from envs import UserError

TRIPLET_FORMAT = "JSON lines with task, history, action, next_obs, as train.py collect writes"
# grpo_step's names -> TRL GRPOTrainer's: metrics.jsonl and the trackers hold TRL's names only
TRL_NAMES = dict(reward_mean="reward", completion_tokens="completions/mean_length",
                 clip_ratio="clip_ratio/region_mean")
# the keys of every stage-1 GRPO row in metrics.jsonl, whichever trainer wrote it (tested for both)
WM_METRICS = ("step", "epoch", "loss", "grad_norm", "learning_rate", "reward", "reward_std",
              "frac_reward_zero_std", "kl", "completions/mean_length", "completions/min_length",
              "completions/max_length", "completions/clipped_ratio", "clip_ratio/region_mean")
PROMPT_TAIL = 300  # a prompt's characters kept in samples.jsonl: the last observation and action

# ------------------------------------------------------------- checks before anything slow runs
def check_run(cfg, processes: bool = False) -> None:
    """Every stage's first checks (`processes`: `accelerate launch`'s processes share the work)."""
    check_fields(cfg)
    check_cache(cfg)
    if not processes:
        check_single_process()


def check_io(cfg) -> None:
    """Every stage's last checks before anything slow: tracker, folders, adapter, context."""
    if cfg.report_to != "none" and importlib.util.find_spec(cfg.report_to) is None:
        raise UserError(f"--report-to {cfg.report_to} needs the {cfg.report_to} package: pip "
                        "install -r requirements-trackers.txt (or --report-to none)")
    check_writable(Path(cfg.out))
    if cfg.filter_dir:
        check_writable(Path(cfg.filter_dir), "--filter-dir")
    check_adapter(cfg.adapter)
    check_context(cfg)


def check_cache(cfg) -> None:
    """$RWML_CACHE a folder, writable where the bundled model is yet to convert."""
    root = engine.MODEL_CACHE
    fix = "; point RWML_CACHE to a writable folder (or unset it: ~/.cache/rwml)"
    if root.exists() and not root.is_dir():
        raise UserError(f"RWML_CACHE={root} is not a folder{fix}")
    if getattr(cfg, "model", None) != engine.BUNDLED_MODEL:
        return
    if (root / engine.BUNDLED_COPY).is_dir():
        engine.bundled_smollm2()  # converted: names a damaged copy now (reads a header, two JSONs)
        return
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create RWML_CACHE={root} ({e.strerror}){fix}") from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise UserError(f"RWML_CACHE={root} is read-only, and the bundled model is to be converted "
                        "into it" + fix)


def check_single_process() -> None:
    """N processes (WORLD_SIZE) of our trainer would run N same jobs into one --out."""
    world = int(os.environ.get("WORLD_SIZE") or 1)
    if world > 1:
        raise UserError(f"launched as {world} processes (WORLD_SIZE={world}), but only TRL's "
                        "GRPOTrainer (lab/trl_grpo.py) shares work between processes; run that, "
                        "or one process")


def use_4bit(cfg) -> bool:
    """--load-in-4bit, or engine.default_4bit's; the size is read only where CUDA could use it."""
    if cfg.load_in_4bit is not None:
        return cfg.load_in_4bit
    cuda = torch.cuda.is_available()
    return engine.default_4bit(cuda, engine.count_parameters(cfg.model) if cuda else None)


def shape_problem(t) -> str | None:
    """A transitions record's problem, or None: the fields the world-model prompt and target use."""
    if not isinstance(t, dict):
        return f"a JSON {type(t).__name__}, not an object"
    for key in ("task", "action", "next_obs"):
        if not isinstance(t.get(key), str):
            return f"{key} is missing or not a string"
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
        lines = Path(path).read_text(encoding="utf-8-sig").splitlines()  # an editor's BOM is fine
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text (byte {e.start}); expected {TRIPLET_FORMAT}") \
            from None
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
        if problem := shape_problem(t) or (fits(t) if fits else None):
            raise UserError(f"{path}, line {n}: {problem}; expected {TRIPLET_FORMAT}")
        trips.append(t)
    if not trips:
        raise UserError(f"{path} holds no triplets (expected {TRIPLET_FORMAT})")
    return trips


@functools.lru_cache(maxsize=8)
def model_context(name: str) -> tuple[object, int | None]:
    """(tokenizer, context length) without the weights; (None, None): load_model says why."""
    from transformers import AutoConfig, AutoTokenizer
    try:
        path = engine.bundled_smollm2() if name == engine.BUNDLED_MODEL else name
        config, tok = AutoConfig.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    except Exception:  # noqa: BLE001 -- no config to read: nothing to check here
        return None, None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return tok, getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)


def check_context(cfg) -> None:
    """--max-new-tokens and --max-completion-length within the model's context, before it loads."""
    names = [n for n in ("max_new_tokens", "max_completion_length")
             if isinstance(getattr(cfg, n, None), int)]
    ctx = model_context(cfg.model)[1] if names and hasattr(cfg, "model") else None
    for n in names if ctx else ():
        if getattr(cfg, n) >= ctx:
            raise UserError(f"--{n.replace('_', '-')} {getattr(cfg, n)}: at least {cfg.model}'s "
                            f"whole context of {ctx} tokens, with no room for the prompt; lower it")


def context_problem(cfg, chats: list[tuple[str, str, str]], answer: str) -> str | None:
    """Why a world-model prompt (as each way asks it) and answer overflow the context, or None."""
    tok, ctx = model_context(cfg.model)
    if ctx is None:
        return None
    prompts = [engine.chat(tok, *c) for c in chats]
    *sizes, answer_size = (len(s.encode("utf-8", "surrogatepass")) for s in (*prompts, answer))
    if max(sizes) + max(answer_size, cfg.max_completion_length) + 16 <= ctx:
        return None  # a token is at least a byte (byte-level BPE): no need to tokenize
    n = max(len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts)
    m = max(len(tok(answer, add_special_tokens=False)["input_ids"]) + 1, cfg.max_completion_length)
    if n + m <= ctx:
        return None
    return (f"its world-model prompt ({n} tokens) and answer ({m}) exceed {cfg.model}'s context "
            f"of {ctx} tokens; shorten or drop this triplet")


# ------------------------------------------------------------ files that survive interrupts
def check_writable(path: Path, flag: str = "--out", folder: bool = True) -> None:
    """An output folder (or file) writable, checked before anything slow; nothing is created."""
    if not folder and path.is_dir():
        raise UserError(f"{flag} {path} is a folder; give a file name, e.g. "
                        f"{path / 'results.json'}")
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir() and (folder or existing != path):
        raise UserError(f"{flag} {path}: {existing} is a file, not a folder; choose another path")
    try:
        probe = (existing if existing.is_dir() else existing.parent) / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot write there ({e.strerror or e}); choose another "
                        "path") from None


def check_adapter(path: str | None, flag: str = "--adapter") -> None:
    """A peft adapter folder whose adapter_config.json reads, checked before any model loads."""
    if not path:
        return
    config = Path(path) / "adapter_config.json"
    if not config.is_file() and (Path(path) / "adapter" / "adapter_config.json").is_file():
        raise UserError(f"{path} is a run folder, not an adapter: its adapter is "
                        f"{Path(path) / 'adapter'}; give {flag} {Path(path) / 'adapter'}")
    if not config.is_file():
        raise UserError(f"no peft adapter at {path} (expected {config})")
    try:
        from peft import PeftConfig
        if not isinstance(json.loads(config.read_text()).get("peft_type"), str):
            raise ValueError("no peft_type")
        PeftConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 -- whatever peft's reader raises, the file is the problem
        why = str(e).splitlines()[0] if str(e) else repr(e)
        raise UserError(f"{config} is not a readable peft adapter config ({why}); save the adapter "
                        f"again, or give another {flag}") from None
    weights = next((Path(path) / n for n in ("adapter_model.safetensors", "adapter_model.bin")
                    if (Path(path) / n).is_file()), Path(path) / "adapter_model.safetensors")
    if problem := engine.file_problem(weights):
        raise UserError(f"{weights} {problem}; save the adapter again, or give another {flag}")


def keep_rng():
    """An evaluation inside training leaves the RNG as it was: a learning curve changes no step."""
    return torch.random.fork_rng(devices=range(torch.cuda.device_count()), device_type="cuda")


def sample_triplets(trips: list[dict], n: int, seed: int = 0) -> list[dict]:
    """`n` of the triplets in their order, drawn with `seed` (0 or more than there are: all)."""
    if not n or n >= len(trips):
        return trips
    return [trips[i] for i in sorted(random.Random(seed).sample(range(len(trips)), n))]


def write_eval(path: Path, result: dict) -> None:
    """An evaluation's summary (JSON) and, to audit it, each triplet's outputs (.triplets.jsonl)."""
    detail = path.with_name(path.stem + ".triplets.jsonl")
    write_jsonl(detail, result.get("triplets", []))
    summary = stored_config({k: v for k, v in result.items() if k != "triplets"})  # a clone's paths
    write_atomic(path, json.dumps(dict(summary, triplets_file=detail.name), indent=2))


def config_json(cfg) -> str:
    """A run's config.json: every setting, its paths relative to the repository (or `<path>`)."""
    return json.dumps(stored_config(dataclasses.asdict(cfg)), indent=2)


def filter_dir(cfg, out: Path) -> Path:
    return Path(cfg.filter_dir) if cfg.filter_dir else out / "filter"


# ----------------------- what eval.py reads too: the play checks, the random policy, resumable logs
RANDOM_UNUSED = ("model", "adapter", "temperature", "top_p", "max_new_tokens", "action_mode",
                 "sampled", "history_len")  # what `--policy random` (no model) never reads


def check_play(cfg) -> None:
    if cfg.action_mode == "choose" and not envs.env_class(cfg.env).can_choose:  # tau2 lists none
        raise UserError(f"--action-mode choose picks among a turn's admissible commands, and "
                        f"{cfg.env} has no such list; use --action-mode generate with --env "
                        f"{cfg.env}")


def random_policy(cfg, given: set):
    """With --policy random, a given setting of the model it never loads is warned of."""
    if cfg.policy == "random" and (unused := [k for k in RANDOM_UNUSED if k in given]):
        print(f"warning: --policy random plays a uniform admissible command, with no model: "
              f"--{', --'.join(k.replace('_', '-') for k in unused)} not used (recorded as null)",
              file=sys.stderr)
    return cfg


def recorded(cfg) -> dict:
    """eval.py agent's settings as its result and log hold them: --policy random's unused, null."""
    unused = dict.fromkeys(RANDOM_UNUSED) if cfg.policy == "random" else {}
    return dataclasses.asdict(cfg) | unused


def finished_episodes(path: Path, job: dict) -> dict[tuple, dict]:
    """An interrupted evaluation's finished episodes by (split, seed, game), if its job is `job`."""
    rows = read_jsonl(path)
    done = rows[1:] if rows and rows[0] == dict(job=job) else []
    if len(rows) > 1 and not done:
        print(f"eval: {path} holds episodes played with other settings; playing all anew")
    if done:
        print(f"eval: {len(done)} episodes already played (from {path}); playing the rest")
    return {(e.get("split"), e["seed"], e["game"]): e for e in done}


@contextlib.contextmanager
def episode_log(path: Path, job: dict, done: dict):
    """on_episode for `play`, to the log rewritten first with `job` and the `done` episodes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(path, [dict(job=job), *done.values()], default=str)  # no line cut short
    with open(path, "a") as f:
        yield jsonl_writer(f)


def triplets_env(path: str | None, flag: str = "--transitions") -> str | None:
    """The environment of a transitions file's triplets (`env`, absent: alfworld), checked against
    collect.json's beside it; a file that mixes them is refused; None where none reads."""
    found = {}  # env -> its first line
    with contextlib.suppress(OSError, UnicodeDecodeError, TypeError):
        for n, line in enumerate(Path(path).read_text(encoding="utf-8-sig").splitlines(), 1):
            with contextlib.suppress(ValueError, AttributeError):
                env = json.loads(line).get("env", "alfworld")
                if isinstance(env, str) and env in envs.ENVIRONMENTS:  # else read_transitions says
                    found.setdefault(env, n)
    if len(found) > 1:
        lines = ", ".join(f"{e} from line {n}" for e, n in found.items())
        raise UserError(f"{flag} {path} mixes environments ({lines}); a run's reward threshold and "
                        "cap are one environment's: give the triplets of one")
    env = next(iter(found), None)
    meta = Path(path).with_name("collect.json") if env else None
    with contextlib.suppress(OSError, ValueError, AttributeError):  # no collect.json to read
        if meta and (named := json.loads(meta.read_text(encoding="utf-8")).get("env", env)) != env:
            raise UserError(f"{meta} names env {json.dumps(named)[:40]}, but the triplets of "
                            f"{path} are {env}'s; fix or delete {meta} (its collection's settings)")
    return env


def triplet_problem(cfg):
    """For read_transitions: why a triplet cannot train with `cfg` (an unknown env, past the model's
    context), or None."""
    def problem(t: dict) -> str | None:
        if "env" in t and (not isinstance(t["env"], str) or t["env"] not in envs.ENVIRONMENTS):
            return (f"env {json.dumps(t['env'])[:40]} is not one of "
                    f"{', '.join(envs.ENVIRONMENTS)} (or left out)")
        chats = [rwml.wm_texts(t, r) for r in {cfg.wm_reasoning, False}]
        answer = t["next_obs"] + chats[0][3]
        return context_problem(cfg, [(p, s, x) for s, p, x, _ in chats], answer)
    return problem


# --------------------------------------------------------- logging: trackers, metrics, GRPO groups
def log_row(metrics, writer, row: dict) -> None:
    """A step's row to metrics.jsonl (TRL's names), its numbers to the tracker (train/, eval/)."""
    row = {TRL_NAMES.get(k, k): v for k, v in row.items()}
    jsonl_writer(metrics)(row)
    if writer is None:
        return
    scalars = {f"eval/{k[5:]}" if k.startswith("eval_") else f"train/{k}": float(v)
               for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
    if hasattr(writer, "add_scalar"):  # TensorBoard
        for k, v in scalars.items():
            writer.add_scalar(k, v, row["step"])
    else:  # a wandb run
        writer.log(scalars, step=row["step"])


def close_tracker(writer) -> None:
    if writer is not None:
        (writer.finish if hasattr(writer, "finish") else writer.close)()


def group_table(step: int, groups: list[dict], parse, width: int = 90) -> str:
    """A step's groups for the log: the first in full (`parse`: the predictions), then all-equal."""
    first = groups[0]
    lines = [f"[step {step}] group 1 of {len(groups)}: action {first['action']!r}; real: "
             f"{first['target'][:width]!r}", f"  {'reward':>6} {'advantage':>9}  predicted"]
    for c, r, a in zip(first["completions"], first["rewards"], first["advantages"]):
        shown = parse(c)
        lines.append(f"  {r:>6.2f} {a:>+9.3f}  {(c if shown is None else shown)[:width]!r}")
    equal = sum(len(set(g["rewards"])) == 1 for g in groups)
    rewards = " ".join("[" + " ".join(f"{r:g}" for r in g["rewards"]) + "]" for g in groups)
    lines.append(f"  rewards by group: {rewards}; {equal} of {len(groups)} all equal (no gradient)")
    return "\n".join(lines)


def run_header(model, cfg, trains: str, per_step: str, start, step: int = 0) -> str:
    """What is about to train (before step 1): data, sizes, start adapter, KL reference, device."""
    fresh = f"a fresh LoRA (r {cfg.lora_r}, alpha {cfg.lora_alpha}, {cfg.lora_target_modules})"
    reference = ("the start adapter, a frozen copy" if start
                 else "the base model (the adapter disabled)")
    dtype = getattr(model, "dtype", None) or next(model.parameters()).dtype
    four_bit = "on" if getattr(model, "is_loaded_in_4bit", False) else "off"
    return "\n".join([
        trains,
        f"  {cfg.max_steps} steps x {per_step} x G {cfg.num_generations}, learning rate "
        f"{cfg.learning_rate}" + (f"; resumed at step {step}" if step else ""),
        f"  start: {start or fresh}",
        f"  beta {cfg.beta}, KL reference: {reference}" if cfg.beta else "  beta 0: no KL term",
        f"  device {model.device}, {str(dtype).replace('torch.', '')}, 4-bit {four_bit}"])


# -------------------------------------------------------------------------------------- on_turn
def jsonl_writer(f):
    """on_turn / on_episode for `rwml.play`: each record to the open file `f` at once."""
    def write(rec):
        f.write(json.dumps(rec, default=str) + "\n")
        f.flush()
    return write
