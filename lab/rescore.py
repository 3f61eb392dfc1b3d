"""Re-score committed world-model predictions with the strict metrics, no retraining.

1. The test-split table's per-triplet archive (stage1_test_table/): per arm and seed the reward accuracy (as
   recorded), exact match and item-set F1 (envs.exact_match, envs.item_f1), and RWML - warm-up / WM SFT / COIN
   under each metric with a CI over seeds (stats.over_seeds: Student's t for 2-4 seeds, at least the
   bootstrap's).
2. How often a REWARDED prediction is wrong under the strict metrics: the GRPO training groups of the default
   run at tau_d 0.1 (strict_rescore/train_samples.jsonl: every 4th step's whole groups), the held-out ones.

    python lab/rescore.py [--archive A] [--samples S | --log L] [--out lab/results/strict_rescore]
    python lab/rescore.py --gains    # only the figure, gains.png, from the committed rescore.json
    python lab/rescore.py --run lab/results/train_default   # one run's RWML − warm-up with CIs
    python lab/rescore.py --evals runs/tw_wm/eval_dev --out runs/tw_wm/tw_wm_dev.md   # lab/tw_wm.sh's tables
"""
from __future__ import annotations

import argparse
import ast
import json
import lzma
import math
import re
import sys
import tarfile
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "lab")]
import envs  # noqa: E402
from readout import stats  # noqa: E402
from envs import UserError  # noqa: E402
from repo_path import repo_path  # noqa: E402

ARMS, BASELINES, SPLITS = ("warmup", "rwml", "wm_sft", "coin"), ("base", "template", "nothing", "copy"), \
    ("explore", "purposeful")
METRICS = dict(reward="reward accuracy", exact="exact match", item_f1="item F1")
COMPARE = (("rwml", "warmup"), ("rwml", "wm_sft"), ("rwml", "coin"))
MARK = {"holds": "✓", "reversed": "✗"}  # kind table; "(CI only)": the CI excludes 0, the exact test does not
CI_OVER_SEEDS = ("CI over seeds: Student's t for 2-4 seeds, never narrower than the bootstrap's; a bootstrap "
                 "over seeds, then games, from 5 "
                 f"(stats.over_seeds, {stats.N_BOOT:,} draws)")
WIDTH = 90  # plumbing.group_table cuts the log's targets and predictions to 90 characters


def mean(xs):
    xs = list(xs)
    return sum(xs) / len(xs) if xs else None


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def triplet_problem(row) -> str | None:
    """What keeps a per-triplet row (`eval.py wm`'s <out>.triplets.jsonl) from being re-scored, or None."""
    if not isinstance(row, dict):
        return "not a JSON object"
    for k in ("game", "kind", "target"):
        if not isinstance(row.get(k), str):
            return f"{k} is missing or not text"
    for k in ("rollout", "step"):
        if k not in row or not (row[k] is None or isinstance(row[k], (int, str))):
            return f"{k} is missing or not a number"
    preds, rewards = row.get("predictions"), row.get("rewards")
    if not (isinstance(preds, list) and preds and all(p is None or isinstance(p, str) for p in preds)):
        return "predictions is missing or not a list of texts"
    if not (isinstance(rewards, list) and len(rewards) == len(preds) and all(map(is_number, rewards))):
        return "rewards is missing or not one number per prediction"
    return None


def read_text(path: Path, name: str, fix: str) -> str:
    """A file's text; missing or unreadable: one line naming it and `fix`."""
    if not path.is_file():
        raise UserError(f"{name} is missing; {fix}")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {name} ({e}); {fix}") from None


