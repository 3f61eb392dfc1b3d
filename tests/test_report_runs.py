"""`lab/reports.py report` on every run the CLI makes: the metrics.jsonl of `train.py wm`
(with and without --eval-steps and --eval-on-start, lab/trl_grpo.py), `train.py policy` (with and without its
held-out curve) and `train.py` (stage all), built here row by row as train.py writes them, no model."""
import json

import matplotlib.axes
import pytest

from stages import plumbing
from stages import runs
import reports

TARGETS = ["You arrive at shelf 1. On the shelf 1, you see a mug 1.", "Nothing happens."]


def wm_rows(steps: int, eval_steps: int = 0, on_start: bool = False) -> list[dict]:
    """train_wm's rows: runs.wm_row per step (log_row renames it to TRL's names), the held-out
    evaluation's eval_* on every eval_steps-th step and the last, and with --eval-on-start a step-0 row of
    those alone."""
    def evaluate(step):
        return dict(eval_wm_accuracy=0.3 + 0.01 * step, eval_mean_cosine=0.8, eval_beyond_template=0.1)

    rows = [dict(step=0, **evaluate(0))] if eval_steps and on_start else []
    for step in range(1, steps + 1):
        res = {"reward_mean": 0.1 * step, "reward_std": 0.2, "frac_reward_zero_std": 0.5, "format_rate": 1.0,
               "completion_tokens": 20.0, "completions/min_length": 12.0, "completions/max_length": 30.0,
               "completions/clipped_ratio": 0.0, "group_rewards": [0.5, 0.0],
               "advantages": [0.1, -0.1, 0.0, 0.0],  # group_nothing [1, 0], advantage [0.1, 0], share 0.25
               "completions": [f"<next_state>{x}</next_state>" for x in ("Nothing happens.", "a", "b", "c")]}
        u = dict(loss=0.01, kl=0.001, clip_ratio=0.0, grad_norm=0.3, skipped=False)
        batch = [dict(next_obs=t) for t in TARGETS]
        row = runs.wm_row(dict(step=step, epoch=0), res, u, batch, 1e-4, 2.5)
        if eval_steps and (step % eval_steps == 0 or step == steps):
            row.update(evaluate(step))
        rows.append(row)
    return rows


def policy_rows(steps: int, eval_steps: int = 0, on_start: bool = False) -> list[dict]:
    """train_policy's rows: rwml.policy_step's stats, its last update, the learning rate and seconds; with
    --eval-steps heldout_success's eval_* on every eval_steps-th step and the last; --eval-on-start: a
    step-0 row of those alone."""
    def evaluate(step):
        return dict(eval_success=0.1 * step, eval_mean_steps=6.5, eval_invalid=0.0)

    rows = [dict(step=0, **evaluate(0))] if eval_steps and on_start else []
    for step in range(1, steps + 1):
        stats = dict(reward_mean=0.25 * step, reward_std=0.4, frac_reward_zero_std=0.5,
                     invalid_action_rate=0.0, mean_steps=7.0, num_turns=54, trained_turns=22,
                     completion_tokens=1.0)
        row = dict(step=step, **stats, loss=0.09, kl=0.0, clip_ratio=0.0, grad_norm=1.1, skipped=False,
                   learning_rate=1e-3, seconds=200.0)
        if eval_steps and (step % eval_steps == 0 or step == steps):
            row.update(evaluate(step))
        rows.append(row)
    return rows


def trl_rows(steps: int) -> list[dict]:
    """lab/trl_grpo.py's metrics.jsonl: TRL's log_history rows that hold a reward."""
    return [{"loss": 0.0, "grad_norm": 0.2, "learning_rate": 1e-4, "num_tokens": 1800.0 * step,
             "completions/mean_length": 20.0, "completions/min_length": 12.0, "completions/max_length": 30.0,
             "completions/clipped_ratio": 0.0, "completions/mean_terminated_length": 20.0,
             "completions/min_terminated_length": 12.0, "completions/max_terminated_length": 30.0,
             "rewards/reward/mean": 0.1 * step, "rewards/reward/std": 0.2, "reward": 0.1 * step,
             "reward_std": 0.2, "frac_reward_zero_std": 0.5, "kl": 0.001, "entropy": 1.2,
             "clip_ratio/low_mean": 0.0, "clip_ratio/low_min": 0.0, "clip_ratio/high_mean": 0.0,
             "clip_ratio/high_max": 0.0, "clip_ratio/region_mean": 0.0, "epoch": 0.5 * step, "step": step}
            for step in range(1, steps + 1)]


def write_metrics(folder, rows: list[dict]) -> None:
    """Through plumbing.log_row, as train.py writes each row (TRL's names: reward_mean -> reward, ...)."""
    with open(folder / "metrics.jsonl", "a") as f:
        for row in rows:
            plumbing.log_row(f, None, row)


