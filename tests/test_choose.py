"""--action-mode choose (the policy is the LM's softmax over the turn's admissible commands), its stage 2, and
TextWorld's generated games: real ALFWorld and TextWorld engines, tiny models built in code."""
import json

import pytest
import torch

import choose
from worlds import textworld
import engine
from stages import plumbing
import envs
import eval as evaluate
import rwml
import train
from stages.settings import GRPOConfig
from envs import UserError
import reports

TRIPLET_KEYS = {"game", "task", "task_type", "rollout", "episode", "step", "history", "action", "next_obs",
                "valid", "format_ok", "won", "done", "response", "explored"}


def first_turn(game=None):
    """The agent's choose-mode prompt and admissible commands at the start of a real ALFWorld game."""
    with envs.Alfworld(num_workers=0, max_turns=5) as env:
        env.reset({0: dict(game=game or envs.list_games("train", 1, seed=0)[0])})
        return env.choice_prompt(0, []), env.admissible(0), env.system


def naive_logprob(model, prompt_ids, candidate):
    """log p(candidate | prompt) the slow way: the model's own forward on [prompt | candidate], full
    logits."""
    ids = torch.tensor([prompt_ids + candidate])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1].float()
    return float(logits.log_softmax(-1).gather(-1, torch.tensor(candidate)[:, None]).sum())


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_choice_probabilities_sum_to_one_and_equal_one_forward_per_candidate(lora_model, temperature):
    model, tok = lora_model(seed=0, std=0.05)
    model.eval()
    prompt, commands, system = first_turn()
    assert len(commands) > 5
    prompt_ids, cands = choose.choice_inputs(tok, prompt, commands, system)
    assert tok.decode(cands[0]) == commands[0] + choose.CHOICE_END
    with torch.no_grad():
        # one prompt forward, all candidates on its cache
        scores = choose.candidate_scores(model, prompt_ids, cands)
    naive = torch.tensor([naive_logprob(model, prompt_ids, c) for c in cands])  # one forward per candidate
    assert torch.allclose(scores, naive, atol=1e-4), (scores - naive).abs().max()
    logp = choose.choice_logprobs(scores, temperature)
    assert float(logp.exp().sum()) == pytest.approx(1.0, abs=1e-5)
    # log space: byte-level candidates are long, and far apart
    want = torch.log_softmax(naive / temperature, -1)
    assert torch.allclose(logp, want, atol=1e-3)
    # the training path (gradients on, in micro-batches) gives the same log pi(a|s) of the choice
    batch = choose.ChoiceBatch(choices=[(prompt_ids, cands, 3), (prompt_ids, cands, 0)],
                               completion_mask=torch.ones(2, 1), advantages=torch.zeros(2),
                               weights=torch.ones(2, 1))
    cfg = GRPOConfig(temperature=temperature)
    trained = choose.CHOOSE.logprobs(model, batch, cfg)
    assert trained.shape == (2, 1) and trained.requires_grad
    assert torch.allclose(trained.detach()[:, 0], want[[3, 0]], atol=1e-3)


def choose_turns(tiny_model, env_name="alfworld", games=None, episodes_per_game=2, max_turns=3,
                 temperature=1.0):
    model, tok = engine.load_model(tiny_model)
    games = games or envs.list_games("train", 2, seed=0)
    turns = []
    torch.manual_seed(0)
    with envs.make(env_name, num_workers=0, max_turns=max_turns) as env:
        summaries = rwml.play(model, tok, env,
                              [dict(game=g) for g in games for _ in range(episodes_per_game)],
                              num_envs=3, on_turn=turns.append, record_tokens=True, actor=choose.CHOOSE,
                              temperature=temperature)
    return model, tok, turns, summaries


def test_choose_mode_plays_only_admissible_commands_and_records_the_choice(tiny_model):
    _, tok, turns, summaries = choose_turns(tiny_model)
    assert len(turns) == sum(s["steps"] for s in summaries) == 12
    assert sum(s["invalid"] for s in summaries) == 0 and sum(s["format_errors"] for s in summaries) == 0
    for t in turns:
        assert t["valid"] and t["format_ok"] and t["response"] == f"<action>{t['action']}</action>"
        assert TRIPLET_KEYS <= t.keys()
        chosen = tok.decode(t["candidate_ids"][t["choice"]])
        assert (chosen == t["action"] + choose.CHOICE_END
                and t["completion_ids"] == t["candidate_ids"][t["choice"]])
        assert t["history"][-1]["observation"][:40] in tok.decode(t["prompt_ids"])


