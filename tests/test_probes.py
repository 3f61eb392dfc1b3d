"""The state probes and the prompt-only state tracker, on the real engine: every probe type is
played and kept only where the tracker reproduces the engine; the tracker never guesses (on real
held-out triplets, wherever it answers the engine agrees); the baselines split as they should (the
template rule misses what needs the state, "rule + copy" solves plain revisits only); score_wm
scores probes by type and counts a target as answerable from the prompt only where the tracker
reproduces it."""
import random
from collections import Counter

import pytest

import envs

GAMES = envs.list_games("valid_seen", 20, 0)[:3]  # the held-out games the default run uses
TAKE_PUT = ("take_revisit", "put_revisit")


@pytest.fixture(scope="module")
def probes():
    dropped = []
    kept = envs.state_probes(GAMES, history_len=2, seed=0, dropped=dropped)
    return kept, dropped


@pytest.fixture(scope="module")
def real():
    """Real held-out triplets beside the probes: the walkthroughs and 40 steps of the exploration
    policy in each game, each at H 1, 2 and 4 (the windows of one H 4 prompt cut shorter)."""
    trips = envs.walkthrough_triplets(games=GAMES, history_len=4, wrong_first=True)
    game = envs.Game(max_turns=40)
    for path in GAMES:
        rng, s = random.Random(envs.game_id(path)), game.reset(path)  # id: paths differ by machine
        past, obs = [], s["obs"]
        while not game.done:
            explore = rng.random() < 0.9
            command = envs.explore_command(game.admissible, rng) if explore else "inventory"
            r = game.step(command)
            window = [{"observation": o, "action": a} for o, a in past[-4:]]
            trips.append(dict(task=s["task"], history=window + [{"observation": obs}],
                              action=command, next_obs=r["obs"]))
            past.append((obs, command))
            obs = r["obs"]
    return [dict(t, history=t["history"][-h - 1:]) for t in trips for h in (1, 2, 4)]


def wrong(tracker, triplets) -> list[dict]:
    """The triplets where `tracker` answers and the engine said otherwise (a guess)."""
    return [t for t in triplets
            if (p := tracker(t)) is not None and not envs.probe_exact(p, t["next_obs"])]


def test_every_probe_type_is_played_and_each_kept_one_is_reproduced_by_the_tracker(probes):
    kept, dropped = probes
    counts = Counter(t["probe"] for t in kept)
    assert set(counts) == set(envs.PROBES), counts
    assert len(kept) >= 10 * len(GAMES)
    assert {t["game"] for t in kept} == {envs.game_id(g) for g in GAMES}
    assert all(envs.probe_exact(envs.track_state(t), t["next_obs"]) for t in kept)
    # dropped only where the window does not determine it: never where the tracker was wrong
    assert all(envs.track_state(t) is None for t in dropped) and len(dropped) <= len(kept) // 5
    fields = {"game", "task", "task_type", "rollout", "step", "history", "action", "next_obs",
              "valid", "format_ok", "won", "done", "response", "probe"}
    assert all(set(t) == fields and len(t["history"]) <= 3 for t in kept)
    keys = {(t["game"], t["rollout"], t["step"]) for t in kept}  # what the verdict pairs by
    assert len(keys) == len(kept)
    first = [t for t in kept if t["game"] == envs.game_id(GAMES[0])]
    assert envs.state_probes(GAMES[:1], seed=0) == first  # the same games, the same probes


def test_the_tracker_never_guesses_on_real_held_out_triplets(real):
    assert not wrong(envs.track_state, real)
    answered = [t for t in real if envs.track_state(t) is not None]
    beyond = [t for t in answered if envs.template_prediction(t["action"]) != t["next_obs"]]
    assert len(answered) >= 20 and len(beyond) >= 10  # it answers some the rule misses (23, 17)
    # a tracker that fills its gaps with a guess (the rule's "nothing", a made-up listing) is caught
    assert wrong(lambda t: envs.track_state(t) or envs.template_prediction(t["action"]), real)

    def made_up(t):
        x = t["action"][6:]
        return envs.track_state(t) or f"You arrive at {x}. On the {x}, you see a apple 1."
    assert wrong(made_up, [t for t in real if t["action"].startswith("go to ")])


def test_baselines_split_the_probes_as_they_should(probes):
    kept, _ = probes

    def solved(name, probe):
        trips = [t for t in kept if t["probe"] == probe]
        return [envs.probe_exact(envs.baseline_prediction(name, t), t["next_obs"]) for t in trips]
    for probe in envs.PROBES:
        assert all(solved("tracker", probe)), probe
        assert not any(solved("template", probe)), probe  # each needs the state
    for probe in ("revisit", "revisit_open"):
        assert all(solved("rule_copy", probe)), probe
    for probe in TAKE_PUT:
        assert not any(solved("rule_copy", probe)), probe


