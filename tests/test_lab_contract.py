"""The lab's table commands held to the CLI's one-line contract: lab/agent_stats.py and
lab/rescore.py on a missing, cut or malformed input end in one line ("error: ...", exit status 1) naming the
file, flag or value and the fix, never a traceback; rescore checks every input before it reads the archive."""
import io
import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import agent_stats
import rescore
from readout import stats
from harness.cli import run_cli

ROOT = Path(__file__).resolve().parents[1]
GAMES = [f"g{i}" for i in range(6)]


def one_line(main, argv: list[str]) -> str:
    """What the command prints when run from the shell (run_cli around its main): one line, status 1."""
    with pytest.raises(SystemExit) as e:
        run_cli(lambda: main(argv))
    msg = e.value.code
    assert isinstance(msg, str) and msg.startswith("error: ") and "\n" not in msg, msg
    return msg


# --------------------------------------------------------------------------------------- lab/agent_stats.py

def write_eval(path: Path, wins: dict, split: str = "test") -> None:
    """An `eval.py agent` result with its episodes: wins is game -> [won per episode]."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(success_rate=0.5, episodes=[
        dict(split=split, game=g, won=bool(w), seed=i) for g, ws in wins.items() for i, w in enumerate(ws)])))


def stage2_folder(root: Path) -> Path:
    """lab/stage2_test.sh's layout: random/sampled.json, base/{greedy,sampled}.json, seedN/policy/..."""
    write_eval(root / "random" / "sampled.json", {g: [0, 1] for g in GAMES})
    for name in ("greedy", "sampled"):
        write_eval(root / "base" / f"{name}.json", {g: [0, 0] for g in GAMES})
        write_eval(root / "seed1" / "policy" / f"{name}.json", {g: [1, 1] for g in GAMES})
    return root


def base(r: Path, name: str = "sampled") -> Path:
    return r / "base" / f"{name}.json"


def policy(r: Path) -> Path:
    return r / "seed1" / "policy" / "sampled.json"


def edit(path: Path, how) -> None:
    data = json.loads(path.read_text())
    path.write_text(json.dumps(how(data)))


def drop(key: str, n: int = 0):
    def how(data):
        del data["episodes"][n][key]
        return data
    return how


AGENT_CASES = {  # name -> (change to a good folder, argv after the folder, the line's expected content)
    "folder missing": (lambda r: None, ["--base", "base"], None),  # root replaced below
    "random missing": (lambda r: (r / "random" / "sampled.json").unlink(), [],
                       r"random/sampled.json is missing; write it again with `eval.py agent --out FILE`"),
    "base missing": (lambda r: (r / "base" / "sampled.json").unlink(), [],
                     r"base/sampled.json is missing"),
    "no policy runs": (lambda r: None, ["--policy", "seed*/nosuch"],
                       r"no seed\*/nosuch/sampled.json under .*: give the folder lab/stage2_test.sh wrote"),
    "cut": (lambda r: base(r).write_text(base(r).read_text()[:90]), [],
            r"base/sampled.json does not read as JSON \(.*\); write it again"),
    "no episodes key": (lambda r: edit(r / "random" / "sampled.json", lambda d: dict(success_rate=0.5)), [],
                        r"random/sampled.json holds no `episodes` list, so it is no result of `eval.py "
                        r"agent`"),
    "not an object": (lambda r: (r / "base" / "sampled.json").write_text("[1, 2]"), [],
                      r"base/sampled.json holds no `episodes` list"),
    "empty episodes": (lambda r: edit(policy(r), lambda d: dict(d, episodes=[])), [],
                       r"seed1/policy/sampled.json holds no episodes \(an empty `episodes` list\)"),
    "no won": (lambda r: edit(r / "base" / "sampled.json", drop("won", 3)), [],
               r"base/sampled.json, episode 4: won is missing or not true / false"),
    "no game": (lambda r: edit(r / "base" / "greedy.json", drop("game")), [],
                r"base/greedy.json, episode 1: game is missing or not text"),
    "won not a truth value": (lambda r: edit(r / "random" / "sampled.json", lambda d: dict(d, episodes=[
        dict(e, won="yes") for e in d["episodes"]])), [], r"random/sampled.json, episode 1: won is missing"),
    "other games": (lambda r: write_eval(policy(r), {g: [1] for g in GAMES[:4]}), [],
                    r"seed1/policy/sampled.json plays other games than .*base/sampled.json \(2 missing, "
                        r"e.g. test/g4\): every arm must play the same games"),
    "out read-only": (lambda r: None, ["--out", "/sys/rwml-test/table.md"],
                      r"--out /sys/rwml-test/table.md: cannot write there"),
    "out a folder": (lambda r: None, ["--out", "{root}"],
                     r"--out .*: give the table's file .*agent_stats.md"),
    "arm without =": (lambda r: None, ["--arm", "policy"], r"--arm 'policy': give NAME=GLOB"),
    "arm matches nothing": (lambda r: None, ["--arm", "x=nosuch*", "--file", "sampled.json"],
                            r"no nosuch\*/sampled.json under .*: check --arm x=nosuch\* "),
    "split absent": (lambda r: None, ["--arm", "x=seed*/policy", "--file", "sampled.json", "--split", "dev"],
                     r"random/sampled.json holds no episode of split dev \(its splits: test\); pass --split"),
}