def read_rows(path: Path, fix: str, problem=None, text: str | None = None, name: str | None = None) -> list:
    """A JSON-lines file's rows (`text`: its content, read from an archive), each checked by `problem`; a
    missing, cut or malformed file, or one without rows: one line naming the file, the line and `fix`."""
    name = name or str(path)
    text = read_text(path, name, fix) if text is None else text
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise UserError(f"{name}, line {n}: not JSON (a cut or damaged file); {fix}") from None
        if p := (problem or (lambda r: None if isinstance(r, dict) else "not a JSON object"))(row):
            raise UserError(f"{name}, line {n}: {p}; {fix}")
        rows.append(row)
    if not rows:
        raise UserError(f"{name} holds no rows; {fix}")
    return rows


def triplet_rows(path: Path, fix: str, text: str | None = None, name: str | None = None) -> dict:
    """{(game, rollout, step): score(row)} of a per-triplet file, every row checked first."""
    return {(r["game"], r["rollout"], r["step"]): score(r)
            for r in read_rows(path, fix, triplet_problem, text, name)}


ARCHIVE_FIX = "restore it (git checkout lab/results/stage1_test_table/), or give another --archive"


def read_archive(path: Path) -> dict:
    """(seedN | baselines, arm, split) -> {(game, rollout, step): row}; checks the recorded summary."""
    if not path.is_file():
        raise UserError(f"--archive {path} is missing; {ARCHIVE_FIX}")
    out, summaries = {}, {}
    try:
        with tarfile.open(path) as tar:
            for m in tar.getmembers():
                hit = re.search(r"/(seed\d+|baselines)/(?:eval_)?(\w+?)_(explore|purposeful)"
                                r"\.(triplets\.jsonl|json)$", m.name)
                if hit:
                    text = tar.extractfile(m).read().decode()
                    name = f"{path}: {m.name}"
                    if hit[4] == "json":
                        try:
                            summaries[hit.groups()[:3]] = json.loads(text)
                        except ValueError:
                            raise UserError(f"{name} does not read as JSON; {ARCHIVE_FIX}") from None
                    else:
                        out[hit.groups()[:3]] = triplet_rows(path, ARCHIVE_FIX, text, name)
    except (tarfile.TarError, lzma.LZMAError, zlib.error, EOFError, OSError, UnicodeDecodeError) as e:
        why = (str(e).splitlines() or [""])[0]
        what = ("is not a tar archive (.tar, .tar.gz, .tar.xz)" if isinstance(e, tarfile.ReadError)
                and "opened" in why else f"is a cut or damaged archive ({why})")
        raise UserError(f"--archive {path} {what}; {ARCHIVE_FIX}") from None
    if not out:
        raise UserError(f"--archive {path} holds no per-triplet results (.../seedN/eval_<arm>_<explore|"
                        f"purposeful>.triplets.jsonl, as lab/sanity.sh writes them); {ARCHIVE_FIX}")
    seeds = sorted({s for s, _, _ in out if s.startswith("seed")})
    need = [a for a in ARMS if a != "coin"]  # COIN: the seeds of COIN_SEEDS (lab/sanity.sh)
    if lost := [f"{s}/eval_{a}_{k}" for s in seeds for a in need for k in SPLITS if (s, a, k) not in out]:
        raise UserError(f"--archive {path} lacks {len(lost)} per-triplet results, e.g. "
                        f"{lost[0]}.triplets.jsonl (each seed needs every arm: {', '.join(need)}); "
                        f"{ARCHIVE_FIX}")
    for key, rows in out.items():  # the re-scored reward and exact match are the recorded ones
        s, preds = summaries.get(key), list(rows.values())
        for metric, recorded in (("reward", "wm_accuracy"), ("exact", "exact_match")):
            if not (isinstance(s, dict) and is_number(s.get(recorded))):
                raise UserError(f"--archive {path}: {'/'.join(key)}'s summary (.json) is missing or has no "
                                f"{recorded}; {ARCHIVE_FIX}")
            if abs((got := mean(r[metric] for r in preds)) - s[recorded]) >= 1e-9:
                raise UserError(f"--archive {path}: {'/'.join(key)}'s triplets give {recorded} {got:.6f}, "
                                f"its summary records {s[recorded]:.6f} (a damaged or edited archive); "
                                f"{ARCHIVE_FIX}")
    return out


