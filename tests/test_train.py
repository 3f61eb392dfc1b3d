"""Stage-1 training end to end on a tiny model: checkpoints, resume, skipped steps, 4-bit gradients."""
import dataclasses
import json
import math
import os

import pytest
import torch

import engine
from stages import plumbing
import envs
from stages import runs
import rwml
import train
from envs import UserError
from stages.plumbing import read_jsonl


def wm(tiny_model, transitions, out, max_steps, *extra):
    train.main(["wm", "--model", tiny_model, "--transitions", transitions, "--no-easy-filter", "--no-warmup",
                "--max-steps", str(max_steps), "--save-steps", "1", "--prompts-per-step", "2",
                "--num-generations", "2", "--max-completion-length", "8", "--micro-batch-size", "2",
                "--learning-rate", "1e-2", "--out", str(out), *extra])


def parity_reward(completions, targets):
    """A random tiny model never writes <next_state>, so r_WM would be 0 throughout and nothing would
    train; this reward is a fixed function of the completion text, so it is mixed and reproducible."""
    return [float(sum(map(ord, c)) % 2) for c in completions]


def wm_direct(tiny_model, transitions, out, max_steps, resume=False):
    cfg = train.Settings(model=tiny_model, max_steps=max_steps, save_steps=1, prompts_per_step=2,
                       num_generations=2, max_completion_length=8, micro_batch_size=2, learning_rate=1e-2,
                       beta=0.1, resume=resume)
    train.train_wm(cfg, plumbing.read_transitions(transitions), out, lambda: engine.load_model(tiny_model),
                   parity_reward)


def final_state(out):
    state = torch.load(out / "checkpoint" / "trainer_state.pt", weights_only=True)  # no pickled objects
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


class _Payload:  # a pickled object that runs code when unpickled (weights_only=False would run it)
    def __reduce__(self):
        return exec, ("import os; os.environ['RWML_UNPICKLED'] = '1'",)


def test_resume_refuses_a_checkpoint_with_pickled_objects(tiny_model, transitions, tmp_path, monkeypatch):
    monkeypatch.delenv("RWML_UNPICKLED", raising=False)
    wm_direct(tiny_model, transitions, tmp_path, 1)
    path = tmp_path / "checkpoint" / "trainer_state.pt"
    state = torch.load(path, weights_only=True)
    torch.save(dict(state, payload=_Payload()), path)  # as an older release, or someone else, might write
    with pytest.raises(UserError, match=r"trainer_state.pt holds pickled objects \(an older release wrote "
                       r"it\); delete .*checkpoint to start the run over, or resume it with the release"):
        wm_direct(tiny_model, transitions, tmp_path, 2, resume=True)
    assert "RWML_UNPICKLED" not in os.environ
    drop = lambda rows: [{k: v for k, v in r.items() if k != "seconds"} for r in rows]  # noqa: E731
    assert (drop(read_jsonl(tmp_path / "a" / "metrics.jsonl"))
            == drop(read_jsonl(tmp_path / "b" / "metrics.jsonl")))


def test_wm_outputs_peft_adapter_metrics_and_plot(tiny_model, transitions, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    wm(tiny_model, transitions, tmp_path, 2)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    # as --trainer trl's
    assert all(set(plumbing.WM_METRICS) | {"seconds", "format_rate"} <= r.keys() for r in rows)
    assert not any(old in r for r in rows for old in ("reward_mean", "lr", "completion_tokens", "clip_ratio"))
    assert (tmp_path / "reward_curve.png").read_bytes()[:4] == b"\x89PNG"
    assert read_jsonl(tmp_path / "samples.jsonl")
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), tmp_path / "adapter")
    assert any("lora_A" in n for n, _ in model.named_parameters())


def test_non_finite_loss_skips_the_step(tiny_model, transitions):
    model, tok = engine.load_model(tiny_model)
    model = engine.add_lora(model, r=4, alpha=8)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    cfg = train.Settings(num_generations=2, max_completion_length=6, micro_batch_size=2)
    trips = plumbing.read_transitions(transitions)[:2]
    res = rwml.grpo_step(model, tok, opt, trips, lambda c, t: [math.nan] * len(c), cfg, reasoning=False)
    assert res["updates"][0]["skipped"] and math.isnan(res["updates"][0]["loss"])
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if p.requires_grad)


