"""The cache across runs ($RWML_CACHE/heldout): what the base model plays alike in every run of
the same settings, games, model, libraries and code (`heldout_key`: the held-out explore set, the
warm-up's more games), kept whole (sha256.json). A run's own resume is stages/runs.py's."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

import engine
import envs
from harness.common import code_sha, write_atomic
from stages.runs import collect_job, collect_meta, sha256_hex, split_games

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
            sums = {n: sha256_hex(d) for n, d in files.items()}
            write_atomic(tmp / "sha256.json", json.dumps(sums, indent=2))
            os.replace(tmp, cache)  # whole or not at all
        shutil.rmtree(tmp, ignore_errors=True)


def heldout_entry(cache: Path) -> tuple[dict[str, bytes] | None, str]:
    """A held-out cache entry's files, each as its sha256.json says; or (None, why not)."""
    try:
        sums, files = json.loads((cache / "sha256.json").read_text()), {}
        for name in HELDOUT_FILES:
            if sha256_hex(data := (cache / name).read_bytes()) != sums.get(name):
                return None, f"{name} differs from the file written (cut or edited)"
            files[name] = data
        return files, ""
    except OSError as e:
        name = Path(e.filename or "sha256.json").name
        return None, f"{name} is missing or unreadable ({e.strerror})"
    except (ValueError, AttributeError):  # sha256.json cut, or not an object
        return None, "sha256.json is damaged"


