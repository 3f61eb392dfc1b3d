"""ALFWorld on the real TextWorld engine: game lists, walkthroughs, the step budget, caches, workers."""
import json
from pathlib import Path

import pytest

import envs
from envs import Game, UserError, list_games
from envs import EnvPool


def walkthrough(game):
    return json.load(open(game))["walkthrough"]


def test_list_games_sorted_and_deterministic():
    seen = list_games("valid_seen")
    assert len(seen) == 140 and seen == sorted(seen)
    assert len(list_games("valid_unseen")) == 134
    a, b = list_games("train", 5, seed=3), list_games("train", 5, seed=3)
    assert a == b == sorted(a) and len(set(a)) == 5
    assert list_games("train", 5, seed=4) != a


@pytest.mark.parametrize("kwargs, message", [
    (dict(split="validseen"), "unknown split"), (dict(split="train", num_games=-1), "at least 1"),
    (dict(split="valid_seen", num_games=10_000), "has 140 games"),
])
def test_list_games_bad_input(kwargs, message):
    with pytest.raises(UserError, match=message):
        list_games(**kwargs)


def test_missing_data_folder_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path))
    with pytest.raises(UserError, match="ALFWORLD_DATA"):
        list_games("train")


@pytest.mark.parametrize("split", envs.SPLITS)
def test_walkthrough_wins_real_games_of_every_split(split):
    game = Game(max_turns=50)
    for path in list_games(split, 2, seed=1):
        s = game.reset(path)
        assert "Welcome" not in s["obs"] and "-=" not in s["obs"] and s["obs"].startswith("You are in")
        assert s["task"] and "Your task is to" not in s["task"] and s["task_type"] in envs.TASK_TYPES
        for command in walkthrough(path):
            assert not s["won"]
            s = game.step(command)
            assert s["valid"]
        assert s["won"] and s["done"]


def test_step_budget_and_invalid_actions():
    game = Game(max_turns=3)
    path = list_games("valid_seen", 1)[0]
    s = game.reset(path)
    first = next(c for c in s["admissible"] if c.startswith("go to"))
    s = game.step("  " + first.upper().replace(" ", "   ") + " ")  # case and spaces do not matter
    assert s["valid"] and s["obs"].startswith("You arrive at") and not s["done"]
    s = game.step("fly to the moon")
    assert not s["valid"] and s["obs"] == "Nothing happens." and not s["done"]
    s = game.step("")
    assert s["turn"] == 3 and s["done"] and not s["won"]
    with pytest.raises(RuntimeError):
        game.step("look")
    assert game.reset(path)["turn"] == 0  # the same game again, from its start


def trace(cache, games):
    envs.use_engine_cache(cache)
    try:
        game, out = Game(max_turns=100), []
        for path in games:
            out.append(game.reset(path))
            out += [game.step(c) for c in ["look", "inventory", "fly away"] + walkthrough(path)]
            out.append(game.reset(path))  # a repeated reset hits the cached translation
        return out
    finally:
        envs.use_engine_cache(False)


def test_cached_engine_matches_stock_engine():
    games = list_games("valid_unseen", 3, seed=0) + list_games("train", 1, seed=0)
    stock, cached = trace(False, games), trace(True, games)
    assert len(stock) > 20
    assert cached == stock  # observations, admissible commands, won, done: all identical


def test_worker_pool_matches_in_process_play():
    games = list_games("valid_seen", 3, seed=2)
    plans = {slot: walkthrough(g) for slot, g in enumerate(games)}

    def play(num_workers):
        with EnvPool(num_workers=num_workers, max_turns=50, game_cls=Game) as pool:
            out = [pool.reset(dict(enumerate(games)))]
            for t in range(max(map(len, plans.values()))):
                out.append(pool.step({s: p[t] for s, p in plans.items() if t < len(p)}))
            return out

    local, workers = play(0), play(2)
    assert workers == local
    assert all(workers[len(plans[s])][s]["won"] for s in plans)


def test_worker_errors_reach_the_caller():
    with EnvPool(num_workers=2, game_cls=Game) as pool:
        with pytest.raises(UserError, match="game file not found"):
            pool.reset({0: "/nonexistent/game.tw-pddl", 1: list_games("valid_seen", 1)[0]})
        pool.reset({0: list_games("valid_seen", 1)[0]})  # the pool still works afterwards


def test_explore_command_draws_the_kind_first():
    """Uniform over commands, "go to X" would be most draws; kind first, each available kind gets an equal
    share. Never look / examine / inventory / help (they change nothing)."""
    import collections
    import random

    admissible = [f"go to cabinet {i}" for i in range(1, 30)] + ["take mug 1 from countertop 1",
                                                                 "open drawer 1", "examine countertop 1",
                                                                 "look", "inventory"]
    rng = random.Random(0)
    kinds = collections.Counter(envs.explore_command(admissible, rng).split()[0] for _ in range(3000))
    assert set(kinds) == {"go", "take", "open"} and all(900 < v < 1100 for v in kinds.values())


def test_observation_kinds_of_real_observations():
    g = envs.Game(max_turns=50)
    path = envs.list_games("train", 1, seed=0)[0]
    g.reset(path)
    kinds = {}
    for cmd in ["fly away", "look", "inventory"] + json.loads(Path(path).read_text())["walkthrough"]:
        kinds.setdefault(envs.observation_kind(g.step(cmd)["obs"]), cmd)
    assert {"nothing_happens", "look", "inventory", "arrive", "take"} <= set(kinds)
    assert envs.observation_kind("You move the mug 1 to the sinkbasin 1.") == "move"
    assert envs.observation_kind("On the desk 1, you see a pen 1.") == "other"