def test_filter_stage_drops_most_easy_triplets_and_logs_the_easy_share(tiny_model, transitions, tmp_path):
    """The split, the SFT copy, easiness with a reward that is often 1 (so that easy triplets exist), the
    threshold rule, the keep rule, and the warm-up adapter kept on disk; filter.json logs the real easy
    share."""
    cfg = train.Settings(model=tiny_model, easy_filter=True, filter_samples=4, sft_epochs=1, filter_split=0.2,
                         max_completion_length=6, mixed_only=False)  # the paper's filter alone
    trips = plumbing.read_transitions(transitions)
    kept, warm = train.filter_triplets(cfg, trips, tmp_path, lambda: engine.load_model(tiny_model),
                                       parity_reward)
    info = json.loads((tmp_path / "filter.json").read_text())
    n = len(trips)
    assert info["num_triplets"] == n and info["num_filter_split"] == round(0.2 * n)
    assert info["num_train"] + info["num_filter_split"] == n
    rows = read_jsonl(tmp_path / "easiness.jsonl")
    assert len(rows) == info["num_train"] and info["num_kept"] == sum(r["kept"] for r in rows) == len(kept)
    tau = info["tau_easy"]
    assert tau is not None and all(r["easy"] == (r["easiness"] >= tau) for r in rows)  # the paper's rule
    easy = [r for r in rows if r["easy"]]
    assert len(easy) >= 4 and info["easy_share"] == len(easy) / len(rows)
    assert all(r["kept"] for r in rows if not r["easy"]) and sum(r["kept"] for r in easy) < len(easy) / 2
    assert (warm / "adapter_config.json").is_file()
    again, _ = train.filter_triplets(cfg, trips, tmp_path,
                                     lambda: pytest.fail("the cached filter reloaded the model"),
                                     parity_reward)
    assert again == kept


def test_the_mixed_only_filter_keeps_triplets_whose_predictions_disagree(tiny_model, transitions, tmp_path,
                                                                         capsys):
    """--mixed-only (the default): of the RWML split, exactly the triplets whose K predictions got rewards
    neither all 1 nor all 0 (their GRPO groups can carry a gradient); none mixed: all kept, said in a line."""
    cfg = train.Settings(model=tiny_model, filter_samples=4, sft_epochs=1, filter_split=0.2,
                         max_completion_length=6)
    trips, load = plumbing.read_transitions(transitions), lambda: engine.load_model(tiny_model)
    kept, _ = train.filter_triplets(cfg, trips, tmp_path / "a", load, parity_reward)
    rows = read_jsonl(tmp_path / "a" / "easiness.jsonl")
    mixed = [r for r in rows if 0 < r["easiness"] < 1]
    assert 0 < len(mixed) < len(rows) and [r["kept"] for r in rows] == [0 < r["easiness"] < 1 for r in rows]
    assert [t["next_obs"] for t in kept] == [r["next_obs"] for r in mixed]
    capsys.readouterr()
    kept, _ = train.filter_triplets(cfg, trips, tmp_path / "b", load, lambda c, t: [0.0] * len(c))
    assert len(kept) == len(rows) and "no triplet's K predictions were mixed" in capsys.readouterr().err


@pytest.fixture(scope="module")
def parrot(tmp_path_factory, tiny_model):
    """The tiny model fully fine-tuned to answer one world-model prompt with one long observation (over
    48 tokens: the filter's old sampling budget) and the closing tag."""
    import shutil

    folder = tmp_path_factory.mktemp("parrot")
    shutil.copytree(tiny_model, folder, dirs_exist_ok=True)
    model, tok = engine.load_model(str(folder))
    trip = dict(task="put a mug in the sink", history=[{"observation": "You are in the middle of a room."}],
                action="go to countertop 1", next_obs=LONG, game="g", step=0, rollout=0)
    torch.manual_seed(0)
    engine.sft(model, tok, [rwml.wm_prompt(trip, reasoning=False)] * 8, [rwml.wm_answer(trip)] * 8,
             system=rwml.wm_system(trip), prefix=rwml.wm_prefix(False), epochs=150, lr=3e-3)
    model.save_pretrained(folder)
    return str(folder), trip


