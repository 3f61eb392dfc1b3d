"""What a tiny wm run leaves a user: a run header, whole GRPO groups in samples.jsonl and the log, and an
adapter that loads anywhere, with a model card."""
import contextlib
import io
import json
import shutil
import sys

import pytest
import torch

import engine
from harness import cli
from stages import plumbing
import cards
import rwml
import envs
import train
from stages.plumbing import read_jsonl

ARGV = ["wm", "--no-easy-filter", "--no-warmup", "--max-steps", "1", "--prompts-per-step", "2",
        "--num-generations", "3", "--max-completion-length", "6", "--micro-batch-size", "6",
        "--log-completions-steps", "1", "--beta", "0.1"]


def parity_reward(completions, targets):
    return [float(sum(map(ord, c)) % 2) for c in completions]


@pytest.fixture(scope="module")
def run(tiny_model, transitions, tmp_path_factory):
    """(the run folder, what it printed): one step, the reward a fixed function of the text."""
    out = tmp_path_factory.mktemp("wm")
    cfg, _ = cli.parse_config(train.Settings, ARGV[1:] + ["--model", tiny_model, "--out", str(out)],
                              prog="t")
    printed = io.StringIO()
    argv, sys.argv = sys.argv, ["train.py", *ARGV, "--model", tiny_model, "--out", str(out)]
    try:
        with contextlib.redirect_stdout(printed), train.card_run("wm", cfg):  # as run_stage
            train.train_wm(cfg, plumbing.read_transitions(transitions), out,
                           lambda: engine.load_model(tiny_model), parity_reward)
    finally:
        sys.argv = argv
    return out, printed.getvalue()


def test_header_says_what_trains_before_step_1(run):
    header = run[1].split("[step 1]")[0]
    assert "wm: RWML GRPO on " in header and " triplets (the filter's output)" in header
    assert "1 steps x 2 prompts x G 3" in header and "start: a fresh LoRA (r 16" in header
    assert "beta 0.1, KL reference: the base model (the adapter disabled)" in header
    assert "device cpu, float32, 4-bit off" in header


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
                 "learning_rate 0.0001", "beta 0.1", "num_generations 3", "prompts_per_step 2", "max_steps 1",
                 "- command: `python train.py wm --no-easy-filter", "AutoPeftModelForCausalLM"):
        assert part in card, part
    assert "Q4_1" not in card  # not the bundled model
    engine.load_model(tiny_model, str(copy / "adapter"))  # and our own loader


def test_bundled_base_is_named_by_its_hub_id(tiny_model, tmp_path, monkeypatch):
    """The bundled model loads from a local conversion cache: the adapter names the Hub model instead."""
    cache = tmp_path / "cache"
    monkeypatch.setattr(engine, "MODEL_CACHE", cache)
    model, _ = engine.load_model(tiny_model)
    model.name_or_path = str(cache / "SmolLM2-135M-Instruct")  # as from_pretrained(the cache) sets it
    saved = train.save_adapter(engine.add_lora(model, r=4, alpha=8), tmp_path, cfg=train.Settings(),
                               stage="wm-sft", data={"triplets": 3})
    assert json.loads((saved / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        "HuggingFaceTB/SmolLM2-135M-Instruct"
    card = (saved / "README.md").read_text()
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in card and "Q4_1 GGUF" in card
    assert "# WM SFT" in card and "- data: triplets: 3" in card
    assert engine.hub_id(engine.BUNDLED_MODEL) == engine.hub_id(str(cache / "SmolLM2-135M-Instruct")) == \
        "HuggingFaceTB/SmolLM2-135M-Instruct"
    engine.load_model(tiny_model, str(saved))  # our loader takes it on the real base


def test_policy_header_says_start_reference_and_games(tiny_model, tmp_path, monkeypatch, capsys):
    """train_policy loads the model through run_stage's `load`, which prints the header once it is there."""
    monkeypatch.setattr(train, "train_policy", lambda cfg, out, load: load())
    cfg = train.Settings(model=tiny_model, init="rwml", adapter="runs/wm/adapter", num_games=3,
                       games_per_step=2, num_generations=2, max_steps=5, beta=0.05)
    train.run_stage("policy", cfg, tmp_path, 0.0, None)
    header = capsys.readouterr().out
    assert "policy: multi-turn GRPO on task success, 3 games of alfworld train, from rwml" in header
    assert "5 steps x 2 games x G 2" in header and "start: runs/wm/adapter" in header
    assert "beta 0.05, KL reference: the start adapter, a frozen copy" in header


def test_card_of_stage_2_and_of_all_says_held_out_before_and_after(tmp_path):
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps(dict(base_model_name_or_path="org/model")))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        dict(step=0, eval_success=0.1), dict(step=1, reward=0.5), dict(step=2, eval_success=0.3)]))
    cards.write_card(folder, train.Settings(init="rwml", adapter="runs/wm/adapter", num_games=5,
                                            eval_games=10), "policy")
    card = (folder / "README.md").read_text()
    assert ("# policy RL: multi-turn GRPO on task success (stage 2, METHOD.md §6), "
            "from rwml (runs/wm/adapter)" in card and "- data: train games (alfworld): 5" in card)
    assert "held-out success (greedy, 10 games) at step 2: 0.300; by step: 0: 0.100, 2: 0.300" in card
    assert "base_model: org/model" in card and "Q4_1" not in card
    cards.write_card(folder, train.Settings(reward_control="coin"), "all", data={train.TRIPLETS_KEPT: 7},
                     heldout=["explore: world-model accuracy 0.100 -> 0.200 (48 triplets)"], bundled=True)
    card = (folder / "README.md").read_text()
    assert "# RWML: world-model GRPO" in card and "control COIN" in card and "stage `train.py all`" in card
    assert "- explore: world-model accuracy 0.100 -> 0.200" in card and "Q4_1 GGUF" in card
    assert "[More Information Needed]" not in card