def test_the_tracker_says_none_where_the_window_lacks_the_answer():
    def t(action, *observations, actions=()):
        acts = list(actions) or ["look"] * (len(observations) - 1)
        return dict(task="put a pen in a drawer", action=action,
                    history=[{"observation": o, "action": a} for o, a in zip(observations, acts)]
                    + [{"observation": observations[-1]}])
    here = "You arrive at countertop 1. On the countertop 1, you see a apple 1, and a pen 2."
    room = ("You are in the middle of a room. Looking quickly around you, you see a drawer 4, and "
            "a desk 1.")
    assert envs.track_state(t("go to drawer 4", room)) is None  # never seen
    assert envs.track_state(t("go to drawer 4", here)) is None
    assert envs.track_state(t("inventory", here)) is None  # what is carried: not in the window
    assert envs.track_state(t("take pen 2 from countertop 1", here)) is None
    assert envs.track_state(t("go to countertop 1", here)) == "Nothing happens."  # where it is
    # seen, but whether the agent stands apart from it is not known (places can share a spot)
    shared = t("go to drawer 6", "You arrive at drawer 6. The drawer 6 is closed.",
               "You open the drawer 7. The drawer 7 is open. In it, you see a pen 1.",
               "Nothing happens.", actions=["open drawer 7", "go to drawer 6"])
    assert envs.track_state(shared) is None
    assert envs.track_state(dict(shared, action="go to drawer 7")) == "Nothing happens."
    # an event it cannot read forgets the room
    heated = t("go to countertop 1", here, "You arrive at microwave 1. The microwave 1 is closed.",
               "You heat the pen 2 using the microwave 1.",
               actions=["go to microwave 1", "heat pen 2 with microwave 1"])
    assert envs.track_state(heated) is None
    seen = t("go to countertop 1", here, "You pick up the pen 2 from the countertop 1.",
             "You arrive at drawer 4. The drawer 4 is closed.",
             actions=["take pen 2 from countertop 1", "go to drawer 4"])
    assert envs.track_state(seen) == ("You arrive at countertop 1. On the countertop 1, you see a "
                                      "apple 1.")
    assert envs.track_state(dict(seen, action="inventory")) == "You are carrying: a pen 2."
    again = dict(seen, action="take apple 1 from countertop 1")
    assert envs.track_state(again) == "Nothing happens."  # one hand
    assert envs.track_state(dict(seen, action="open drawer 4")) is None  # what is in it: unknown
    assert envs.track_state(dict(seen, history=seen["history"][-2:])) is None  # H 1: listing gone


def reward_fn(completions, targets):  # the reward's interface without the embedder: exact or 0
    from envs import parse_next_state

    return [float(envs.exact_match(parse_next_state(c), t)) for c, t in zip(completions, targets)]


reward_fn.similarity = lambda states, targets: [0.0] * len(targets)


def test_an_empty_listing_never_seen_in_the_prompt_is_not_counted_as_answerable():
    """"On the drawer 4, you see nothing." after no sight of drawer 4 is a guess (unseen_objects
    found no unseen object in it: held by the prompt, it said); the tracker's count says so."""
    trip = dict(game="g", rollout=0, step=1, task="put a pen in a drawer", action="go to drawer 4",
                history=[{"observation": "You arrive at desk 1. On the desk 1, you see a pen 1.",
                          "action": "go to drawer 3"},
                         {"observation": "You arrive at drawer 3. On the drawer 3, you see "
                                         "nothing."}],
                next_obs="You arrive at drawer 4. On the drawer 4, you see nothing.")
    r = envs.score_wm([trip], ["<next_state>x</next_state>"], reward_fn)
    row = r["triplets"][0]
    assert not row["template_hit"] and row["unseen_objects"] and not row["tracker_hit"]
    assert r["per_kind"]["beyond_template_unseen"]["n"] == 1


def test_score_wm_scores_probes_by_type_and_put_listings_as_sets(probes):
    kept, _ = probes
    trips = [t for p in envs.PROBES for t in kept if t["probe"] == p][::2]
    preds = [f"<next_state>{envs.baseline_prediction('rule_copy', t)}</next_state>" for t in trips]
    r = envs.score_wm(trips, preds, reward_fn)
    assert set(r["per_probe"]) <= set(envs.PROBES)
    assert sum(s["n"] for s in r["per_probe"].values()) == len(trips)
    assert r["per_probe"]["take_revisit"]["exact_match"] == 0.0
    assert all(row["probe"] == t["probe"] for row, t in zip(r["triplets"], trips))
    plain = [dict(t, probe=None) for t in trips[:2]]
    assert "per_probe" not in envs.score_wm(plain, preds[:2], reward_fn)
    put = next(t for t in kept
               if t["probe"] == "put_revisit" and len(envs.observation_items(t["next_obs"])) > 1)
    head, _, listed = put["next_obs"].partition("you see ")
    items = listed.rstrip(".").split(", ")
    other = head + "you see " + ", ".join([items[-1].removeprefix("and "), *items[:-2],
                                           "and " + items[-2].removeprefix("and ")]) + "."
    assert not envs.exact_match(other, put["next_obs"]) and envs.probe_exact(other, put["next_obs"])
    row = envs.score_wm([put], [f"<next_state>{other}</next_state>"], reward_fn)["triplets"][0]
    assert row["exact"] == [True]
    assert not envs.probe_exact(other.replace("you see", "you find"), put["next_obs"])  # the frame
