"""Memory: SFT in token-sized micro-batches makes the whole batch's update; one SFT and one GRPO update of a
fixed shape stay within a stated bound; every run's cost line and cost.json."""
import dataclasses
import json
import math

import pytest
import torch

import engine
import rwml
import train
from stages.settings import GRPOConfig


def test_token_micro_batches_cover_every_row_once_within_the_budget():
    rows = [([1] * p, [2] * c) for p, c in [(30, 5), (10, 2), (50, 9), (100, 1), (20, 20), (12, 3)]]
    parts = engine.token_micro_batches(rows, 64)
    assert sorted(map(id, (r for part in parts for r in part))) == sorted(map(id, rows))
    for part in parts:  # padded as `pack` pads: rows x (longest prompt + longest completion)
        size = len(part) * (max(len(p) for p, _ in part) + max(len(c) for _, c in part))
        assert size <= 64 or len(part) == 1
    assert [len(p) for p in parts] == [2, 1, 1, 1, 1]  # (10, 2) + (12, 3) share one; (100, 1) goes alone
    assert len(engine.token_micro_batches(rows, 10 ** 9)) == 1


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
        losses = engine.sft(model, tok, prompts, answers, system=rwml.wm_system(trip),
                          prefix=rwml.wm_prefix(False), epochs=2, lr=1e-2, batch_size=4, seed=3,
                          max_tokens=budget)
        runs.append((losses, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}))
    (loss0, weights0), others = runs[0], runs[1:]
    assert loss0[1] < loss0[0]  # it learns: the comparison is not between two no-ops
    for losses, weights in others:
        assert losses == pytest.approx(loss0, rel=1e-5)
        for n in weights0:
            assert torch.allclose(weights[n], weights0[n], atol=1e-5, rtol=1e-4), n


@pytest.mark.parametrize("shared", [True, False])
def test_grpo_token_budget_makes_the_same_update(lora_model, shared):
    """Micro-batches cut by a token budget (and trimmed of the padding columns all their rows share) give
    the update of the whole batch at once, for groups sharing a prompt forward and for whole rows."""
    deltas, counts = [], []
    for budget in (0, 1, 170):
        model, tok = lora_model(seed=0, std=0.05)
        prompts = [tok(engine.chat(tok, p))["input_ids"]
                   for p in ("go to desk 1", "open the drawer 2 please", "look")]
        completions = [tok(c)["input_ids"]
                       for c in ("You arrive", "Nothing happens.", "You", "You open it", "ok", "x")]
        ids, attn, cmask = engine.pack([p for p in prompts for _ in range(2)], completions, tok.pad_token_id)
        batch = rwml.Batch(input_ids=ids, attention_mask=attn, completion_mask=cmask,
                           advantages=torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0]),
                           weights=rwml.token_weights(cmask, "grpo", 16))
        if shared:
            P = ids.shape[1] - cmask.shape[1]
            batch = dataclasses.replace(batch, prompt_ids=ids[::2, :P], prompt_mask=attn[::2, :P],
                                        group_size=2)
        counts.append(len(rwml.micro_batches(batch, 6, budget)))
        before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
        cfg = GRPOConfig(micro_batch_size=6, micro_batch_tokens=budget, beta=0.1, max_grad_norm=1e9)
        rwml.grpo_update(model, opt, batch, cfg)
        deltas.append({n: p.detach() - before[n] for n, p in model.named_parameters() if p.requires_grad})
    assert counts[0] == 1 and counts[1] == 3 if shared else counts[1] == 6
    assert 1 < counts[2] < counts[1]
    for other in deltas[1:]:
        for n in deltas[0]:
            assert torch.allclose(deltas[0][n], other[n], atol=1e-6, rtol=1e-4), n
    assert any(d.abs().sum() > 0 for d in deltas[0].values())


def test_each_stage_has_its_own_peak_and_the_run_the_highest():
    """A stage's peak RSS is its own, not the process's running maximum: a stage after a big one reports
    less; an enclosing stage the higher one; the run the process's high-water mark, never reset (it is what
    getrusage and /usr/bin/time -v report)."""
    import resource
    import time

    import cost

    with cost.run(None) as run:
        with cost.stage("outer"):
            with cost.stage("big"):
                x = torch.ones(300 * 2 ** 20 // 4)  # 300 MB, touched, held a while (as activations are)
                time.sleep(0.3)
                del x
            with cost.stage("small"):
                y = torch.ones(1000)
                del y
        s = run.summary()
    big, small, outer = (s["stages"][k]["peak_rss_gb"] for k in ("big", "small", "outer"))
    assert big - small > 0.25 and outer == big and s["peak_rss_gb"] >= big
    assert abs(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20 - s["peak_rss_gb"]) < 0.01
    assert s["stages"]["big"]["calls"] == 1 and s["seconds"] >= 0


def test_every_run_ends_with_a_cost_line_and_cost_json(tiny_model, transitions, tmp_path, capsys):
    train.main(["wm", "--model", tiny_model, "--transitions", transitions, "--no-easy-filter", "--no-warmup",
                "--max-steps", "1", "--prompts-per-step", "2", "--num-generations", "2",
                "--max-completion-length", "4", "--out", str(tmp_path)])
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("cost: ")]
    data = json.loads((tmp_path / "cost.json").read_text())
    assert len(line) == 1 and " | filter " in line[0] and " | grpo " in line[0]
    assert list(data["stages"]) == ["filter", "grpo"]  # train.py's stages: rwml.py keeps no accounts
    assert 0 < data["stages"]["grpo"]["peak_rss_gb"] <= data["peak_rss_gb"] and data["seconds"] > 0


# What one update may add to a process's memory, on the tiny model with SmolLM2's 49,152-word vocabulary
# (bench/random_models.py "tiny-wide"), at bench/memory.py's fixed shapes. Measured (1 thread): SFT ours
# 0.18 GB, the same without its token budget 0.62 GB, the naive full-logits step 3.8 GB; GRPO ours 0.07 GB,
# without micro-batches 0.48 GB, naive 2.6 GB. Either regression breaks its bound. sample (the held-out
# evaluation's batch, the default run's peak stage before the sampler's rewrite): ours 0.04 GB,
# model.generate 0.11 GB (the bundled model: 0.26 and 0.39 GB).
BOUNDS_GB = dict(sft=0.35, grpo=0.25, sample=0.08)


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    from bench.random_models import build

    return str(build(tmp_path_factory.mktemp("tiny-wide"), "tiny-wide"))


@pytest.mark.parametrize("job", ["sft", "grpo", "sample"])
def test_one_update_stays_within_its_memory_bound(wide_model, job):
    """One SFT update (8 of the longest real world-model prompts, ~6,700 tokens), one GRPO update (16 x
    400 tokens) and the evaluation's sampling batch (4 of the longest prompts x 4 samples, 64 tokens), each in
    a fresh process: the RSS it adds over what the process held before stays within BOUNDS_GB."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "lab" / "bench" / "memory.py"
    r = subprocess.run([sys.executable, str(script), "--arm", f"{job}:ours", "--model", wide_model],
                       capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-2000:]
    row = json.loads(r.stdout.strip().splitlines()[-1])
    assert row["tokens"] > (1000 if job == "sample" else 6000) and math.isfinite(row["loss"])
    assert row["added_gb"] <= BOUNDS_GB[job], row
