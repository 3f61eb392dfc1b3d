"""Model cards that state a run's result, its license and its command without the machine's folders; figures
with labelled axes, whole steps and bands within a rate's range; a first run that shows its download, checks
the data before it creates anything, counts the bundled model's conversion in its cost line, and can install
PyTorch's CPU build; the GPU plan's seeds."""
import json
import os
import shutil
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import engine
from stages import plumbing
import cards
import train
from envs import UserError
from stages.plumbing import read_jsonl

ROOT = Path(__file__).resolve().parent.parent
WM_ARGS = ["--no-easy-filter", "--no-warmup", "--prompts-per-step", "2", "--num-generations", "2",
           "--max-completion-length", "6", "--micro-batch-size", "2", "--max-steps", "1"]


# ------------------------------------------------------------------------------------------------ the cards

def test_a_wm_card_made_with_a_learning_curve_states_its_held_out_result(tiny_model, transitions, tmp_path):
    out = tmp_path / "run"
    train.main(["wm", "--model", tiny_model, "--transitions", transitions, *WM_ARGS, "--eval-steps", "1",
                "--eval-transitions", transitions, "--eval-max-triplets", "2", "--eval-samples", "1",
                "--out", str(out)])
    last = [r for r in read_jsonl(out / "metrics.jsonl") if "eval_wm_accuracy" in r][-1]
    card = (out / "adapter" / "README.md").read_text()
    assert (f"- held-out world-model accuracy (<path>, 1 prediction(s) on each of up to 2 triplets) at step "
            f"1: {last['eval_wm_accuracy']:.3f}; by step: 1: {last['eval_wm_accuracy']:.3f}") in card
    config = json.loads((out / "config.json").read_text())  # no folder of this machine
    assert [config[k] for k in ("transitions", "eval_transitions", "out", "model")] == ["<path>"] * 4
    assert str(tmp_path) not in card


def test_the_all_card_puts_the_template_rule_beside_before_and_after(tmp_path):
    """Each kind's card line carries that kind's numbers, whatever order the held-out sets were built in (on
    61e63ba the card zipped HELDOUT_KINDS with lines built purposeful first: the kinds were swapped)."""
    out = tmp_path / "run"
    (out / "adapter").mkdir(parents=True)
    (out / "adapter" / "adapter_config.json").write_text(json.dumps(dict(base_model_name_or_path="org/m")))
    held = {"purposeful": "world-model accuracy 0.200 -> 0.300 (48 triplets)",  # built first, as `all` does
            "explore": "world-model accuracy 0.349 -> 0.370 (48 triplets)"}
    rules = {"explore": 0.729, "purposeful": 0.667}
    train.card_all(train.Settings(), out, held, rules, 30, Path("warmup"))
    card = (out / "adapter" / "README.md").read_text()
    assert ("- held-out explore (valid_unseen, 20 games), before = the warm-up: the content-free template "
            "rule 0.729, world-model accuracy 0.349 -> 0.370 (48 triplets)") in card
    assert ("- held-out purposeful (valid_unseen, 20 games), before = the warm-up: the content-free template "
            "rule 0.667, world-model accuracy 0.200 -> 0.300") in card


def test_a_cards_command_line_names_no_folder_of_the_machine(tmp_path, monkeypatch):
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps(dict(base_model_name_or_path="org/model")))
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", [str(ROOT / "train.py"), "wm", "--transitions",
                                      str(ROOT / "runs" / "c" / "transitions.jsonl"), "--out",
                                      str(tmp_path / "run"), f"--config={tmp_path / 'c.json'}", "--seed", "3",
                                      "--filter-dir", "runs/f"])
    cards.write_card(folder, train.Settings(), "wm")
    card = (folder / "README.md").read_text()
    assert ("- command: `python train.py wm --transitions runs/c/transitions.jsonl --out '<path>' "
            "'--config=<path>' --seed 3 --filter-dir runs/f`") in card
    assert str(tmp_path) not in card and str(ROOT) not in card


def test_a_card_states_the_base_models_license_where_it_is_known(tmp_path):
    def card(base: str) -> str:
        folder = tmp_path / "adapter"
        folder.mkdir(exist_ok=True)
        (folder / "adapter_config.json").write_text(json.dumps(dict(base_model_name_or_path=base)))
        cards.write_card(folder, train.Settings(), "wm-sft")
        return (folder / "README.md").read_text().split("\n---\n")[0]  # the metadata

    assert "\nlicense: apache-2.0\n" in card(engine.BUNDLED_HUB_ID)  # SmolLM2's, the bundled model
    local = tmp_path / "local-model"
    local.mkdir()
    (local / "README.md").write_text("---\nlicense: mit\n---\n# a model\n")
    assert "\nlicense: mit\n" in card(str(local))
    unknown = card("org/not-in-any-cache")  # offline and never downloaded: left out, and why
    assert "\nlicense:" not in unknown
    assert ("# license: not stated: no card of the base model (org/not-in-any-cache) on this machine states "
            "one (the Hub is not asked); this adapter's license is the base model's") in unknown


