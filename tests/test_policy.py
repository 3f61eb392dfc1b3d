"""Stage 2 (policy RL on task success) and the RWML reward controls, on the real ALFWorld engine."""
import json

import pytest
import torch

import engine
from stages import plumbing
import envs
import rwml
import train
from stages.settings import GRPOConfig
from envs import UserError
from stages.plumbing import read_jsonl
from reward import coin_reward, mis_targets


def record_turns(tiny_model, num_games=2, episodes_per_game=2, max_turns=3):
    model, tok = engine.load_model(tiny_model)
    games = envs.list_games("train", num_games, seed=0)
    turns = []
    torch.manual_seed(0)
    with envs.make("alfworld", num_workers=0, max_turns=max_turns) as env:
        summaries = rwml.play(model, tok, env,
                              [dict(game=g) for g in games for _ in range(episodes_per_game)],
                              max_new_tokens=6, num_envs=3, on_turn=turns.append,
                              record_tokens=True)
    return tok, turns, summaries


def test_every_turn_gets_its_episodes_advantage_and_environment_tokens_are_masked(tiny_model):
    tok, turns, summaries = record_turns(tiny_model)
    assert len(turns) == sum(s["steps"] for s in summaries) == 12
    adv = torch.tensor([1.5, -0.5, 0.0, 2.0])  # one per episode
    ids, attn, cmask, turn_adv, weights = rwml.policy_batch(turns, adv, tok.pad_token_id, "grpo", 6)
    C = cmask.shape[1]
    for j, t in enumerate(turns):
        assert turn_adv[j] == adv[t["episode"]]
        # the trained tokens are exactly the model's reply; the prompt, which holds every observation the
        # environment wrote, is outside the completion mask
        assert ids[j, -C:][cmask[j].bool()].tolist() == t["completion_ids"]
        assert ids[j, :-C][attn[j, :-C].bool()].tolist() == t["prompt_ids"]
        assert t["history"][-1]["observation"][:40] in tok.decode(t["prompt_ids"])
        assert (tok.decode(t["completion_ids"], skip_special_tokens=True)
                == t["response"][len(envs.AGENT_PREFIX):])
    # later turns' prompts hold the observations that earlier turns caused: those are never trained on
    later = [t for t in turns if t["step"] > 0]
    assert later and all(t["history"][-2]["action"] in tok.decode(t["prompt_ids"]) for t in later)
    assert torch.allclose(weights.sum(), torch.tensor(1.0))  # grpo: per-turn mean, then mean over turns

    # beta = 0: turns of zero-advantage episodes are dropped, the others keep the full batch's weights
    ids2, attn2, cmask2, adv2, w2 = rwml.policy_batch(turns, adv, tok.pad_token_id, "grpo", 6,
                                                      keep_zero_advantage=False)
    kept = [j for j, t in enumerate(turns) if adv[t["episode"]] != 0]
    assert ids2.shape[0] == len(kept) and torch.equal(adv2, turn_adv[kept])
    assert torch.allclose(w2.sum(1), weights[kept].sum(1))
    assert torch.equal(cmask2.sum(1), cmask[kept].sum(1))


def test_policy_step_with_all_equal_groups_trains_nothing(tiny_model):
    """The tiny model never wins: every group is all-equal, and with beta = 0 nothing is computed and the
    weights stay put."""
    model, tok = engine.load_model(tiny_model)
    model = engine.add_lora(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    cfg = GRPOConfig(num_generations=2, max_completion_length=6, beta=0.0)
    with envs.make("alfworld", num_workers=0, max_turns=2) as env:
        res = rwml.policy_step(model, tok, opt, env, envs.list_games("train", 2, seed=0), cfg, num_envs=4)
    assert res["reward_mean"] == 0 and res["frac_reward_zero_std"] == 1
    assert res["num_turns"] == 8 and res["trained_turns"] == 0 and res["updates"][0]["loss"] == 0
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters() if p.requires_grad)


def scripted_episode(tok, game: str, commands: list[str], episode: int, max_turns: int):
    """An episode on the real engine with the given commands, recorded as `play(record_tokens=True)` does:
    the agent prompt, and a reply "<think>..</think><action>command</action>" as token ids."""
    turns, past = [], []
    with envs.Alfworld(num_workers=0, max_turns=max_turns) as env:
        obs = env.reset({0: dict(game=game)})[0]["obs"]
        for step, command in enumerate(commands):
            prompt = env.prompt(0, past[-2:])
            reply = f"I will {command}.</think><action>{command}</action>"
            r = env.step({0: envs.AGENT_PREFIX + reply})[0]
            turns.append(dict(episode=episode, step=step, prompt=prompt, response=envs.AGENT_PREFIX + reply,
                              prompt_ids=tok(engine.chat(tok, prompt, env.system,
                                                       envs.AGENT_PREFIX))["input_ids"],
                              completion_ids=tok(reply)["input_ids"]))
            past.append((obs, r["action"]))
            obs = r["obs"]
            if r["done"]:
                break
    return turns, dict(won=r["won"], steps=len(turns), invalid=0)


