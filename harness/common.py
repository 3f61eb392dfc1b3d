"""What the run layer needs: a setting's declaration (`arg`), files written whole, paths as a
reader's clone has them, a cache key's code. The one-line error is the core's (envs.py)."""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import hashlib
import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository (this file is in harness/)


def clip(text: str, n: int = 80) -> str:
    """A user's string echoed in a one-line error: at most `n` characters of it."""
    return text if len(text) <= n else f"{text[:n]}... ({len(text):,} characters)"


def arg(default, help: str, *, choices: tuple | None = None, min: float | None = None, check=None,
        why: str | None = None, resume_free: bool = False, part_of: str = ""):
    """A setting: a dataclass field that is also a flag (`num_games` -> `--num-games`) and a
    `--config` key; its help, choices and bounds here only (`check(value)` false: "--name value:
    `why`"; None passes). `resume_free`: --resume takes another value (no trained weight changes).
    `part_of` (`names`): "filter" the filter's cache key; "collect", "collect:<env>" a collect.json;
    these and "episodes" eval.py's episodes' key; "card", "card:<stage>" a model card; "score" a
    world-model score's; "no-trl" none in TRL."""
    meta = dict(help=help, choices=choices, min=min, check=check, why=why, resume_free=resume_free,
                part_of=tuple(part_of.split()))
    meta = {k: v for k, v in meta.items() if v is not None and v is not False}  # min=0 stays
    return dataclasses.field(default=default, metadata=meta)


def names(cfg, *tags: str) -> tuple[str, ...]:
    """The settings of `cfg` (a config or its class) with one of `tags` in `part_of`, in order."""
    fields = dataclasses.fields(cfg)
    return tuple(f.name for f in fields if set(tags) & set(f.metadata.get("part_of", ())))


def again(cls, name: str, default=dataclasses.MISSING, help: str | None = None):
    """`cls`'s setting `name` in another config, with another default or help (eval.py's protocol:
    30 turns, not train.py's 10): its declaration, bounds and choices stay `cls`'s."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    meta = dict(f.metadata, **({"help": help} if help else {}))
    default = f.default if default is dataclasses.MISSING else default
    return dataclasses.field(default=default, metadata=meta)


def code_sha(entry: str = "train.py", root: Path = ROOT) -> str:
    """A cache key's code: the sha256 of `entry` and every repository module it imports, read from
    the sources (sys.modules depends on what a process ran first)."""
    seen, todo = {}, [root / entry]
    while todo:
        if (path := todo.pop()) in seen:
            continue
        seen[path] = data = path.read_bytes()
        for module in _imports(data):  # a module's file, or a package's __init__.py
            m = module.replace(".", "/")
            todo += [p for p in (root / f"{m}.py", root / m / "__init__.py") if p.is_file()]
    return hashlib.sha256(b"".join(p.relative_to(root).as_posix().encode() + b"\0" + d + b"\0"
                                   for p, d in sorted(seen.items()))).hexdigest()[:16]


@functools.lru_cache(maxsize=256)
def _imports(source: bytes) -> tuple[str, ...]:
    """The modules (and `from` names, which may be modules) a source imports, anywhere in it, and
    the modules of its "module:name" strings (a registry's entries)."""
    return tuple(m for node in ast.walk(ast.parse(source)) for m in (
        [a.name for a in node.names] if isinstance(node, ast.Import) else [
            node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        if isinstance(node, ast.ImportFrom) and node.module and not node.level else
        [node.value.split(":")[0]]
        if isinstance(node, ast.Constant) and ":" in str(node.value) else []))


def write_atomic(path: Path, data: str | bytes) -> None:
    """A temporary file, then a rename: readers see the old or the new file, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data) if isinstance(data, bytes) else tmp.write_text(data)
    os.replace(tmp, path)


def read_jsonl(path: Path) -> list[dict]:
    """Records of a JSON-lines file; a last line cut short by an interrupt is dropped."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8-sig", errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def write_jsonl(path: Path, rows, default=None) -> None:
    write_atomic(path, "".join(json.dumps(r, default=default) + "\n" for r in rows))


OUTSIDE = "<path>"  # what a recorded path outside the repository becomes
PATH_KEYS = ("transitions", "eval_transitions", "adapter", "out", "filter_dir")  # path settings
MAYBE_PATH_KEYS = ("model", "embedder", "user_model")  # a Hub id or bundled:NAME, or a local folder


def repo_path(path, outside: str | None = OUTSIDE, root: Path = ROOT) -> str:
    """`path` relative to `root` (the repository) when it lies inside it, else `outside` (None: as
    given), never the machine's absolute path. A relative path is from the working directory."""
    full = Path(os.path.abspath(os.path.expanduser(str(path))))
    for candidate in (full, full.resolve()):  # a symlinked folder in the repository is inside
        with contextlib.suppress(ValueError):
            return candidate.relative_to(root).as_posix()
    return str(path) if outside is None else outside


def is_local_path(value: str) -> bool:
    """An absolute or home path, or one that exists here (a local model folder, not a Hub id)."""
    return os.path.isabs(os.path.expanduser(value)) or Path(value).exists()


def stored_config(config: dict, root: Path = ROOT) -> dict:
    """A config or result as it is written: its paths relative to the repository (or `<path>`), ids
    as they are, a `config` inside it too."""
    return {k: stored_config(v, root) if k == "config" and isinstance(v, dict)
            else repo_path(v, root=root) if isinstance(v, str) and (
                k in PATH_KEYS or k in MAYBE_PATH_KEYS and is_local_path(v)) else v
            for k, v in config.items()}