@pytest.fixture
def bundled_cards(tiny_model, tmp_path, monkeypatch):
    """(the warm-up's card, the wm card) of a run on the bundled model: wm starts from the saved warm-up,
    whose adapter_config.json already names the Hub id (as `wm` and `wm --trainer trl` load it)."""
    from peft import PeftModel

    cache = tmp_path / "cache"
    monkeypatch.setattr(engine, "MODEL_CACHE", cache)

    def base():
        model, _ = engine.load_model(tiny_model)
        model.name_or_path = str(cache / "SmolLM2-135M-Instruct")  # as from_pretrained(the cache) sets it
        return model
    warm = train.save_adapter(engine.add_lora(base(), r=4, alpha=8), tmp_path, "warmup_adapter",
                              cfg=train.Settings(), stage="filter")
    wm = train.save_adapter(PeftModel.from_pretrained(base(), str(warm), is_trainable=True), tmp_path,
                            cfg=train.Settings(), stage="wm")
    return warm / "README.md", wm / "README.md"


def test_every_card_of_a_bundled_run_says_q4_1(bundled_cards):
    for card in reversed(bundled_cards):  # the wm card first: it lacked the note
        assert "Q4_1 GGUF" in card.read_text(), card
        assert "not these original weights" in card.read_text(), card


def test_card_yaml_is_the_hubs_model_card_data(bundled_cards):
    from huggingface_hub import ModelCard

    for card in bundled_cards:
        data = ModelCard.load(card).data
        assert data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct" and data.library_name == "peft"
        assert data.pipeline_tag == "text-generation" and {"rwml", "lora", "world-model"} <= set(data.tags)


@pytest.mark.parametrize("stage, reasoning", [("wm", False), ("wm", True), ("filter", False)])
def test_the_cards_query_snippet_runs_with_transformers_and_peft(stage, reasoning, tiny_model, tmp_path):
    cfg = train.Settings(model=tiny_model, max_completion_length=6, wm_reasoning=reasoning)
    with train.card_run(stage, cfg):  # a run's cards: the world-model prompt it trained on
        saved = train.save_adapter(engine.add_lora(engine.load_model(tiny_model)[0], r=4, alpha=8), tmp_path,
                                   cfg=cfg, stage=stage)
    card = (saved / "README.md").read_text()
    code = card.split("## Query this world model")[1].split("```python\n")[1].split("```")[0]
    assert repr(envs.Alfworld.wm_system) in code and repr(rwml.WM_STOP) in code
    assert repr(rwml.wm_prefix(reasoning and stage == "wm")) in code
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(code.replace("path/to/this/folder", str(saved)), {})  # noqa: S102 -- the card's own code
    assert printed.getvalue().endswith("\n")  # a completion, printed (random weights: any text)
    assert "The agent's task: {task}" in code and "[Action] {action}" in code and "task='put a vase" in code


def test_the_checkpoint_has_a_real_card(run):
    out, _ = run
    card = (out / "checkpoint" / "README.md").read_text()
    assert "[More Information Needed]" not in card and "# RWML: world-model GRPO" in card
    assert "checkpoint at step 1: `--resume` continues from it" in card
    assert "## Query this world model" in card


def test_saving_an_adapter_makes_no_hub_lookup(tiny_model, tmp_path, monkeypatch):
    """peft's save_embedding_layers="auto" checks a Hub id's config.json online (offline: a warning)."""
    import warnings

    import peft.utils.save_and_load as peft_save

    def no_lookup(*args, **kwargs):
        raise AssertionError("a Hub lookup on save")
    monkeypatch.setattr(peft_save, "check_file_exists_on_hf_hub", no_lookup)
    model = engine.add_lora(engine.load_model(tiny_model)[0], r=4, alpha=8)
    model.peft_config["default"].base_model_name_or_path = "org/model"  # a Hub id, as a warm-up's config
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train.save_adapter(model, tmp_path, cfg=train.Settings(model=tiny_model))
        train.save_checkpoint(tmp_path / "checkpoint", model, opt, dict(step=1, stage="wm"))
    assert not [w for w in caught if "Could not find a config file" in str(w.message)]
