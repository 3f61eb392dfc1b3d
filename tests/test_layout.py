"""The layout a reader relies on: the method in the five files of the card, the core (the five and the
engine) within its line budget, every other module in a package named for its concern, the environments other
than ALFWorld, choose mode and verl's bridge loaded by name (never imported by the core), the lab beside them
and never imported, imports that run one way over every module (a declared order of layers), every setting
declared once with its help, and a README of at most 200 lines."""
import ast
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# No per-file cap: a module is as long as its concern (the method's play loop, its update's data and step sit
# in rwml.py beside the steps they serve, log pi computed fast in the engine). The core, the five and the
# engine, at most 3,500 lines. All Python but tests / lab (package faces included): the aim of 5,500 is not
# reached; TOTAL_MAX stops the growth (7,048: +21 for `python -m readout`, a run's verdict from its folder;
# +9 for import lines: eval.py's shared checks apart from the run's checkpoints, a run's own resume apart from
# the cache across runs).
CORE = ("rwml", "reward", "envs", "train", "eval", "engine")
CORE_MAX, TOTAL_MAX = 3500, 7048
# Imports run down this list: a module imports only modules of the layers above its own, never one of its own
# layer or of a later one. The environment interface (with the one-line error every module raises, ALFWorld,
# the game pool, the registry), the run layer's bottom (common), the cost line, verl's reward file; the
# engine, the command line; choose mode, the reward; the method, the other environments; model cards (they
# show the method's prompt); plumbing; the stages' bookkeeping (a run's own resume too), the settings, verl's
# export; the cache across runs; evaluation (the scores, the baselines); the stages, what a run concludes
# (read from its folder: `python -m readout RUN`). By package: envs / harness / cost, engine, reward / choose,
# rwml / worlds, cards, stages, verl_bridge / caches / eval / train, readout.
LAYERS = (("envs", "harness.common", "cost", "verl_bridge.reward", "readout.stats"),
          ("engine", "harness.cli"),
          ("choose", "reward"),
          ("rwml", "worlds.tau2", "worlds.textworld"),
          ("cards",),
          ("stages.plumbing",),
          ("stages.runs", "stages.settings", "verl_bridge.export"),
          ("caches",),
          ("eval",),
          ("train", "readout.verdict"),
          ("readout.__main__",))
FIVE = ("rwml", "reward", "envs", "train", "eval")  # the card's files: the root holds these and no other
# one concern each (its __init__.py says which): the engine; the other environments; choose mode; what runs a
# command; what the stages run on; what a run concludes; the cache across runs; the adapters' model cards; the
# cost line; verl's bridge
PACKAGES = ("engine", "worlds", "choose", "harness", "stages", "readout", "caches", "cards", "cost",
            "verl_bridge")
BY_NAME = ("worlds", "choose", "verl_bridge")  # loaded by name (envs.load), never imported by the core
# extras the core never imports: loaded by name, or a command over a run's folder (readout); the cards, the
# cost line and the caches are still imported by train.py, not by eval.py (lab/NOTEBOOK.md, "The house")
NEVER_IN_CORE = (*BY_NAME, "readout")
LAB = ("reports", "bench", "lab")


def path(name: str) -> Path:  # "engine" -> engine/__init__.py, "worlds.tau2" -> worlds/tau2.py
    p = ROOT / name.replace(".", "/")
    return p / "__init__.py" if p.is_dir() else p.with_suffix(".py")


def lines(name: str) -> list[str]:
    return path(name).read_text().splitlines()


def modules() -> set[str]:
    """The five, each package's modules, and a package whose __init__.py holds code (not a face)."""
    found = {p.stem for p in ROOT.glob("*.py")}
    for pkg in PACKAGES:
        found |= {f"{pkg}.{p.stem}" for p in (ROOT / pkg).glob("*.py") if p.stem != "__init__"}
        found |= {pkg} if len(ast.parse(path(pkg).read_text()).body) > 1 else set()
    return found


