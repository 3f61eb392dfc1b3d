"""lab/reward_audit.py: every label of the pair set holds by construction (checked here with parsers of our
own, not the generator's), the halves share no game, the audit runs with the bundled embedder, bad input is
one line."""
import collections
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

import reward_audit as ra
from envs import UserError

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def built():
    """Pairs of 2 real ALFWorld games and 2 generated TextWorld games per half (short walks): valid_seen and
    dev games choose (the dev half), valid_unseen and test games only report."""
    games = [g for half in ("dev", "test")
             for g in ra.alfworld_observations(2, 0, 4, ra.SPLITS["alfworld"][half])
             + ra.textworld_observations(2, 0, 4, ra.SPLITS["textworld"][half])]
    return games, ra.build_pairs(games, 0)


def norm(text: str) -> str:
    """Case, spacing and final punctuation away: what a positive may change."""
    text = re.sub(r"\s+([,.!?])", r"\1", " ".join(text.lower().split()))
    return text.rstrip(".!? ")


def alf_facts(text: str):
    """(the text with its "you see ..." list cut out, the list's (object, number) pairs as a multiset)."""
    text = norm(text)
    m = re.search(r"you see ([^.]*?)(?:\.|$)", text)
    if not m:
        return text, collections.Counter()
    if m[1] == "nothing":
        return text[:m.start(1)] + "<list>" + text[m.end(1):], collections.Counter()
    items = [re.fullmatch(r"(?:and )?a ([a-z]+) (\d+)", p.strip()) for p in m[1].split(",")]
    assert all(items), text
    skeleton = text[:m.start(1)] + "<list>" + text[m.end(1):]
    return skeleton, collections.Counter((i[1], int(i[2])) for i in items)


def mentions(text: str) -> set:
    return {(w, int(n)) for w, n in re.findall(r"\b([a-z]+) (\d+)\b", text)}


def check_alfworld(p: dict, g: dict) -> None:
    t, c, kind, edit = p["target"], p["candidate"], p["kind"], p.get("edit")
    (ts, ti), (cs, ci) = alf_facts(t), alf_facts(c)
    if p["label"]:
        assert (ts, ti) == (cs, ci), p
        assert kind == "exact" or c != t
        return
    assert c != t
    if kind in ("rename", "object_number", "receptacle_number"):
        old, new = tuple(edit["old"]), tuple(edit["new"])
        assert old in mentions(t) and new not in mentions(t)
        assert c == re.sub(rf"\b{old[0]} {old[1]}\b", f"{new[0]} {new[1]}", t)
        start = {w for w, _ in g["start_mentions"]}  # the receptacles: the start room's list
        if kind == "rename":
            assert old[0] != new[0] and old[1] == new[1] and old[0] not in start and new[0] not in start
        else:
            assert old[0] == new[0] and old[1] != new[1]
            assert (old[0] in start) == (kind == "receptacle_number")
    elif kind in ("missing", "added", "empty"):
        assert ts == cs
        gone, extra = ti - ci, ci - ti
        if kind == "missing":
            assert sum(gone.values()) == 1 and not extra and ci
        elif kind == "added":
            assert sum(extra.values()) == 1 and not gone
            assert next(iter(extra)) not in mentions(t)
        else:
            assert ti and not ci
    elif kind == "state":
        swap = {"closed": "open", "open": "closed"}[edit["old"]]
        assert edit["new"] == swap and c == re.sub(rf"\bis {edit['old']}\b", f"is {swap}", t)
    else:
        assert kind == "event" and c == "Nothing happens."


def present(text: str, name: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text, re.I) is not None


