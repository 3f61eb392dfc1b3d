"""No absolute paths in the committed results: a reader's clone has none of the machines'
folders, so lab/results names files relative to the repository (runs/..., lab/results/...) or `<path>`; the
lab's scripts record paths that way where they print or store them."""
import gzip
import json
import re
import subprocess
import tarfile
from pathlib import Path

import pytest

import repo_path
from test_lab_contract import evals_folder, tiny_archive, tiny_samples

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "lab" / "results"
# an absolute (or home) path of at least two parts, where a path starts: at a line's start, after a space,
# a quote, a bracket, "=", ":" or ","; not a URL (https://), a fraction (1/2), a split pair (dev/test), a
# game id (/w2-n4-q2-dev)
ABSOLUTE = re.compile(r"""(?:^|(?<=[\s"'`(\[=,{|:]))(?:~|/[\w.-]+)/[\w.-][^\s"'`)\]<>,;|]*""", re.M)


def texts(root: Path):
    """(name, text) of every text file under root: .gz decompressed, each member of a .tar.xz archive."""
    for f in sorted(root.rglob("*")):
        if not f.is_file():
            continue
        if f.name.endswith((".tar.xz", ".tar.gz", ".tar")):
            with tarfile.open(f) as tar:
                for m in tar.getmembers():
                    if m.isfile():
                        yield f"{f.relative_to(ROOT)}: {m.name}", tar.extractfile(m).read().decode()
            continue
        data = gzip.decompress(f.read_bytes()) if f.suffix == ".gz" else f.read_bytes()
        if b"\0" not in data[:8000]:  # not a PNG
            yield str(f.relative_to(ROOT)), data.decode()


def test_the_scan_finds_absolute_paths_and_nothing_else():
    found = ABSOLUTE.findall('"out": "/work/after/rwml", -> /tmp/meas/run (x: /root/.cache/a) --out=/a/b '
                             '~/runs/x')
    assert found == ["/work/after/rwml", "/tmp/meas/run", "/root/.cache/a", "/a/b", "~/runs/x"]
    assert not ABSOLUTE.findall("https://github.com/x/y 1/2 dev/test <path>/heldout runs/rwml /w2-n4-q2-dev "
                                "`runs/sanity` 35 ~20 %")


def test_no_absolute_path_in_the_committed_results():
    hits = [f"{name}, line {text.count(chr(10), 0, m.start()) + 1}: {m.group()}"
            for name, text in texts(RESULTS) for m in ABSOLUTE.finditer(text)]
    assert not hits, f"{len(hits)} absolute paths, e.g. {hits[:5]}"


def test_repo_path_and_stored_config(tmp_path, monkeypatch):
    assert repo_path.repo_path(ROOT / "runs" / "rwml") == "runs/rwml"
    assert repo_path.repo_path(tmp_path / "x.json") == "<path>"
    assert repo_path.repo_path(tmp_path / "x.json", None) == str(tmp_path / "x.json")
    monkeypatch.chdir(ROOT / "lab")
    assert repo_path.repo_path("results/tau2") == "lab/results/tau2"  # relative: from the working directory
    cfg = dict(transitions=str(ROOT / "runs/c/transitions.jsonl"), adapter=None, tau_d=0.1,
               out=str(tmp_path / "r.json"), model="bundled:SmolLM2-135M-Instruct",
               embedder=str(ROOT / "runs/emb"), filter_dir="../runs/f")
    assert repo_path.stored_config(cfg) == dict(
        transitions="runs/c/transitions.jsonl", adapter=None, tau_d=0.1, out="<path>",
        model="bundled:SmolLM2-135M-Instruct", embedder="runs/emb", filter_dir="runs/f")
    hub = "Qwen/Qwen2.5-1.5B-Instruct"  # a Hub id, not a folder here: as it is
    assert repo_path.stored_config(dict(model=hub)) == dict(model=hub)


def test_rescore_names_its_inputs_relative_to_the_repository(tmp_path, capsys):
    """An archive outside the repository (a copy in /tmp) was a ValueError (Path.relative_to) after the whole
    re-score; the tables name it and the samples `<path>`, as --evals names its folder."""
    import rescore

    out = tmp_path / "out"
    rescore.main(["--archive", str(tiny_archive(tmp_path / "a.tar.xz")), "--samples",
                  str(tiny_samples(tmp_path / "samples.jsonl")), "--out", str(out)])
    md = (out / "rescore.md").read_text()
    assert md.startswith("# Strict re-score of `<path>` (valid_unseen, seed0)")
    assert "## Rewarded GRPO training predictions (`<path>`)" in md and str(tmp_path) not in md
    assert str(tmp_path) not in "\n".join(rescore.evals_report(evals_folder(tmp_path / "eval_dev")))
    capsys.readouterr()
    rescore.main(["--gains", "--out", str(out)])
    assert capsys.readouterr().out.strip() == str(out / "gains.png")  # printed: a path outside, as given