@pytest.mark.parametrize("case", AGENT_CASES)
def test_agent_stats_bad_input_is_one_line(case, tmp_path):
    root = stage2_folder(tmp_path / "runs")
    change, argv, expected = AGENT_CASES[case]
    change(root)
    if case == "folder missing":
        root, expected = tmp_path / "nosuch", r"nosuch is not a folder; give the folder of the evaluations"
    msg = one_line(agent_stats.main, [str(root)] + [a.replace("{root}", str(root)) for a in argv])
    assert re.search(expected, msg), msg
    assert not list(tmp_path.rglob("*.md"))  # nothing written


def test_agent_stats_makes_the_tables_folder(tmp_path):
    """--out in a folder not made yet: the table and its numbers (was a FileNotFoundError after the work)."""
    root = stage2_folder(tmp_path / "runs")
    agent_stats.main([str(root), "--out", str(tmp_path / "t" / "table.md")])
    assert (tmp_path / "t" / "table.md").read_text().startswith("TextWorld test games: 6,")
    assert json.loads((tmp_path / "t" / "table.json").read_text())["games"] == [f"test/{g}" for g in GAMES]


def test_verdict_on_no_data_says_so():
    assert stats.verdict(None) == stats.NO_DATA == "no data (nothing to compare)"
    assert stats.verdict(dict(diff=0.0, lo=None, hi=None)) == stats.NO_DATA
    assert stats.verdict(dict(diff=0.1, lo=0.05, hi=0.2, p=0.01)) == "holds"
    assert stats.verdict(dict(diff=0.1, lo=0.05, hi=0.2)).startswith("no difference detected")  # no test


# ------------------------------------------------------------------------------------------- lab/rescore.py

def triplet(game: str, step: int, reward: float, target: str = "You pick up the mug 1 from the shelf 2.",
            kind: str = "take") -> dict:
    pred = target if reward else "Nothing happens."
    return dict(game=game, rollout=0, step=step, action="take mug 1 from shelf 2", target=target, kind=kind,
                predictions=[pred, pred], rewards=[reward, reward])


LISTING = "You arrive at shelf 1. On the shelf 1, you see a mug 1."  # a target that lists items: item F1


def tiny_archive(path: Path, change=None) -> Path:
    """lab/sanity.sh's per-triplet results as the test-split archive holds them: one seed, every arm, both
    held-out kinds, 4 triplets of 2 games each, with the summaries their triplets give."""
    files = {}
    for i, arm in enumerate(rescore.ARMS):
        for kind in rescore.SPLITS:
            rows = [triplet(f"g{j % 2}", j, float((i + j) % 2), LISTING, "arrive") for j in range(4)]
            stem = f"runs/sanity/valid_unseen/seed0/eval_{arm}_{kind}"
            files[f"{stem}.triplets.jsonl"] = "".join(json.dumps(r) + "\n" for r in rows)
            files[f"{stem}.json"] = json.dumps(dict(wm_accuracy=sum(r["rewards"][0] for r in rows) / 4,
                                                    exact_match=sum(r["rewards"][0] for r in rows) / 4))
    if change:
        change(files)
    with tarfile.open(path, "w:xz") as tar:
        for name, text in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    return path


def tiny_samples(path: Path) -> Path:
    group = dict(action="take mug 1 from shelf 2", target="You pick up the mug 1 from the shelf 2.",
                 completions=["<next_state>You pick up the mug 1 from the shelf 2.</next_state>",
                              "<next_state>You pick up a mug 1.</next_state>"], rewards=[1.0, 1.0])
    path.write_text("".join(json.dumps(dict(step=s, groups=[group])) + "\n" for s in (1, 2)))
    return path


@pytest.fixture
def no_archive_first(monkeypatch):
    """The archive (and the bootstraps after it) must not be reached: every input fails first."""
    monkeypatch.setattr(rescore, "read_archive", lambda *_: pytest.fail("the archive was read first"))


def cut_member(files):
    name = "runs/sanity/valid_unseen/seed0/eval_rwml_explore.triplets.jsonl"
    files[name] = files[name][:-40]


def edited_summary(files):
    files["runs/sanity/valid_unseen/seed0/eval_coin_purposeful.json"] = json.dumps(dict(wm_accuracy=0.9,
                                                                                        exact_match=0.5))