def score(row: dict) -> dict:
    """One triplet: each metric the mean over its k predictions; item_f1 None if the target lists nothing."""
    preds, target = row["predictions"], row["target"]
    f1 = [envs.item_f1(p, target) for p in preds]
    return dict(game=row["game"], kind=row["kind"], reward=mean(row["rewards"]), rewards=row["rewards"],
                exact=mean(envs.exact_match(p, target) for p in preds), exacts=[envs.exact_match(p, target)
                                                                              for p in preds],
                item_f1=None if f1[0] is None else mean(f1), f1s=f1)


def pct(x, digits=3):
    return "–" if x is None else f"{x:.{digits}f}"


def ci_text(ci):
    return f"{ci['diff']:+.3f} [{ci['lo']:+.3f}, {ci['hi']:+.3f}]"


def paired(data, seeds, x, y, split, metric, kinds=None):
    """The CI over seeds (stats.over_seeds) of arm x - arm y on their common triplets (those the metric
    scores), with the CI's half-width; None without such triplets."""
    runs = []
    for seed in seeds:
        run = ([], [], [])
        for sp in (SPLITS if split is None else (split,)):
            if (seed, x, sp) not in data or (seed, y, sp) not in data:  # an arm some seeds ran (COIN_SEEDS)
                continue
            a, b = data[(seed, x, sp)], data[(seed, y, sp)]
            keys = [k for k in sorted(a) if k in b and a[k][metric] is not None
                    and (kinds is None or a[k]["kind"] in kinds)]
            for r, v in zip(run, ([a[k][metric] for k in keys], [b[k][metric] for k in keys],
                                  [a[k]["game"] for k in keys])):
                r.extend(v)
        if run[0]:
            runs.append(run)
    if not runs:
        return None
    ci = stats.over_seeds(runs)
    return dict(ci, items=len(runs[0][0]), half_width=stats.half_width(ci))


def arm_table(data, seeds, splits=SPLITS, arms=ARMS) -> list[str]:
    lines = ["| split | arm | " + " | ".join(f"{v} (seeds {'/'.join(s[4:] for s in seeds)}) [95 % CI]"
                                            for v in METRICS.values()) + " | item n |", "|" + "---|" * 6]
    for split in splits:
        for arm in arms:
            cells, ran = [], [s for s in seeds if (s, arm, split) in data]  # COIN_SEEDS: maybe not every seed
            for metric in METRICS:
                rows = [[r for r in data[(s, arm, split)].values() if r[metric] is not None] for s in ran]
                if not any(rows):  # no triplet this metric scores (item F1: no target lists items)
                    cells.append("–")
                    continue
                runs = [([r[metric] for r in rs], [0] * len(rs), [r["game"] for r in rs]) for rs in rows]
                ci = stats.over_seeds(runs)
                cells.append(f"{ci['diff']:.3f} ({'/'.join(pct(v) for v in ci['per_seed'])}) "
                             f"[{ci['lo']:.3f}, {ci['hi']:.3f}]")
            n = sum(r["item_f1"] is not None for r in data[(ran[0], arm, split)].values())
            lines.append(f"| {split} | {arm}{'' if ran == seeds else ' (' + '/'.join(ran) + ')'} | "
                         + " | ".join(cells) + f" | {n} |")
        for arm in BASELINES:
            rows = list(data.get(("baselines", arm, split), {}).values())
            if rows:
                lines.append(f"| {split} | {arm} (one run) | " + " | ".join(
                    pct(mean(r[m] for r in rows if r[m] is not None)) for m in METRICS) + " | |")
    return lines