WM_RESULT = dict(wm_accuracy=0.375, mean_cosine=0.8, per_kind={}, n=8)  # eval.py wm --out <run>/eval_wm.json
AGENT_RESULT = dict(split="valid_seen,valid_unseen", success_rate=0.25, per_split={
    sp: dict(success_rate=0.25, success_rate_std=0.0, invalid_action_rate=0.1, mean_steps=10.0,
             num_episodes=8) for sp in ("valid_seen", "valid_unseen")})

SHAPES = {  # the command -> its metrics rows and the result JSON put beside them
    "train.py wm": (wm_rows(4), "eval_wm.json", WM_RESULT),
    "train.py wm --eval-steps 2": (wm_rows(4, 2), "eval_wm.json", WM_RESULT),
    "train.py wm --eval-steps 2 --eval-on-start": (wm_rows(4, 2, True), "eval_wm.json", WM_RESULT),
    "lab trl_grpo": (trl_rows(4), "eval_wm.json", WM_RESULT),
    "train.py policy": (policy_rows(3), "eval_agent.json", AGENT_RESULT),
    "train.py policy --eval-steps 1": (policy_rows(3, 1), "eval_agent.json", AGENT_RESULT),
    "train.py policy --eval-steps 2 --eval-on-start": (policy_rows(3, 2, True), "eval_agent.json",
                                                       AGENT_RESULT),
    "train.py": (wm_rows(4), None, None),
    "train.py --eval-steps 2 --eval-on-start": (wm_rows(4, 2, True), None, None),
}


def all_results(folder) -> None:
    """What `python train.py` writes beside its metrics: held-out accuracy before / after, the baselines."""
    for kind, before, after in (("explore", 0.359, 0.464), ("purposeful", 0.438, 0.484)):
        for arm, acc in (("before", before), ("rwml", after), ("template", 0.75), ("nothing", 0.1),
                         ("copy", 0.0)):
            (folder / f"wm_eval_{arm}_{kind}.json").write_text(json.dumps(dict(
                WM_RESULT, wm_accuracy=acc, n=48, split="valid_unseen", transitions="runs/rwml/heldout")))
    (folder / "cost.json").write_text(json.dumps(dict(seconds=700.0, stages={})))


@pytest.mark.parametrize("command", SHAPES)
def test_report_accepts_every_run_shape(command, tmp_path, monkeypatch):
    rows, result, data = SHAPES[command]
    run = tmp_path / command.replace(" ", "_").replace("-", "")
    run.mkdir()
    write_metrics(run, rows)
    (run / "config.json").write_text(json.dumps(dict(model="bundled:SmolLM2-135M-Instruct")))
    if result:
        (run / result).write_text(json.dumps(data))
    else:
        all_results(run)
    drawn, plot = [], matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot",
                        lambda self, *a, **k: drawn.append((a, k.get("label"))) or plot(self, *a, **k))
    out = tmp_path / "report" / "results.md"
    reports.main(["report", str(run), "--out", str(out)])
    row = next(line for line in out.read_text().splitlines() if line.startswith(f"| {run.name} |"))
    if result == "eval_agent.json":
        assert row.startswith(f"| {run.name} | 25.0 ± 0.0 | 25.0 ± 0.0 | 25.0 | 10.0 | – |")
    else:
        assert ("explore 35.9 → 46.4; purposeful 43.8 → 48.4" if result is None else "| 37.5 |") in row
    trained = [r for r in plumbing.read_jsonl(run / "metrics.jsonl") if "reward" in r]
    assert (drawn[0][0][0], drawn[0][0][1], drawn[0][1]) == ([r["step"] for r in trained],
                                                              [r["reward"] for r in trained], run.name)
    assert (tmp_path / "report" / "results_rewards.png").stat().st_size > 1000


def test_a_row_the_cli_never_writes_is_still_refused(tmp_path):
    """Accepting step-0 rows does not accept anything: a row without a step, or a reward or held-out number
    that is not a number, is named in one line."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "eval_wm.json").write_text(json.dumps(WM_RESULT))
    for bad, problem in ((dict(reward=0.5), "step is missing or not a number"),
                         (dict(step=0, eval_wm_accuracy="x"), "eval_wm_accuracy is missing or not a number"),
                         (dict(step=1, reward=None), "reward is missing or not a number")):
        (run / "metrics.jsonl").write_text(json.dumps(bad) + "\n")
        with pytest.raises(reports.UserError, match=f"metrics.jsonl, record 1: {problem}; fix or remove"):
            reports.main(["report", str(run), "--out", str(tmp_path / "r.md"), "--no-plots"])
