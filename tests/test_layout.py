"""The layout a reader relies on: the method part of rwml.py and train.py within their line budgets, and
imports that run one way (envs <- reward <- rwml <- plumbing <- train <- eval)."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ORDER = ("envs", "reward", "rwml", "plumbing", "train", "eval")  # each may import only those before it


def test_the_method_and_train_py_stay_within_their_budgets():
    lines = (ROOT / "rwml.py").read_text().splitlines()
    start = next(i for i, x in enumerate(lines) if re.match(r"# =+ §2 ", x))
    end = next(i for i, x in enumerate(lines) if re.match(r"# =+ §8 ", x))
    assert 0 < start < end and end - start <= 600, f"rwml.py §2-§6: {end - start} lines"
    assert all(re.match(r"# =+ (§[2-6]|Plumbing)", x) or not x.startswith("# ====")
               for x in lines[start:end])  # nothing but the method in between
    assert len((ROOT / "train.py").read_text().splitlines()) <= 1000


def test_imports_run_one_way():
    for i, name in enumerate(ORDER):
        tree = ast.parse((ROOT / f"{name}.py").read_text())
        nodes = list(ast.walk(tree))  # function-level imports count too
        imported = {a.name.split(".")[0] for n in nodes if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module.split(".")[0] for n in nodes if isinstance(n, ast.ImportFrom) and n.module}
        later = imported & set(ORDER[i:])
        assert not later, f"{name}.py imports {sorted(later)}, which come after it"