def comparison_table(data, seeds, splits=SPLITS, compare=COMPARE) -> tuple[list[str], list[dict]]:
    lines = ["| split | comparison | metric | diff [95 % CI] | per seed | CI half-width "
             "| verdict |", "|" + "---|" * 7]
    found = []
    for split in splits:
        for x, y in compare:
            for metric, name in METRICS.items():
                c = paired(data, seeds, x, y, split, metric)
                v = stats.verdict(c)
                if c is None:  # no common triplet this metric scores
                    found.append(dict(split=split, x=x, y=y, metric=metric, verdict=v))
                    lines.append(f"| {split} | {x} − {y} | {name} | – | – | – | {v} |")
                    continue
                keep = ("diff", "lo", "hi", "per_seed", "half_width", "items")
                found.append(dict(split=split, x=x, y=y, metric=metric, verdict=v, **{k: c[k] for k in keep}))
                lines.append(f"| {split} | {x} − {y} | {name} | {ci_text(c)} | "
                             f"{'/'.join(f'{d:+.3f}' for d in c['per_seed'])} | {c['half_width']:.3f} "
                             f"| {v} |")
    return lines, found


def kind_table(data, seeds) -> list[str]:
    """RWML - warm-up per observation kind, both held-out sets pooled: is the gain on facts or on form?"""
    kinds = sorted({r["kind"] for (s, a, _), rows in data.items() if s in seeds for r in rows.values()})
    lines = ["| kind | triplets (per seed) | " + " | ".join(METRICS.values()) + " |", "|" + "---|" * 5]
    for kind in kinds:
        cells, items = [], 0
        for metric in METRICS:
            c = paired(data, seeds, "rwml", "warmup", None, metric, kinds=(kind,))
            v = stats.verdict(c)
            mark = MARK.get(v, "(CI only)" if "CI excludes 0" in v else "")
            cells.append("–" if c is None else f"{ci_text(c)} {mark}".rstrip())
            items = max(items, c["items"] if c else 0)
        lines.append(f"| {kind} | {items} | " + " | ".join(cells) + " |")
    return lines


def rewarded_wrong(preds: list[dict]) -> dict:
    """Of the rewarded predictions: how many are not an exact match; (listing targets) have item F1 < 1."""
    hit = [p for p in preds if p["reward"] >= 1]
    listing = [p for p in hit if p["f1"] is not None]
    return dict(rewarded=len(hit), of=len(preds), not_exact=sum(not p["exact"] for p in hit),
                listing=len(listing), f1_below_1=sum(p["f1"] < 1 for p in listing))


def heldout_rewarded(data, seeds) -> list[str]:
    lines = ["| arm | kind | rewarded / predictions | not exact | listing targets: item F1 < 1 |",
             "|" + "---|" * 5]
    for arm in ("warmup", "rwml"):
        preds = [dict(reward=rw, exact=ex, f1=f1, kind=r["kind"])
                 for (s, a, _), rows in data.items() if s in seeds and a == arm for r in rows.values()
                 for rw, ex, f1 in zip(r["rewards"], r["exacts"], r["f1s"])]
        for kind in ["all"] + sorted({p["kind"] for p in preds}):
            w = rewarded_wrong([p for p in preds if kind == "all" or p["kind"] == kind])
            if w["rewarded"]:
                share = w["not_exact"] / w["rewarded"]
                lines.append(f"| {arm} | {kind} | {w['rewarded']} / {w['of']} | {w['not_exact']} "
                             f"({share:.0%}) | {w['f1_below_1']} of {w['listing']} |")
    return lines


