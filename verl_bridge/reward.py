"""The reward file verl loads by path (`custom_reward_function.path=<this folder>/reward.py
custom_reward_function.name=compute_score`), for the parquets `train.py export` writes.

verl >= 0.7 executes this file without registering it in `sys.modules` (older verl: as
`custom_module`), from any folder, with nothing on `sys.path`: so it defines no dataclass, and loads
the repository's reward.py (and the modules it imports) under private names, leaving `sys.path` and
the host's modules of the same names as they were. verl calls `compute_score` from several threads:
each setting's reward is built once, under a lock. Reward managers `naive` (verl's default) and
`batch` (lists; verl <= 0.7) work."""
import contextlib
import importlib
import importlib.abc
import importlib.util
import math
import sys
import threading
import types
from collections.abc import Mapping
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent  # the repository: reward.py, harness/
_PRIVATE = "_rwml_verl_"  # the repository's modules as this file loads them: _rwml_verl_reward, ...


class _RepoFinder(importlib.abc.MetaPathFinder):
    """While the reward module loads: a top-level import of one of the repository's own modules
    finds its file, whatever the host has on sys.path or in sys.modules under that name."""

    def __init__(self, names: set[str]):
        self.names = names

    def find_spec(self, fullname, path=None, target=None):
        if path is None and fullname in self.names:
            where = _ROOT / fullname  # a package (its submodules load from its folder) or a file
            if where.is_dir():
                return importlib.util.spec_from_file_location(
                    fullname, where / "__init__.py", submodule_search_locations=[str(where)])
            return importlib.util.spec_from_file_location(fullname, where.with_suffix(".py"))
        return None


def _load_private(name: str):
    """The repository's module `name` and those it imports, kept under private names only
    (`_rwml_verl_<name>`): `sys.modules` holds the host's of those names again. Once per process."""
    done = sys.modules.get(_PRIVATE + name)
    if done is not None and getattr(done, "__file__", None) == str(_ROOT / f"{name}.py"):
        return done
    names = {p.stem for p in _ROOT.glob("*.py")}
    names |= {p.parent.name for p in _ROOT.glob("*/__init__.py")}
    hidden = {n: sys.modules.pop(n) for n in [m for m in sys.modules if m.split(".")[0] in names]}
    finder = _RepoFinder(names)
    sys.meta_path.insert(0, finder)
    try:
        importlib.import_module(name)
    finally:
        sys.meta_path.remove(finder)
        ours = {n: sys.modules.pop(n) for n in [m for m in sys.modules if m.split(".")[0] in names]}
        sys.modules.update(hidden)
    for n, module in ours.items():  # private names: what pickle or typing finds via obj.__module__
        module.__name__ = _PRIVATE + n
        for obj in list(vars(module).values()):
            if getattr(obj, "__module__", None) == n:
                with contextlib.suppress(AttributeError, TypeError):
                    obj.__module__ = _PRIVATE + n
        sys.modules[_PRIVATE + n] = module
    return ours[name]


_reward = _load_private("reward")

_FLAGS = {"true": True, "1": True, "false": False, "0": False}
# setting -> (SimToRealReward, the lock its calls take), shared by every load of this file in the
# process (verl 0.5 and 0.7 load it twice: the train and the validation reward managers)
_CACHE = sys.modules.setdefault(_PRIVATE + "cache", types.ModuleType(_PRIVATE + "cache"))
_LOCK = _CACHE.__dict__.setdefault("lock", threading.Lock())
_REWARDS: dict[tuple, tuple] = _CACHE.__dict__.setdefault("rewards", {})


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _text(value, what: str, fix: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"compute_score: {what} is {_show(value)} ({type(value).__name__}), "
                        f"not text; {fix}")
    return value


def _setting(info: Mapping, kwargs: dict, where: str) -> tuple[tuple, str]:
    """(embedder, tau_d, metric, binary, rouge_gate) and a row's reply prefix: reward_kwargs first,
    then the row's extra_info (as `train.py export` writes it), then SimToRealReward's defaults."""
    def get(key, default):
        if key in kwargs:
            return kwargs[key], f"reward_kwargs {key}"
        return info.get(key, default), f"{where}[{key!r}]"

    embedder, src = get("embedder", _reward.BUNDLED_EMBEDDER)
    _text(embedder, src, "give a sentence-transformers folder or Hub id, or "
          + _reward.BUNDLED_EMBEDDER)
    metric, src = get("reward_metric", "embedding")
    if metric not in ("embedding", "rouge"):
        raise ValueError(f"compute_score: {src} is {_show(metric)}; use embedding or rouge")
    tau_d = _number(*get("tau_d", 0.1), lambda v: 0 < v <= 2, "(0, 2]",
                    "the distance threshold, e.g. 0.1 (train.py export writes --tau-d)")
    gate = _number(*get("rouge_gate", 0.0), lambda v: 0 <= v <= 1, "[0, 1]",
                   "the ROUGE-1 gate, 0 for none (train.py export writes --rouge-gate)")
    flag, src = get("reward_binary", True)
    flag = flag.item() if hasattr(flag, "item") and not isinstance(flag, str) else flag
    binary = _FLAGS.get(flag.strip().lower()) if isinstance(flag, str) else None
    if isinstance(flag, int) and flag in (0, 1):  # bool too
        binary = bool(flag)
    if binary is None:
        raise ValueError(f"compute_score: {src} is {_show(flag)}; use true or false (or 1 / 0)")
    prefix, src = get("assistant_prefix", "")
    _text(prefix, src, 'the reply prefix our trainer writes, e.g. "<next_state>" '
          "(train.py export writes it)")
    return (embedder, tau_d, metric, binary, gate), prefix


