"""The strict world-model metrics beside the reward: exact match and the item-set F1 (envs.py)."""
import pytest

import envs

LIST = "You arrive at countertop 1. On the countertop 1, you see a apple 2, a knife 1, and a plate 3."


def test_items_of_the_observation_forms():
    assert envs.observation_items(LIST) == {("apple", 2), ("knife", 1), ("plate", 3)}
    opened = "You open the drawer 1. The drawer 1 is open. In it, you see a pen 2."
    assert envs.observation_items(opened) == {("pen", 2)}
    assert envs.observation_items("You arrive at fridge 1. The fridge 1 is open. In it, you see nothing.") \
        == set()
    assert envs.observation_items("You are carrying: a apple 1.") == {("apple", 1)}
    assert envs.observation_items("You are not carrying anything.") == set()
    for plain in ("You pick up the apple 2 from the countertop 1.", "Nothing happens.",
                  "You arrive at drawer 2. The drawer 2 is closed.", "", None):
        assert envs.observation_items(plain) is None


def test_f1_known_answers():
    reordered = ("You arrive at countertop 1. "
                 "On the countertop 1, you see a plate 3, a apple 2, and a knife 1.")
    assert envs.item_f1(reordered, LIST) == 1.0
    assert not envs.exact_match(reordered, LIST)
    missing = "You arrive at countertop 1. On the countertop 1, you see a apple 2, and a plate 3."
    assert envs.item_f1(missing, LIST) == pytest.approx(0.8)  # 2 of 3 found, nothing extra
    renumbered = LIST.replace("knife 1", "knife 2")
    assert envs.item_f1(renumbered, LIST) == pytest.approx(2 / 3)
    assert envs.item_f1("You arrive at countertop 1. On the countertop 1, you see nothing.", LIST) == 0.0
    assert envs.item_f1("Nothing happens.", LIST) == 0.0  # lists nothing where the target lists items
    assert envs.item_f1(LIST, "You pick up the apple 2 from the countertop 1.") is None  # no list to score
    assert envs.item_f1("In it, you see nothing.", "On the desk 1, you see nothing.") == 1.0
    assert envs.exact_match("  you ARRIVE at countertop 1. on the countertop 1, you see a apple 2, "
                            "a knife 1, and a plate 3.", LIST)
    assert not envs.exact_match(None, LIST) and not envs.exact_match("", "")


def test_real_walkthrough_observations():
    """Each listing observation of two valid_unseen walkthroughs scores itself 1, and one fact edited < 1."""
    triplets = envs.walkthrough_triplets("valid_unseen", num_games=2, seed=0)
    listing = [t["next_obs"] for t in triplets if envs.observation_items(t["next_obs"])]
    assert len(listing) >= 3
    for obs in listing:
        items = envs.observation_items(obs)
        assert all(isinstance(n, int) and n > 0 for _, n in items), obs
        assert envs.exact_match(obs, obs) and envs.item_f1(obs, obs) == 1.0
        (name, num), *_ = sorted(items)
        assert envs.item_f1(obs.replace(f"{name} {num}", f"{name} {num + 10}"), obs) < 1.0  # renumbered
        dropped = (obs.replace(f"a {name} {num}, ", "").replace(f", and a {name} {num}", "")
                   .replace(f"you see a {name} {num}.", "you see nothing."))
        assert envs.item_f1(dropped, obs) < 1.0 and envs.observation_items(dropped) < items  # one dropped
    for t in triplets:
        if envs.observation_kind(t["next_obs"]) in ("take", "move", "heat", "nothing_happens"):
            assert envs.item_f1(t["next_obs"], t["next_obs"]) is None


class _Reward:  # a reward that passes everything: the strict metrics must still tell the predictions apart
    def __call__(self, completions, targets):
        return [1.0] * len(completions)

    def similarity(self, states, targets):
        return [1.0] * len(states)


def test_score_wm_reports_the_strict_metrics_beside_the_reward():

    triplets = [dict(game="g", action="go to countertop 1", next_obs=LIST, history=[{"observation": "x"}]),
                dict(game="g", action="take apple 2 from countertop 1", history=[{"observation": LIST}],
                     next_obs="You pick up the apple 2 from the countertop 1.")]
    preds = [f"<next_state>{p}</next_state>" for p in
             (LIST, LIST.replace("knife 1", "knife 2"), triplets[1]["next_obs"], "x")]
    r = envs.score_wm(triplets, preds, _Reward(), k=2)
    assert r["wm_accuracy"] == 1.0 and r["exact_match"] == 0.5
    assert r["item_n"] == 1 and r["item_f1"] == pytest.approx((1 + 2 / 3) / 2)
    assert r["triplets"][0]["exact"] == [True, False] and r["triplets"][1]["item_f1"] == [None, None]
    assert r["per_observation_kind"]["take"]["item_f1"] is None