def training_groups(log: Path) -> list[dict]:
    """The GRPO groups the run log shows (group 1 of every logged step), one row per completion."""
    fix = "give a `train.py` run log (what it printed), or --samples"
    text = read_text(log, f"--log {log}", fix)
    out, head = [], None
    for n, line in enumerate(text.splitlines(), 1):
        try:
            m = re.match(r"\[step (\d+)\] group 1 of \d+: action (.*); real: (.*)$", line)
            if m:
                head = dict(step=int(m[1]), action=ast.literal_eval(m[2]), target=ast.literal_eval(m[3]))
                continue
            if not (head and (m := re.match(r"\s+(\d+\.\d+)\s+[+-]\d+\.\d+\s+(.*)$", line))):
                continue
            pred, target = ast.literal_eval(m[2]), head["target"]
        except (ValueError, SyntaxError):
            raise UserError(f"{log}, line {n}: a GRPO group's line whose text does not read (a cut or edited "
                            f"log); {fix}") from None
        if not (isinstance(pred, str) and isinstance(target, str)):
            raise UserError(f"{log}, line {n}: a GRPO group's prediction or target is not text; {fix}")
        cut = max(len(pred), len(target)) >= WIDTH
        out.append(dict(head, prediction=pred, reward=float(m[1]), cut=cut,
                        kind=envs.observation_kind(target), exact=envs.exact_match(pred, target),
                        f1=envs.item_f1(pred, target)))
    if not out:
        raise UserError(f"--log {log} shows no GRPO group (\"[step N] group 1 of G: ...\" and its "
                        f"predictions); {fix}")
    return out


def training_samples(path: Path) -> list[dict]:
    """Every completion of the whole GRPO groups in a run's samples.jsonl (each logged step), a row each."""
    from envs import parse_next_state

    out = []
    fix = "give a run's samples.jsonl (train.py wm writes it), or --log"
    for row in read_rows(path, fix, samples_problem):
        for g in row["groups"]:
            for text, reward in zip(g["completions"], g["rewards"]):
                pred = parse_next_state(text) or ""
                out.append(dict(step=row["step"], action=g["action"], target=g["target"], prediction=pred,
                                reward=float(reward), cut=False, kind=envs.observation_kind(g["target"]),
                                exact=envs.exact_match(pred, g["target"]),
                                f1=envs.item_f1(pred, g["target"])))
    return out


def samples_problem(row) -> str | None:
    """What keeps a samples.jsonl row (a logged step's whole groups) from the training table, or None."""
    if not isinstance(row, dict):
        return "not a JSON object"
    if not is_number(row.get("step")):
        return "step is missing or not a number"
    groups = row.get("groups")
    if not isinstance(groups, list):
        return "groups is missing or not a list"
    for i, g in enumerate(groups, 1):
        if not (isinstance(g, dict) and all(isinstance(g.get(k), str) for k in ("action", "target"))):
            return f"group {i}: action or target is missing or not text"
        texts, rewards = g.get("completions"), g.get("rewards")
        if not (isinstance(texts, list) and all(isinstance(t, str) for t in texts)
                and isinstance(rewards, list) and len(rewards) == len(texts)
                and all(map(is_number, rewards))):
            return f"group {i}: completions and rewards are not one text and one number each"
    return None


def form_only(pred: str, target: str) -> bool:
    """Equal once articles and punctuation are dropped: the words differ in form, not in a fact."""
    words = lambda t: [w for w in re.findall(r"\w+", t.lower()) if w not in ("the", "a", "an")]  # noqa: E731
    return words(pred) == words(target)


def training_table(groups: list[dict]) -> list[str]:
    lines = ["| kind | rewarded / predictions | not exact | of those, a fact wrong (not only articles, "
             "punctuation) | listing targets: item F1 < 1 | examples |", "|" + "---|" * 6]
    usable = [g for g in groups if not g["cut"]]
    for kind in ["all"] + sorted({g["kind"] for g in usable}):
        rows = [g for g in usable if kind == "all" or g["kind"] == kind]
        w = rewarded_wrong(rows)
        ex = [f"{g['prediction']!r} for {g['target']!r}" for g in rows
              if g["reward"] >= 1 and not g["exact"]][:1 if kind != "all" else 0]
        lo, hi = stats.wilson(w["not_exact"], w["rewarded"]) if w["rewarded"] else (0, 0)
        share = f" ({w['not_exact'] / w['rewarded']:.0%} [{lo:.0%}, {hi:.0%}])" if w["rewarded"] else ""
        facts = sum(g["reward"] >= 1 and not g["exact"] and not form_only(g["prediction"], g["target"])
                    for g in rows)
        lines.append(f"| {kind} | {w['rewarded']} / {w['of']} | {w['not_exact']}{share} | {facts} | "
                     f"{w['f1_below_1']} of "
                     f"{w['listing']} | {'; '.join(ex)} |")
    return lines