# ---------------------------------------------------------------------------------------------- the figures

@pytest.fixture
def figures(monkeypatch):
    """Every figure saved, by file name: its axes, read from matplotlib (not from pixels)."""
    from matplotlib.figure import Figure

    saved, save = {}, Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, path, **k: saved.update({Path(path).name: self.axes})
                        or save(self, path, **k))
    return saved


def whole_steps(ax) -> bool:
    low, high = ax.get_xlim()
    return all(float(t).is_integer() for t in ax.get_xticks() if low <= t <= high)


def test_the_reward_curve_has_a_y_label_and_whole_steps(tmp_path, figures):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(dict(step=s, reward=0.2 * s, format_rate=0.5))
                                                    + "\n" for s in (1, 2, 3)))
    cards.plot_rewards(tmp_path / "metrics.jsonl", tmp_path / "reward_curve.png", "RWML")
    ax, = figures["reward_curve.png"]
    assert ax.get_ylabel() and ax.get_xlabel() == "optimizer step" and whole_steps(ax)


def test_the_agent_curves_and_bars_stay_within_a_rates_range_on_whole_steps(tmp_path, figures):
    import reports

    curves = {"policy RL": [[(0, 5.0), (3, v)] for v in (0.0, 0.0, 10.0)]}  # 2 steps: markers, error bars
    assert reports.plot_curves(curves, tmp_path / "curve.png", xlabel="stage-2 step", ylabel="success (%)",
                               title="t", top=100)
    ax, = figures["curve.png"]
    assert whole_steps(ax)
    lows = [seg[0][1] for c in ax.collections for seg in c.get_segments()]  # an error bar: (x, low)-(x, high)
    assert lows and min(lows) >= 0
    run = dict(name="a", curve=[dict(step=s, reward=0.1 * s) for s in (1, 2, 3)],
               splits={reports.ID_SPLIT: dict(success_rate=0.05, success_rate_std=0.2),
                       reports.OOD_SPLIT: dict(success_rate=0.9, success_rate_std=0.2)})
    reports.report_plots([run], tmp_path / "report")
    assert whole_steps(figures["report_rewards.png"][0])
    bars = [seg for c in figures["report_success.png"][0].collections for seg in c.get_segments()]
    assert bars and min(s[0][1] for s in bars) >= 0 and max(s[1][1] for s in bars) <= 100


# ---------------------------------------------------------------------------------------- the first contact

def test_make_data_shows_the_download(tmp_path):
    """alfworld-download's progress was sent to /dev/null under `timeout 900`: up to 15 silent minutes."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / ".installed").touch()  # `setup` done: newer than requirements.txt
    fake = venv / "bin" / "alfworld-download"  # alfworld's downloader, without the network
    fake.write_text(f"#!{sys.executable}\n" + """import os, sys
from tqdm import tqdm
data = sys.argv[sys.argv.index("--data-dir") + 1]
for name in ("json_2.1.1_json.zip", "json_2.1.2_tw-pddl.zip"):
    with tqdm(total=4096, unit="B", unit_scale=True, desc=f"Downloading {name}") as bar:
        bar.update(4096)
