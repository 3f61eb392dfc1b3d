"""The paper's weight-change measure and the results table, from hand-made tensors and fixture JSONs."""
import json

import pytest
import torch

import eval as ev
from envs import UserError
import reports


def test_weight_change_by_hand():
    q, mlp, emb = ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight",
                   "model.embed_tokens.weight")
    before = {q: torch.tensor([1.0, 1.0, 0.0, 2.0]), mlp: torch.tensor([[1.0, -1.0], [0.5, 0.0]]),
              emb: torch.ones(6)}
    after = {q: torch.tensor([1.0005, 1.002, 0.0, -2.0]),  # 5e-4 relative: unchanged; 2e-3: changed; 0 -> 0;
                                                           # sign flip
             mlp: torch.tensor([[1.0, -1.0], [0.5, 1e-9]]),  # 0 -> 1e-9 is a change relative to
                                                             # max(|w|, |w'|)
             emb: torch.ones(6)}
    r = ev.weight_change(before, after, rel=1e-3)
    assert (r["changed"], r["total"]) == (3, 14) and r["changed_share"] == pytest.approx(3 / 14)
    assert r["per_module"]["q"] == dict(changed_share=0.5, changed=2, total=4)
    assert r["per_module"]["mlp"] == dict(changed_share=0.25, changed=1, total=4)
    assert r["per_module"]["other"]["changed"] == 0
    assert list(r["per_layer"]) == ["0", "1", "other"] and r["per_layer"]["1"]["changed"] == 1
    assert ev.weight_change(before, before)["changed"] == 0
    with pytest.raises(UserError, match="missing"):
        ev.weight_change(before, {q: before[q]})


def test_weights_command_counts_only_the_adapters_modules(tiny_model, tmp_path):
    import engine

    model, _ = engine.load_model(tiny_model)
    model = engine.add_lora(model, target_modules="q_proj,v_proj")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n and "layers.1." in n:
                p.fill_(0.1)  # only layer 1 moves
    model.save_pretrained(tmp_path / "adapter")
    ev.main(["weights", "--model", tiny_model, "--adapter", str(tmp_path / "adapter"),
             "--out", str(tmp_path / "w.json")])
    r = json.loads((tmp_path / "w.json").read_text())
    assert r["per_layer"]["0"]["changed"] == 0 and r["per_layer"]["1"]["changed"] > 0
    # q and v of layer 1 (half of all q and v parameters) move; nothing else does
    assert r["per_module"]["q"]["changed_share"] > 0.45 and r["per_module"]["v"]["changed_share"] > 0.45
    assert (r["per_module"]["k"]["changed"] == r["per_module"]["o"]["changed"]
            == r["per_module"]["mlp"]["changed"] == 0)


def agent_json(split_rates: dict, seeds_std: float = 0.05) -> dict:
    per_split = {sp: dict(success_rate=s, success_rate_std=seeds_std, invalid_action_rate=inv,
                          mean_steps=10.0, num_episodes=n) for sp, (s, inv, n) in split_rates.items()}
    return dict(split=",".join(split_rates), success_rate=0.0, per_split=per_split)


def test_report_table_from_fixture_jsons(tmp_path):
    base, rwml_run, empty = tmp_path / "base", tmp_path / "rwml", tmp_path / "not_evaluated"
    for d in (base, rwml_run, empty):
        d.mkdir()
    (base / "eval_agent.json").write_text(json.dumps(agent_json({"valid_seen": (0.10, 0.60, 20),
                                                                  "valid_unseen": (0.05, 0.80, 10)})))
    (rwml_run / "eval_agent.json").write_text(json.dumps(agent_json({"valid_seen": (0.40, 0.30, 20),
                                                                      "valid_unseen": (0.25, 0.40, 20)},
                                                                    0.0)))
    (rwml_run / "eval_wm.json").write_text(json.dumps(dict(wm_accuracy=0.375, per_kind={}, n=8)))
    (rwml_run / "weights.json").write_text(json.dumps(dict(changed_share=0.0123, per_module={},
                                                           per_layer={})))
    (rwml_run / "config.json").write_text(json.dumps(dict(model="x")))  # not a result: ignored
    (rwml_run / "metrics.jsonl").write_text("".join(json.dumps(dict(step=i, reward=i / 4)) + "\n"
                                                    for i in range(1, 5)))
    out = tmp_path / "report" / "results.md"
    reports.main(["report", str(base), str(rwml_run), str(empty), "--out", str(out)])
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| arm | ALFWorld ID | OOD | AVG |")
    # AVG over all episodes of both splits: (0.10 * 20 + 0.05 * 10) / 30; invalid per action likewise
    assert rows[1] == "| base | 10.0 ± 5.0 | 5.0 ± 5.0 | 8.3 | 66.7 | – | – | 30 |"
    assert rows[2] == "| rwml | 40.0 ± 0.0 | 25.0 ± 0.0 | 32.5 | 35.0 | 37.5 | 1.23 | 40 |"
    assert rows[3] == "| not_evaluated | – | – | – | – | – | – | – |"
    assert (tmp_path / "report" / "results_rewards.png").stat().st_size > 1000
    assert (tmp_path / "report" / "results_success.png").stat().st_size > 1000
    assert "results_success.png" in out.read_text()