def plot_gains(comparisons: list[dict], png: Path) -> Path:
    """The test-split table's gains as a figure: per metric, each comparison's paired difference per seed
    (dots) and over seeds with its 95 % CI (bar); 0 is no gain."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(METRICS), figsize=(11, 3.6), sharey=True)
    for ax, (metric, name) in zip(axes, METRICS.items()):
        rows = [c for c in comparisons if c["metric"] == metric and "diff" in c]  # not those without data
        for i, c in enumerate(rows):
            ax.errorbar([c["diff"]], [i], xerr=[[c["diff"] - c["lo"]], [c["hi"] - c["diff"]]], fmt="D",
                        color="C0" if c.get("verdict", "holds" if c["lo"] > 0 else "") == "holds" else "C7",
                        ms=5, capsize=3,
                        label="mean over seeds, 95 % CI" if i == 0 else None)
            ax.plot(c["per_seed"], [i] * len(c["per_seed"]), "o", color="C1", ms=3, alpha=0.8,
                    label="each seed" if i == 0 else None)
        ax.axvline(0, color="k", lw=0.8)
        ax.set(title=name, xlabel="paired difference (RWML − other)", yticks=range(len(rows)),
               yticklabels=[f"{c['split']}: {c['x']} − {c['y']}" for c in rows])
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=2, fontsize=7)
    fig.suptitle("test split (valid_unseen): RWML's paired gain per seed and over seeds (blue: the verdict "
                 "holds)",
                 fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def run_gain(run: Path) -> list[str]:
    """One run's RWML − warm-up (`python train.py`'s wm_eval_{before,rwml}_*.triplets.jsonl), paired on
    triplets, CI over games: under the reward and exact match."""
    if not run.is_dir():
        raise UserError(f"--run {run} is not a folder; give a `python train.py` run folder (e.g. runs/rwml)")
    fix = "give a `python train.py` run folder (its wm_eval_{before,rwml}_<kind>.triplets.jsonl)"
    files = {(arm, kind): run / f"wm_eval_{arm}_{kind}.triplets.jsonl" for kind in ("explore", "purposeful")
             for arm in ("before", "rwml")}
    data = {key: triplet_rows(f, fix) for key, f in files.items()}  # every file checked first
    lines = []
    for kind in ("explore", "purposeful"):
        rows = {arm: data[(arm, kind)] for arm in ("before", "rwml")}
        keys = sorted(rows["before"])
        if set(keys) != set(rows["rwml"]):
            raise UserError(f"{files[('rwml', kind)]} scores other triplets than {files[('before', kind)]}; "
                            "both come from one run: score them again on the same held-out set")
        for metric in ("reward", "exact"):
            c = stats.paired_bootstrap([rows["rwml"][k][metric] for k in keys],
                                       [rows["before"][k][metric] for k in keys], [k[0] for k in keys])
            lines.append(f"{kind} {metric}: RWML − warm-up {ci_text(c)} "
                         f"({c['units']} games): {stats.verdict(c)}")
    return lines


def read_evals(folder: Path) -> dict:
    """`eval.py wm` results laid out as lab/tw_wm.sh writes them: <folder>/seedN/<arm>.triplets.jsonl and the
    one-run baselines <folder>/<base|template|nothing|copy>.triplets.jsonl -> read_archive's dict."""
    fix = "write it again with `eval.py wm --out` (lab/tw_wm.sh), or remove it"
    if not folder.is_dir():
        raise UserError(f"--evals {folder} is not a folder; give lab/tw_wm.sh's evaluation folder (e.g. "
                        "runs/tw_wm/eval_dev)")

    def rows(f):
        return triplet_rows(f, fix)
    split = folder.name.removeprefix("eval_")
    data = {(f.parent.name, f.name.split(".")[0], split): rows(f)
            for f in folder.glob("seed*/*.triplets.jsonl")}
    if not data:
        raise UserError(f"--evals {folder}: no seed*/<arm>.triplets.jsonl in it; give lab/tw_wm.sh's "
                        "evaluation folder (e.g. runs/tw_wm/eval_dev)")
    data.update({("baselines", f.name.split(".")[0], split): rows(f)
                 for f in folder.glob("*.triplets.jsonl")})
    return data