def test_policy_update_raises_the_won_episodes_replies_and_lowers_the_lost_ones(tiny_model):
    """A group of two real episodes of one game: the expert walkthrough (won, by the engine's word) and a
    wrong one (lost). One stage-2 update makes the won episode's replies more likely and the lost one's
    less likely: the advantage reaches every turn with the right sign."""
    model, tok = engine.load_model(tiny_model)
    torch.manual_seed(0)
    model = engine.add_lora(model, r=8, alpha=16)
    game = envs.list_games("train", 1, seed=0)[0]
    walk = json.loads(open(game).read())["walkthrough"]
    won, s_won = scripted_episode(tok, game, walk, 0, len(walk))
    lost, s_lost = scripted_episode(tok, game, ["fly away"] * len(walk), 1, len(walk))
    assert s_won["won"] and not s_lost["won"]
    turns = won + lost
    ids, attn, cmask = engine.pack([t["prompt_ids"] for t in turns], [t["completion_ids"] for t in turns],
                                 tok.pad_token_id)

    def episode_logps():
        with torch.no_grad():
            lp = engine.completion_logprobs(model, ids, attn, cmask).sum(1)
        return float(lp[:len(won)].mean()), float(lp[len(won):].mean())

    before = episode_logps()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    cfg = GRPOConfig(num_generations=2, beta=0.0, micro_batch_size=4, max_completion_length=32,
                           loss_type="grpo", scale_rewards="group")  # the paper's GRPO
    res = rwml.policy_update(model, tok, opt, turns, [s_won, s_lost], cfg)
    after = episode_logps()
    assert (res["reward_mean"] == 0.5 and res["frac_reward_zero_std"] == 0
            and res["trained_turns"] == len(turns))
    assert after[0] > before[0] and after[1] < before[1], (before, after)