def test_report_bad_input(tmp_path):
    with pytest.raises(UserError, match="not a run folder"):
        reports.main(["report", str(tmp_path / "nope")])
    with pytest.raises(UserError, match="no results"):
        reports.main(["report", str(tmp_path)])


def test_report_shows_the_runs_own_world_model_accuracy_not_a_baselines(tmp_path):
    """A folder shaped like `python train.py`'s: the RWML row is wm_eval_rwml_<kind> after
    wm_eval_before_<kind>, per kind; the baselines' files (the template rule's 66.7 %) never count."""
    run = tmp_path / "rwml"
    run.mkdir()
    scores = dict(before_explore=0.359, rwml_explore=0.464, before_purposeful=0.438,
                  rwml_purposeful=0.484, template_explore=0.75, template_purposeful=0.667,
                  nothing_explore=0.125, copy_purposeful=0.0)
    for name, acc in scores.items():
        (run / f"wm_eval_{name}.json").write_text(json.dumps(dict(wm_accuracy=acc, per_kind={}, n=48)))
    out = tmp_path / "r.md"
    reports.main(["report", str(run), "--out", str(out), "--no-plots"])
    row = next(line for line in out.read_text().splitlines() if line.startswith("| rwml"))
    assert "explore 35.9 → 46.4; purposeful 43.8 → 48.4" in row and "66.7" not in row
    (run / "wm_eval_rwml2_explore.json").write_text(json.dumps(dict(wm_accuracy=0.5, per_kind={})))
    with pytest.raises(UserError, match="more than one world-model result for explore"):
        reports.main(["report", str(run), "--out", str(out), "--no-plots"])


def test_the_default_runs_plot_shows_heldout_accuracy_before_and_after(tmp_path, monkeypatch):
    import matplotlib.axes

    import cards

    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps(dict(step=s, reward=0.1 * s % 1, format_rate=1.0)) + "\n" for s in range(1, 9)))
    for kind, before, after in (("explore", 0.3, 0.46), ("purposeful", 0.4, 0.48)):
        (tmp_path / f"wm_eval_before_{kind}.json").write_text(json.dumps(dict(wm_accuracy=before)))
        (tmp_path / f"wm_eval_rwml_{kind}.json").write_text(json.dumps(dict(wm_accuracy=after)))
    drawn, plot = [], matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot",
                        lambda self, *a, **k: drawn.append((a, k.get("label", ""))) or plot(self, *a, **k))
    cards.plot_rewards(tmp_path / "metrics.jsonl", tmp_path / "reward_curve.png", "RWML")
    heldout = {label.split(",")[1].split()[0]: a for a, label in drawn
               if label.startswith("held-out accuracy,")}
    assert heldout == {"explore": ([0, 8], [0.3, 0.46]), "purposeful": ([0, 8], [0.4, 0.48])}
    assert (tmp_path / "reward_curve.png").stat().st_size > 10_000


def test_curves_clip_their_bands_and_draw_few_points_as_markers(tmp_path, monkeypatch):
    import matplotlib.axes

    bands, bars = [], []
    monkeypatch.setattr(matplotlib.axes.Axes, "fill_between",
                        lambda self, x, lo, hi, **k: bands.append((lo, hi)))
    errorbar = matplotlib.axes.Axes.errorbar
    monkeypatch.setattr(matplotlib.axes.Axes, "errorbar",
                        lambda self, *a, **k: bars.append(k["yerr"]) or errorbar(self, *a, **k))
    many = {"arm": [[(s, v) for s in range(5)] for v in (0.0, 0.0, 0.9)]}  # mean 0.3, sd 0.52
    assert reports.plot_curves(many, tmp_path / "many.png", xlabel="x", ylabel="y", title="t")
    (lo, hi), = bands
    assert min(lo) == 0.0 and max(hi) <= 1.0 and not bars
    few = {"arm": [[(1, v), (2, v)] for v in (0.0, 0.0, 90.0)]}  # two steps, percent
    assert reports.plot_curves(few, tmp_path / "few.png", xlabel="x", ylabel="y", title="t", top=100)
    assert len(bands) == 1 and len(bars) == 1 and bars[0][0] == pytest.approx([30.0, 30.0])  # down to 0
    assert (tmp_path / "few.png").stat().st_size > 5_000