def scripted_choices(tok, game, pick, episode, max_turns):
    """An episode on the real engine in which `pick(admissible, step)` chooses each command, recorded as
    `play(record_tokens=True, actor=choose.CHOOSE)` records it."""
    turns, past = [], []
    with envs.Alfworld(num_workers=0, max_turns=max_turns) as env:
        obs = env.reset({0: dict(game=game)})[0]["obs"]
        for step in range(max_turns):
            prompt, commands = env.choice_prompt(0, past[-1:]), env.admissible(0)
            k = commands.index(pick(commands, step))
            prompt_ids, cands = choose.choice_inputs(tok, prompt, commands, env.system)
            r = env.step({0: f"<action>{commands[k]}</action>"})[0]
            turns.append(dict(episode=episode, step=step, prompt_ids=prompt_ids, candidate_ids=cands,
                              choice=k, response=f"<action>{commands[k]}</action>"))
            past.append((obs, r["action"]))
            obs = r["obs"]
            if r["done"]:
                break
    return turns, dict(won=r["won"], steps=len(turns), invalid=0)


def test_a_positive_advantage_raises_the_chosen_commands_probability(tiny_model):
    """A group of two real episodes of one game: the expert walkthrough picked from the admissible list (won,
    by the engine's word) and "look" every turn (lost). One stage-2 update raises log pi(a|s) of the won
    episode's choices and lowers the lost one's: the exact choice probability, normaliser included, trains."""
    model, tok = engine.load_model(tiny_model)
    torch.manual_seed(0)
    model = engine.add_lora(model, r=8, alpha=16)
    game = envs.list_games("train", 1, seed=0)[0]
    walk = json.loads(open(game).read())["walkthrough"]
    won, s_won = scripted_choices(tok, game, lambda cs, i: walk[i], 0, len(walk))
    lost, s_lost = scripted_choices(tok, game, lambda cs, i: "look", 1, len(walk))
    assert s_won["won"] and not s_lost["won"]
    turns = won + lost
    cfg, keep = GRPOConfig(num_generations=2, beta=0.0, micro_batch_size=4), GRPOConfig(beta=0.1)

    def chosen_logps():
        with torch.no_grad():
            lp = choose.CHOOSE.logprobs(model, choose.CHOOSE.batch(turns, torch.zeros(2), keep), cfg)[:, 0]
        return float(lp[:len(won)].mean()), float(lp[len(won):].mean())

    before = chosen_logps()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    res = rwml.policy_update(model, tok, opt, turns, [s_won, s_lost], cfg, choose.CHOOSE)
    after = chosen_logps()
    assert res["reward_mean"] == 0.5 and res["trained_turns"] == len(turns) and res["completion_tokens"] == 1
    assert after[0] > before[0] and after[1] < before[1], (before, after)


def test_collect_in_choose_mode_writes_the_same_triplet_fields(tiny_model, tmp_path):
    common = ["collect", "--model", tiny_model, "--num-games", "2", "--max-turns", "3",
              "--max-new-tokens", "6", "--num-workers", "0", "--history-len", "2", "--explore-prob", "0.3"]
    train.main(common + ["--out", str(tmp_path / "generate")])
    train.main(common + ["--action-mode", "choose", "--out", str(tmp_path / "choose")])
    gen, cho = ([json.loads(line) for line in (tmp_path / m / "transitions.jsonl").read_text().splitlines()]
                for m in ("generate", "choose"))
    assert len(gen) == len(cho) == 6
    assert {frozenset(t) for t in gen} == {frozenset(t) for t in cho}  # the same record fields, every turn
    assert all(t["valid"] and t["format_ok"] for t in cho)  # the choice is an admissible command
    assert all(t["action"] == envs.parse_action(t["response"])[0] for t in cho if not t["explored"])
    # the world-model prompt of a choose-mode triplet is built as any other's
    assert cho[1]["action"] in rwml.wm_prompt(cho[1]) and plumbing.shape_problem(cho[1]) is None


