"""What a tiny wm run leaves a user: whole GRPO groups in samples.jsonl and the log, and an adapter that
loads anywhere, with a model card."""
import contextlib
import io
import json
import shutil
import sys

import pytest

import rwml
import train
from train import read_jsonl

ARGV = ["wm", "--no-easy-filter", "--no-warmup", "--max-steps", "1", "--prompts-per-step", "2",
        "--num-generations", "3", "--max-completion-length", "6", "--micro-batch-size", "6",
        "--log-completions-steps", "1", "--beta", "0.1"]


def parity_reward(completions, targets):
    return [float(sum(map(ord, c)) % 2) for c in completions]


@pytest.fixture(scope="module")
def run(tiny_model, transitions, tmp_path_factory):
    """(the run folder, what it printed): one step, the reward a fixed function of the text."""
    out = tmp_path_factory.mktemp("wm")
    cfg, _ = train.parse_config(train.Config, ARGV[1:] + ["--model", tiny_model, "--out", str(out)], prog="t")
    printed = io.StringIO()
    argv, sys.argv = sys.argv, ["train.py", *ARGV, "--model", tiny_model, "--out", str(out)]
    try:
        with contextlib.redirect_stdout(printed):
            train.train_wm(cfg, train.read_transitions(transitions), out, lambda: rwml.load_model(tiny_model),
                           parity_reward)
    finally:
        sys.argv = argv
    return out, printed.getvalue()


def test_samples_hold_whole_groups(run):
    out, printed = run
    (row,) = read_jsonl(out / "samples.jsonl")
    assert row["step"] == 1 and len(row["groups"]) == 2
    for g in row["groups"]:
        assert len(g["completions"]) == len(g["rewards"]) == len(g["advantages"]) == 3
        assert g["rewards"] == parity_reward(g["completions"], None)
        mean = sum(g["rewards"]) / 3
        assert all((a > 0) == (r > mean) for r, a in zip(g["rewards"], g["advantages"]) if r != mean)
        assert g["action"] in g["prompt_tail"] and g["target"]
    assert row["completion"] == row["groups"][0]["completions"][0]  # the old keys stay
    table = printed.split("[step 1]")[1]
    assert "reward advantage  predicted" in table and "rewards by group: [" in table
    assert len([line for line in table.splitlines() if line.startswith("  ") and line[2:8].strip()]) >= 3


def test_adapter_loads_from_a_copy_of_the_run_folder(run, tiny_model, tmp_path):
    from peft import AutoPeftModelForCausalLM

    out, _ = run
    copy = shutil.copytree(out, tmp_path / "elsewhere")
    config = json.loads((copy / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == tiny_model  # the --model given
    model = AutoPeftModelForCausalLM.from_pretrained(str(copy / "adapter"))
    assert any("lora_A" in n for n, _ in model.named_parameters())
    card = (copy / "adapter" / "README.md").read_text()
    assert "[More Information Needed]" not in card
    for part in ("# RWML: world-model GRPO", "stage `train.py wm`", "- data: training triplets",
                 "learning_rate 0.0001, beta 0.1, num_generations 3, prompts_per_step 2, max_steps 1",
                 "- command: `python train.py wm --no-easy-filter", "AutoPeftModelForCausalLM"):
        assert part in card, part
    assert "Q4_1" not in card  # not the bundled model
    rwml.load_model(tiny_model, str(copy / "adapter"))  # and our own loader


def test_bundled_base_is_named_by_its_hub_id(tiny_model, tmp_path, monkeypatch):
    """The bundled model loads from a local conversion cache: the adapter names the Hub model instead."""
    cache = tmp_path / "cache"
    monkeypatch.setattr(rwml, "MODEL_CACHE", cache)
    model, _ = rwml.load_model(tiny_model)
    model.name_or_path = str(cache / "SmolLM2-135M-Instruct")  # as from_pretrained(the cache) sets it
    saved = train.save_adapter(rwml.add_lora(model, r=4, alpha=8), tmp_path, cfg=train.Config(), stage="wm-sft",
                               data={"triplets": 3})
    assert json.loads((saved / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        "HuggingFaceTB/SmolLM2-135M-Instruct"
    card = (saved / "README.md").read_text()
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in card and "Q4_1 GGUF" in card
    assert "# WM SFT" in card and "- data: triplets: 3" in card
    assert rwml.hub_id(rwml.BUNDLED_MODEL) == rwml.hub_id(str(cache / "SmolLM2-135M-Instruct")) == \
        "HuggingFaceTB/SmolLM2-135M-Instruct"
    rwml.load_model(tiny_model, str(saved))  # our loader takes it on the real base