def lost_arm(files):
    for kind in rescore.SPLITS:
        del files[f"runs/sanity/valid_unseen/seed0/eval_wm_sft_{kind}.triplets.jsonl"]


@pytest.mark.parametrize("case, argv, expected", [
    ("missing", ["--archive", "{tmp}/nosuch.tar.xz"], r"--archive .*nosuch.tar.xz is missing; restore it"),
    ("not a tar", ["--archive", "{tmp}/notar.tar.xz"], r"notar.tar.xz is not a tar archive \(.tar, "),
    ("cut", ["--archive", "{tmp}/cut.tar.xz"], r"cut.tar.xz is a cut or damaged archive"),
    ("cut member", ["--archive", "{tmp}/cut_member.tar.xz"],
     r"cut_member.tar.xz: runs/.*/seed0/eval_rwml_explore.triplets.jsonl, line 4: not JSON"),
    ("edited", ["--archive", "{tmp}/edited.tar.xz"],
     r"edited.tar.xz: seed0/coin/purposeful's triplets give wm_accuracy 0.500000, its summary records "
     r"0.900000 \(a damaged or edited archive\)"),
    ("lost arm", ["--archive", "{tmp}/lost.tar.xz"],
     r"lost.tar.xz lacks 2 per-triplet results, e.g. seed0/eval_wm_sft_explore.triplets.jsonl"),
])
def test_rescore_bad_archive_is_one_line(case, argv, expected, tmp_path):
    (tmp_path / "notar.tar.xz").write_text("not an archive")
    whole = tiny_archive(tmp_path / "whole.tar.xz").read_bytes()
    (tmp_path / "cut.tar.xz").write_bytes(whole[:len(whole) // 2])
    tiny_archive(tmp_path / "cut_member.tar.xz", cut_member)
    tiny_archive(tmp_path / "edited.tar.xz", edited_summary)
    tiny_archive(tmp_path / "lost.tar.xz", lost_arm)
    samples = tiny_samples(tmp_path / "samples.jsonl")
    msg = one_line(rescore.main, [a.replace("{tmp}", str(tmp_path)) for a in argv]
                   + ["--samples", str(samples), "--out", str(tmp_path / "out")])
    assert re.search(expected, msg), msg
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case, argv, expected", [
    ("samples cut", ["--samples", "{tmp}/cut.jsonl"],
     r"cut.jsonl, line 2: not JSON \(a cut or damaged file\); give a run's samples.jsonl"),
    ("samples missing", ["--samples", "{tmp}/nosuch.jsonl"],
     r"nosuch.jsonl is missing; give a run's samples"),
    ("samples without groups", ["--samples", "{tmp}/nogroups.jsonl"],
     r"nogroups.jsonl, line 1: groups is missing or not a list"),
    ("samples rewards", ["--samples", "{tmp}/norewards.jsonl"],
     r"norewards.jsonl, line 1: group 1: completions and rewards are not one text and one number each"),
    ("log missing", ["--log", "{tmp}/nosuch.txt"],
     r"--log .*nosuch.txt is missing; give a `train.py` run log"),
    ("log without groups", ["--log", "{tmp}/log.txt"], r"log.txt shows no GRPO group"),
    ("samples and log", ["--samples", "{tmp}/samples.jsonl", "--log", "{tmp}/log.txt"],
     r"--samples and --log are two sources of the training groups; give one of them"),
    ("out read-only", ["--samples", "{tmp}/samples.jsonl", "--out", "/sys/rwml-test/out"],
     r"--out /sys/rwml-test/out: cannot write there"),
    ("out a file", ["--samples", "{tmp}/samples.jsonl", "--out", "{tmp}/log.txt"],
     r"log.txt is a file, not a folder"),
])
def test_rescore_inputs_are_checked_before_the_archive(case, argv, expected, tmp_path, no_archive_first):
    good = tiny_samples(tmp_path / "samples.jsonl").read_text()
    (tmp_path / "cut.jsonl").write_text(good[:len(good) - 30])
    (tmp_path / "nogroups.jsonl").write_text(json.dumps(dict(step=1)) + "\n")
    row = json.loads(good.splitlines()[0])
    row["groups"][0]["rewards"] = [1.0]
    (tmp_path / "norewards.jsonl").write_text(json.dumps(row) + "\n")
    (tmp_path / "log.txt").write_text("collect: 16 games\nwm: 20 steps\n")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    msg = one_line(rescore.main, argv + ([] if "--out" in argv else ["--out", str(tmp_path / "out")]))
    assert re.search(expected, msg), msg


