"""The plumbing under train.py and eval.py, none of it the method: every value checked before any
model loads (one-line errors), files that survive interrupts, checkpoints and --resume, metrics
under TRL's names, trackers. The method (a reply's parser) comes in as arguments."""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import io
import json
import os
import pickle
import random
import shutil
from pathlib import Path

import torch

import engine
from stages.cards import save_peft
from harness.cli import check_fields, resume_free
from harness.common import PATH_KEYS, read_jsonl, stored_config, write_atomic, write_jsonl
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


def triplet_problem(t) -> str | None:
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
        if problem := triplet_problem(t) or (fits(t) if fits else None):
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


def checkpoint_problem(folder: Path) -> str | None:
    """Why a checkpoint would not load back, or None: both files read whole, not merely exist."""
    return next((f"{folder / n} {p}" for n in ("adapter_model.safetensors", "trainer_state.pt")
                 if (p := engine.file_problem(folder / n))), None)


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


# ---------------------------------------------------------------------- checkpoints and resume
def filter_dir(cfg, out: Path) -> Path:
    return Path(cfg.filter_dir) if cfg.filter_dir else out / "filter"


def save_checkpoint(path: Path, model, optimizer, state: dict) -> None:
    """Adapter, optimizer, RNG, cursor, step to checkpoint.tmp, swapped in: no crash loses one."""
    tmp = path.with_name(path.name + ".tmp")
    _remove_checkpoint(tmp)
    save_peft(model, tmp, stage=state.get("stage"), extra=[
        f"checkpoint at step {state['step']}: `--resume` continues from it (trainer_state.pt: "
        "optimizer, RNG states and data cursor, tensors and plain values only); the finished "
        "adapter: ../adapter"])
    buffer = io.BytesIO()  # written after: torch.save to a full disk says only "unexpected pos"
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    torch.save(dict(state, optimizer=optimizer.state_dict(), torch_rng=torch.get_rng_state(),
                    cuda_rng=cuda_rng), buffer)
    write_atomic(tmp / "trainer_state.pt", buffer.getvalue())  # last: it marks a complete folder
    swap_checkpoint(path, verify=False)  # just written: no need to read it back


def _remove_checkpoint(folder: Path) -> None:
    """The marker first: a folder that a crash leaves half removed never looks complete."""
    (folder / "trainer_state.pt").unlink(missing_ok=True)
    shutil.rmtree(folder, ignore_errors=True)


def swap_checkpoint(path: Path, verify: bool = True) -> bool:
    """A whole checkpoint.tmp (else .old) into `path`; whether `path` then holds a checkpoint."""
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
    """trainer_state.pt, loaded weights_only: tensors and plain values, no pickled code."""
    try:
        return torch.load(path, weights_only=True, **kwargs)
    except pickle.UnpicklingError:
        raise UserError(f"cannot resume: {path} holds pickled objects (an older release wrote "
                        f"it); delete {path.parent} to start the run over, or resume it with the "
                        "release that wrote it") from None


def check_resume(cfg, out: Path, stage: str, resume: bool | None = None) -> bool:
    """Whether out/checkpoint is there to resume: whole, of this stage, made with these settings."""
    ckpt = out / "checkpoint"
    if not swap_checkpoint(ckpt):
        return False
    if not (cfg.resume if resume is None else resume):
        raise UserError(f"{out} already holds a run; pass --resume to continue it, or use another "
                        "--out")
    if problem := checkpoint_problem(ckpt):
        raise UserError(f"cannot resume: {problem}; delete {ckpt} to start the run over, or use "
                        "another --out")
    state = read_state(ckpt / "trainer_state.pt", mmap=True, map_location="cpu")
    if (saved := state.get("stage", stage)) != stage:
        raise UserError(f"cannot resume: {out} holds a {saved} run, not a {stage} run; use another "
                        "--out")
    check_settings(cfg, out, state.get("paths", {}))
    return True


def run_paths(cfg) -> dict:  # the run's paths, kept in its checkpoints for --resume
    fields = dataclasses.asdict(cfg)
    return {k: os.path.abspath(v) for k, v in fields.items() if k in PATH_KEYS and v}


def check_settings(cfg, out: Path, paths: dict | None = None) -> None:
    """The settings that change training (not `resume_free`) match config.json, paths `paths`."""
    try:  # start_run writes it before the first checkpoint: without it no setting could be checked
        old = stored_config(json.loads((out / "config.json").read_text(encoding="utf-8-sig")))
    except (OSError, ValueError, AttributeError) as e:
        why = "missing" if isinstance(e, FileNotFoundError) else "damaged"
        raise UserError(f"cannot resume: {out / 'config.json'}, the settings {out / 'checkpoint'} "
                        f"was trained with, is {why}; restore it, or delete {out / 'checkpoint'} "
                        "to start the run over") from None
    new = json.loads(config_json(cfg))  # paths as recorded: relative to the repository, or <path>
    if paths:  # as this machine names them (the checkpoint's): `<path>` cannot tell two apart
        old |= {k: p for k, p in paths.items() if k in old}
        new |= {k: p for k, p in run_paths(cfg).items() if k in old}
    diff = ", ".join(f"--{k.replace('_', '-')} {old[k]!r} -> {v!r}" for k, v in new.items()
                     if k not in resume_free(cfg) and k in old and old[k] != v)
    if diff:
        raise UserError(f"cannot resume: {out} was trained with other settings ({diff}); resume "
                        "with its settings, or use another --out")


def start_run(cfg, out: Path, model, optimizer, stage: str = "wm") -> tuple[dict, object]:
    """Resume (or refuse to overwrite), logs cut back to its step, config.json, the tracker."""
    ckpt = out / "checkpoint"
    state = dict(step=0, epoch=0, cursor=0, stage=stage, paths=run_paths(cfg))
    if check_resume(cfg, out, stage):  # an earlier release's checkpoint has no stage
        state = dict(dict(stage=stage), **load_checkpoint(ckpt, model, optimizer))
        print(f"resumed from {ckpt} at step {state['step']}")
    out.mkdir(parents=True, exist_ok=True)
    for log in (out / "metrics.jsonl", out / "samples.jsonl", out / "eval_episodes.jsonl"):
        if log.exists():  # a per-step log
            write_jsonl(log, [r for r in read_jsonl(log) if r.get("step", 0) <= state["step"]])
    write_atomic(out / "config.json", config_json(cfg))
    if cfg.report_to == "tensorboard":
        from torch.utils.tensorboard import SummaryWriter
        return state, SummaryWriter(str(out / "tensorboard"))
    if cfg.report_to == "wandb":  # a resumed run continues the same wandb run
        import wandb
        id_file = out / "wandb_run_id"
        if not id_file.is_file():
            write_atomic(id_file, wandb.util.generate_id())
        return state, wandb.init(project=os.environ.get("WANDB_PROJECT", "rwml"), name=out.name,
                                 dir=str(out), id=id_file.read_text().strip(), resume="allow",
                                 job_type=stage, config=dataclasses.asdict(cfg))
    return state, None


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