LONG = "You arrive at countertop 1. On the countertop 1, you see a mug 1, a pen 2, and a spatula 3."


def test_a_long_target_can_be_easy(parrot, tmp_path):
    """The filter samples as many tokens as GRPO may write (max_completion_length): a target longer than
    the old fixed 48-token budget can be predicted whole and score 1."""
    from reward import SimToRealReward

    folder, trip = parrot
    tok = engine.load_model(folder)[1]
    assert len(tok(LONG)["input_ids"]) > 48
    cfg = train.Settings(model=folder, easy_filter=True, filter_split=0.4, sft_epochs=1,
                         sft_learning_rate=1e-6, filter_samples=4,
                         max_completion_length=len(tok(LONG + "</next_state>")["input_ids"]) + 4)
    trips = [dict(trip, step=i) for i in range(10)]
    train.filter_triplets(cfg, trips, tmp_path, lambda: engine.load_model(folder), SimToRealReward())
    rows = read_jsonl(tmp_path / "easiness.jsonl")
    assert sum(r["easiness"] for r in rows) / len(rows) > 0.5


def test_4bit_lora_gradients_survive_generate(tiny_model):
    bnb = pytest.importorskip("bitsandbytes")
    try:
        model, tok = engine.load_model(tiny_model, load_in_4bit=True, device="cpu")
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"bitsandbytes cannot run 4-bit here: {e}")
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    model = engine.add_lora(model, r=4, alpha=8)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    torch.manual_seed(0)
    roll = engine.sample_chat(model, tok, ["go to desk 1"], n=2, max_new_tokens=6)

    def grads():
        model.zero_grad()
        lp = engine.completion_logprobs(model, roll.input_ids, roll.attention_mask, roll.completion_mask)
        (-lp.sum()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    first = grads()
    # the eval-mode no-grad forward
    engine.sample_chat(model, tok, ["open drawer 1"], max_new_tokens=4, temperature=0)
    second = grads()
    assert all(torch.allclose(first[n], second[n], rtol=1e-4, atol=1e-7) for n in first)
    assert any(g.abs().sum() > 0 for g in first.values())


def test_num_iterations_reuses_one_batch_for_several_updates(tiny_model, transitions):
    model, tok = engine.load_model(tiny_model)
    torch.manual_seed(0)
    model = engine.add_lora(model, r=4, alpha=8)
    with torch.no_grad():  # start away from the reference, so that the KL term has a gradient
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    cfg = train.Settings(num_generations=2, max_completion_length=6, micro_batch_size=2, num_iterations=3,
                       beta=0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    res = rwml.grpo_step(model, tok, opt, plumbing.read_transitions(transitions)[:2], parity_reward, cfg,
                         reasoning=False)
    assert len(res["updates"]) == 3 and not any(u["skipped"] for u in res["updates"])
    assert res["updates"][0]["clip_ratio"] == 0.0  # first update: pi_theta == pi_old
    assert all(u["kl"] > 0 for u in res["updates"])
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters() if p.requires_grad)


def test_shared_prompt_forward_gives_the_same_update_as_the_plain_path(lora_model, transitions):
    """The whole GRPO step (sampling, reward, old / ref / train forwards, optimizer) with and without the
    shared prompt forward: same samples, same loss, same KL, same weights afterwards
    (detaching the cache inside group_logprobs makes this test fail: k / v gradients flow through it)."""
    results = []
    for shared in (True, False):
        model, tok = lora_model(seed=0, std=0.05)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        cfg = train.Settings(num_generations=3, max_completion_length=8, micro_batch_size=3, num_iterations=2,
                           beta=0.1, shared_prompt_forward=shared)
        torch.manual_seed(1)
        res = rwml.grpo_step(model, tok, opt, plumbing.read_transitions(transitions)[3:5], parity_reward, cfg,
                             reasoning=False)
        results.append((res, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}))
    (a, wa), (b, wb) = results
    assert a["sample"] == b["sample"] and a["reward_std"] > 0 and a["updates"][1]["kl"] > 0
    for ua, ub in zip(a["updates"], b["updates"]):
        assert (ua["loss"] == pytest.approx(ub["loss"], abs=1e-5)
                and ua["kl"] == pytest.approx(ub["kl"], abs=1e-6))
    for n in wa:
        assert torch.allclose(wa[n], wb[n], atol=1e-5), n