def write_rows(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def run_folder(root: Path) -> Path:
    root.mkdir(parents=True)
    for arm in ("before", "rwml"):
        for kind in ("explore", "purposeful"):
            rows = [triplet(f"g{j % 2}", j, float(j % 2 if arm == "before" else 1)) for j in range(4)]
            write_rows(root / f"wm_eval_{arm}_{kind}.triplets.jsonl", rows)
    return root


def evals_folder(root: Path, target: str = "You pick up the mug 1 from the shelf 2.") -> Path:
    """lab/tw_wm.sh's evaluation folder: seedN/<arm>.triplets.jsonl and the one-run baselines beside."""
    for s in (0, 1):
        for i, arm in enumerate(("warmup", "rwml", "wm_sft")):
            (root / f"seed{s}").mkdir(parents=True, exist_ok=True)
            rows = [triplet(f"g{j % 3}", j, float((i + j + s) % 2), target) for j in range(6)]
            write_rows(root / f"seed{s}" / f"{arm}.triplets.jsonl", rows)
    return root


def test_rescore_run_and_evals_bad_input(tmp_path):
    run = run_folder(tmp_path / "run")
    assert len(rescore.run_gain(run)) == 4  # the good folder
    one = run / "wm_eval_rwml_purposeful.triplets.jsonl"
    one.write_text(one.read_text()[:-25])
    msg = one_line(rescore.main, ["--run", str(run)])
    assert ("wm_eval_rwml_purposeful.triplets.jsonl, line 4: not JSON (a cut or damaged file); give a "
            "`python train.py` run folder") in msg
    one.write_text(json.dumps(dict(triplet("g0", 0, 1.0), predictions=None)) + "\n")
    msg = one_line(rescore.main, ["--run", str(run)])
    assert "purposeful.triplets.jsonl, line 1: predictions is missing or not a list of texts" in msg
    one.unlink()
    msg = one_line(rescore.main, ["--run", str(run)])
    assert "wm_eval_rwml_purposeful.triplets.jsonl is missing" in msg
    assert "--run " in one_line(rescore.main, ["--run", str(tmp_path / "nosuch")])

    assert "is not a folder" in one_line(rescore.main, ["--evals", str(tmp_path / "nosuch")])
    (tmp_path / "empty").mkdir()
    msg = one_line(rescore.main, ["--evals", str(tmp_path / "empty")])
    assert "no seed*/<arm>.triplets.jsonl in it" in msg
    ev = evals_folder(tmp_path / "eval_dev")
    cut = ev / "seed1" / "rwml.triplets.jsonl"
    cut.write_text(cut.read_text()[:-10])
    assert "seed1/rwml.triplets.jsonl, line 6: not JSON" in one_line(rescore.main, ["--evals", str(ev)])
    assert "--out /sys/rwml-test/t.md: cannot write there" in one_line(
        rescore.main, ["--evals", str(ev), "--out", "/sys/rwml-test/t.md"])
    assert "--run and --evals are different commands" in one_line(rescore.main, ["--run", str(run),
                                                                                 "--evals", str(ev)])


def test_rescore_gains_bad_input(tmp_path):
    assert "rescore.json is missing; write it again with `python lab/rescore.py --out FOLDER`" in one_line(
        rescore.main, ["--gains", "--out", str(tmp_path)])
    (tmp_path / "rescore.json").write_text('{"comparisons": [')
    assert "rescore.json does not read as JSON" in one_line(rescore.main, ["--gains", "--out", str(tmp_path)])
    (tmp_path / "rescore.json").write_text(json.dumps(dict(training=[])))
    assert "holds no `comparisons` list" in one_line(rescore.main, ["--gains", "--out", str(tmp_path)])


def test_a_metric_with_no_data_is_a_row_that_says_so(tmp_path):
    """Item F1 where no target lists items (TextWorld's "You pick up ..."): stats.verdict(None) was a
    TypeError; the table now says "no data" in that row and "–" for the arm's rate."""
    md = "\n".join(rescore.evals_report(evals_folder(tmp_path / "eval_dev")))
    rows = [line for line in md.splitlines() if "| item F1 |" in line]
    assert len(rows) == 3 and all(line.endswith(f"| – | – | – | {stats.NO_DATA} |") for line in rows), rows
    assert all(line.split(" | ")[4] == "–" for line in md.splitlines() if line.startswith("| dev | rwml |"))


def test_rescore_from_the_shell_is_one_line_on_stderr(tmp_path):
    """The scripts' __main__ runs main inside run_cli: one stderr line, status 1, no traceback."""
    for argv in (["lab/rescore.py", "--archive", str(tmp_path / "nosuch.tar.xz"), "--samples",
                  str(tiny_samples(tmp_path / "s.jsonl")), "--out", str(tmp_path / "o")],
                 ["lab/agent_stats.py", str(tmp_path / "nosuch")]):
        done = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
        assert done.stderr.startswith("error: ") and "nosuch" in done.stderr
