"""Memory: SFT in token-sized micro-batches makes the whole batch's update; one SFT and one GRPO update of a
fixed shape stay within a stated bound; every run's cost line and cost.json."""
import json

import pytest
import torch

import rwml
import train


def test_token_micro_batches_cover_every_row_once_within_the_budget():
    rows = [([1] * p, [2] * c) for p, c in [(30, 5), (10, 2), (50, 9), (100, 1), (20, 20), (12, 3)]]
    parts = rwml.token_micro_batches(rows, 64)
    assert sorted(map(id, (r for part in parts for r in part))) == sorted(map(id, rows))
    for part in parts:  # padded as `pack` pads: rows x (longest prompt + longest completion)
        size = len(part) * (max(len(p) for p, _ in part) + max(len(c) for _, c in part))
        assert size <= 64 or len(part) == 1
    assert [len(p) for p in parts] == [2, 1, 1, 1, 1]  # (10, 2) + (12, 3) share one; (100, 1) goes alone
    assert len(rwml.token_micro_batches(rows, 10 ** 9)) == 1


def _sft_pairs(transitions, n=8):
    trips = train.read_jsonl(__import__("pathlib").Path(transitions))[:n]
    return [rwml.wm_prompt(t, reasoning=False) for t in trips], [rwml.wm_answer(t) for t in trips], trips[0]


def test_sft_micro_batches_make_the_whole_batchs_update(lora_model, transitions):
    """The same optimizer steps whatever the token budget: one per batch of `batch_size` pairs, the loss a
    mean over the batch's answer tokens, gradients summed over micro-batches (same numbers to float noise)."""
    prompts, answers, trip = _sft_pairs(transitions)
    runs = []
    for budget in (10 ** 9, 1, 3000):  # the whole batch at once, one row at a time, a few rows at a time
        model, tok = lora_model(seed=0)
        losses = rwml.sft(model, tok, prompts, answers, system=rwml.wm_system(trip), prefix=rwml.wm_prefix(False),
                          epochs=2, lr=1e-2, batch_size=4, seed=3, max_tokens=budget)
        runs.append((losses, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}))
    (loss0, weights0), others = runs[0], runs[1:]
    assert loss0[1] < loss0[0]  # it learns: the comparison is not between two no-ops
    for losses, weights in others:
        assert losses == pytest.approx(loss0, rel=1e-5)
        for n in weights0:
            assert torch.allclose(weights[n], weights0[n], atol=1e-5, rtol=1e-4), n