def test_the_sanity_table_names_the_held_out_file_relative_to_the_repository(tmp_path, capsys, monkeypatch):
    """eval.py's results record the transitions file as given (absolute, if so); the sanity table states it
    relative to the repository (here tmp_path), and `-> FILE` too."""
    import reports
    from test_reports_malformed import sanity_folder

    monkeypatch.setattr(repo_path, "ROOT", tmp_path)
    run = sanity_folder(tmp_path / "runs" / "sanity")
    held = tmp_path / "runs" / "sanity" / "valid_unseen" / "heldout_explore" / "transitions.jsonl"
    for f in (run / "valid_unseen").rglob("*.json"):
        f.write_text(json.dumps(dict(json.loads(f.read_text()), transitions=str(held))))
    reports.main(["sanity", str(run), "--out", str(tmp_path / "runs" / "sanity.md")])
    text = (tmp_path / "runs" / "sanity.md").read_text()
    assert "(`runs/sanity/valid_unseen/heldout_explore/transitions.jsonl`)" in text
    assert str(tmp_path) not in text
    assert capsys.readouterr().out.rstrip().endswith("-> runs/sanity.md")


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "lab").glob("*.sh")
                                          if "OUT=${OUT:-" in p.read_text()))
def test_the_lab_scripts_make_an_out_under_the_repository_relative(script):
    """OUT=$PWD/runs/x is recorded as runs/x (the scripts pass it on to train.py and eval.py)."""
    lines = (ROOT / "lab" / script).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("OUT=${OUT:-"))
    outs = "\n".join(line for line in lines[start:start + 3] if line.startswith("OUT="))
    for given, recorded in ((f"{ROOT}/runs/x", "runs/x"), ("runs/y", "runs/y"),
                            ("/elsewhere/z", "/elsewhere/z")):
        done = subprocess.run(["bash", "-c", f'cd "{ROOT}"; OUT="{given}"\n{outs}\necho "$OUT"'],
                              capture_output=True, text=True, check=True)
        assert done.stdout.strip() == recorded, (script, given, done.stdout)


def test_a_kept_run_names_no_folder_of_the_machine(tmp_path, monkeypatch):
    """lab/keep_run.sh: a run's conclusions (settings, scores per triplet, metrics) without its adapter, and
    its log with the repository's root, the caches, ALFWorld's data, $HOME and the run's own folder cut."""
    run, cache, data, home = (tmp_path / n for n in ("run", "cache", "alf", "home"))
    (run / "adapter").mkdir(parents=True)
    for name in ("config.json", "filter.json", "metrics.jsonl", "wm_eval_rwml_state.triplets.jsonl",
                 "adapter/adapter_model.safetensors"):
        (run / name).write_text("{}")
    (tmp_path / "run.log").write_text(f"model {cache}/SmolLM2 games {data}/json_2.1.1 in {home}/x\n"
                                      f"saved {run}/adapter, code {ROOT}/train.py\n")
    monkeypatch.setenv("RWML_CACHE", str(cache))
    monkeypatch.setenv("ALFWORLD_DATA", str(data))
    monkeypatch.setenv("HOME", str(home))
    kept = tmp_path / "kept"
    subprocess.run(["bash", str(ROOT / "lab" / "keep_run.sh"), str(run), str(kept)], check=True,
                   capture_output=True)
    assert sorted(p.name for p in kept.iterdir()) == [
        "config.json", "filter.json", "metrics.jsonl", "run_log.txt", "wm_eval_rwml_state.triplets.jsonl"]
    log = (kept / "run_log.txt").read_text()
    assert not ABSOLUTE.findall(log), log
    assert "$RWML_CACHE/SmolLM2" in log and "<run>/adapter" in log and "code train.py" in log
    done = subprocess.run(["bash", str(ROOT / "lab" / "keep_run.sh"), str(tmp_path / "none"), str(kept)],
                          capture_output=True, text=True)
    assert done.returncode == 1 and done.stderr.count("\n") == 1 and "no config.json" in done.stderr