def evals_report(folder: Path) -> list[str]:
    """The tables of lab/tw_wm.sh's evaluations: each arm with its CI (every seed shown), the baselines, and
    RWML against the warm-up and WM SFT, WM SFT against the warm-up, paired on triplets."""
    data = read_evals(folder)
    seeds = sorted({s for s, _, _ in data if s.startswith("seed")})
    split = folder.name.removeprefix("eval_")
    arms = [a for a in ("warmup", "rwml", "wm_sft") if all((s, a, split) in data for s in seeds)]
    comp, _ = comparison_table(data, seeds, (split,), [c for c in (("rwml", "warmup"), ("rwml", "wm_sft"),
                                                                   ("wm_sft", "warmup"))
                                                       if c[0] in arms and c[1] in arms])
    if not arms:
        raise UserError(f"--evals {folder}: no arm (warmup, rwml, wm_sft) scored by every seed "
                        f"({', '.join(seeds)}); score the missing ones (lab/tw_wm.sh reruns what is missing)")
    return [f"# World-model accuracy on `{repo_path(folder)}` ({', '.join(seeds)})", "",
            "Rates: the mean over seeds, each seed's value in brackets, 4 predictions per triplet; "
            f"{CI_OVER_SEEDS}; the baselines are one run each.", "",
            *arm_table(data, seeds, (split,), arms), "",
            "## Paired on the same triplets", "",
            stats.RULE + ".", "", *comp, ""]