def test_choose_mode_on_tau2_is_one_line_before_any_model_loads(tmp_path):
    for main, args in ((train.main, ["collect"]), (train.main, ["policy"]), (evaluate.main, ["agent"])):
        with pytest.raises(UserError, match="tau2 has no such list"):
            main(args + ["--env", "tau2", "--action-mode", "choose", "--model", str(tmp_path / "no-model"),
                         "--out", str(tmp_path / "out.json")])


def test_a_turn_without_admissible_commands_is_an_error_naming_the_game():
    game = envs.list_games("train", 1, seed=0)[0]
    with envs.Alfworld(num_workers=0, max_turns=5) as env:
        env.reset({0: dict(game=game)})
        env.state[0]["admissible"] = []  # as an engine that lists none would leave it
        with pytest.raises(UserError, match=f"game {envs.game_id(game)} offers no admissible commands"):
            env.admissible(0)


# ----------------------------------------------------------------------------- TextWorld generated games

def walkthrough(path):
    import textworld

    env = textworld.start(path, textworld.EnvInfos(policy_commands=True))
    try:
        return env.reset()["policy_commands"]
    finally:
        env.close()


def test_textworld_games_are_generated_by_split_and_seed_and_won_by_their_walkthrough():
    test = textworld.textworld_games("test", 3, seed=0)
    assert test == textworld.textworld_games("test", 3, seed=0)  # the same draw: cached files
    dev = textworld.textworld_games("dev", 3, seed=0)
    train_games = textworld.textworld_games("train", 3, seed=0)
    assert not set(test) & set(dev) and not set(test) & set(train_games)  # disjoint game seeds
    assert textworld.textworld_games("test", 3, seed=1) != test
    with envs.make("textworld", num_workers=1, max_turns=20) as env:
        start = env.reset({0: dict(game=test[0])})[0]
        assert start["game"] == envs.game_id(test[0]) and start["task_type"] == "textworld"
        assert start["obs"].startswith("-= ") and "$$" not in start["obs"]  # the room, not the banner
        assert start["task"] and env.admissible(0)
        for command in walkthrough(test[0]):
            assert command in env.admissible(0)
            r = env.step({0: f"<action>{command}</action>"})[0]
            assert r["valid"] and not r["obs"].endswith(">")
        assert r["won"] and r["done"]
        env.reset({0: dict(game=test[1])})
        r = env.step({0: "<action>fly away</action>"})[0]
        assert not r["valid"] and r["counts"]["invalid"] and not r["won"]


