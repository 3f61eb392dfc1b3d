"""lab/reports.py on malformed run folders: one line naming the file and the fix, never a
traceback or a silently wrong table; a seed1_old/ backup folder is left out with a note."""
import json
import shutil

import pytest

import reports
from readout import verdict
from envs import UserError
from test_choose import _agent_eval
from test_heldout import _wm


def agent_folder(root):
    """agent_sanity.sh's layout, as test_choose's agent-table test builds it."""
    for arm, dev, test in (("base", 0.0, 0.1), ("rwml", 0.1, 0.2), ("wm_sft", 0.2, None)):
        (root / arm).mkdir(parents=True)
        splits = dict(dev=(dev, 0.0, 10, 10), **({"test": (test, 0.0, 10, 10)} if test is not None else {}))
        (root / arm / "eval_agent.json").write_text(_agent_eval(splits))
    (root / "random").mkdir()
    (root / "random" / "eval_agent.json").write_text(_agent_eval(dict(dev=(0.3, 0.05, 30, 10),
                                                                      test=(0.4, 0.1, 30, 10))))
    for s, (mid, end, test) in enumerate([(0.2, 0.5, 0.4), (0.1, 0.3, 0.2), (0.3, 0.4, 0.3)]):
        for arm in ("policy", "rwml_policy", "wm_sft_policy"):
            d = root / f"seed{s}" / arm
            d.mkdir(parents=True)
            rows = [dict(step=1, reward=0.1), dict(step=2, reward=0.2, eval_success=mid),
                    dict(step=4, reward=0.3, eval_success=end)]
            (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            (d / "eval_agent.json").write_text(_agent_eval(dict(test=(test, 0.0, 10, 10))))
    return root


def sanity_folder(root):
    """sanity.sh's layout, as test_heldout's sanity-table test builds it, with --eval-steps rows."""
    held = root / "valid_unseen"
    (held / "baselines").mkdir(parents=True)
    kinds = dict(arrive=(0.5, 30), take=(1.0, 4))
    for kind in verdict.HELDOUT_KINDS:
        (held / "baselines" / f"template_{kind}.json").write_text(json.dumps(_wm(0.85, 0.8, 0.0, kinds)))
    for s, (w, r) in enumerate([(0.40, 0.50), (0.30, 0.25), (0.35, 0.45)]):
        d = root / f"seed{s}"
        (d / "rwml").mkdir(parents=True)
        (d / "rwml" / "config.json").write_text(json.dumps(dict(beta=0.1, out="x", num_generations=4)))
        rows = [dict(step=k, reward=x, frac_reward_zero_std=0.5, nothing_share=x, target_kinds=["arrive"],
                     group_rewards=[0.5], group_nothing=[1], group_nothing_advantage=[-0.5])
                for k, x in enumerate((0.1, 0.2, 0.3, 0.4), 1)]
        rows += [dict(step=k, eval_wm_accuracy=0.1 * k) for k in (0, 2, 4)]
        (d / "rwml" / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
        (held / d.name).mkdir()
        for kind in verdict.HELDOUT_KINDS:
            (held / d.name / f"eval_warmup_{kind}.json").write_text(json.dumps(_wm(w, w, w, kinds)))
            (held / d.name / f"eval_rwml_{kind}.json").write_text(json.dumps(_wm(r, r, r, kinds)))
    return root


def edit_json(path, change):
    data = json.loads(path.read_text())
    path.write_text(json.dumps(change(data)))


def edit_rows(path, change):
    rows = [change(json.loads(line)) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def cut(path):
    path.write_text(path.read_text()[:40])


def backup(root):
    shutil.copytree(root / "seed1", root / "seed1_old")
    if (root / "valid_unseen").is_dir():
        shutil.copytree(root / "valid_unseen" / "seed1", root / "valid_unseen" / "seed1_old")
    for f in root.glob("seed1_old/**/*.json*"):  # a backup of other numbers: they must not reach the table
        f.write_text(f.read_text().replace("0.", "0.9"))


CASES = {  # name -> (report, what breaks the folder, the error it gives; None: the table as before)
    "agent cut JSON": ("agent-table", lambda r: cut(r / "seed1" / "policy" / "eval_agent.json"),
                       r"seed1/policy/eval_agent.json does not read as JSON .*write it again"),
    "agent per_split null": ("agent-table", lambda r: (r / "base" / "eval_agent.json").write_text(
        '{"per_split": null}'), r"base/eval_agent.json: per_split is missing or not an object"),
    "agent list for an object": ("agent-table", lambda r: edit_json(
        r / "rwml" / "eval_agent.json", lambda d: dict(per_split=dict(dev=[0.1]))),
        r"rwml/eval_agent.json: per_split.dev: not a JSON object"),
    "agent whole file a list": ("agent-table", lambda r: (
        r / "seed0" / "policy" / "eval_agent.json").write_text("[]"),
        r"seed0/policy/eval_agent.json holds a JSON list, not an object"),
    "agent non-numeric step": ("agent-table", lambda r: edit_rows(
        r / "seed2" / "wm_sft_policy" / "metrics.jsonl", lambda x: dict(x, step=str(x["step"]))),
        r"seed2/wm_sft_policy/metrics.jsonl, record 1: step is missing or not a number"),
    "agent missing split": ("agent-table", lambda r: edit_json(
        r / "random" / "eval_agent.json", lambda d: dict(per_split=dict(dev=d["per_split"]["dev"]))),
        "| uniform random admissible | 30.0 ± 5.0 | – | – | – | – |"),
    "agent seed1_old": ("agent-table", backup, None),
    "sanity cut JSON": ("sanity", lambda r: cut(r / "valid_unseen" / "seed0" / "eval_rwml_explore.json"),
                        r"valid_unseen/seed0/eval_rwml_explore.json does not read as JSON"),
    "sanity missing per_kind": ("sanity", lambda r: edit_json(
        r / "valid_unseen" / "baselines" / "template_purposeful.json",
        lambda d: {k: v for k, v in d.items() if k != "per_kind"}),
        r"template_purposeful.json: per_kind is missing or not an object, so it is no result of `eval.py "
        "wm`"),
    "sanity list for an object": ("sanity", lambda r: edit_json(
        r / "valid_unseen" / "seed1" / "eval_warmup_explore.json",
        lambda d: dict(d, per_observation_kind=[])),
        r"eval_warmup_explore.json: per_observation_kind is missing or not an object"),
    "sanity non-numeric step": ("sanity", lambda r: edit_rows(
        r / "seed0" / "rwml" / "metrics.jsonl", lambda x: dict(x, step="2") if x == dict(
            step=2, eval_wm_accuracy=0.2) else x),
        r"seed0/rwml/metrics.jsonl, record 6: step is missing or not a number"),
    "sanity seed1_old": ("sanity", backup, None),
    "sanity split absent": ("sanity", lambda r: (r / "valid_unseen").rename(r / "valid_seen"),
                            r"no held-out split 'valid_unseen' in .*: the splits there are valid_seen; "
                            "pass --split"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_malformed_report_folder_is_one_line_naming_the_file(case, tmp_path, capsys):
    command, damage, expect = CASES[case]
    root = (agent_folder if command == "agent-table" else sanity_folder)(tmp_path / "run")
    argv = [command, str(root), "--out", str(tmp_path / "table.md")]
    reports.main(argv)
    valid = (tmp_path / "table.md").read_text()
    damage(root)
    if expect is None or expect.startswith("|"):  # valid input: the table, unchanged but for that row
        reports.main(argv)
        text = (tmp_path / "table.md").read_text()
        if expect is None:
            assert text == valid and "seed1_old is no seed folder" in capsys.readouterr().err
        else:
            assert expect in text and len(text.splitlines()) == len(valid.splitlines())
        return
    with pytest.raises(UserError, match=expect) as e:
        reports.main(argv)
    assert "\n" not in str(e.value)


def test_sanity_split_bogus_names_the_splits_there(tmp_path):
    root = sanity_folder(tmp_path / "run")
    with pytest.raises(UserError, match=r"no held-out split 'bogus' in .*: the splits there are "
                                        "valid_unseen; pass --split with one of them"):
        reports.main(["sanity", str(root), "--split", "bogus", "--out", str(tmp_path / "t.md")])
    assert not (tmp_path / "t.md").exists()