def test_the_test_split_gains_figure_is_drawn(tmp_path):
    import rescore

    found = json.loads((rescore.ROOT / "lab/results/strict_rescore/rescore.json").read_text())["comparisons"]
    png = rescore.plot_gains(found, tmp_path / "gains.png")
    assert png.stat().st_size > 20_000


def test_one_runs_gain_is_paired_with_a_ci_and_an_honest_verdict(tmp_path):
    """`lab/rescore.py --run`: RWML − warm-up per held-out set under the reward and exact match, paired on
    triplets with a CI over games; RWML predictions equal to the warm-up's show +0.000, not detected."""
    import shutil

    import rescore

    lines = rescore.run_gain(rescore.ROOT / "lab" / "results" / "train_default")
    assert len(lines) == 4 and lines[0].startswith("explore reward: RWML − warm-up +0.021 [")
    assert all("no difference detected" in line for line in lines)
    for kind in ("explore", "purposeful"):
        src = rescore.ROOT / "lab" / "results" / "train_default" / f"wm_eval_before_{kind}.triplets.jsonl"
        shutil.copy(src, tmp_path / src.name)
        shutil.copy(src, tmp_path / f"wm_eval_rwml_{kind}.triplets.jsonl")
    same = rescore.run_gain(tmp_path)
    assert all("RWML − warm-up +0.000 [+0.000, +0.000]" in line for line in same)


def test_the_tw_wm_tables_pair_arms_on_triplets_with_every_seed_shown(tmp_path):
    """`lab/rescore.py --evals`: lab/tw_wm.sh's layout (seedN/<arm>.triplets.jsonl, one-run baselines beside)
    -> each arm's mean reward with its seeds, the baselines, and paired differences: RWML = the run's after,
    warm-up and WM SFT = its before in both seeds, so RWML − warm-up is the run's own paired gain in each
    seed and WM SFT − warm-up exactly 0: no item changed."""
    import shutil

    import rescore

    src = rescore.ROOT / "lab" / "results" / "train_default"
    folder = tmp_path / "eval_dev"
    for seed in ("seed0", "seed1"):
        (folder / seed).mkdir(parents=True)
        for arm, run in (("warmup", "before"), ("wm_sft", "before"), ("rwml", "rwml")):
            shutil.copy(src / f"wm_eval_{run}_explore.triplets.jsonl",
                        folder / seed / f"{arm}.triplets.jsonl")
    shutil.copy(src / "wm_eval_template_explore.triplets.jsonl", folder / "template.triplets.jsonl")
    rows = [json.loads(x) for x in (src / "wm_eval_before_explore.triplets.jsonl").read_text().splitlines()]
    before = sum(sum(r["rewards"]) / len(r["rewards"]) for r in rows) / len(rows)
    md = "\n".join(rescore.evals_report(folder))
    warm = next(line for line in md.splitlines() if line.startswith("| dev | warmup |"))
    assert f"{before:.3f} ({before:.3f}/{before:.3f})" in warm
    assert any(line.startswith("| dev | template (one run) | 0.729") for line in md.splitlines())
    same = next(line for line in md.splitlines() if "| wm_sft − warmup | reward accuracy |" in line)
    assert "+0.000 [+0.000, +0.000]" in same and "no item changed" in same
    gain = next(line for line in md.splitlines() if "| rwml − warmup | reward accuracy |" in line)
    assert "+0.021/+0.021" in gain


def test_an_arm_only_some_seeds_ran_is_paired_and_shown_on_those_seeds():
    """COIN_SEEDS=1 (lab/sanity.sh): COIN on one seed of three; its row and RWML − COIN use that seed only."""
    import rescore

    def arm(values, seed):
        return {(f"g{g}", 0, 0): dict(reward=v, exact=v, item_f1=None, game=f"g{g}", kind="arrive")
                for g, v in enumerate(values)} | {("gs", 0, 0): dict(reward=0.0, exact=0.0, item_f1=None,
                                                                     game="gs", kind="arrive")}
    data = {(s, a, k): arm(v, s) for s in ("seed1", "seed2", "seed3") for k in rescore.SPLITS
            for a, v in (("warmup", [0, 0, 1]), ("rwml", [1, 1, 1]), ("wm_sft", [0, 1, 1]))}
    data |= {("seed1", "coin", k): arm([0, 0, 0], "seed1") for k in rescore.SPLITS}
    seeds = ["seed1", "seed2", "seed3"]
    c = rescore.paired(data, seeds, "rwml", "coin", "explore", "reward")
    assert c["per_seed"] == [0.75] and c["items"] == 4  # seed1 alone: 3 of its 4 items differ by 1
    assert len(rescore.paired(data, seeds, "rwml", "warmup", "explore", "reward")["per_seed"]) == 3
    rows = rescore.arm_table(data, seeds)
    assert any(line.startswith("| explore | coin (seed1) | 0.000 (0.000)") for line in rows)
