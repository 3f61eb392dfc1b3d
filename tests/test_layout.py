"""The layout a reader relies on: the method in the five files of the card within their line budgets, support
modules that say so in their first line, the lab beside them and never imported, imports that run one way,
a config a user can read, and a README of at most 200 lines."""
import ast
import dataclasses
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
READER = dict(rwml=650, reward=180, envs=500, train=510, eval=350)  # the reader's path, in lines
READER_TOTAL = 2200
ORDER = ("envs", "reward", "rwml", "train", "eval")  # each may import only those before it
SUPPORT = ("engine", "plumbing", "cost", "worlds", "choose", "bridges", "gamepool", "verl_reward")
LAB = ("reports", "bench", "lab")


def lines(name: str) -> list[str]:
    return (ROOT / f"{name}.py").read_text().splitlines()


def imports(path: Path) -> set[str]:
    nodes = list(ast.walk(ast.parse(path.read_text())))  # function-level imports count too
    found = {a.name.split(".")[0] for n in nodes if isinstance(n, ast.Import) for a in n.names}
    return found | {n.module.split(".")[0] for n in nodes if isinstance(n, ast.ImportFrom) and n.module}


def test_the_readers_files_stay_within_their_budgets():
    sizes = {name: len(lines(name)) for name in READER}
    over = {name: n for name, n in sizes.items() if n > READER[name]}
    assert not over, f"over budget (lines): {over}, budgets {READER}"
    assert sum(sizes.values()) <= READER_TOTAL, f"the reader's path is {sum(sizes.values())} lines"


def test_rwml_py_holds_the_method_in_the_papers_order():
    text = lines("rwml")
    headers = [re.match(r"# =+ (§\d)", x).group(1) for x in text if re.match(r"# =+ §\d", x)]
    assert headers[0] == "§2" and headers[-1] == "§8" and headers == sorted(headers), headers
    assert not [x for x in text if x.startswith("# ====") and not re.match(r"# =+ §\d", x)]


def test_support_modules_say_so_in_their_first_line():
    for name in SUPPORT:
        path = ROOT / f"{name}.py"
        if path.exists():
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            assert doc.startswith("Support"), f"{name}.py's docstring starts {doc[:40]!r}"


def test_imports_run_one_way_and_nothing_imports_the_lab():
    for i, name in enumerate(ORDER):
        later = imports(ROOT / f"{name}.py") & set(ORDER[i + 1:])
        assert not later, f"{name}.py imports {sorted(later)}, which come after it"
    for path in ROOT.glob("*.py"):
        found = imports(path)
        assert not found & set(LAB), f"{path.name} imports the lab: {sorted(found & set(LAB))}"
        if path.stem in SUPPORT:
            top = found & {"train", "eval"}
            assert not top, f"support {path.name} imports {sorted(top)}"


def test_the_config_a_user_sets_has_at_most_40_fields_each_with_help():
    import plumbing
    import train

    names = [f.name for f in dataclasses.fields(train.Config)]
    assert len(names) <= 40, f"train.Config has {len(names)} fields"
    helps = {}
    for cls in train.Config.__mro__:
        if dataclasses.is_dataclass(cls):
            helps.update({k: v for k, v in plumbing.field_comments(cls).items() if v})
    assert not [n for n in names if n not in helps], "fields without help"


def test_the_lab_holds_the_scripts_studies_and_notebook():
    lab = ROOT / "lab"
    scripts = ("sanity.sh", "agent_sanity.sh", "arms.sh", "jobs.sh", "reports.py", "README.md", "NOTEBOOK.md")
    for name in scripts:
        assert (lab / name).is_file(), name
    studies = [d for d in (lab / "results").iterdir() if d.is_dir()]
    assert studies and all((d / "README.md").is_file() for d in studies), "a study folder without a README.md"
    assert not [p for p in ROOT.iterdir() if p.suffix == ".sh"], "lab scripts at the top level"


def test_the_readme_is_at_most_200_lines():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= 200, f"README.md has {n} lines"
