"""The sim-to-real reward with the real embedding model (all-MiniLM-L6-v2 from its PyPI wheel)."""
import pytest

from calibrate import calibrate  # lab/calibrate.py
from envs import parse_next_state
from reward import SimToRealReward, rouge_l

REAL = ["You arrive at desk 1. On the desk 1, you see a pen 1 and a book 2.",
        "You pick up the mug 1 from the countertop 1."]
PARAPHRASE = ["You reach desk 1. On it you see a pen 1 and a book 2.",
              "You take the mug 1 from the countertop 1."]
UNRELATED = ["You open the fridge 1. The fridge 1 is open. In it, you see a tomato 1.", "Nothing happens."]


@pytest.fixture(scope="module")
def reward():
    return SimToRealReward(tau_d=0.1, rouge_gate=0)  # the plain embedding reward at 0.1


def wrap(s):
    return f"<think>thinking</think><next_state>{s}</next_state>"


def test_paraphrases_earn_one_unrelated_states_zero(reward):
    assert reward([wrap(p) for p in PARAPHRASE], REAL) == [1.0, 1.0]
    assert reward([wrap(u) for u in UNRELATED], REAL) == [0.0, 0.0]
    assert reward([wrap(r) for r in REAL], REAL) == [1.0, 1.0]


def test_tau_d_separates_a_wrong_object_or_event_from_a_paraphrase(reward):
    """Why tau_d = 0.1: MiniLM puts ALFWorld paraphrases at d ~ 0.05, the same sentence about another
    object at ~ 0.2, and another event at the same place at ~ 0.12."""
    wrong = ["You open the drawer 2. The drawer 2 is open. In it, you see a pen 1.",
             "You arrive at countertop 1. On the countertop 1, you see a mug 1."]
    real = ["You open the drawer 1. The drawer 1 is open. In it, you see nothing.", REAL[1]]
    assert reward([wrap(w) for w in wrong], real) == [0.0, 0.0]
    assert all(0.1 < 1 - s < 0.3 for s in reward.similarity(wrong, real))


def test_a_missing_full_stop_fails_a_short_target(reward):
    """A known false negative (README, the drift): on a two-word target the full stop alone moves MiniLM's
    cosine to ~0.86, so "Nothing happens" without it earns 0 at tau_d 0.1; with it, or in another case, 1."""
    target = "Nothing happens."
    assert reward([wrap("Nothing happens"), wrap("Nothing happens."), wrap("nothing happens.")],
                  [target] * 3) == [0.0, 1.0, 1.0]
    assert 0.8 < reward.similarity(["Nothing happens"], [target])[0] < 0.9


@pytest.mark.parametrize("completion", [
    "", "no tags at all: You arrive at desk 1.", "<next_state></next_state>", "<next_state>   </next_state>",
    "<next_state>You arrive at desk 1. On the desk 1", None, 42, "<think>You arrive at desk 1.</think>",
])
def test_parse_failures_earn_zero(reward, completion):
    assert reward([completion], REAL[:1]) == [0.0]


def test_parse_takes_the_last_block_and_folds_spaces():
    assert parse_next_state("<next_state>a</next_state> <next_state> b \n c </next_state>") == "b c"
    # TRL chat format
    assert parse_next_state([{"role": "assistant", "content": "<next_state>x</next_state>"}]) == "x"


def test_continuous_and_rouge_options():
    cont = SimToRealReward(binary=False)
    a, b = cont([wrap(PARAPHRASE[0]), wrap(UNRELATED[0])], [REAL[0], REAL[0]])
    assert 0.9 < a < 1.0 and 0.0 <= b < 0.6
    rouge = SimToRealReward(metric="rouge", tau_d=0.3, rouge_gate=0)
    assert rouge([wrap("the cat sat on the mat")], ["the cat sat on a mat"]) == [1.0]
    assert rouge_l("a b c d", "a c d e") == pytest.approx(2 * 3 / 8)
    assert rouge_l("", "a") == 0.0


def test_target_embeddings_are_cached(reward, monkeypatch):
    reward._targets.clear()
    encoded = []
    embed = reward._embed
    monkeypatch.setattr(reward, "_embed", lambda texts: encoded.extend(texts) or embed(texts))
    first = reward([wrap(p) for p in PARAPHRASE] * 3, REAL * 3)
    assert sorted(t for t in encoded if t in REAL) == sorted(REAL)  # each target embedded once, not 3 times
    encoded.clear()
    again = reward([wrap(p) for p in PARAPHRASE] * 3, REAL * 3)
    assert not set(encoded) & set(REAL)  # the second call embeds predictions only
    assert again == first == [1.0, 1.0] * 3  # and the cached embeddings give the same rewards


def test_calibrate_reports_mean_reward_and_uninformative_groups(reward):
    groups = [[wrap(PARAPHRASE[0]), wrap(UNRELATED[0])], [wrap(UNRELATED[1])] * 2]
    first, *rows = calibrate(reward, groups, REAL, taus=(0.1, 2.0))
    assert first["format_rate"] == 1.0
    assert rows[0] == dict(tau_d=0.1, mean_reward=0.25, frac_groups_all_equal=0.5)
    assert rows[1]["mean_reward"] == 1.0 and rows[1]["frac_groups_all_equal"] == 1.0