def check_textworld(p: dict, g: dict) -> None:
    t, c, kind, edit = p["target"], p["candidate"], p["kind"], p.get("edit")
    if p["label"]:
        if kind == "reorder":
            paras = [[norm(x) for x in re.split(r"\n\s*\n", s) if x.strip()] for s in (t, c)]
            assert paras[0][0] == paras[1][0] and sorted(paras[0]) == sorted(paras[1])
            assert paras[0] != paras[1]
        else:
            assert norm(t) == norm(c) and (kind == "exact") == (c == t)
        return
    if kind == "event":
        assert c == g["refusal"] != t
        return
    vocab = dict(direction=ra.DIRECTIONS, room=g["rooms"], object=g["things"])[kind]
    old, new = edit["old"], edit["new"]
    assert old in vocab and new in vocab and old != new and present(t, old) and not present(t, new)
    assert present(c, new) and not present(c, old)
    # the one change: every old name, and nothing else (compared with the names blanked out)
    blank = [re.sub(rf"(?<![\w-]){re.escape(x)}(?![\w-])", "#", s, flags=re.I)
             for s, x in ((t, old), (c, new))]
    assert blank[0] == blank[1]


def test_every_label_holds_by_construction(built):
    games, pairs = built
    by_game = {(g["env"], g["game"]): g for g in games}
    kinds = collections.Counter((p["env"], p["kind"]) for p in pairs)
    for p in pairs:
        assert set(ra.FIELDS) <= set(p) and p["label"] == (p["kind"] in ra.POSITIVE)
        assert p["target"] in by_game[p["env"], p["game"]]["obs"]  # a real observation of that game
        (check_alfworld if p["env"] == "alfworld" else check_textworld)(p, by_game[p["env"], p["game"]])
    for env, want in (("alfworld", ("exact", "reorder", "rename", "object_number", "receptacle_number",
                                    "missing", "added", "empty", "event")),
                      ("textworld", ("exact", "direction", "room", "object", "event"))):
        assert all(kinds[env, k] for k in want), (env, kinds)


def test_the_dev_half_holds_only_dev_games_and_the_set_is_deterministic(built):
    """The pairs that choose tau_d come from the dev split's games (ALFWorld valid_seen, TextWorld
    dev), never a test game (valid_unseen, TextWorld test); the test half only reports."""
    games, pairs = built
    for env, dev, test in (("alfworld", "valid_seen", "valid_unseen"), ("textworld", "dev", "test")):
        halves = collections.defaultdict(set)
        for p in pairs:
            if p["env"] == env:
                halves[p["half"]].add((p["split"], p["game"]))
        assert halves["dev"] and halves["test"] and not halves["dev"] & halves["test"]
        assert {s for s, _ in halves["dev"]} == {dev} and {s for s, _ in halves["test"]} == {test}
    assert ra.build_pairs(games, 0) == pairs
    assert ra.build_pairs(games, 1) != pairs


def test_the_committed_pairs_that_choose_hold_no_test_game():
    """The committed audit's dev half: valid_seen / TextWorld dev games only; no game of the held-out test
    sets (envs.list_games("valid_unseen", ..., seed 0) and worlds' test games) among them."""
    import envs

    pairs = ra.read_pairs(str(ROOT / "lab" / "results" / "reward_audit" / "pairs.jsonl.gz"))
    dev = {(p["env"], p["split"]) for p in pairs if p["half"] == "dev"}
    assert dev == {("alfworld", "valid_seen"), ("textworld", "dev")}
    test_games = {envs.game_id(g) for g in envs.list_games("valid_unseen", None, 0)}
    assert not test_games & {p["game"] for p in pairs if p["half"] == "dev" and p["env"] == "alfworld"}


def test_audit_runs_with_the_bundled_embedder(built, tmp_path, capsys):
    _, pairs = built
    few = [p for p in pairs if p["kind"] in ("exact", "punct", "object_number", "event")]
    few = [p for i, p in enumerate(few) if i % 3 == 0]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in few))
    ra.main(["audit", str(path), "--no-lengths", "--taus", "0.05,0.1"])
    out = capsys.readouterr().out
    assert "rule (stated before looking): per reward form, the largest tau_d" in out
    assert "chosen (dev half, the rule above)" in out and "kinds no tau_d separates (alfworld)" in out
    assert "reward embedding AND ROUGE-1 F >= 0.9:" in out  # the authors' gate, audited beside
    assert "- object_number" in out and "verdict:" in out