os.makedirs(os.path.join(data, "json_2.1.1"))
""")
    fake.chmod(0o755)
    r = subprocess.run(["make", "-s", "data", f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "ALFWORLD_DATA": str(tmp_path / "data")}, timeout=120)
    assert r.returncode == 0, r.stderr
    text = r.stdout + r.stderr
    assert f"ALFWorld data: downloading into {tmp_path / 'data'} with alfworld-download" in text
    assert "Downloading json_2.1.1_json.zip: 100%" in text and "4.10k/4.10k" in text  # each step, its size
    assert f"ALFWorld data downloaded to {tmp_path / 'data'}" in text


@pytest.mark.parametrize("stage", ["collect", "policy"])
def test_missing_alfworld_data_is_one_line_before_out_or_a_cost_line(stage, tiny_model, tmp_path, monkeypatch,
                                                                     capsys):
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path / "nothing"))
    out = tmp_path / "run"
    with pytest.raises(UserError, match=f"ALFWorld data not found: {tmp_path / 'nothing' / 'json_2.1.1'}"):
        train.main([stage, "--model", tiny_model, "--out", str(out)])
    assert not out.exists() and "cost:" not in capsys.readouterr().out


def test_the_first_runs_cost_line_counts_the_bundled_models_conversion(tiny_model, tmp_path, monkeypatch,
                                                                       capsys):
    """The conversion ran while the run's inputs were checked, before its cost clock: 4.3 s reported, 70 real.
    Here it is a stand-in of 1.5 s (a copy of the tiny model), on an empty cache."""
    def convert(folder, gguf, cached):
        time.sleep(1.5)
        shutil.copytree(tiny_model, cached)

    monkeypatch.setattr(engine, "MODEL_CACHE", tmp_path / "cache")
    monkeypatch.setattr(engine, "convert_gguf", convert)
    plumbing.model_context.cache_clear()  # the bundled model's tokenizer, read from the cache above
    try:
        train.main(["collect", "--walkthrough", "--num-games", "1", "--out", str(tmp_path / "run")])
    finally:
        plumbing.model_context.cache_clear()
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("cost: "))
    cost = json.loads((tmp_path / "run" / "cost.json").read_text())
    assert "model conversion" in line and cost["stages"]["model conversion"]["seconds"] >= 1.5
    assert cost["seconds"] >= 1.5  # the run's total holds it


def test_setup_picks_pytorchs_build_by_the_gpu_it_finds(tmp_path):
    """`make setup` without TORCH: PyPI's torch where `nvidia-smi -L` lists a GPU, the CPU build where it is
    missing or fails; TORCH=cpu / TORCH=cuda force either; the choice is one printed line. nvidia-smi is faked
    on PATH; this machine has none, so its plain `make -n setup` shows the CPU build (fails on 61e63ba, whose
    default was PyPI's torch everywhere)."""
    fake = tmp_path / "bin"
    fake.mkdir()

    def setup(*extra, gpu=None):
        env = dict(os.environ)
        if gpu is not None:  # a fake nvidia-smi: `ok` lists a GPU, else it fails as a driverless one does
            (fake / "nvidia-smi").write_text("#!/bin/sh\n" + ('echo "GPU 0: NVIDIA H200 (UUID: GPU-0)"\n'
                                                              if gpu == "ok" else "exit 9\n"))
            (fake / "nvidia-smi").chmod(0o755)
            env["PATH"] = f"{fake}:{env['PATH']}"
        env.pop("TORCH", None)
        r = subprocess.run(["make", "-n", "setup", f"VENV={tmp_path / 'venv'}", *extra], cwd=ROOT, env=env,
                           capture_output=True, text=True)
        said = [x for x in r.stdout.splitlines()
                if x.startswith('echo "torch: ') or "install -q" in x and "torch==" in x]
        return r.returncode, said, r.stderr

    cpu = (f"{tmp_path / 'venv'}/bin/python -m pip install -q --no-deps torch==2.13.0 "
           "--index-url https://download.pytorch.org/whl/cpu")
    cuda = f"{tmp_path / 'venv'}/bin/python -m pip install -q torch==2.13.0"
    assert shutil.which("nvidia-smi") is None  # this machine: no NVIDIA GPU
    for extra, gpu, install, why in [((), None, cpu, "no NVIDIA GPU answers nvidia-smi -L"),
                                     ((), "fails", cpu, "no NVIDIA GPU answers nvidia-smi -L"),
                                     ((), "ok", cuda, "an NVIDIA GPU answers nvidia-smi -L"),
                                     (("TORCH=cuda",), None, cuda, "TORCH=cuda was set"),
                                     (("TORCH=cpu",), "ok", cpu, "TORCH=cpu was set")]:
        code, lines, _ = setup(*extra, gpu=gpu)
        assert code == 0 and len(lines) == 2, (extra, gpu, lines)
        assert lines[0].startswith('echo "torch: ') and why in lines[0] and lines[1] == install, (extra, gpu)
    code, _, err = setup("TORCH=gpu")
    assert code != 0 and "TORCH=gpu: set TORCH=cpu or TORCH=cuda" in err
    reqs = (ROOT / "requirements.txt").read_text()
    assert "setuptools==" in reqs  # torch's own requirement, not installed with the CPU build's --no-deps
    assert "nvidia-smi" in reqs and "nvidia-smi" in (ROOT / "README.md").read_text()


def test_the_gpu_plans_seeds_are_what_the_power_analysis_says():
    """lab/power.py moved to Student's t (71 seeds at 140 games) after 80cec84, whose normal quantiles said
    70, as configs/agent_gpu.env did: this fails on cdc5b75, not on 80cec84."""
    import power

    s = power.spread(ROOT / "lab" / "results" / "agent_sanity")
    needed = power.seeds_needed(0.069, max(s["var"] - s["binomial"], 0.0), s["p"], 140)
    text = (ROOT / "configs" / "agent_gpu.env").read_text()
    assert f'SEEDS="$(seq 0 {needed - 1})"' in text and f"gives {needed} seeds per arm at 140 games" in text
    assert "EVAL_GAMES=70" in text  # 70 dev + 70 test games: the 140


def test_the_readme_says_no_more_than_its_intervals():
    """Sentences stronger than their CIs on 61e63ba, each gone: a non-detection read as equality or as
    "nothing learned", one COIN seed read as every seed, a CI width never measured."""
    text = " ".join((ROOT / "README.md").read_text().split())
    for claim in ("does as well or better", "Nothing is learned on the listed items",
                  "and beats COIN on both kinds", "a narrower CI over games |",
                  "95 % CIs over seeds and games;"):
        assert claim not in text, claim


def readme_block() -> list[str]:
    """README's output block, one entry per printed line (its continuation lines joined)."""
    readme = (ROOT / "README.md").read_text().split("## The method")[0]
    block = []
    for line in readme.splitlines():
        if line.startswith(("    (", "    verdict", "    state probes")):
            block.append(line.strip())
        elif line.startswith("        ") and block:
            block[-1] += " " + line.strip()
    return block


def test_the_readmes_output_block_is_what_todays_code_reads_from_a_committed_run():
    """README's output lines, shortened at "...", are today's closing lines (train.py's probe line and
    `python -m readout`'s) read from the per-triplet files of the committed run it names, a seed and held-out
    games no study chose with."""
    import eval as evaluation
    from readout import verdict

    run = ROOT / "lab" / "results" / "state_probes" / "test_seed91"
    block = readme_block()
    lines = [evaluation.probe_line(run, "warm-up"), *verdict.gain_lines(run, start="warm-up")]
    assert len(block) >= 4 and "(lab/results/state_probes/test_seed91/)" in (ROOT / "README.md").read_text()
    for entry in block:
        assert any(all(part.strip() in line for part in entry.split("...")) for line in lines), entry
    config = json.loads((run / "config.json").read_text())
    assert config["seed"] not in (0, 1, 2, 12, 21) and config["heldout_split"] == "valid_unseen"
    assert config["heldout_seed"] not in (0, 30)  # not the games every earlier run or dev scored


def test_the_readmes_verdict_words_match_its_numbers():
    """Every "+d [lo, hi] holds / reversed / no difference detected" in README agrees with the rule: holds
    (reversed) only where the CI is above (below) 0 and the p printed after it is below 0.05; "no difference
    detected" never where both are so. A README that says "holds" of a CI with p 0.062 fails here."""
    text = " ".join((ROOT / "README.md").read_text().split())
    found = re.findall(r"([+-]\d+\.\d+) \[([+-]\d+\.\d+), ([+-]\d+\.\d+)\] (holds|reversed|no difference "
                       r"detected)([^\[]*?)\bp (\d\.\d+)", text)
    assert len(found) >= 3
    for _, lo, hi, word, _, p in found:
        lo, hi, p = float(lo), float(hi), float(p)
        if word == "holds":
            assert lo > 0 and p < 0.05, (lo, hi, word, p)
        elif word == "reversed":
            assert hi < 0 and p < 0.05, (lo, hi, word, p)
        else:
            assert not ((lo > 0 or hi < 0) and p < 0.05), (lo, hi, word, p)


def test_readout_prints_a_runs_lines_and_verdict_and_refuses_a_folder_without_a_run(tmp_path):
    """`python -m readout RUN` is the default run's conclusion, read from its folder: the committed run's
    lines (a)-(f) and its verdict, last; a folder that holds no finished run: one line, exit status 1."""
    from readout import verdict

    run = ROOT / "lab" / "results" / "state_probes" / "test_seed91"
    done = subprocess.run([sys.executable, "-m", "readout", str(run)], cwd=ROOT, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == verdict.gain_lines(run, start="warm-up")
    assert done.stdout.splitlines()[-1].startswith("verdict: ")
    bad = subprocess.run([sys.executable, "-m", "readout", str(tmp_path)], cwd=ROOT, capture_output=True,
                         text=True)
    assert bad.returncode == 1 and bad.stderr.startswith(f"error: {tmp_path} holds no finished")
    assert len(bad.stderr.strip().splitlines()) == 1