def test_bad_reward_settings_are_user_errors():
    from envs import UserError

    with pytest.raises(UserError, match="tau_d"):
        SimToRealReward(tau_d=0)
    with pytest.raises(UserError, match="rouge"):
        SimToRealReward(metric="bleu")
    with pytest.raises(UserError, match="cannot load embedding model"):
        SimToRealReward(embedder="/no/such/embedder")


def test_nested_opening_tags_give_the_innermost_block():
    assert parse_next_state("<next_state>a <next_state> b </next_state>") == "b"
    assert parse_next_state("<next_state>a</next_state></next_state> <next_state>c") == "a"


@pytest.mark.parametrize("metric", ["embedding", "rouge"])
def test_one_target_per_completion(reward, metric):
    from envs import UserError

    r = reward if metric == "embedding" else SimToRealReward(metric="rouge")
    with pytest.raises(UserError, match="2 completions but 1 targets"):
        r([wrap(REAL[0]), wrap(REAL[1])], REAL[:1])


def test_lone_surrogates_are_embedded_not_raised(reward):
    assert reward([wrap(REAL[0] + "\ud800")], [REAL[0] + "\udfff"]) == [1.0]


def test_verl_export_and_compute_score_reproduce_our_rewards(tiny_model, transitions, tmp_path, reward):
    """`train.py export --format verl` writes verl's GRPO parquet; `verl_reward.compute_score` (verl's custom
    reward signature) on its rows gives exactly SimToRealReward's rewards of our completions (the real
    embedder)."""
    pq = pytest.importorskip("pyarrow.parquet")
    import rwml
    import train
    from verl_bridge.reward import compute_score

    out = tmp_path / "verl"
    train.main(["export", "--format", "verl", "--model", tiny_model, "--transitions", transitions,
                "--no-easy-filter", "--out", str(out)])
    rows = pq.read_table(out / "train.parquet").to_pylist()
    kept = train.read_jsonl(out / "filter" / "kept.jsonl")
    assert len(rows) == len(kept) > 3
    first = rows[0]
    assert [m["role"] for m in first["prompt"]] == ["system", "user"]
    assert first["prompt"][1]["content"] == rwml.wm_prompt(kept[0], reasoning=False)
    assert first["reward_model"] == dict(style="rule", ground_truth=kept[0]["next_obs"])
    # verl's responses: what our trainer's completion is after the prefix it writes for the model
    responses = [f"{r['reward_model']['ground_truth']}</next_state>" for r in rows[:2]]
    responses += ["Nothing happens at all.</next_state>", "no tag",
                  f"<next_state>{rows[4]['reward_model']['ground_truth']}</next_state>"]
    truths = [r["reward_model"]["ground_truth"] for r in rows[:5]]
    ours = reward([rwml.wm_prefix(False) + x for x in responses], truths)
    theirs = [compute_score(r["data_source"], x, t, r["extra_info"])
              for r, x, t in zip(rows, responses, truths)]
    assert theirs == ours and ours[:2] == [1.0, 1.0] and ours[3] == 0.0 and ours[4] == 1.0


def test_the_rouge_gate_refuses_what_the_embedding_alone_passes():
    """The authors' gate: r = 1 needs d < tau_d AND ROUGE-1 F >= rouge_gate. A prediction that
    changes a few words of a long observation passes a loose tau_d alone and is refused with the gate; the
    exact text passes both; ROUGE-1 F is the clipped word overlap (here 2 of 3 words: 2/3)."""
    from reward import rouge1

    assert rouge1("a b c", "a b d") == pytest.approx(2 / 3) and rouge1("", "a") == 0.0
    assert rouge1("You arrive at X.", "you ARRIVE at x") == 1.0  # case and punctuation do not count
    real = "You arrive at countertop 1. On the countertop 1, you see a apple 2, a bread 1, and a knife 3."
    wrong = "You arrive at countertop 1. On the countertop 1, you see a tomato 4, a cup 2, and a fork 1."
    preds = [f"<next_state>{x}</next_state>" for x in (real, wrong)]
    assert SimToRealReward(tau_d=0.5, rouge_gate=0)(preds, [real, real]) == [1.0, 1.0]
    assert SimToRealReward(tau_d=0.5, rouge_gate=0.9)(preds, [real, real]) == [1.0, 0.0]


def test_the_reward_alone_is_alfworlds_as_a_run_uses_it():
    """`SimToRealReward()` with no arguments is ALFWorld's reward (tau_d and the ROUGE-1 gate of
    envs.Alfworld, from the reward audit); on 61e63ba it was tau_d 0.1 without the gate, a reward no run
    used."""
    import inspect

    import envs
    from reward import SimToRealReward

    params = inspect.signature(SimToRealReward).parameters
    assert (params["tau_d"].default, params["rouge_gate"].default) == (envs.Alfworld.tau_d,
                                                                       envs.Alfworld.rouge_gate)