def test_textworld_choose_mode_and_random_baseline_end_to_end(tiny_model, tmp_path):
    """`eval.py agent --policy random` needs no model (the model path does not exist); choose mode plays
    with 0 invalid actions; both on generated TextWorld test games."""
    out = tmp_path / "random.json"
    evaluate.main(["agent", "--env", "textworld", "--policy", "random", "--num-games", "4",
                   "--max-turns", "10", "--seeds", "2", "--num-workers", "0",
                   "--model", str(tmp_path / "no-model"), "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["split"] == "test" and r["num_episodes"] == 8 and r["invalid_action_rate"] == 0
    assert 0 < r["success_rate"] <= 1  # a random admissible policy wins some 2-step quests in 10 steps
    out = tmp_path / "choose.json"
    evaluate.main(["agent", "--env", "textworld", "--action-mode", "choose", "--model", tiny_model,
                   "--num-games", "2", "--max-turns", "3", "--num-workers", "0", "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["num_episodes"] == 2 and r["invalid_action_rate"] == 0 and r["format_error_rate"] == 0
    greedy = [(e["game"], e["steps"], e["won"]) for e in r["episodes"]]
    out = tmp_path / "sampled.json"  # --sampled: the policy stage 2 trains, --seeds episodes of every game
    evaluate.main(["agent", "--env", "textworld", "--action-mode", "choose", "--model", tiny_model,
                   "--num-games", "2", "--max-turns", "3", "--num-workers", "0", "--sampled", "--temperature",
                   "1.0", "--seeds", "4", "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["num_episodes"] == 8 and sorted({e["seed"] for e in r["episodes"]}) == [0, 1, 2, 3]
    assert sorted({e["game"] for e in r["episodes"]}) == sorted({g for g, _, _ in greedy})


def test_policy_stage_in_choose_mode_on_textworld_with_its_learning_curve(tiny_model, tmp_path):
    """Stage 2 in choose mode; --eval-steps / --eval-on-start play the dev games greedily before step 1 and
    after every step:
    the curve's points are in metrics.jsonl, and each of their episodes in eval_episodes.jsonl."""
    train.main(["policy", "--env", "textworld", "--action-mode", "choose", "--model", tiny_model,
                "--num-games", "2", "--games-per-step", "1", "--num-generations", "2", "--max-turns", "3",
                "--max-steps", "2", "--beta", "0.1", "--num-workers", "0", "--eval-steps", "1",
                "--eval-on-start", "--eval-games", "2", "--out", str(tmp_path / "policy")])
    rows = train.read_jsonl(tmp_path / "policy" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2] and "reward" not in rows[0]
    assert all(r["invalid_action_rate"] == 0 and r["trained_turns"] == r["num_turns"] for r in rows[1:])
    assert all(0 <= r["eval_success"] <= 1 and r["eval_invalid"] == 0 for r in rows)
    episodes = train.read_jsonl(tmp_path / "policy" / "eval_episodes.jsonl")
    dev = {envs.game_name(g) for g in textworld.textworld_games("dev", 2, seed=0)}
    assert [e["step"] for e in episodes] == [0, 0, 1, 1, 2, 2] and {e["game"] for e in episodes} == dev
    assert rows[2]["eval_success"] == sum(e["won"] for e in episodes[4:]) / 2
    assert (tmp_path / "policy" / "adapter" / "adapter_config.json").is_file()
    with pytest.raises(UserError, match="the split stage 2 trains on"):
        train.main(["policy", "--env", "textworld", "--eval-steps", "1", "--eval-split", "train",
                    "--model", str(tmp_path / "no-model"), "--out", str(tmp_path / "p2")])


@pytest.mark.parametrize("args, message", [
    (["--env", "textworld", "--split", "valid_seen"], "unknown TextWorld split 'valid_seen'"),
    (["--env", "textworld", "--quest-length", "0"], "--quest-length"),
    (["--env", "textwrld"], "did you mean 'textworld'"),
    (["--action-mode", "chose"], "did you mean 'choose'"),
])
def test_textworld_and_action_mode_errors(args, message, tmp_path):
    with pytest.raises(UserError, match=message):
        train.main(["collect", "--model", str(tmp_path / "no-model"), "--out", str(tmp_path / "c"), *args])


def _agent_eval(per_split: dict) -> str:  # an `eval.py agent` result, reduced to what the table reads
    return json.dumps(dict(per_split={sp: dict(success_rate=r, success_rate_std=sd, num_episodes=n,
                                               num_games=g)
                                      for sp, (r, sd, n, g) in per_split.items()}))


def test_agent_table_gives_each_arm_and_the_spread_over_seeds_and_draws_the_curve(tmp_path, monkeypatch):
    """agent_sanity.sh's layout -> the five-arm table: single evaluations as they are, stage-2 arms as mean
    ± sd over seeds (dev = the final evaluation's, else the curve's last point), both splits pooled, the
    random baseline; the curve runs from the start's dev score to the final evaluation's."""
    from test_reports_malformed import agent_folder  # the layout's builder, shared

    agent_folder(tmp_path)
    png = tmp_path / "curve.png"
    text = reports.agent_report(tmp_path, png)
    assert "| uniform random admissible | 30.0 ± 5.0 | 40.0 ± 10.0 | 35.0 | 30 | 3 |" in text
    assert "| base | 0.0 | 10.0 | 5.0 | 10 | – |" in text and "| RWML | 10.0 | 20.0 | 15.0 | 10 | – |" in text
    assert ("| policy RL | 40.0 ± 10.0 (50 / 30 / 40) | 30.0 ± 10.0 (40 / 20 / 30) | "
            "– | 10 | 0, 1, 2 |") in text
    assert png.is_file() and png.stat().st_size > 1000
    # the final evaluation played the dev games too (20 of them): the table takes it, pooled with the test
    # games, and it is the curve's last point (the run's step-4 row on its own --eval-games gives way to it)
    (tmp_path / "base" / "eval_agent.json").write_text(_agent_eval(dict(dev=(0.05, 0.0, 20, 20),
                                                                        test=(0.1, 0.0, 20, 20))))
    for d in tmp_path.glob("seed*/policy"):
        (d / "eval_agent.json").write_text(_agent_eval(dict(dev=(0.25, 0.0, 20, 20),
                                                            test=(0.5, 0.0, 20, 20))))
    drawn = {}
    monkeypatch.setattr(reports, "plot_curves", lambda curves, png, **kw: drawn.update(curves))
    text = reports.agent_report(tmp_path, png)
    assert sorted(drawn["policy RL"]) == [[(0, 5.0), (2, 100 * m), (4, 25.0)] for m in (0.1, 0.2, 0.3)]
    # no final dev: the rows
    assert drawn["RWML + policy RL"][0] == [(0, 10.0), (2, 100 * 0.2), (4, 100 * 0.5)]
    assert ("| policy RL | 25.0 ± 0.0 (25 / 25 / 25) | 50.0 ± 0.0 (50 / 50 / 50) | "
            "37.5 ± 0.0 (38 / 38 / 38) | 20 |") in text
    assert "| base | 5.0 | 10.0 | 7.5 | 20 | – |" in text
    with pytest.raises(UserError, match="run agent_sanity.sh first"):
        reports.agent_report(tmp_path / "base")


def test_choose_mode_update_cut_by_a_token_budget_is_the_same_update(tiny_model):
    """Stage 2's choose-mode turns go into micro-batches by their tokens (prompt + every candidate, as in
    `micro_batch_tokens`), so memory follows the budget, not the number of trained turns; the update equals
    the whole batch's at once."""
    model, tok = engine.load_model(tiny_model)
    game = envs.list_games("train", 1, seed=0)[0]
    walk = json.loads(open(game).read())["walkthrough"]
    won, _ = scripted_choices(tok, game, lambda cs, i: walk[i], 0, len(walk))
    lost, _ = scripted_choices(tok, game, lambda cs, i: "look", 1, len(walk))
    batch = choose.CHOOSE.batch(won + lost, torch.tensor([1.0, -1.0]), GRPOConfig(beta=0.1))
    tokens = [len(p) + sum(map(len, c)) for p, c, _ in batch.choices]
    budget = max(tokens) + 1  # about one turn a micro-batch
    cuts = choose.CHOOSE.micro_batches(batch, 8, budget)
    assert len(cuts) > len(choose.CHOOSE.micro_batches(batch, 8, 0)) == -(-len(tokens) // 8)
    assert all(len(mb.choices) == 1
               or sum(len(p) + sum(map(len, c)) for p, c, _ in mb.choices) <= budget
               for mb in cuts)
    assert [k for mb in cuts for k in mb.advantages.tolist()] == batch.advantages.tolist()
    deltas = []
    for cut in (0, budget):
        torch.manual_seed(0)
        m = engine.add_lora(engine.load_model(tiny_model)[0], r=8, alpha=16)
        for n, p in m.named_parameters():
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.05)  # a non-zero adapter: every LoRA weight gets a gradient
        before = {n: p.detach().clone() for n, p in m.named_parameters() if p.requires_grad}
        opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=1.0)
        rwml.grpo_update(m, opt, batch, GRPOConfig(micro_batch_size=8, micro_batch_tokens=cut, beta=0.0,
                                                         max_grad_norm=1e9), choose.CHOOSE)
        deltas.append({n: p.detach() - before[n] for n, p in m.named_parameters() if p.requires_grad})
    assert any(d.abs().sum() > 0 for d in deltas[0].values())
    for n in deltas[0]:
        assert torch.allclose(deltas[0][n], deltas[1][n], atol=1e-6, rtol=1e-4), n