@pytest.mark.parametrize("content, taus, embedder, message", [
    ("", "0.1", None, "holds no pairs"),
    ("{not json\n", "0.1", None, "line 1: not JSON"),
    ('{"env": "alfworld"}\n', "0.1", None, "line 1: needs game"),
    (None, "0", None, r"every tau_d must be in \(0, 2\)"),
    (None, "0.1,2", None, r"every tau_d must be in \(0, 2\)"),
    (None, "x", None, "must be numbers"),
    (None, "0.1", "/no/such/embedder", "cannot load embedding model"),
])
def test_bad_input_is_one_line(tmp_path, content, taus, embedder, message):
    path = tmp_path / "pairs.jsonl"
    good = dict(env="alfworld", game="g", half="dev", kind="exact", label=1, target="a", candidate="a")
    path.write_text(json.dumps(good) + "\n" if content is None else content)
    with pytest.raises(UserError, match=message):
        ra.main(["audit", str(path), "--taus", taus] + (["--embedder", embedder] if embedder else []))


def test_a_bad_tau_is_one_line_on_the_command_line(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "lab" / "reward_audit.py"), "audit",
                        str(tmp_path / "none.jsonl"), "--taus", "2.5"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        "error: every tau_d must be in (0, 2), got '2.5'"]


def test_tau_d_and_the_cap_default_to_the_audits_per_environment(tmp_path):
    """Unset, tau_d and the completion cap are the environment's (chosen on the audit's dev half); a value
    given on the command line or in code wins; eval.py wm takes the environment of the transitions."""
    from harness import cli
    import eval as evaluate
    import train
    import envs

    cfg = train.Settings()
    assert (cfg.tau_d, cfg.rouge_gate, cfg.max_completion_length) == (0.01, 0.9, 80)
    tw = train.Settings(env="textworld")
    assert (tw.tau_d, tw.rouge_gate, tw.max_completion_length) == (0.03, 0.0, 112)
    assert train.Settings(env="tau2").tau_d == 0.1
    assert train.Settings(env="textworld", tau_d=0.3, max_completion_length=32).tau_d == 0.3
    argv = ["wm", "--env", "textworld", "--tau-d", "0.05"]
    _, parsed, _ = cli.parse_stage(argv, train.STAGES, train.Settings)
    assert (parsed.tau_d, parsed.max_completion_length) == (0.05, 112)
    assert cli.parse_stage([], train.STAGES, train.Settings)[1].tau_d == 0.01
    # the committed audit's choices and the dev half's lengths: tau_d and the reward's form as chosen, the
    # cap = the dev half's 95th percentile + 10 %, to 16s
    text = (ROOT / "lab" / "results" / "reward_audit" / "audit.txt").read_text()
    found = re.findall(r"(\w+): chosen tau_d ([\d.]+); reward (embedding(?: AND ROUGE-1 F >= ([\d.]+))?);",
                       text)
    assert {env for env, *_ in found} == {"alfworld", "textworld"}
    for env, tau, _, gate in found:
        p95 = int(re.search(rf"{env}\s+dev\s+\d+ observations: .*?95th pct (\d+)", text)[1])
        cap = 16 * math.ceil(p95 * 1.1 / 16)
        env_class = envs.env_class(env)  # the one declaration of each environment's defaults
        assert (env_class.tau_d, env_class.rouge_gate, env_class.max_completion_length) == (
            float(tau), float(gate or 0), cap), env
    trips = tmp_path / "tw" / "transitions.jsonl"
    trips.parent.mkdir()
    trips.write_text(json.dumps(dict(env="textworld")) + "\n")  # the triplets' own environment
    (trips.parent / "collect.json").write_text(json.dumps(dict(env="textworld", split="test")))
    wm = evaluate.with_env_defaults(evaluate.WMEvalConfig(transitions=str(trips)))
    assert (wm.tau_d, wm.rouge_gate, wm.max_completion_length) == (0.03, 0.0, 112)
    wm = evaluate.with_env_defaults(evaluate.WMEvalConfig(transitions=str(trips), tau_d=0.2))
    assert wm.tau_d == 0.2
    assert evaluate.with_env_defaults(evaluate.WMEvalConfig()).tau_d == 0.01
