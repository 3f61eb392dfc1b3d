"""Rollout collection and agent evaluation end to end: real ALFWorld games, a tiny model built in code."""
import json

import pytest

import envs
import eval as evaluate
import train

TRIPLET_KEYS = {"game", "task", "task_type", "rollout", "step", "history", "action", "next_obs", "valid",
                "format_ok", "won", "done", "response"}


def collect(tiny_model, out, *extra):
    train.main(["collect", "--model", tiny_model, "--num-games", "2", "--rollouts-per-game", "2",
                "--max-turns", "3", "--max-new-tokens", "8", "--num-envs", "3", "--num-workers", "2",
                "--history-len", "2", "--out", str(out), *extra])
    return [json.loads(x) for x in (out / "transitions.jsonl").read_text().splitlines()], \
        [json.loads(x) for x in (out / "episodes.jsonl").read_text().splitlines()]


def test_collect_writes_every_turn_as_a_triplet(tiny_model, tmp_path):
    trips, eps = collect(tiny_model, tmp_path)
    assert len(eps) == 4 and sorted((e["game"], e["rollout"]) for e in eps) == sorted(
        (envs.game_id(g), r) for g in envs.list_games("train", 2, seed=0) for r in range(2))
    assert len(trips) == sum(e["steps"] for e in eps) == 12  # a random model never wins in 3 turns
    for t in trips:
        assert TRIPLET_KEYS <= t.keys()
        assert isinstance(t["next_obs"], str) and t["next_obs"]
        hist = t["history"]
        assert len(hist) == min(t["step"], 2) + 1  # H = 2 previous pairs, then the current observation
        assert (set(hist[-1]) == {"observation"}
                and all(set(h) == {"observation", "action"} for h in hist[:-1]))
        if not t["valid"]:
            assert t["next_obs"] == "Nothing happens."
    # consecutive turns chain: what the game answered is the next turn's current observation
    by_ep = {}
    for t in trips:
        by_ep.setdefault((t["game"], t["rollout"]), []).append(t)
    for turns in by_ep.values():
        assert [t["step"] for t in turns] == [0, 1, 2]
        assert turns[-1]["done"] and not turns[0]["done"]
        for a, b in zip(turns, turns[1:]):
            assert b["history"][-1]["observation"] == a["next_obs"]
            assert b["history"][-2] == {"observation": a["history"][-1]["observation"], "action": a["action"]}


def test_interrupted_collection_continues(tiny_model, tmp_path):
    trips, eps = collect(tiny_model, tmp_path)
    # as if killed in the middle of the last episode: its summary and last turn were never written
    last = (eps[-1]["game"], eps[-1]["rollout"])
    cut = [t for t in trips if (t["game"], t["rollout"]) != last] + \
        [t for t in trips if (t["game"], t["rollout"]) == last][:1]
    (tmp_path / "transitions.jsonl").write_text("".join(json.dumps(t) + "\n" for t in cut)
                                                + '{"game": "half a li')
    (tmp_path / "episodes.jsonl").write_text("".join(json.dumps(e) + "\n" for e in eps[:-1]))
    trips2, eps2 = collect(tiny_model, tmp_path)
    assert len(eps2) == 4 and len(trips2) == 12
    assert ([t for t in trips2 if (t["game"], t["rollout"]) != last]
            == [t for t in cut if (t["game"], t["rollout"]) != last])
    assert [t["step"] for t in trips2 if (t["game"], t["rollout"]) == last] == [0, 1, 2]
    trips3, _ = collect(tiny_model, tmp_path)  # nothing left to do: nothing changes
    assert trips3 == trips2


def test_collection_refuses_to_mix_settings(tiny_model, tmp_path):
    collect(tiny_model, tmp_path)
    with pytest.raises(envs.UserError, match="other settings.*max_turns 3 -> 4"):
        collect(tiny_model, tmp_path, "--max-turns", "4")


def test_eval_agent_writes_the_documented_json(tiny_model, tmp_path):
    out = tmp_path / "results.json"
    evaluate.main(["agent", "--model", tiny_model, "--split", "valid_unseen", "--num-games", "2",
                   "--seeds", "2", "--max-turns", "2", "--max-new-tokens", "8", "--num-workers", "0",
                   "--out", str(out)])
    r = json.loads(out.read_text())
    for key in ("success_rate", "invalid_action_rate", "inefficient_action_rate", "mean_steps",
                "num_episodes", "per_task_type", "success_rate_std", "per_seed"):
        assert key in r
    assert r["num_episodes"] == 4 and len(r["per_seed"]) == 2 and r["mean_steps"] == 2.0
    assert 0 <= r["invalid_action_rate"] <= 1 and r["success_rate"] == 0.0
    assert sum(v["num_episodes"] for v in r["per_task_type"].values()) == 4
    assert set(r["per_task_type"]) <= set(envs.TASK_TYPES)


def test_eval_agent_plays_both_splits_in_one_run(tiny_model, tmp_path):
    out = tmp_path / "both.json"
    evaluate.main(["agent", "--model", tiny_model, "--split", "valid_seen,valid_unseen", "--num-games", "2",
                   "--seeds", "2", "--max-turns", "2", "--max-new-tokens", "6", "--num-workers", "0",
                   "--out", str(out)])
    r = json.loads(out.read_text())
    assert set(r["per_split"]) == {"valid_seen", "valid_unseen"} and r["num_episodes"] == 8
    for split, s in r["per_split"].items():
        assert s["num_episodes"] == 4 and len(s["per_seed"]) == 2 and "success_rate_std" in s
        games = {e["game"] for e in r["episodes"] if e["split"] == split}
        assert games == set(map(envs.game_id, envs.list_games(split, 2, 0)))


def test_eval_with_a_peft_adapter(tiny_model, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model),
                                LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    peft_model.save_pretrained(tmp_path / "adapter")
    model, _ = train.engine.load_model(tiny_model, adapter=str(tmp_path / "adapter"))
    assert isinstance(model, PeftModel)
    out = tmp_path / "r.json"
    evaluate.main(["agent", "--model", tiny_model, "--adapter", str(tmp_path / "adapter"), "--num-games", "1",
                   "--seeds", "1", "--max-turns", "1", "--max-new-tokens", "4", "--out", str(out)])
    assert json.loads(out.read_text())["config"]["adapter"] == "<path>"  # outside the repo: no machine's path


def test_exploration_draws_by_kind_and_never_asks_the_model(tiny_model, tmp_path, monkeypatch):
    """With explore_prob 1 every executed action is an admissible command drawn by kind (the model is never
    asked); each triplet says so, and the next observations are the game's own answers to those commands."""
    import rwml

    monkeypatch.setattr(rwml, "sample_chat", lambda *a, **k: pytest.fail("the model was asked"))
    trips, eps = collect(tiny_model, tmp_path, "--explore-prob", "1")
    assert len(trips) == 12 and all(t["explored"] and t["valid"] and t["response"] == "" for t in trips)
    assert all(e["explored"] == e["steps"] for e in eps)
    assert all(not envs.is_inefficient(t["action"]) for t in trips)
    assert {envs.observation_kind(t["next_obs"]) for t in trips} - {"arrive"}  # not only "go to"