def imports(file: Path) -> set[str]:
    """The modules `file` imports, dotted (`from worlds import tau2` -> worlds, worlds.tau2); function-level
    imports count too."""
    nodes = list(ast.walk(ast.parse(file.read_text())))
    found = {a.name for n in nodes if isinstance(n, ast.Import) for a in n.names}
    for n in nodes:
        if isinstance(n, ast.ImportFrom) and n.module:
            found |= {n.module} | {f"{n.module}.{a.name}" for a in n.names}
    return found


def imported_by(name: str) -> set[str]:
    """The repo's modules that `name` imports, and theirs, at any depth (function-level imports too): every
    module any of its commands can load."""
    every, found, todo = modules(), set(), [name]
    while todo:
        for m in imports(path(todo.pop())) & every - found:
            found.add(m)
            todo.append(m)
    return found


def test_evaluation_imports_no_training_code():
    """eval.py (`eval.py wm` as every other command) scores a model without the trainer: neither train.py,
    the stages' bookkeeping (checkpoints, the --out lock, collections), the adapters' cards, the caches nor
    TRL is among the modules it can load, at any depth, nor among those `import eval` loads."""
    training = {"train", "stages.runs", "cards", "caches", "cost"}
    assert not training & imported_by("eval"), "eval.py reaches training code"
    code = ("import sys, eval; sys.exit(int(bool({'train', 'stages.runs', 'cards', 'caches', 'cost', 'trl', "
            "'trl_grpo'} & set(sys.modules))))")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0, "eval loads training code"


def test_the_default_run_loads_no_other_environment():
    """`import train` and the default settings load ALFWorld's code only: TextWorld and tau2 load by name
    once --env names them (a setting's help or choices never load them), choose mode and verl's bridge once
    named, readout never; tau2's domains, declared as a setting's choices, are those worlds/tau2.py plays."""
    code = ("import sys, train, eval; train.Settings(); eval.WMEvalConfig(); eval.AgentEvalConfig(); "
            f"sys.exit(int(any(m.split('.')[0] in {NEVER_IN_CORE} for m in sys.modules)))")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0, "the default loads extras"
    from stages.settings import WorldArgs
    from worlds import tau2
    domain = next(f for f in dataclasses.fields(WorldArgs) if f.name == "domain")
    assert domain.metadata["choices"] == tau2.TAU2_DOMAINS
    import train
    assert train.Settings(env="tau2").tau_d == tau2.Tau2.tau_d  # the environment's own, loaded by name


def test_the_root_holds_the_five_files_of_the_card_and_packages_one_concern_each():
    """The root: the five files alone. Every other module: in a package named for its concern, whose
    __init__.py says which. The core (the five and the engine) imports none of worlds/, choose/, verl_bridge/
    (it loads them by name: envs.load) nor readout/ (a command over a run's folder), and the engine none of
    the five but envs.py (the error it raises)."""
    assert sorted(p.stem for p in ROOT.glob("*.py")) == sorted(FIVE)
    packages = sorted(p.parent.name for p in ROOT.glob("*/__init__.py"))
    assert packages == sorted(PACKAGES), packages
    for pkg in PACKAGES:
        assert ast.get_docstring(ast.parse(path(pkg).read_text())), f"{pkg}/__init__.py names no concern"
    for name in CORE:
        found = {m.split(".")[0] for m in imports(path(name))}
        assert not found & set(NEVER_IN_CORE), f"{name} imports {sorted(found & set(NEVER_IN_CORE))}"
    assert not imports(path("engine")) & set(FIVE) - {"envs"}, "the engine imports the method's files"


def test_the_method_and_its_engine_import_nothing_outside_the_core():
    """rwml.py, reward.py, envs.py and the engine read alone: none imports the run layer or an extra
    (train.py and eval.py still do: the run layer is yet to move into them)."""
    for name in ("rwml", "reward", "envs", "engine"):
        outside = {m.split(".")[0] for m in imports(path(name)) & modules()} - set(CORE)
        assert not outside, f"{name} imports {sorted(outside)}, outside the core"


def test_the_core_stays_within_its_budget():
    sizes = {name: len(lines(name)) for name in CORE}
    assert sum(sizes.values()) <= CORE_MAX, f"the core (the five and the engine) is {sizes} lines"


