"""Stage-1 training end to end on a tiny model: checkpoints, resume, skipped steps, 4-bit gradients."""
import json
import math

import pytest
import torch

import rwml
import train
from envs import UserError
from train import read_jsonl


def wm(tiny_model, transitions, out, max_steps, *extra):
    train.main(["wm", "--model", tiny_model, "--transitions", transitions, "--no-easy-filter", "--max-steps",
                str(max_steps), "--save-steps", "1", "--prompts-per-step", "2", "--num-generations", "2",
                "--max-completion-length", "8", "--micro-batch-size", "2", "--learning-rate", "1e-2",
                "--out", str(out), *extra])


def parity_reward(completions, targets):
    """A random tiny model never writes <next_state>, so r_WM would be 0 throughout and nothing would
    train; this reward is a fixed function of the completion text, so it is mixed and reproducible."""
    return [float(sum(map(ord, c)) % 2) for c in completions]


def wm_direct(tiny_model, transitions, out, max_steps, resume=False):
    cfg = train.Config(model=tiny_model, max_steps=max_steps, save_steps=1, prompts_per_step=2, num_generations=2,
                       max_completion_length=8, micro_batch_size=2, learning_rate=1e-2, beta=0.1, resume=resume)
    train.train_wm(cfg, train.read_transitions(transitions), out, lambda: rwml.load_model(tiny_model), parity_reward)


def final_state(out):
    state = torch.load(out / "checkpoint" / "trainer_state.pt", weights_only=False)
    from safetensors.torch import load_file

    return state, load_file(out / "checkpoint" / "adapter_model.safetensors")


def test_resume_after_interrupt_equals_an_uninterrupted_run(tiny_model, transitions, tmp_path):
    wm_direct(tiny_model, transitions, tmp_path / "a", 4)
    wm_direct(tiny_model, transitions, tmp_path / "b", 2)  # "interrupted" after step 2 ...
    with pytest.raises(UserError, match="--resume"):
        wm(tiny_model, transitions, tmp_path / "b", 4)  # ... a rerun without --resume refuses to overwrite
    wm_direct(tiny_model, transitions, tmp_path / "b", 4, resume=True)
    (sa, wa), (sb, wb) = final_state(tmp_path / "a"), final_state(tmp_path / "b")
    assert sa["step"] == sb["step"] == 4 and sa["cursor"] == sb["cursor"] and sa["epoch"] == sb["epoch"]
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    oa, ob = sa["optimizer"]["state"], sb["optimizer"]["state"]
    assert oa.keys() == ob.keys() and len(oa) > 0
    for k in oa:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(oa[k][name], ob[k][name])
    assert any(v.abs().sum() > 0 for k, v in wa.items() if "lora_B" in k)  # it did train
    assert any(r["loss"] != 0 for r in read_jsonl(tmp_path / "a" / "metrics.jsonl"))
    drop = lambda rows: [{k: v for k, v in r.items() if k != "seconds"} for r in rows]  # noqa: E731
    assert drop(read_jsonl(tmp_path / "a" / "metrics.jsonl")) == drop(read_jsonl(tmp_path / "b" / "metrics.jsonl"))


def test_wm_outputs_peft_adapter_metrics_and_plot(tiny_model, transitions, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    wm(tiny_model, transitions, tmp_path, 2)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("step", "reward_mean", "reward_std", "frac_reward_zero_std", "loss", "kl", "completion_tokens", "seconds"):
        assert all(key in r for r in rows)
    assert (tmp_path / "reward_curve.png").read_bytes()[:4] == b"\x89PNG"
    assert read_jsonl(tmp_path / "samples.jsonl")
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), tmp_path / "adapter")
    assert any("lora_A" in n for n, _ in model.named_parameters())


def test_non_finite_loss_skips_the_step(tiny_model, transitions):
    model, tok = rwml.load_model(tiny_model)
    model = rwml.add_lora(model, r=4, alpha=8)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    cfg = train.Config(num_generations=2, max_completion_length=6, micro_batch_size=2)
    trips = train.read_transitions(transitions)[:2]
    res = rwml.grpo_step(model, tok, opt, trips, lambda c, t: [math.nan] * len(c), cfg)
    assert res["updates"][0]["skipped"] and math.isnan(res["updates"][0]["loss"])
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if p.requires_grad)


