"""A run's bookkeeping under train.py's stages: the --out lock, a stage's settings, its games, a
collection that continues, its own resume (the filter's output, `all`'s "before" scores, reused
when whole and made by these inputs), checkpoints and --resume, a GRPO step's metrics."""
from __future__ import annotations

import collections
import dataclasses
import fcntl
import functools
import hashlib
import importlib.util
import io
import json
import os
import pickle
import random
import shutil
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

import engine
import envs
import rwml
import cost
from harness.cli import resume_free
from harness.common import (PATH_KEYS, code_sha, names, read_jsonl, stored_config, write_atomic,
                            write_jsonl)
from envs import UserError, parse_next_state
from cards import save_peft
from stages.plumbing import (PROMPT_TAIL, check_play, config_json, group_table, jsonl_writer,
                             read_transitions, run_header, sample_triplets, triplets_env,
                             write_eval)

TRIPLET_STAGES = ("wm-sft", "filter", "wm", "export")  # the stages that read a collection
WARMUP_STREAM = 100  # the warm-up's more train games are drawn with seed + this
# ---------------------------------------------------- the --out lock: one run at a time in a folder
_LOCKS: dict[str, int] = {}  # --out folder -> the descriptor of its lock, held by this process


def claim_out(cfg, out: Path, stage: str) -> None:
    """One run at a time per --out (a flock on <out>/.lock till the process ends); resume checks."""
    key = str(out.resolve())
    if os.environ.get("RANK", "0") == "0" and key not in _LOCKS:  # accelerate launch: rank 0's
        out.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(out / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:  # a folder, or no permission
            raise UserError(f"cannot open the run lock {out / '.lock'} ({e.strerror}); remove it "
                            "(it holds only its run's pid), or use another --out") from None
        for tries in range(41):  # a run killed a moment ago: its game workers hold the lock a while
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:  # BlockingIOError: another process holds it
                pid = os.pread(fd, 20, 0).decode(errors="replace").strip() or "?"
                if tries == 40 or Path(f"/proc/{pid}").exists():  # its writer still runs
                    os.close(fd)
                    raise UserError(f"another run is using {out} (pid {pid}); wait for it to end, "
                                    "or use another --out") from None
                time.sleep(0.05)
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        _LOCKS[key] = fd
    if stage in ("wm", "policy", "all"):
        if found := next(out.glob("trl/checkpoint-*"), None):  # lab/trl_grpo.py's run is kept
            raise UserError(f"{out} holds a run of TRL's GRPOTrainer ({found}), which train.py "
                            "cannot continue; use another --out")
        check_resume(cfg, out, stage if stage == "policy" else "wm", cfg.resume or stage == "all")


def releases_locks(fn):
    """`fn` gives back the --out locks it took, however it ends (tests run stages one by one)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        before = set(_LOCKS)
        try:
            return fn(*args, **kwargs)
        finally:
            for key in set(_LOCKS) - before:
                os.close(_LOCKS.pop(key))
    return wrapper


# ------------------------------------------------------------------ the stages' settings, together
def check_stage(cfg, stage: str) -> None:
    """What a stage needs of its settings together, before anything slow runs."""
    def bad(name, why):
        raise UserError(f"--{name.replace('_', '-')} {getattr(cfg, name)!r}: {why}")
    check_play(cfg)
    if stage == "wm" and cfg.eval_transitions and not cfg.eval_steps:
        bad("eval_transitions", "is read only by the learning curve, which is off: add "
            "--eval-steps N (a held-out evaluation every N steps), or leave --eval-transitions out")
    if stage == "all" and cfg.num_games is not None:  # collection gives at most this many triplets
        n = cfg.num_games * cfg.rollouts_per_game * cfg.max_turns
        if n - max(1, round(cfg.filter_split * n)) < cfg.prompts_per_step:
            bad("filter_split", f"leaves fewer than --prompts-per-step {cfg.prompts_per_step} of "
                f"the at most {n} collected triplets for GRPO; lower it or collect more "
                "(--num-games, --max-turns)")
    if stage == "all" and cfg.coin_control and cfg.reward_control == "coin":
        bad("coin_control", "trains a matched COIN arm beside RWML, and --reward-control coin "
            "makes RWML a coin too: leave one of them out")
    if stage == "export" and importlib.util.find_spec("pyarrow") is None:
        raise UserError("train.py export --format verl writes parquet, which needs pyarrow: "
                        "pip install pyarrow")
    for name in ("train.parquet", "test.parquet", "train.parquet.tmp", "test.parquet.tmp"):
        if stage == "export" and (path := Path(cfg.out) / name).is_dir():
            raise UserError(f"export writes the file {path}, which is a folder; remove it or use "
                            "another --out")
    if stage in ("collect", "policy", "rft") and cfg.env == "alfworld":
        split_games(cfg)  # ALFWorld's data, the split and --num-games: before --out or a cost line
    if stage == "policy" and cfg.init == "base" and cfg.adapter:
        raise UserError(f"--init base starts from the bare model, but --adapter {cfg.adapter} was "
                        "given; say which kind it is, e.g. --init rwml")
    if stage == "policy" and cfg.init != "base" and not cfg.adapter:
        raise UserError(f"--init {cfg.init} needs --adapter DIR: the adapter/ folder of that run, "
                        f"e.g. runs/{cfg.init}/adapter")
    if stage == "all":
        check_heldout(cfg)


def check_heldout(cfg) -> None:
    """`all` scores games never trained on: no held-out game among the train games."""
    if cfg.env != "alfworld":
        raise UserError("the `all` stage runs on ALFWorld; for tau2 use the collect / wm / policy "
                        "stages")
    train = {envs.game_id(g) for g in split_games(cfg)}
    held = {envs.game_id(g)
            for g in envs.list_games(cfg.heldout_split, cfg.heldout_games, cfg.heldout_seed)}
    if cfg.heldout_split == cfg.split or train & held:
        raise UserError(f"--heldout-split {cfg.heldout_split} shares {len(train & held)} games "
                        f"with the train games (--split {cfg.split}); use valid_unseen (the test "
                        "split) or valid_seen (the dev split)")
    if cfg.warmup and cfg.warmup_games:
        warmup_games(cfg)  # before any collection: more than the split holds besides GRPO's games


def warmup_games(cfg) -> list:
    """The warm-up's more train games: drawn with seed + WARMUP_STREAM, none of them GRPO's."""
    every, train = envs.list_games(cfg.split), set(split_games(cfg))
    if cfg.warmup_games > len(every) - len(train):
        raise UserError(f"--warmup-games {cfg.warmup_games}: the {cfg.split} split holds "
                        f"{len(every)} games, {len(train)} of them GRPO's (--num-games); use at "
                        f"most {len(every) - len(train)}")
    drawn = envs.list_games(cfg.split, cfg.warmup_games, cfg.seed + WARMUP_STREAM)
    rest = [g for g in every if g not in train and g not in drawn]
    redrawn = random.Random(cfg.seed + WARMUP_STREAM).sample(rest, len(train & set(drawn)))
    return sorted([g for g in drawn if g not in train] + redrawn)


# ------------------------------------- the games, a stage's triplets, a collection that continues
def split_games(cfg) -> list:
    """The games a stage plays: `num_games` of `split` (ALFWorld's files), or `num_tasks` (tau2)."""
    return envs.games(cfg.env, cfg.split, cfg.num_tasks if cfg.env == "tau2" else cfg.num_games,
                      cfg.seed, cfg.domain, (cfg.world_size, cfg.nb_objects, cfg.quest_length))


def settle_env(stage: str, cfg, given: set):
    """A stage that takes triplets takes their environment and, unless given, its world-model
    defaults (`envs.ENV_DEFAULTS`: tau_d, the cap); a given --env that disagrees is refused."""
    if stage == "all" and "warmup_games" in given and cfg.warmup_games and not cfg.warmup:
        raise UserError(f"--warmup-games {cfg.warmup_games} collects more games for the warm-up, "
                        "and --no-warmup has none: leave one of them out")
    if stage not in TRIPLET_STAGES or not (env := triplets_env(cfg.transitions)):
        return cfg  # no triplet reads: read_transitions says why
    if "env" in given and cfg.env != env:
        raise UserError(f"--env {cfg.env} disagrees with --transitions {cfg.transitions}, whose "
                        f"triplets are {env}'s; leave --env out (a stage that takes triplets takes "
                        f"theirs) or give {cfg.env} triplets")
    if stage == "wm" and cfg.eval_transitions and (
            held := triplets_env(cfg.eval_transitions, "--eval-transitions")) not in (None, env):
        raise UserError(f"--eval-transitions {cfg.eval_transitions} holds {held} triplets, "
                        f"--transitions {env} ones; the learning curve scores the run's "
                        f"environment: give held-out {env} triplets")
    return dataclasses.replace(cfg, env=env, **dict.fromkeys(set(envs.ENV_DEFAULTS) - given))


def stage_inputs(cfg, stage: str, problem) -> tuple[list[dict] | None, list[dict] | None]:
    """The triplets a stage trains on and, for `wm --eval-steps`, its held-out ones, checked."""
    trips = read_transitions(cfg.transitions, problem) if stage in TRIPLET_STAGES else None
    if stage in (*TRIPLET_STAGES, "all"):
        more_warmup(cfg, problem)  # before the model loads
    if stage != "wm" or not cfg.eval_steps:
        return trips, None
    if not cfg.eval_transitions:
        raise UserError("wm --eval-steps scores held-out triplets along the way: give them with "
                        "--eval-transitions (a transitions.jsonl of held-out games, e.g. train.py "
                        "collect --split valid_seen)")
    return trips, sample_triplets(read_transitions(cfg.eval_transitions, problem),
                                  cfg.eval_max_triplets)


def more_warmup(cfg, problem=None) -> list[dict]:
    """--warmup-transitions' triplets, more games' collections the filter's copy also learns."""
    more = [f for f in (cfg.warmup_transitions or "").split(",") if f]
    if missing := [f for f in more if not Path(f).is_file()]:
        raise UserError(f"--warmup-transitions: {', '.join(missing)} not found; give "
                        "transitions.jsonl files of `train.py collect`, comma-separated")
    for f in more:
        if (env := triplets_env(f, "--warmup-transitions")) not in (None, cfg.env):
            raise UserError(f"--warmup-transitions {f} holds {env} triplets, and this run is "
                            f"{cfg.env}'s: give {cfg.env} triplets")
    return [t for f in more for t in read_transitions(f, problem)]


def collect_job(cfg) -> dict:
    job = {k: getattr(cfg, k) for k in names(cfg, "collect", f"collect:{cfg.env}")}
    if cfg.action_mode != "generate":  # only when set: collections made before the field stay valid
        job["action_mode"] = cfg.action_mode
    return job | ({} if cfg.env == "alfworld" else dict(env=cfg.env))  # ALFWorld's files name none


def collection_todo(cfg, out: Path, games: list) -> tuple[list[dict], int]:
    """A collection's settings (collect.json), its finished episodes kept: (to play, done)."""
    job = collect_job(cfg)
    meta = out / "collect.json"
    if (old := collect_meta(meta)) is not None and old != job:
        diff = ", ".join(f"{k} {old.get(k)!r} -> {v!r}" for k, v in job.items() if old.get(k) != v)
        raise UserError(f"{out} holds a collection made with other settings ({diff}); use another "
                        "--out")
    write_atomic(meta, json.dumps(job, indent=2))
    transitions, episodes_file = out / "transitions.jsonl", out / "episodes.jsonl"
    done, turns = read_jsonl(episodes_file), read_jsonl(transitions)
    count = collections.Counter((t["game"], t["rollout"]) for t in turns)
    if short := [e for e in done if e.get("steps") not in (None, count[e["game"], e["rollout"]])]:
        print(f"collect: {transitions} misses turns of {len(short)} finished episodes (lines cut "
              "or edited); playing them again")
        done = [e for e in done if e not in short]
    finished = {(e["game"], e["rollout"]) for e in done}
    kept = [t for t in turns if (t["game"], t["rollout"]) in finished]
    if len(kept) < len(turns):  # the per-episode rule (README, "No run loses work")
        cut = {(t["game"], t["rollout"]) for t in turns} - finished
        print(f"collect: dropped {len(turns) - len(kept)} turns of {len(cut)} unfinished episodes: "
              "an episode is kept once it ends; one that did not is played again from its start")
    write_jsonl(transitions, kept)  # no line cut short by an interrupt, no unfinished episode
    write_jsonl(episodes_file, done)
    todo = [dict(game=g, rollout=r) for g in games for r in range(cfg.rollouts_per_game)
            if (envs.game_name(g), r) not in finished]
    print(f"collect: {len(games)} {cfg.split} games x {cfg.rollouts_per_game} rollouts; "
          f"{len(finished)} episodes already done, {len(todo)} to play -> {transitions}")
    return todo, len(finished)


def collection_summary(cfg, out: Path) -> None:
    eps, trips = read_jsonl(out / "episodes.jsonl"), read_jsonl(out / "transitions.jsonl")
    n, own = max(len(trips), 1), [t for t in trips if not t.get("explored")]
    print(f"collect: {len(trips)} triplets from {len(eps)} episodes ({len(trips) - len(own)} "
          f"explored turns); success {sum(e['won'] for e in eps)}/{len(eps)}, "
          f"valid actions {sum(t['valid'] for t in trips) / n:.1%}, the model's own replies "
          f"well formed {sum(t['format_ok'] for t in own) / max(len(own), 1):.1%}")
    if cfg.env == "alfworld":
        print("collect: next observations by kind: " + kind_mix(trips))


def collect_meta(meta: Path) -> dict | None:
    """A collection's settings (collect.json), None if there is none; a damaged one: an error."""
    try:
        old = json.loads(meta.read_text(encoding="utf-8")) if meta.exists() else None
    except ValueError as e:  # cut by a full disk or an editor, or not text
        old = e
    if old is None or isinstance(old, dict):
        return old
    raise UserError(f"{meta} is damaged ({str(old)[:60]}); delete it to go on collecting in "
                    f"{meta.parent} with these settings, or use another --out")


def kind_mix(triplets: list[dict]) -> str:
    """"arrive 51%, take 16%, ...": each observation kind's share among the triplets' targets."""
    counts = collections.Counter(envs.observation_kind(t["next_obs"]) for t in triplets)
    return ", ".join(f"{k} {v / max(len(triplets), 1):.0%}" for k, v in counts.most_common())


# ------------------------------------------------------------------- what a stage logs and prints
def wm_row(state: dict, res: dict, u: dict, batch: list[dict], lr: float, seconds: float) -> dict:
    """A stage-1 GRPO step's metrics.jsonl row (`log_row` renames it), with its targets' kinds."""
    return dict(step=state["step"], epoch=state["epoch"], **{
        k: res[k] for k in ("reward_mean", "reward_std", "frac_reward_zero_std", "format_rate",
                            "completion_tokens", "completions/min_length", "completions/max_length",
                            "completions/clipped_ratio")},
        **u, learning_rate=lr, seconds=round(seconds, 2),
        target_kinds=[envs.observation_kind(t["next_obs"]) for t in batch],
        group_rewards=res["group_rewards"], **nothing_by_group(  # the drift diagnostics
            [parse_next_state(c) for c in res["completions"]], torch.tensor(res["advantages"]),
            len(res["completions"]) // len(batch)))


def nothing_by_group(states: list[str | None], advantages: torch.Tensor, G: int) -> dict:
    """The share of "Nothing happens." predictions, and per prompt how many and their advantage:
    which groups move the small model's most common drift."""
    nothing = torch.tensor([s == envs.NOTHING for s in states], dtype=torch.float).view(-1, G)
    pushed = [round(a, 4) for a in (nothing * advantages.view(-1, G)).sum(1).tolist()]
    return dict(nothing_share=sum(s == envs.NOTHING for s in states) / len(states),
                group_nothing=nothing.sum(1).tolist(), group_nothing_advantage=pushed)


def telling(load, cfg):
    """`load` that prints stage 2's run header once the model is there."""
    def load_and_tell():
        model, tok = load()
        games = f"{cfg.num_tasks} tasks" if cfg.env == "tau2" else f"{cfg.num_games} games"
        print(run_header(model, cfg, f"policy: multi-turn GRPO on task success, {games} of "
                         f"{cfg.env} {cfg.split}, from {cfg.init}", f"{cfg.games_per_step} games",
                         cfg.adapter))
        return model, tok
    return load_and_tell


# ---------------- a run's own resume: the filter's output, `all`'s "before" scores, reused if whole
def filter_cache(cfg, triplets: list[dict], out: Path) -> tuple[dict, tuple | None]:
    """The filter's cache key and, if `out` holds a whole output of it, (kept, warm-up)."""
    kept_file, meta_file, warm = out / "kept.jsonl", out / "filter.json", out / "warmup_adapter"
    job = {k: getattr(cfg, k) for k in names(cfg, "filter")} | dict(
        seed=cfg.seed if cfg.filter_seed is None else cfg.filter_seed, num_triplets=len(triplets))
    # by content, not by name: the same triplets and warm-up files elsewhere are the same job
    more = [Path(f) for f in (cfg.warmup_transitions or "").split(",") if f]
    warm_files = b"".join(f.read_bytes() for f in more if f.is_file())
    job.update(triplets=sha256_hex(json.dumps(triplets, sort_keys=True).encode()),
               warmup_transitions=sha256_hex(warm_files) if more else None, code=code_sha())
    try:
        meta = json.loads(meta_file.read_text()) if meta_file.exists() else {}
        stored = meta.get("job")
    except (ValueError, AttributeError) as e:  # cut by a kill or a full disk, or not an object
        print(f"filter: {meta_file} is damaged ({str(e)[:60]}); filtering again")
        meta, stored = {}, None
    # a kept set is the same with or without the warm-up unless mixed_only (the warm-up's) chose it
    same = stored == job or stored == job | {"warmup": True} and not cfg.mixed_only
    usable = not cfg.warmup or ((warm / "adapter_config.json").is_file()  # the warm-up, whole
                                and not engine.file_problem(warm / "adapter_model.safetensors"))
    if kept_file.exists() and same and usable:
        if len(kept := read_jsonl(kept_file)) == meta.get("num_kept"):
            print(f"filter: reusing {kept_file} ({len(kept)} triplets)"
                  + (f" and {warm}" if cfg.warmup else ""))
            return job, (kept, warm if cfg.warmup else None)
        print(f"filter: {kept_file} holds {len(kept)} of the {meta.get('num_kept')} triplets "
              f"{meta_file} records (cut or edited); filtering again")
    return job, None


def save_filter(out: Path, job: dict, info: dict, kept: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "kept.jsonl", kept)
    write_atomic(out / "filter.json", json.dumps(dict(job=job, **info), indent=2))
    shown = (f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
             for k, v in info.items() if k not in ("sft_losses", "easiness_counts"))
    print("filter: " + ", ".join(shown))


def save_easiness(out: Path, train: list[dict], scores: list, easy: list, keep: list) -> None:
    """easiness.jsonl: each training triplet's easiness, whether easy, whether GRPO gets it."""
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "easiness.jsonl", [dict(
        game=t.get("game"), step=t.get("step"), rollout=t.get("rollout"), next_obs=t["next_obs"],
        easiness=s, easy=e, kept=k) for t, s, e, k in zip(train, scores, easy, keep)])


def scores_before(cfg, out: Path, sets: dict, start, load, reward_fn) -> dict[str, Path]:
    """`all`'s "before" scores (RWML's start), reused if whole and `before_made_by` matches."""
    files = {kind: out / f"wm_eval_before_{kind}.json" for kind in sets}  # train: RWML's prompts
    made = {kind: before_made_by(cfg, start, s) for kind, s in sets.items()}
    why = [p for kind, f in files.items() if (p := _before_problem(f, made[kind]))]
    if not why:
        print(f"eval: reusing the \"before\" scores {out}/wm_eval_before_*.json (made by this "
              "run's model, triplets, settings and code)")
        return files
    if said := [p for p in why if not p.endswith(" is missing")]:
        print(f"eval: scoring \"before\" again ({said[0]})")
    model, tok = load()
    if start:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, str(start))
    with cost.stage("eval before"):
        for kind, f in files.items():
            scores = rwml.evaluate_heldout(cfg, model, tok, sets[kind]["triplets"], reward_fn)
            write_eval(f, dict(scores, made_by=made[kind],
                               model="warm-up" if start else "base", transitions=sets[kind]["file"],
                               split=cfg.split if kind == "train" else cfg.heldout_split))
    if start:
        model.unload()  # the bare base model again, for train_wm
    return files


def _before_problem(f: Path, made: dict) -> str | None:
    """Why a "before" score cannot be reused: missing, damaged, made by other inputs, rows cut."""
    if problem := engine.file_problem(f):
        return f"{f} {problem}"
    if not isinstance(old := json.loads(f.read_text()), dict) or old.get("made_by") != made:
        return f"{f} was made by another model, triplets, settings or code"
    if len(read_jsonl(rows := f.with_suffix(".triplets.jsonl"))) != old.get("n"):
        return f"{rows} is not its {old.get('n')} rows (cut or edited)"
    return None


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------- checkpoints and resume
def checkpoint_problem(folder: Path) -> str | None:
    """Why a checkpoint would not load back, or None: both files read whole, not merely exist."""
    return next((f"{folder / n} {p}" for n in ("adapter_model.safetensors", "trainer_state.pt")
                 if (p := engine.file_problem(folder / n))), None)


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


# ---------------------- the warm-up's walkthroughs, GRPO's samples, the policy's games, "before"
def walkthroughs(cfg, out: Path, games: list, probes: bool = False) -> Path:
    """`collect --walkthrough`: the expert plans, a triplet a step, no model (the "purposeful" set);
    with `probes`, the games' state probes instead (envs.state_probes, seeded by cfg.seed)."""
    if cfg.env != "alfworld":
        raise UserError("--walkthrough needs --env alfworld (tau2 tasks have no expert "
                        "walkthrough here)")
    transitions, meta = out / "transitions.jsonl", out / "collect.json"
    job = dict(walkthrough=True, split=cfg.split, seed=cfg.seed, num_games=cfg.num_games,
               history_len=cfg.history_len, games=[envs.game_id(g) for g in games],
               code=code_sha(), **({"probes": 1} if probes else {}))
    what = "state probes" if probes else "walkthrough triplets"
    old = (collect_meta(meta) or {}) if transitions.is_file() else {}
    if {k: v for k, v in old.items() if k != "num_triplets"} == job:  # a rerun: done, if whole
        if len(read_jsonl(transitions)) == old.get("num_triplets"):
            print(f"collect: reusing {transitions} ({what} of {len(games)} {cfg.split} games)")
            return transitions
        print(f"collect: {transitions} is not the {old.get('num_triplets')} triplets {meta} "
              f"records (cut or edited); writing the {what} again")
    out.mkdir(parents=True, exist_ok=True)
    trips = envs.state_probes(games, cfg.history_len, cfg.seed) if probes else (
        envs.walkthrough_triplets(history_len=cfg.history_len, wrong_first=False, games=games))
    write_atomic(meta, json.dumps(job | dict(num_triplets=len(trips)), indent=2))
    write_jsonl(transitions, trips)
    by_probe = collections.Counter(t["probe"] for t in trips) if probes else {}
    mix = ", ".join(f"{k} {v}" for k, v in by_probe.items()) if probes else kind_mix(trips)
    print(f"collect: {len(trips)} {what} of {len(games)} {cfg.split} games -> {transitions}; by "
          f"{'probe type' if probes else 'kind of next observation'}: {mix}")
    return transitions


def log_groups(samples, cfg, step: int, batch: list[dict], prompts: list[str], res: dict) -> None:
    """A step's groups (`batch`, asked `prompts`) to samples.jsonl and, as a table, to the log."""
    G = cfg.num_generations
    groups = [dict(prompt_tail=p[-PROMPT_TAIL:], action=t["action"],
                   target=t["next_obs"], completions=res["completions"][i * G:(i + 1) * G],
                   rewards=res["rewards"][i * G:(i + 1) * G],
                   advantages=[round(a, 4) for a in res["advantages"][i * G:(i + 1) * G]])
              for i, (t, p) in enumerate(zip(batch, prompts))]
    jsonl_writer(samples)(dict(step=step, action=batch[0]["action"], completion=res["sample"],
                               target=res["sample_target"], reward=res["sample_reward"],
                               groups=groups))
    tqdm.write(group_table(step, groups, parse_next_state))


def policy_eval_games(cfg) -> list:
    """Stage 2's learning curve's held-out games: eval_games of eval_split (not the train split)."""
    split = cfg.eval_split or envs.env_class(cfg.env).splits.get("dev")
    if split is None:
        raise UserError(f"--eval-steps plays held-out games, which --env {cfg.env} has no dev "
                        "split of; use --eval-steps 0 and eval.py afterwards")
    if split == cfg.split:
        raise UserError(f"--eval-split {split} is the split stage 2 trains on; pick a held-out one "
                        "(e.g. dev)")
    return envs.games(cfg.env, split, cfg.eval_games, 0, cfg.domain,
                      (cfg.world_size, cfg.nb_objects, cfg.quest_length))


def before_made_by(cfg, start, heldout: dict) -> dict:
    """What made a "before" evaluation, all of which a rerun's must match to reuse it: the start
    model's bytes, the triplets, the settings tagged "score" (that decide a score) and the code."""
    warm = Path(start) / "adapter_model.safetensors" if start else None
    sha = hashlib.sha256(warm.read_bytes()).hexdigest() if warm and warm.is_file() else None
    return dict(start=sha, triplets=[triplet_key(t) for t in heldout["triplets"]], code=code_sha(),
                **{k: getattr(cfg, k) for k in names(cfg, "score")})


def triplet_key(r: dict) -> list:
    return [str(r.get("game")), r.get("rollout"), r.get("step"), r.get("action")]