def test_the_code_stays_small():
    sizes = {name: len(lines(name)) for name in modules()}
    assert sum(sizes.values()) <= TOTAL_MAX, f"{sum(sizes.values())} lines of Python outside tests/ and lab/"


def test_no_line_of_the_code_is_over_100_characters():
    """Characters, not bytes ("§" is one); ruff.toml holds the same width, tests/ and lab/ their own."""
    long = [f"{path(name).relative_to(ROOT)}:{i}" for name in modules() | {f"{p}" for p in PACKAGES}
            for i, x in enumerate(lines(name), 1) if len(x) > 100]
    assert not long, f"{len(long)} lines over 100 characters, e.g. {long[:3]}"


def test_one_grpo_step_walks_few_modules(tiny_model):
    """One RWML step (sample a group per prompt, the real reward, advantages, two updates with the KL term)
    calls functions of five of the repo's modules: rwml.py, reward.py, the engine, common's text cleaning
    (the embedder's input) and envs.py (the registry: the triplet's environment class, its prompts)."""
    import torch

    import envs
    import rwml
    import train
    from reward import SimToRealReward
    import engine

    model, tok = engine.load_model(tiny_model)
    model = engine.add_lora(model, r=4, alpha=8)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    cfg = train.Settings(num_generations=2, max_completion_length=6, micro_batch_size=2, beta=0.1,
                         num_iterations=2)
    trips, reward_fn = envs.walkthrough_triplets()[:2], SimToRealReward()
    root, skip = f"{ROOT}/", tuple(f"{ROOT}/{d}/" for d in ("tests", "lab", ".venv"))
    walked = set()

    def profile(frame, event, arg):  # every Python call: the module of the function called
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(root) and not name.startswith(skip):
            walked.add(name[len(root):-len(".py")].replace("/", ".").removesuffix(".__init__"))

    torch.manual_seed(0)
    sys.setprofile(profile)
    try:
        res = rwml.grpo_step(model, tok, opt, trips, reward_fn, cfg, reasoning=False)
    finally:
        sys.setprofile(None)
    assert len(res["updates"]) == 2 and walked <= modules(), walked
    want = {"rwml", "reward", "engine", "envs"}
    assert walked <= want, f"one GRPO step walks {sorted(walked)}"


def test_rwml_py_holds_the_method_in_the_papers_order():
    text = lines("rwml")
    headers = [re.match(r"# =+ (§\d)", x).group(1) for x in text if re.match(r"# =+ §\d", x)]
    assert headers[0] == "§2" and headers[-1] == "§8" and headers == sorted(headers), headers
    assert not [x for x in text if x.startswith("# ====") and not re.match(r"# =+ §\d", x)]


def test_rwml_py_declares_no_settings_keeps_no_accounts_and_defines_what_it_trains_on():
    """The method alone. Settings are stages/settings.py's (a dataclass of `arg` fields
    here fails), cost accounting too (an import of cost fails); the filters (§4), the plain log pi
    and the reference-policy switch are rwml.py's own (the engine's fast paths are held to them:
    tests/test_grpo.py)."""
    import rwml

    tree = ast.parse(path("rwml").read_text())
    fields = [n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)
              and any(isinstance(s, ast.AnnAssign) and isinstance(s.value, ast.Call)
                      and getattr(s.value.func, "id", "") == "arg" for s in n.body)]
    assert not fields, f"rwml.py declares settings: {fields}"
    assert "cost" not in imports(path("rwml")) and "cost." not in path("rwml").read_text()
    for name in ("filter_copy", "filter_keep", "easiness", "logprobs", "reference_policy"):
        assert getattr(rwml, name).__module__ == "rwml", name


def test_imports_run_one_way_over_every_module_and_nothing_imports_the_lab():
    layer = {name: i for i, names in enumerate(LAYERS) for name in names}
    every = modules()
    assert every == set(layer), f"place every module in LAYERS: {sorted(every ^ set(layer))}"
    for name in every:
        found = imports(path(name))
        up = {m for m in found & every if layer[m] >= layer[name]}
        assert not up, f"{name}.py imports {sorted(up)}, of its own layer or a later one (LAYERS)"
        assert not found & set(LAB), f"{name}.py imports the lab: {sorted(found & set(LAB))}"