def adapter_with_weights(tiny_model, folder):
    """A saved LoRA adapter that is not the identity (as an RWML or WM-SFT run leaves one)."""
    model, _ = engine.load_model(tiny_model)
    torch.manual_seed(1)
    model = engine.add_lora(model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    model.save_pretrained(folder)
    return str(folder)


def test_kl_reference_is_the_frozen_init_adapter(tiny_model, tmp_path):
    adapter = adapter_with_weights(tiny_model, tmp_path / "rwml_adapter")
    cfg = train.Settings(model=tiny_model, init="rwml", adapter=adapter, beta=0.5, temperature=1.0,
                       micro_batch_size=4, num_iterations=1)
    model, tok = engine.load_model(tiny_model)
    model = train.start_adapter(cfg, model, adapter)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(".default." in n for n, p in model.named_parameters() if p.requires_grad)
    roll = engine.sample_chat(model, tok, ["go to desk 1", "open drawer 2"], system=envs.Alfworld.wm_system,
                            prefix=rwml.WM_PREFIX, stop=rwml.WM_STOP, n=2, max_new_tokens=6)
    args = roll.input_ids, roll.attention_mask, roll.completion_mask
    with torch.no_grad():
        policy = engine.completion_logprobs(model, *args)
        with rwml.reference_policy(model):
            ref = engine.completion_logprobs(model, *args)
        with model.disable_adapter():
            bare = engine.completion_logprobs(model, *args)
    assert torch.allclose(policy, ref)  # the reference is the starting adapter ...
    assert not torch.allclose(policy, bare, atol=1e-3)  # ... not the bare base model
    opt = torch.optim.AdamW(trainable, lr=5e-2)
    batch = rwml.Batch(input_ids=args[0], attention_mask=args[1], completion_mask=args[2],
                       advantages=torch.tensor([1.0, -1.0, 1.0, -1.0]),
                       weights=rwml.token_weights(roll.completion_mask, "grpo", 6))
    first = rwml.grpo_update(model, opt, batch, cfg)
    assert first[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # starts at its reference
    second = rwml.grpo_update(model, opt, batch, cfg)
    assert second[0]["kl"] > 0  # the policy moved away from it ...
    with torch.no_grad(), rwml.reference_policy(model):
        # ... and the reference did not move
        assert torch.allclose(engine.completion_logprobs(model, *args), ref)
    assert all(".default." in n for n, p in model.named_parameters() if p.requires_grad)
    train.save_checkpoint(tmp_path / "ckpt", model, opt, dict(step=2))
    assert not (tmp_path / "ckpt" / "ref").exists()  # only the trained adapter is saved


def test_policy_stage_end_to_end_from_an_adapter_with_resume(tiny_model, transitions, tmp_path):
    train.main(["wm-sft", "--model", tiny_model, "--transitions", transitions, "--sft-epochs", "1",
                "--out", str(tmp_path / "wm_sft")])
    assert (tmp_path / "wm_sft" / "adapter" / "adapter_config.json").is_file()
    args = ["policy", "--model", tiny_model, "--init", "wm-sft",
            "--adapter", str(tmp_path / "wm_sft" / "adapter"),
            "--num-games", "3", "--games-per-step", "1", "--num-generations", "2", "--max-turns", "2",
            "--max-new-tokens", "6", "--save-steps", "1", "--num-workers", "0",
            "--out", str(tmp_path / "policy")]
    train.main(args + ["--max-steps", "1"])
    with pytest.raises(UserError, match="--resume"):
        train.main(args + ["--max-steps", "2"])
    train.main(args + ["--max-steps", "2", "--resume"])
    rows = read_jsonl(tmp_path / "policy" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and all(r["num_turns"] == 4 for r in rows)
    saved = json.loads((tmp_path / "policy" / "adapter" / "adapter_config.json").read_text())
    assert saved["peft_type"] == "LORA" and (tmp_path / "policy" / "reward_curve.png").is_file()


@pytest.mark.parametrize("args, message", [
    (["--init", "rwml"], "needs --adapter"),
    (["--init", "base", "--adapter", "x"], "--init base starts from the bare model"),
    (["--init", "rwm"], "did you mean 'rwml'"),
])
def test_policy_init_errors(args, message):
    with pytest.raises(UserError, match=message):
        train.main(["policy", *args])


def test_mis_moves_every_target_to_another_text_where_it_can():
    for n, seed in ((2, 0), (5, 1), (17, 2), (100, 3)):
        targets = [f"obs {i % (n // 2 + 1)}" for i in range(n)]  # repeated texts, none over half
        new, unchanged = mis_targets(targets, seed)
        assert sorted(new) == sorted(targets) and unchanged == 0.0
        assert all(a != b for a, b in zip(new, targets))
    assert mis_targets(targets, 4)[0] != mis_targets(targets, 5)[0]  # random, not one fixed pairing
    # 90 % "Nothing happens.": at most 20 triplets can change text (10 others <-> 10 of the 90);
    # all of them do
    targets = ["Nothing happens."] * 90 + [f"You open the drawer {i}." for i in range(10)]
    new, unchanged = mis_targets(targets, 0)
    assert sorted(new) == sorted(targets) and unchanged == pytest.approx(0.8)
    assert all(a != b for a, b in zip(new, targets) if b != "Nothing happens.")


def test_mis_scores_each_triplet_against_another_ones_target(tiny_model, transitions, tmp_path):
    trips = plumbing.read_transitions(transitions)
    seen = []

    def recording_reward(completions, targets):
        seen.extend(targets)
        return [float(i % 2) for i in range(len(completions))]

    cfg = train.Settings(model=tiny_model, max_steps=len(trips) // 2, prompts_per_step=2, num_generations=2,
                       max_completion_length=4, reward_control="mis", save_steps=100)
    train.train_wm(cfg, trips, tmp_path / "mis", lambda: engine.load_model(tiny_model), recording_reward)
    state = dict(epoch=0, cursor=0)
    order = train.next_batch(state, len(trips), len(seen) // 2, cfg.seed)  # train_wm's data order
    mis, unchanged = mis_targets([t["next_obs"] for t in trips], cfg.seed)
    assert seen[::2] == seen[1::2] == [mis[i] for i in order]
    assert all(seen[2 * k] != trips[i]["next_obs"] for k, i in enumerate(order))  # never its own text
    assert json.loads((tmp_path / "mis" / "mis.json").read_text())["unchanged_share"] == unchanged == 0.0


def test_coin_reward_is_a_fair_coin_that_ignores_the_prediction():
    coin = coin_reward(seed=0)
    right = coin(["<next_state>You arrive at desk 1.</next_state>"] * 4000, ["You arrive at desk 1."] * 4000)
    wrong = coin([""] * 4000, ["You arrive at desk 1."] * 4000)
    assert 0.47 < sum(right) / 4000 < 0.53 and 0.47 < sum(wrong) / 4000 < 0.53
    assert set(right) == {0.0, 1.0}
    assert coin_reward(seed=3)(["a"] * 50) == coin_reward(seed=3)(["b"] * 50)  # reproducible by seed