def test_filter_stage_keeps_the_90_percent_split_minus_easy(tiny_model, transitions, tmp_path):
    train.main(["filter", "--model", tiny_model, "--transitions", transitions, "--filter-samples", "2",
                "--sft-epochs", "1", "--out", str(tmp_path)])
    info = json.loads((tmp_path / "filter" / "filter.json").read_text())
    n = len(read_jsonl(__import__("pathlib").Path(transitions)))
    assert info["num_triplets"] == n and info["num_filter_split"] == round(0.1 * n)
    assert info["num_train"] + info["num_filter_split"] == n
    rows = read_jsonl(tmp_path / "filter" / "easiness.jsonl")
    assert len(rows) == info["num_train"] and info["num_kept"] == sum(r["kept"] for r in rows)
    assert all(r["kept"] for r in rows if not r["easy"])


def test_4bit_lora_gradients_survive_generate(tiny_model):
    bnb = pytest.importorskip("bitsandbytes")
    try:
        model, tok = rwml.load_model(tiny_model, load_in_4bit=True, device="cpu")
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"bitsandbytes cannot run 4-bit here: {e}")
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    model = rwml.add_lora(model, r=4, alpha=8)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    torch.manual_seed(0)
    roll = rwml.sample_group(model, tok, ["go to desk 1"], num_generations=2, max_completion_length=6)

    def grads():
        model.zero_grad()
        lp = rwml.completion_logprobs(model, roll["input_ids"], roll["attention_mask"], roll["completion_mask"])
        (-lp.sum()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    first = grads()
    rwml.generate(model, tok, ["open drawer 1"], max_new_tokens=4, temperature=0)  # the eval-mode no-grad forward
    second = grads()
    assert all(torch.allclose(first[n], second[n], rtol=1e-4, atol=1e-7) for n in first)
    assert any(g.abs().sum() > 0 for g in first.values())


def test_num_iterations_reuses_one_batch_for_several_updates(tiny_model, transitions):
    model, tok = rwml.load_model(tiny_model)
    torch.manual_seed(0)
    model = rwml.add_lora(model, r=4, alpha=8)
    with torch.no_grad():  # start away from the reference, so that the KL term has a gradient
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    cfg = train.Config(num_generations=2, max_completion_length=6, micro_batch_size=2, num_iterations=3, beta=0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    res = rwml.grpo_step(model, tok, opt, train.read_transitions(transitions)[:2], parity_reward, cfg)
    assert len(res["updates"]) == 3 and not any(u["skipped"] for u in res["updates"])
    assert res["updates"][0]["clip_ratio"] == 0.0  # first update: pi_theta == pi_old
    assert all(u["kl"] > 0 for u in res["updates"])
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters() if p.requires_grad)


def test_shared_prompt_forward_gives_the_same_update_as_the_plain_path(tiny_model, transitions):
    """The whole GRPO step (sampling, reward, old / ref / train forwards, optimizer) with and without the
    shared prompt forward: same samples, same loss, same KL, same weights afterwards
    (detaching the cache inside group_logprobs makes this test fail: k / v gradients flow through it)."""
    results = []
    for shared in (True, False):
        model, tok = rwml.load_model(tiny_model)
        torch.manual_seed(0)
        model = rwml.add_lora(model, r=4, alpha=8)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.05)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        cfg = train.Config(num_generations=3, max_completion_length=8, micro_batch_size=3, num_iterations=2, beta=0.1,
                           shared_prompt_forward=shared)
        torch.manual_seed(1)
        res = rwml.grpo_step(model, tok, opt, train.read_transitions(transitions)[3:5], parity_reward, cfg)
        results.append((res, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}))
    (a, wa), (b, wb) = results
    assert a["sample"] == b["sample"] and a["reward_std"] > 0 and a["updates"][1]["kl"] > 0
    for ua, ub in zip(a["updates"], b["updates"]):
        assert ua["loss"] == pytest.approx(ub["loss"], abs=1e-5) and ua["kl"] == pytest.approx(ub["kl"], abs=1e-6)
    for n in wa:
        assert torch.allclose(wa[n], wb[n], atol=1e-5), n
