"""Shared fixtures: the real ALFWorld data (from $ALFWORLD_DATA) and a tiny causal LM built in code."""
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "lab"))  # lab/reports.py, lab/bench/
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session", autouse=True)
def alfworld_data():
    import envs

    try:
        return envs.data_root()
    except envs.UserError as e:
        pytest.exit(f"tests need the real ALFWorld games: {e}", returncode=2)


def build_tiny_model(folder: Path) -> Path:
    """A random 2-layer Llama with a byte-level tokenizer and a ChatML template, saved like a Hub model."""
    from bench.random_models import build

    return build(folder, "tiny-llama")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture
def lora_model(tiny_model):
    """make(seed, std) -> (tiny model with a LoRA adapter r 4 whose lora_B is drawn ~ N(0, std), tokenizer):
    an adapter that is not the identity, so that it changes log-probs from the first step."""
    import torch

    import engine

    def make(seed: int = 0, std: float = 0.05):
        model, tok = engine.load_model(tiny_model)
        torch.manual_seed(seed)
        model = engine.add_lora(model, r=4, alpha=8)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, std)
        return model, tok
    return make


@pytest.fixture(scope="session")
def transitions(tmp_path_factory) -> str:
    import json

    import envs

    path = tmp_path_factory.mktemp("collect") / "transitions.jsonl"
    path.write_text("".join(json.dumps(t) + "\n" for t in envs.walkthrough_triplets()))
    return str(path)