def _number(value, src: str, ok, bounds: str, what: str) -> float:
    if hasattr(value, "item") and not isinstance(value, str):  # numpy scalars
        value = value.item()
    number = isinstance(value, (int, float, str)) and not isinstance(value, bool)
    try:
        x = float(value) if number else math.nan
    except ValueError:
        x = math.nan
    if not ok(x):  # also NaN
        raise ValueError(f"compute_score: {src} is {_show(value)}, not a number in {bounds}; "
                         f"set it to {what}")
    return x


def _scores(solutions, truths, infos, kwargs: dict, batch: bool) -> list[float]:
    n = len(solutions)
    if len(truths) != n or len(infos) != n:
        raise ValueError(f"compute_score: {n} solution_strs, {len(truths)} ground_truths and "
                         f"{len(infos)} extra_infos; the batch manager passes one of each per "
                         "response")
    groups: dict[tuple, list[int]] = {}
    texts = []
    for i, (solution, truth, info) in enumerate(zip(solutions, truths, infos)):
        at = f"s[{i}]" if batch else ""  # solution_strs[3], or solution_str
        sol, gt, ei = f"solution_str{at}", f"ground_truth{at}", f"extra_info{at}"
        info = {} if info is None else info
        if not isinstance(info, Mapping):
            raise TypeError(f"compute_score: {ei} is {_show(info)} ({type(info).__name__}), "
                            "not a dict; pass the row's extra_info as train.py export writes it "
                            "(or None)")
        _text(solution, sol, "the reward manager passes each decoded response as a string")
        _text(truth, gt, "each row needs its real next observation as text in "
              "reward_model.ground_truth (train.py export writes it)")
        key, prefix = _setting(info, kwargs, ei)
        groups.setdefault(key, []).append(i)
        texts.append(prefix + solution)
    scores = [0.0] * n
    for key, rows in groups.items():
        with _LOCK:  # one SimToRealReward per setting, even when verl's threads ask at once
            if key not in _REWARDS:
                _REWARDS[key] = (_reward.SimToRealReward(*key), threading.Lock())
            reward, lock = _REWARDS[key]
        with lock:  # one scoring at a time per embedder: a fast tokenizer is not thread-safe
            got = reward([texts[i] for i in rows], [truths[i] for i in rows])
        for i, s in zip(rows, got):
            scores[i] = float(s)
    return scores


def compute_score(data_source=None, solution_str=None, ground_truth=None, extra_info=None, *,
                  data_sources=None, solution_strs=None, ground_truths=None, extra_infos=None,
                  **kwargs):
    """r_WM of verl responses as `SimToRealReward` scores ours: a float for the naive manager, a
    list for the batch one. The reply prefix (`extra_info["assistant_prefix"]`) goes back in front;
    embedder, tau_d, metric, binarisation: the row's unless `reward_kwargs` set them."""
    if solution_strs is not None or ground_truths is not None or extra_infos is not None:
        if solution_str is not None or ground_truth is not None or extra_info is not None:
            raise TypeError("compute_score: got both one response (solution_str, ...) and lists "
                            "(solution_strs, ...); verl's naive manager passes the first, its "
                            "batch manager the second")
        solutions = _listed(solution_strs, "solution_strs")
        truths = _listed(ground_truths, "ground_truths")
        infos = ([None] * len(solutions) if extra_infos is None
                 else _listed(extra_infos, "extra_infos"))
        return _scores(solutions, truths, infos, kwargs, batch=True)
    return _scores([solution_str], [ground_truth], [extra_info], kwargs, batch=False)[0]


def _listed(value, what: str) -> list:
    if value is None or isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__len__"):
        raise TypeError(f"compute_score: {what} is {_show(value)}, not a list; the batch manager "
                        "passes one item per response")
    return list(value)