def test_every_tensor_reaching_the_loss_is_on_the_models_device(tiny_model, transitions, monkeypatch):
    """Stage 1 and stage 2 with the model on a device that is not the CPU (PyTorch's meta device stands in
    for a GPU; sampling and the forward, which meta cannot run, return tensors on the model's device as
    they would on a GPU). Rewards and advantages are built on the CPU: every tensor reaching grpo_loss must
    be on the model's device. (Stage 1 once crashed on CUDA here: advantages stayed on the CPU.)"""
    class Reached(Exception):
        pass

    seen = []

    def checking_loss(logp, old_logp, ref_logp, advantages, weights, **kw):
        seen.extend(t.device for t in (logp, old_logp, ref_logp, advantages, weights) if t is not None)
        raise Reached

    model, tok = engine.load_model(tiny_model)
    model = engine.add_lora(model, r=4, alpha=8)
    trips = plumbing.read_transitions(transitions)[:2]
    cfg = train.Settings(num_generations=2, max_completion_length=6, micro_batch_size=4, beta=0.1,
                       num_iterations=2)
    torch.manual_seed(0)
    roll = rwml.sample_predictions(model, tok, trips, reasoning=False, n=2, max_new_tokens=6)
    turns = []
    with envs.make("alfworld", num_workers=0, max_turns=2) as env:
        summaries = rwml.rollouts(model, tok, env, envs.list_games("train", 1, seed=0), 2, max_new_tokens=4,
                                  on_turn=turns.append)
    summaries[0]["won"] = True  # a mixed group, so that stage 2 has turns to train on
    model.to("meta")
    assert model.device.type == "meta"
    # the sampled batch stays on the CPU here (the micro-batch cut reads its lengths, which meta cannot):
    # the update must still move every tensor of it to the model's device
    on_device = roll
    monkeypatch.setattr(rwml, "sample_chat", lambda *a, **k: on_device)
    monkeypatch.setattr(rwml, "rollouts",
                        lambda *a, on_turn=None, **k: [on_turn(t) for t in turns] and summaries)
    monkeypatch.setattr(rwml, "group_logprobs",
                        lambda model, p, pm, c, cm, **k: torch.zeros(cm.shape, device=model.device))
    monkeypatch.setattr(rwml, "completion_logprobs",
                        lambda model, i, a, cm, **k: torch.zeros(cm.shape, device=model.device))
    monkeypatch.setattr(rwml, "grpo_loss", checking_loss)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    reward = lambda completions, targets: [float(i % 2) for i in range(len(completions))]  # noqa: E731
    with pytest.raises(Reached):
        rwml.grpo_step(model, tok, opt, trips, reward, cfg, reasoning=False)
    with pytest.raises(Reached):
        rwml.policy_step(model, tok, opt, None, ["game"], cfg)
    assert len(seen) >= 8 and all(d.type == "meta" for d in seen), seen


