"""The caches that let a run reuse what the same settings and code (`code_sha`) made, each checked
whole before use: the filter's, the held-out explore set's ($RWML_CACHE/heldout), the warm-up's
more games', `all`'s "before" scores. Never imports train.py: train.py plays, these keep."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

import engine
from harness import cost
import envs
import rwml
from harness.common import code_sha, names, read_jsonl, write_atomic, write_jsonl
from stages.plumbing import write_eval
from stages.runs import before_made_by, collect_job, collect_meta, split_games

def filter_cache(cfg, triplets: list[dict], out: Path) -> tuple[dict, tuple | None]:
    """The filter's cache key and, if `out` holds a whole output of it, (kept, warm-up)."""
    kept_file, meta_file, warm = out / "kept.jsonl", out / "filter.json", out / "warmup_adapter"
    job = {k: getattr(cfg, k) for k in names(cfg, "filter")} | dict(
        seed=cfg.seed if cfg.filter_seed is None else cfg.filter_seed, num_triplets=len(triplets))
    # by content, not by name: the same triplets and warm-up files elsewhere are the same job
    more = [Path(f) for f in (cfg.warmup_transitions or "").split(",") if f]
    warm_files = b"".join(f.read_bytes() for f in more if f.is_file())
    job.update(triplets=_sha(json.dumps(triplets, sort_keys=True).encode()),
               warmup_transitions=_sha(warm_files) if more else None, code=code_sha())
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


HELDOUT_FILES = ("collect.json", "transitions.jsonl", "episodes.jsonl")


def heldout_key(cfg, games: list | None = None) -> str:
    """What determines the held-out explore set: settings, games, engine, libraries, code."""
    import transformers
    model = Path(cfg.model)
    weights = sorted((f.name, f.stat().st_size, int(f.stat().st_mtime)) for f in model.iterdir()
                     if f.is_file()) if model.is_dir() else None
    games = [envs.game_id(g) for g in (split_games(cfg) if games is None else games)]
    key = dict(job=collect_job(cfg), env=cfg.env, num_envs=cfg.num_envs, games=games,
               weights=weights, torch=torch.__version__, transformers=transformers.__version__,
               threads=torch.get_num_threads(), code=code_sha())
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def heldout_restore(cfg, out: Path, what: str, games: list | None = None) -> tuple[Path, bool]:
    """Before a cached collection: `out` cleared of other settings' or filled from the cache."""
    cache = engine.MODEL_CACHE / "heldout" / heldout_key(cfg, games)
    for old in [*cache.parent.glob("*.tmp"), *cache.parent.glob("*.damaged")]:
        if not Path(f"/proc/{old.name.split('.')[-2]}").exists():  # a killed run's leftovers
            shutil.rmtree(old, ignore_errors=True)
    trans = out / "transitions.jsonl"
    if trans.exists() and collect_meta(out / "collect.json") != collect_job(cfg):
        print(f"collect: {out} holds {what} of other settings; collecting these in their place")
        for name in HELDOUT_FILES:
            (out / name).unlink(missing_ok=True)
    fresh = not trans.exists()  # a resumed collection draws other samples: not cached
    if fresh and cache.exists():
        files, why = heldout_entry(cache)
        if files:
            out.mkdir(parents=True, exist_ok=True)
            for name, data in files.items():
                write_atomic(out / name, data)
            print(f"collect: reused {what} from {cache} (the same settings, games, "
                  "model and code played them before; delete the folder to play them again)")
        else:
            print(f"collect: the cached set {cache} is not whole ({why}); playing it again to "
                  "replace it")
            with contextlib.suppress(OSError):  # aside first: no reader sees half a folder
                os.replace(cache, aside := cache.with_name(f"{cache.name}.{os.getpid()}.damaged"))
                shutil.rmtree(aside, ignore_errors=True)
    return cache, fresh


def heldout_store(cache: Path, out: Path, fresh: bool) -> None:
    """After it: a fresh collection's files into the cache entry, whole or not at all."""
    if fresh and not cache.exists():
        tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
        with contextlib.suppress(OSError):  # a read-only cache costs only the next run's collection
            tmp.mkdir(parents=True, exist_ok=True)
            files = {name: (out / name).read_bytes() for name in HELDOUT_FILES}
            for name, data in files.items():
                (tmp / name).write_bytes(data)
            sums = {n: _sha(d) for n, d in files.items()}
            write_atomic(tmp / "sha256.json", json.dumps(sums, indent=2))
            os.replace(tmp, cache)  # whole or not at all
        shutil.rmtree(tmp, ignore_errors=True)


def heldout_entry(cache: Path) -> tuple[dict[str, bytes] | None, str]:
    """A held-out cache entry's files, each as its sha256.json says; or (None, why not)."""
    try:
        sums, files = json.loads((cache / "sha256.json").read_text()), {}
        for name in HELDOUT_FILES:
            if _sha(data := (cache / name).read_bytes()) != sums.get(name):
                return None, f"{name} differs from the file written (cut or edited)"
            files[name] = data
        return files, ""
    except OSError as e:
        name = Path(e.filename or "sha256.json").name
        return None, f"{name} is missing or unreadable ({e.strerror})"
    except (ValueError, AttributeError):  # sha256.json cut, or not an object
        return None, "sha256.json is damaged"


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


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