def read_gains(path: Path) -> list[dict]:
    """The comparisons of a rescore.json (what --gains draws), each with what the figure reads."""
    fix = "write it again with `python lab/rescore.py --out FOLDER`, or give the --out that holds it"
    if not path.is_file():
        raise UserError(f"{path} is missing; {fix}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"{path} does not read as JSON ({(str(e).splitlines() or [''])[0]}); {fix}") from None
    found = data.get("comparisons") if isinstance(data, dict) else None
    if not isinstance(found, list) or not found:
        raise UserError(f"{path} holds no `comparisons` list; {fix}")
    for n, c in enumerate(found, 1):
        if not (isinstance(c, dict) and all(isinstance(c.get(k), str) for k in ("split", "x", "y",
                                                                               "metric"))):
            raise UserError(f"{path}, comparison {n}: split, x, y or metric is missing or not text; {fix}")
        seeds = c.get("per_seed")
        if "diff" in c and not (all(is_number(c.get(k)) for k in ("diff", "lo", "hi"))
                                and isinstance(seeds, list) and all(map(is_number, seeds))):
            raise UserError(f"{path}, comparison {n}: diff, lo, hi or per_seed is not a number; {fix}")
    return found


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    results = ROOT / "lab" / "results"
    p.add_argument("--archive", type=Path,
                   default=results / "stage1_test_table" / "sanity_valid_unseen_triplets.tar.xz")
    p.add_argument("--log", type=Path, help="a `train.py` run log: its GRPO groups (default, without "
                   "--samples: lab/results/train_default/run_log.txt)")
    p.add_argument("--samples", type=Path, help="a run's samples.jsonl (every logged step's whole groups; "
                   "default lab/results/strict_rescore/train_samples.jsonl); else the log's groups")
    p.add_argument("--out", type=Path, help="the tables' folder (default lab/results/strict_rescore); "
                   "with --evals: a markdown file")
    p.add_argument("--gains", action="store_true", help="only draw <out>/gains.png from <out>/rescore.json")
    p.add_argument("--run", type=Path, help="only a `python train.py` run's paired RWML − warm-up, with CIs")
    p.add_argument("--evals", type=Path,
                   help="only the tables of a lab/tw_wm.sh evaluation folder (eval_SPLIT)")
    args = p.parse_args(argv)
    from stages.plumbing import check_writable  # (torch) after the flags: --help stays quick

    modes = [f for f, v in (("--gains", args.gains), ("--run", args.run), ("--evals", args.evals)) if v]
    if len(modes) > 1:
        raise UserError(f"{' and '.join(modes)} are different commands; give one of them")
    if args.samples and args.log:
        raise UserError("--samples and --log are two sources of the training groups; give one of them")
    if args.evals:
        if args.out:
            check_writable(args.out, folder=False)
        md = "\n".join(evals_report(args.evals))
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(md)
        print(md)
        return
    if args.run:
        print("\n".join(run_gain(args.run)))
        return
    args.out = args.out or results / "strict_rescore"
    check_writable(args.out)
    if args.gains:
        found = read_gains(args.out / "rescore.json")
        print(repo_path(plot_gains(found, args.out / "gains.png"), None))
        return
    # every input read and checked before the archive and the bootstraps (minutes): a bad one fails at once
    default = results / "strict_rescore" / "train_samples.jsonl"
    whole = bool(args.samples) or (not args.log and default.is_file())  # else the log's groups
    source = (args.samples or default) if whole else (args.log or results / "train_default" / "run_log.txt")
    groups = training_samples(source) if whole else training_groups(source)
    data = read_archive(args.archive)
    seeds = sorted({s for s, _, _ in data if s.startswith("seed")})
    comp, found = comparison_table(data, seeds)
    md = [f"# Strict re-score of `{repo_path(args.archive)}` (valid_unseen, {', '.join(seeds)})", "",
          "Rates: the mean over seeds, each seed's value in brackets; "
          f"{CI_OVER_SEEDS}. Item F1: over the triplets whose target lists items (item n per "
          "seed). "
          "The recorded reward accuracy and exact match were re-derived from the predictions and match.", "",
          *arm_table(data, seeds), "", "## RWML against each control, paired on the same triplets", "",
          stats.RULE + ".", "", *comp, "",
          "## RWML − warm-up per observation kind (explore and purposeful pooled; ✓: the verdict holds, "
          "(CI only): the CI excludes 0, the exact sign-flip test over seeds does not)", "",
          *kind_table(data, seeds), "",
          "## Rewarded held-out predictions that the strict metrics call wrong", "",
          *heldout_rewarded(data, seeds), "",
          f"## Rewarded GRPO training predictions (`{repo_path(source)}`)", "",
          (f"Every completion of the whole groups of every logged step ({len({g['step'] for g in groups})} "
           f"steps, {len(groups)} completions); not exact: the share of the rewarded with its Wilson 95 % CI."
           if whole else
           "The run log shows group 1 of every 4th step. Rows whose target or prediction the log cut at "
           f"{WIDTH} characters are left out ({sum(g['cut'] for g in groups)} of {len(groups)})."), "",
          *training_table(groups), ""]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rescore.md").write_text("\n".join(md))
    (args.out / "rescore.json").write_text(json.dumps(dict(comparisons=found, training=groups), indent=1))
    plot_gains(found, args.out / "gains.png")
    print("\n".join(md))


if __name__ == "__main__":
    from harness.cli import run_cli  # bad input: one line ("error: ..."), exit status 1

    run_cli(main)
