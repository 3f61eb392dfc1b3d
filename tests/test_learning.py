"""GRPO learns: a few dozen steps on a tiny model raise the mean reward well above where it starts."""
import string

import pytest
import torch
from bench.random_models import build

import engine
import rwml
from stages.settings import GRPOConfig


def starts_with_a_letter(completions, targets=None, **kw):
    """A reward that checks the prediction against a fixed string: 1 iff its first character (after the
    <next_state> the reply starts with) is one of "abc...z". A random byte-level model does so ~10 % of
    the time; nothing but the reward tells it to."""
    prefix = rwml.wm_prefix(False)
    return [float(c[len(prefix):][:1] in string.ascii_lowercase and len(c) > len(prefix))
            for c in completions]


@pytest.fixture(scope="module")
def steerable_model(tmp_path_factory) -> str:
    """The tiny Llama with weights drawn at a larger scale: at the usual 0.02 its logits are so flat that no
    LoRA update can move its output distribution (measured: p(letter) stuck at 0.13 even when maximised
    directly), which would test the model, not GRPO."""
    return str(build(tmp_path_factory.mktemp("steerable"), "tiny-llama", initializer_range=0.3))


def test_grpo_raises_the_reward_it_is_given(steerable_model):
    model, tok = engine.load_model(steerable_model)
    torch.manual_seed(0)
    model = engine.add_lora(model, r=8, alpha=16, target_modules="all-linear")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    cfg = GRPOConfig(num_generations=8, max_completion_length=4, micro_batch_size=16, beta=0.0)
    trips = [dict(task="open the box", history=[{"observation": f"You see box {i}."}], action=f"open box {i}",
                  next_obs=f"The box {i} is open.") for i in range(4)]
    rewards = []
    for step in range(25):
        res = rwml.grpo_step(model, tok, opt, trips[step % 2 * 2:][:2], starts_with_a_letter, cfg,
                             reasoning=False)
        rewards.append(res["reward_mean"])
    start, end = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert start < 0.3 and end > 0.7, rewards  # from ~10 % to most samples