def test_every_setting_is_declared_once_with_its_help():
    import train

    owners = {}
    for group in {g for _, groups in train.STAGES.values() for g in groups}:
        for f in dataclasses.fields(group):
            owners.setdefault(f.name, []).append(group.__name__)
            assert f.metadata.get("help", "").strip(), f"{group.__name__}.{f.name} has no help"
    assert not {k: v for k, v in owners.items() if len(v) > 1}, "a setting declared in two groups"
    assert set(owners) == {f.name for f in dataclasses.fields(train.Settings)}, "a setting no stage reads"


def test_what_a_setting_decides_is_one_of_the_tags_that_are_read():
    """`part_of`: a misspelt tag ("card:wn") would leave a setting out of a cache key or a
    card without a word; every tag is one that `names` is asked for, and each such key has settings."""
    import eval as ev
    import train
    import envs
    import cards

    read = {"filter", "collect", "episodes", "card", "no-trl", "score",
            *(f"collect:{e}" for e in envs.ENVIRONMENTS),
            *(f"card:{k}" for k in cards.METHODS)}
    used = {(f.name, t) for cfg in (train.Settings, ev.AgentEvalConfig) for f in dataclasses.fields(cfg)
            for t in f.metadata.get("part_of", ())}
    assert not {u for u in used if u[1] not in read}, "a part_of tag no key reads"
    assert {t for _, t in used} == read, "a key no setting is part of"


def test_no_code_names_an_issue():
    """Code, docstrings, comments and help strings say what they do, not which issue asked: every Python
    and shell file, the Makefile and the tool configs (the notebook and the studies' folders keep history)."""
    kinds = ("*.py", "*.sh", "*.toml", "Makefile", ".ci/run")
    files = {p for k in kinds for p in ROOT.glob(k if "/" in k else f"**/{k}")
             if p.is_file() and not {".venv", "results", "__pycache__"} & set(p.relative_to(ROOT).parts)}
    said = re.compile(r"\bissues? ?#?\d+", re.I)
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in files for i, x in enumerate(p.read_text().splitlines(), 1)
            if said.search(x)]
    assert len(files) > 100 and not hits, f"{len(hits)} lines name an issue, e.g. {hits[:3]}"


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


def test_envs_imports_without_torch():
    """envs.py (the games and their worker processes' module) stays cheap to import: reward.py, and torch with
    it, comes in only when a held-out set is scored (envs.score_wm imports it there)."""
    code = "import sys, envs; sys.exit(int('torch' in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0, "import envs imports torch"


def test_rwml_functions_default_to_the_runs_settings():
    """A reader of rwml.py sees the run's values: each of its functions' defaults that a setting also decides
    is that setting's default (reasoning: wm_reasoning, k: filter_samples, frac: filter_split, max_tokens:
    micro_batch_tokens, ...; beta has none)."""
    import inspect

    import rwml
    import train

    run = train.Settings()
    same = dict(reasoning=run.wm_reasoning, scale_rewards=run.scale_rewards, k=run.filter_samples,
                frac=run.filter_split, easy_share=run.easy_share, keep_prob=run.easy_keep_prob,
                history_len=run.history_len, epsilon=run.epsilon, epsilon_high=run.epsilon_high,
                max_tokens=run.micro_batch_tokens, temperature=run.temperature, top_p=run.top_p,
                num_envs=run.num_envs)
    for name, fn in inspect.getmembers(rwml, inspect.isfunction):
        for p in inspect.signature(fn).parameters.values():
            if p.name in same and p.default is not inspect.Parameter.empty:
                assert p.default == same[p.name], (name, p.name, p.default, same[p.name])
    assert inspect.signature(rwml.grpo_loss).parameters["beta"].default is inspect.Parameter.empty
    # the agent's reply (play's max_new_tokens; a prediction's is max_completion_length); play's explore_prob
    # stays 0 (the model plays: eval.py, the policy stage), the collect stage passes its 0.85
    assert inspect.signature(rwml.play).parameters["max_new_tokens"].default == run.max_new_tokens