def test_coin_control_resumes_with_the_same_coins(tiny_model, transitions, tmp_path):
    """The coin's random state is in the checkpoint: an interrupted-then-resumed COIN run flips the same
    coins, so its metrics and weights equal an uninterrupted run's."""
    def run(out, steps, resume=False):
        cfg = train.Settings(model=tiny_model, max_steps=steps, save_steps=1, prompts_per_step=2,
                           num_generations=2, max_completion_length=6, micro_batch_size=2, learning_rate=1e-2,
                           reward_control="coin", warmup=False, resume=resume)
        trips = plumbing.read_transitions(transitions)
        train.train_wm(cfg, trips, out, lambda: engine.load_model(tiny_model), None)

    run(tmp_path / "a", 4)
    run(tmp_path / "b", 2)
    run(tmp_path / "b", 4, resume=True)
    rewards = lambda out: [r["reward"] for r in read_jsonl(out / "metrics.jsonl")]  # noqa: E731
    assert rewards(tmp_path / "a") == rewards(tmp_path / "b")
    (_, wa), (_, wb) = final_state(tmp_path / "a"), final_state(tmp_path / "b")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_rwml_from_the_warmup_trains_it_on_and_keeps_it_as_the_reference(tiny_model, lora_model, transitions,
                                                                         tmp_path):
    """With warm-up, RWML's adapter starts as the warm-up adapter (not a fresh one) and the KL reference is a
    frozen copy of it (not the bare base model): KL 0 at the first update, > 0 after; the reference
    unchanged."""
    from safetensors.torch import load_file

    model, _ = lora_model(seed=3, std=0.3)
    model.save_pretrained(tmp_path / "warm")
    warm = load_file(tmp_path / "warm" / "adapter_model.safetensors")
    cfg = train.Settings(model=tiny_model, max_steps=2, save_steps=1, prompts_per_step=2, num_generations=2,
                       max_completion_length=6, micro_batch_size=2, learning_rate=5e-2, beta=0.5, lora_r=4,
                       lora_alpha=8)
    peft = train.train_wm(cfg, plumbing.read_transitions(transitions), tmp_path / "run",
                          lambda: engine.load_model(tiny_model), parity_reward, start=tmp_path / "warm")
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-7) and rows[1]["kl"] > 0
    ref = {k.replace(".ref.", "."): v for k, v in peft.state_dict().items() if ".ref." in k}
    assert ref and all(torch.equal(ref[k], warm[k]) for k in warm)  # the reference did not move
    trained = load_file(tmp_path / "run" / "adapter" / "adapter_model.safetensors")
    assert trained.keys() == warm.keys() and any(not torch.equal(trained[k], warm[k]) for k in warm)


def test_wm_sft_control_sees_rwmls_triplets_in_rwmls_order(tiny_model, transitions, tmp_path, monkeypatch):
    """The matched WM-SFT control: the same kept triplets, the same order, the same number of updates."""
    seen_rwml, seen_sft = [], []
    reward = lambda completions, targets: seen_rwml.extend(targets[::2]) or [0.0] * len(completions)  # noqa: E731
    args = dict(model=tiny_model, max_steps=3, prompts_per_step=2, num_generations=2, max_completion_length=4,
                save_steps=10, easy_filter=False, mixed_only=False, sft_epochs=1,
                filter_dir=str(tmp_path / "filter"))
    trips = plumbing.read_transitions(transitions)
    kept, start = train.filter_triplets(train.Settings(**args), trips, tmp_path / "filter",
                                        lambda: engine.load_model(tiny_model), reward)
    train.train_wm(train.Settings(**args), kept, tmp_path / "rwml", lambda: engine.load_model(tiny_model),
                   reward, start)
    real_sft = engine.sft

    def recording_sft(model, tok, prompts, answers, **kw):
        seen_sft.extend(a[:-len("</next_state>")] for a in answers)
        assert kw["batch_size"] == 2 and kw["epochs"] == 1 and not kw["shuffle"]
        return real_sft(model, tok, prompts, answers, **kw)

    monkeypatch.setattr(engine, "sft", recording_sft)
    train.train_wm_sft(train.Settings(**args), trips, tmp_path / "sft", lambda: engine.load_model(tiny_model),
                       reward)
    assert len(seen_rwml) == 6 and seen_sft == seen_rwml


def test_eval_steps_draws_the_heldout_curve_without_changing_training(tiny_model, transitions, tmp_path):
    """wm --eval-steps: held-out world-model accuracy at step 0 (--eval-on-start), every N steps and at the
    end, as eval_* in metrics.jsonl; the evaluations leave the training's random state alone, so the run
    trains exactly as one without them."""
    common = ["wm", "--model", tiny_model, "--transitions", transitions, "--no-easy-filter", "--no-warmup",
              "--max-steps", "3", "--prompts-per-step", "2", "--num-generations", "2",
              "--max-completion-length", "8"]
    train.main(common + ["--out", str(tmp_path / "plain")])
    train.main(common + ["--eval-steps", "2", "--eval-on-start", "--eval-transitions", transitions,
                         "--eval-max-triplets", "3", "--eval-samples", "2", "--out", str(tmp_path / "curve")])
    plain, curve = (read_jsonl(tmp_path / "plain" / "metrics.jsonl"),
                    read_jsonl(tmp_path / "curve" / "metrics.jsonl"))
    assert [r["step"] for r in curve] == [0, 1, 2, 3] and "reward" not in curve[0]
    assert [("eval_wm_accuracy" in r) for r in curve] == [True, False, True, True]
    assert all(0 <= r["eval_wm_accuracy"] <= 1 for r in curve if "eval_wm_accuracy" in r)
    drop = lambda r: {k: v for k, v in r.items() if k != "seconds" and not k.startswith("eval_")}  # noqa: E731
    assert [drop(r) for r in curve[1:]] == [drop(r) for r in plain]
    with pytest.raises(UserError, match="--eval-transitions"):
        train.main(common + ["--eval-steps", "2", "--out", str(tmp_path / "none")])


def test_the_warm_up_can_train_on_more_triplets_than_its_split(parrot, tmp_path, capsys):
    """A dev lever (lab/results/wm_dev): --warmup-transitions adds triplets to the warm-up's SFT, never
    to GRPO's kept set; its content is part of the filter's cache key (another file: made again; the same
    bytes elsewhere: reused), as are the triplets'; a missing file is one line that names the flag."""
    from reward import SimToRealReward

    folder, trip = parrot
    trips = [dict(trip, step=i) for i in range(10)]
    more = tmp_path / "more.jsonl"
    more.write_text("".join(json.dumps(dict(trip, step=100 + i, game="other")) + "\n" for i in range(7)))
    cfg = train.Settings(model=folder, filter_split=0.4, sft_epochs=1, filter_samples=2,
                         warmup_transitions=str(more))
    kept, warm = train.filter_triplets(cfg, trips, tmp_path / "f", lambda: engine.load_model(folder),
                                       SimToRealReward())
    info = json.loads((tmp_path / "f" / "filter.json").read_text())
    assert info["more_warmup_triplets"] == 7 and info["num_filter_split"] == 4
    assert all(t["game"] != "other" for t in kept)  # GRPO never sees them
    assert "- data: more warm-up triplets: 7" in (warm / "README.md").read_text()
    plain = dataclasses.replace(cfg, warmup_transitions=None)
    assert runs.filter_cache(plain, trips, tmp_path / "f")[1] is None  # another warm-up: not reused
    assert runs.filter_cache(cfg, trips, tmp_path / "f")[1] is not None
    moved = tmp_path / "elsewhere.jsonl"  # keyed by content: the same file elsewhere (another run's folder)
    moved.write_bytes(more.read_bytes())
    there = dataclasses.replace(cfg, warmup_transitions=str(moved))
    assert runs.filter_cache(there, trips, tmp_path / "f")[1] is not None
    moved.write_text(more.read_text().replace('"step": 100', '"step": 99'))  # a triplet changed: made again
    assert runs.filter_cache(there, trips, tmp_path / "f")[1] is None
    changed = trips[:-1] + [dict(trips[-1], next_obs="other")]
    assert runs.filter_cache(cfg, changed, tmp_path / "f")[1] is None
    with pytest.raises(UserError, match="--warmup-transitions: .*nosuch.jsonl not found"):
        train.filter_triplets(dataclasses.replace(cfg, warmup_transitions=str(tmp_path / "nosuch.jsonl")),
                              trips, tmp_path / "g", lambda: engine.load_model(folder), SimToRealReward())
