"""Lab: the report generators (were eval.py's), Markdown tables and PNG plots of the results in run folders.

    python lab/reports.py report runs/base runs/rwml ... --out results.md    # lab/arms.sh: like Table 1
    python lab/reports.py sanity runs/sanity --split valid_unseen --out sanity.md    # lab/sanity.sh
    python lab/reports.py agent-table runs/agent_sanity --out agent_sanity.md     # lab/agent_sanity.sh
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo's modules

import json
import math
import statistics
from dataclasses import dataclass

import envs
from harness.cli import commands_help, parse_config, resume_free, run_cli
from harness.common import arg, read_jsonl, write_atomic
from envs import UserError
from stages.plumbing import check_writable
from train import Settings
from readout.verdict import HELDOUT_KINDS
from repo_path import repo_path

ID_SPLIT, OOD_SPLIT = "valid_seen", "valid_unseen"  # the paper's in-distribution, out-of-distribution games


RESUME_FREE = resume_free(Settings)  # settings that change no trained weight: not an arm's difference


@dataclass
class ReportConfig:
    out: str = arg("results.md", "the table; the plots go next to it (<out>_rewards.png, <out>_success.png)")
    plots: bool = arg(True, "draw the plots")


@dataclass
class AgentTableConfig:
    out: str = arg("agent_sanity.md", "the table; the curve goes next to it (<out stem>_curve.png)")


@dataclass
class SanityConfig:
    split: str = arg("valid_unseen", "whose held-out scores to tabulate: valid_unseen (test) or valid_seen "
                                     "(dev)")
    out: str = arg("sanity.md", "the table")


def read_run(folder: Path) -> dict:
    """A run folder's results (`eval.py agent` per split, `wm`, `weights`, tau2), by their keys; its curve."""
    run = dict(name=folder.name, splits={}, tau2={}, wm=None, weights=None,
               curve=read_jsonl(folder / "metrics.jsonl"))
    wms = {}
    for n, row in enumerate(run["curve"], 1):  # every row shape train.py writes (CURVE_ROWS)
        problem = _numbers_problem(row, ("step",)) or _numbers_problem(
            row, [k for k in ("reward", *CURVE_EVALS) if k in row])  # or "not a JSON object"
        if problem:
            raise UserError(f"{folder / 'metrics.jsonl'}, record {n}: {problem}; fix or remove that file")
    for f in sorted(folder.glob("*.json")):
        try:
            data = json.loads(f.read_text(encoding="utf-8-sig"))
        except (OSError, ValueError) as e:  # damaged results are named, not taken for "no results"
            raise UserError(f"{f} does not read as JSON ({(str(e).splitlines() or [''])[0]}); "
                            "fix or remove it") from None
        if not isinstance(data, dict):
            continue
        if "success_rate" in data and "split" in data:
            kind, parts = "eval.py agent", data.get("per_split") or {str(data["split"]): data}
            problem = _numbers_problem(parts, ()) or next(
                (p for p in (_numbers_problem(x, AGENT_KEYS) for x in parts.values()) if p), None)
        elif data.get("env") == "tau2" and "average_reward" in data:
            kind = "eval.py agent --env tau2"
            problem = _numbers_problem(data, TAU2_KEYS) or (
                None if isinstance(data.get("domain"), str) else "domain is missing or not text")
        elif "wm_accuracy" in data and "per_kind" in data:
            kind, problem = "eval.py wm", _numbers_problem(data, ("wm_accuracy",))
        elif "changed_share" in data and "per_module" in data:
            kind, problem = "eval.py weights", _numbers_problem(data, ("changed_share",))
        else:
            continue
        if problem:  # a traceback in the table otherwise (KeyError, TypeError), far from the file
            raise UserError(f"{f}: {problem}, so it is no result of `{kind}`; write it again, or remove it")
        if kind == "eval.py agent":
            run["splits"].update(parts)
        elif kind == "eval.py wm":
            wms[f.stem] = data
        elif kind == "eval.py weights":
            run["weights"] = data
        else:
            run["tau2"][data["domain"]] = data
    run["wm"] = own_wm(folder, wms)
    return run


def own_wm(folder: Path, wms: dict[str, dict]) -> dict | None:
    """The run's own world-model accuracy, by file name, never a baseline's or the matched COIN arm's
    (--coin-control): {kind: (before, after)}. `python train.py` writes
    wm_eval_{before,rwml,coin,<baseline>}_{explore,purposeful}.json; eval.py wm, one."""
    if not wms:
        return None
    ours = {stem: d for stem, d in wms.items()
            if not any(f"_{b}_" in f"{stem}_" for b in (*envs.BASELINES, "coin"))}
    pairs = {}
    for stem, d in ours.items():
        if stem.startswith("wm_eval_before_"):
            continue
        kind = stem.rsplit("_", 1)[-1] if stem.startswith("wm_eval_") else "all"
        if kind in pairs:
            raise UserError(f"{folder}: more than one world-model result for {kind} ({pairs[kind][2]}.json, "
                            f"{stem}.json); keep one per run folder")
        pairs[kind] = (ours.get(f"wm_eval_before_{kind}"), d, stem)
    if not pairs:
        raise UserError(f"{folder}: only baseline world-model results ({', '.join(sorted(wms))}); "
                        "the run's own is wm_eval_rwml_<kind>.json or one `eval.py wm` result")
    return {kind: (before, after) for kind, (before, after, _) in sorted(pairs.items())}


def _wm_cell(wm: dict | None) -> str:
    """"explore 35.9 → 46.4; purposeful 43.8 → 48.4" (%), or one number for a lone `eval.py wm` result."""
    if not wm:
        return "–"
    return "; ".join(f"{'' if kind == 'all' else kind + ' '}"
                     + (f"{_pct(before['wm_accuracy'])} → " if before else "") + _pct(after["wm_accuracy"])
                     for kind, (before, after) in wm.items())


# metrics.jsonl's rows, as train.py writes them: a training step's (`wm` / `all`: plumbing.wm_row; `policy`:
# its stats; lab/trl_grpo.py: TRL's log_history) has step and reward, and the held-out evaluation's numbers on
# the --eval-steps steps; an --eval-on-start run's step-0 row holds only step and the evaluation (no reward)
CURVE_EVALS = ("eval_wm_accuracy", "eval_mean_cosine", "eval_beyond_template",  # wm, all
               "eval_success", "eval_mean_steps", "eval_invalid")  # policy
AGENT_KEYS = ("success_rate", "num_episodes", "mean_steps", "invalid_action_rate")  # what the tables read
TAU2_KEYS = ("average_reward", "num_tasks", "num_episodes", "tool_calls", "invalid_tool_call_rate")


def _numbers_problem(data, keys) -> str | None:
    """What keeps a result from the tables (`keys` missing or not numbers; a *_std not a number), or None."""
    if not isinstance(data, dict):
        return "not a JSON object"
    is_num = lambda v: (isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
                        and math.isfinite(v))
    bad = next((k for k in keys if not is_num(data.get(k))), None) or next(
        (k for k in data if k.endswith("_std") and not is_num(data[k])), None)
    return None if bad is None else f"{bad} is missing or not a number"


def read_json(f: Path) -> dict | None:
    """A report input's JSON object, None if there is no such file; a damaged one is named in one line."""
    if not f.is_file():
        return None
    try:
        data = json.loads(f.read_text(encoding="utf-8-sig"))
    except (OSError, ValueError) as e:
        raise UserError(f"{f} does not read as JSON ({(str(e).splitlines() or [''])[0]}); "
                        "write it again (rerun what wrote it), or remove it") from None
    if not isinstance(data, dict):
        raise UserError(f"{f} holds a JSON {type(data).__name__}, not an object; write it again, "
                        "or remove it")
    return data


def read_rows(f: Path, numbers: tuple[str, ...], needs_step: tuple[str, ...] = (),
              lists: tuple[str, ...] = ()) -> list[dict]:
    """A metrics.jsonl's rows, each a JSON object whose `numbers` are numbers and `lists` lists of numbers
    where present, with a step where it has one of `needs_step`; else one line naming the file and record."""
    rows = read_jsonl(f)
    for n, row in enumerate(rows, 1):
        keys = [k for k in numbers if isinstance(row, dict) and k in row]
        keys += ["step"] if isinstance(row, dict) and any(k in row for k in needs_step) else []
        problem = _numbers_problem({k: row.get(k) for k in keys} if isinstance(row, dict) else row, keys)
        problem = problem or next((f"{k} is not a list of numbers" for k in lists if k in row and not (
            isinstance(row[k], list) and all(not _numbers_problem(dict(x=x), ("x",)) for x in row[k]))), None)
        if problem:
            raise UserError(f"{f}, record {n}: {problem}; fix or remove that file")
    return rows


def seed_folders(folder: Path) -> list[Path]:
    """The seed<N>/ folders, by N; any other seed*/ folder (a backup, seed1_old/) is left out with a note."""
    found = [d for d in folder.glob("seed*") if d.is_dir()]
    for d in sorted(d for d in found if not d.name[4:].isdigit()):
        print(f"note: {d} is no seed folder (seed<N>/): left out of the table", file=sys.stderr)
    return sorted((d for d in found if d.name[4:].isdigit()), key=lambda d: int(d.name[4:]))


def _pct(x, std=None) -> str:
    return "–" if x is None else f"{100 * x:.1f}" + ("" if std is None else f" ± {100 * std:.1f}")


def report_table(runs: list[dict]) -> str:
    """Markdown like the paper's Table 1: success (%) ID, OOD, over both (mean ± std over seeds);
    invalid actions, world-model accuracy, the share of parameters changed."""
    lines = ["| arm | ALFWorld ID | OOD | AVG | invalid actions (%) | WM accuracy (%) | params changed (%) "
             "| episodes |",
             "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        sp = r["splits"]
        ide, ood = sp.get(ID_SPLIT), sp.get(OOD_SPLIT)
        both = [x for x in (ide, ood) if x]
        n = sum(x["num_episodes"] for x in both)
        avg = sum(x["success_rate"] * x["num_episodes"] for x in both) / n if n else None
        steps = sum(x["mean_steps"] * x["num_episodes"] for x in both)
        invalid = (sum(x["invalid_action_rate"] * x["mean_steps"] * x["num_episodes"] for x in both) / steps
                   if steps else None)
        lines.append("| " + " | ".join([
            r["name"], _pct(ide and ide["success_rate"], ide and ide.get("success_rate_std")),
            _pct(ood and ood["success_rate"], ood and ood.get("success_rate_std")), _pct(avg), _pct(invalid),
            _wm_cell(r["wm"]),
            "–" if not r["weights"] else f"{100 * r['weights']['changed_share']:.2f}",
            str(n) if n else "–"]) + " |")
    return "\n".join(lines) + "\n"


TAU2_TABLE_DOMAINS = ("retail", "telecom", "airline")  # the paper's column order


def tau2_table(runs: list[dict]) -> str:
    """Markdown, Table 1's tau2-bench columns: average reward (%) per domain (mean ± std over seeds); AVG over
    all tasks of the three (weighted by tasks, as the paper's); the agent's invalid tool calls."""
    lines = ["| arm | tau2 retail | telecom | airline | AVG | invalid tool calls (%) | conversations |",
             "|---|---|---|---|---|---|---|"]
    for r in runs:
        got = [r["tau2"][d] for d in TAU2_TABLE_DOMAINS if d in r["tau2"]]
        tasks = sum(x["num_tasks"] for x in got)
        avg = sum(x["average_reward"] * x["num_tasks"] for x in got) / tasks if len(got) == 3 else None
        calls = sum(x["tool_calls"] for x in got)
        invalid = sum(x["invalid_tool_call_rate"] * x["tool_calls"] for x in got) / calls if calls else None
        cells = [_pct(x and x["average_reward"], x and x.get("average_reward_std"))
                 for x in (r["tau2"].get(d) for d in TAU2_TABLE_DOMAINS)]
        n = sum(x["num_episodes"] for x in got)
        lines.append("| " + " | ".join([r["name"], *cells, _pct(avg), _pct(invalid), str(n or "–")]) + " |")
    return "\n".join(lines) + "\n"


def report_plots(runs: list[dict], stem: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    written = []
    # the training reward: rows that have one (an --eval-on-start run's step-0 row holds only its evaluation)
    trained = {r["name"]: rows for r in runs if (rows := [x for x in r["curve"] if "reward" in x])}
    if trained:
        fig, ax = plt.subplots(figsize=(6.5, 3.5))
        for name, rows in trained.items():
            ax.plot([x["step"] for x in rows], [x["reward"] for x in rows], marker=".", label=name)
        ax.set(xlabel="optimizer step", ylabel="mean reward", title="training reward per step",
               ylim=(-0.02, 1.02))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
        ax.legend(fontsize=7, loc="best")
        fig.tight_layout()
        written.append(stem.with_name(stem.name + "_rewards.png"))
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    evaluated = [r for r in runs if r["splits"]]
    if evaluated:
        fig, ax = plt.subplots(figsize=(6.5, 3.5))
        x = range(len(evaluated))
        for k, (split, label) in enumerate(((ID_SPLIT, "ID (valid_seen)"),
                                            (OOD_SPLIT, "OOD (valid_unseen)"))):
            vals = [100 * r["splits"].get(split, {}).get("success_rate", 0.0) for r in evaluated]
            errs = [100 * r["splits"].get(split, {}).get("success_rate_std", 0.0) for r in evaluated]
            low, high = clipped_band(vals, errs, 100)  # a rate's bar never below 0 % nor above 100 %
            ax.bar([i + (k - 0.5) * 0.4 for i in x], vals, 0.4, capsize=3, label=label,
                   yerr=[[v - lo for v, lo in zip(vals, low)], [h - v for v, h in zip(vals, high)]])
        ax.set_xticks(list(x), [r["name"] for r in evaluated], rotation=30, ha="right", fontsize=7)
        ax.set(ylabel="success (%)", title="ALFWorld success by arm", ylim=(0, 100))
        ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(stem.with_name(stem.name + "_success.png"))
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written


def report(cfg: ReportConfig, folders: list[str]) -> str:
    missing = [f for f in folders if not Path(f).is_dir()]
    if missing:
        raise UserError(f"not a run folder: {missing[0]}")
    runs = [read_run(Path(f)) for f in folders]
    if not any(r["splits"] or r["tau2"] or r["wm"] or r["weights"] for r in runs):
        raise UserError("no results in these folders: put the JSON of `eval.py agent`, `eval.py wm` or "
                        "`eval.py weights` into each run folder first")
    alfworld = any(r["splits"] or r["wm"] or r["weights"] for r in runs)
    tau2 = any(r["tau2"] for r in runs)
    text = "\n".join(([report_table(runs)] if alfworld else []) + ([tau2_table(runs)] if tau2 else []))
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if cfg.plots:
        for png in report_plots(runs, out.with_suffix("")):
            text += f"\n![{png.stem}]({png.name})\n"
    return text


SANITY_ARMS = (("warmup", "warm-up"), ("rwml", "+ RWML"), ("wm_sft", "+ WM SFT"), ("coin", "+ COIN"))
SANITY_BASELINES = (("template", "template rule"), ("nothing", "always \"Nothing happens.\""),
                    ("copy", "copy the observation"), ("base", "base model"))
SANITY_COLUMNS = (("all targets", lambda r: r["wm_accuracy"]),
                  ("the template rule's targets",
                   lambda r: r["per_kind"].get("within_template", {}).get("wm_accuracy")),
                  ("not \"Nothing happens.\"", lambda r: r["per_kind"]["change"]["wm_accuracy"]),
                  ("beyond the template rule", lambda r: r["per_kind"]["beyond_template"]["wm_accuracy"]),
                  ("mean cosine", lambda r: r["mean_cosine"]))
SANITY_ROW_NUMBERS = ("step", "reward", "nothing_share", "frac_reward_zero_std", "eval_wm_accuracy")
SANITY_ROW_LISTS = ("group_rewards", "group_nothing", "group_nothing_advantage")  # GRPO rows: per group
MIN_RATE_N = 10  # a kind with fewer held-out triplets is listed, not quoted as a rate


def _wm_problem(data: dict) -> str | None:
    """What keeps an `eval.py wm` result from the sanity table (what its columns and kind table read)."""
    pk, obs = data.get("per_kind"), data.get("per_observation_kind")
    parts = [("", data, ("wm_accuracy", "mean_cosine", "n")), ("per_kind", pk, ()),
             ("per_observation_kind", obs, ())]
    if isinstance(pk, dict):
        parts += [("per_kind.change", pk.get("change"), ("wm_accuracy",)),
                  ("per_kind.beyond_template", pk.get("beyond_template"), ("wm_accuracy", "n"))]
        parts += [(f"per_kind.{k}", pk[k], ("wm_accuracy",) if k == "within_template" else ())
                  for k in ("within_template", "beyond_template_unseen") if k in pk]
    if isinstance(obs, dict):
        parts += [(f"per_observation_kind.{k}", x, ("wm_accuracy", "n")) for k, x in obs.items()]
    if not isinstance(data.get("config", {}), dict):
        return "config is not an object"
    for where, x, keys in parts:
        if not isinstance(x, dict):
            return f"{where} is missing or not an object"
        if problem := _numbers_problem(x, keys):
            return f"{where + ': ' if where else ''}{problem}"
    return None


def _spread(xs: list[float], fmt: str = ".3f") -> str:
    """"mean ± sd (a / b / c)" over seeds (sample sd)."""
    xs = [x for x in xs if x is not None]  # None: a value older result files do not have
    if not xs:
        return "–"
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.fmean(xs):{fmt}} ± {sd:.3f} ({' / '.join(f'{x:{fmt}}' for x in xs)})"


def variant_arms(seeds: list[Path]) -> list[tuple[str, str]]:
    """sanity.sh's VARIANTS (seed*/rwml_<name>), labelled by the flags in which they differ from RWML's."""
    def flag(key: str, value) -> str:
        name = key.replace("_", "-")
        if isinstance(value, bool):
            return f"--{name}" if value else f"--no-{name}"
        return f"--{name} {'none' if value is None else value}"

    arms = []
    for name in sorted({d.name for s in seeds for d in s.glob("rwml_*") if d.is_dir()}):
        label = name[len("rwml_"):]
        for s in seeds:
            mine, rwml_cfg = s / name / "config.json", s / "rwml" / "config.json"
            if mine.is_file() and rwml_cfg.is_file():
                a, b = read_json(mine), read_json(rwml_cfg)
                label = " ".join(flag(k, v) for k, v in a.items()
                                 if k not in RESUME_FREE and b.get(k) != v) or label
                break
        arms.append((name, f"+ RWML, {label}"))
    return arms


def nothing_rates(rows: list[dict], G: int) -> tuple[float | None, float | None, float, float]:
    """From GRPO metrics rows: the share of "Nothing happens." predictions on its targets and on the others,
    and their advantage summed in groups with that target (> 0: pushed up) and in the others (< 0: down)."""
    on = {True: [0.0, 0], False: [0.0, 0]}
    push = {True: 0.0, False: 0.0}
    for r in rows:
        for k, n, a in zip(r.get("target_kinds", []), r.get("group_nothing", []),
                           r.get("group_nothing_advantage", [])):
            nh = k == "nothing_happens"
            on[nh][0] += n
            on[nh][1] += G
            push[nh] += a
    rate = {nh: (x / n if n else None) for nh, (x, n) in on.items()}
    return rate[True], rate[False], push[True], push[False]


def filter_rows(seeds: list[Path]) -> list[str]:
    """Per seed, the "Nothing happens." targets in the collection, the warm-up and RWML splits and the kept
    triplets; the warm-up's mean easiness of those targets and of the rest."""
    lines = []
    for d in seeds:
        meta, rows = d / "filter" / "filter.json", read_jsonl(d / "filter" / "easiness.jsonl")
        if not rows or not meta.is_file():
            continue
        info = read_json(meta)
        nh = [envs.observation_kind(r["next_obs"]) == "nothing_happens" for r in rows]
        n_all, n_split = info["num_triplets"], info["num_filter_split"]
        coll = d / "collect" / "transitions.jsonl"
        nh_all = sum(envs.observation_kind(t["next_obs"]) == "nothing_happens" for t in read_jsonl(coll)) \
            if coll.is_file() else None

        def share(k: int | None, n: int) -> str:
            return "–" if k is None else f"{k} of {n} ({k / max(n, 1):.0%})"

        def mean(xs):
            return f"{statistics.fmean(xs):.2f}" if xs else "–"

        kept = [h for h, r in zip(nh, rows) if r["kept"]]
        lines.append(f"| {d.name[4:]} | {share(nh_all, n_all)} | "
                     f"{share(None if nh_all is None else nh_all - sum(nh), n_split)} | "
                     f"{share(sum(nh), len(nh))} | {share(sum(kept), len(kept))} | "
                     f"{mean([r['easiness'] for h, r in zip(nh, rows) if h])} | "
                     f"{mean([r['easiness'] for h, r in zip(nh, rows) if not h])} | {info.get('tau_easy')} |")
    if not lines:
        return []
    return ["### the easy filter and the target mix", "",
            "Per seed: triplets with a \"Nothing happens.\" target in the collection, in the warm-up's split "
            "(its SFT data), in the RWML split and among the triplets the easy filter kept; the warm-up's "
            "easiness (its mean reward over K predictions) of those targets and of the others; tau_easy.", "",
            "| seed | collected | warm-up split | RWML split | kept | easiness, \"Nothing happens.\" | "
            "easiness, other | tau_easy |", "|---|---|---|---|---|---|---|---|", *lines, ""]


def _tau(value) -> str:
    return "not recorded" if value is None else f"{value}"


def tau_d_used(scores: dict[str, list[dict]]) -> str:
    """The tau_d the table's scores used, read from each result's own config (eval.py wm records the one it
    applied): "tau_d X" when they agree, else each value with the rows scored at it."""
    rows = {}  # tau_d -> row names
    for name, results in scores.items():
        for r in results:
            v = (r.get("config") or {}).get("tau_d") if isinstance(r.get("config"), dict) else None
            rows.setdefault(v, [])
            if name not in rows[v]:
                rows[v].append(name)
    if len(rows) == 1:
        return f"tau_d {_tau(next(iter(rows)))} (every score's config)"
    return "tau_d " + "; ".join(f"{_tau(v)} ({', '.join(names)})" for v, names in rows.items()) + \
        " (each score's config: the rows were scored at different tau_d)"


def tau_d_trained(seeds: list[Path], arms) -> str:
    """The tau_d the reward-trained arms (RWML, its variants, COIN) trained with, from each run's
    config.json; empty when no such run records a config."""
    found = {}  # tau_d -> arm names
    for a, name in arms:
        if a not in ("rwml", "coin") and not a.startswith("rwml_"):
            continue
        for d in seeds:
            cfg = read_json(d / a / "config.json")
            if isinstance(cfg, dict):
                found.setdefault(cfg.get("tau_d"), [])
                if name not in found[cfg.get("tau_d")]:
                    found[cfg.get("tau_d")].append(name)
    if not found:
        return ""
    if len(found) == 1:
        return f"Trained (RWML's reward) at tau_d {_tau(next(iter(found)))} (every run's config.json)."
    return ("Trained (RWML's reward) at tau_d "
            + "; ".join(f"{_tau(v)} ({', '.join(n.lstrip('+ ') for n in names)})"
                        for v, names in found.items())
            + " (each run's config.json).")


def sanity_report(folder: Path, split: str = "valid_unseen", png: Path | None = None) -> str:
    """`sanity.sh`'s tables: per held-out kind the baselines and each arm over seeds, RWML - warm-up
    (paired), accuracy per observation kind; the training diagnostics; `png`: the GRPO arms' curves."""
    seeds = seed_folders(folder)
    if not seeds:
        raise UserError(f"no seed*/ folders in {folder}: run sanity.sh first")
    held = folder / split  # the held-out sets of this split and every score on them
    if not held.is_dir():
        present = sorted(d.name for d in folder.iterdir() if d.is_dir() and (
            (d / "baselines").is_dir() or any(d.glob("seed*/eval_*.json"))))
        raise UserError(f"no held-out split {split!r} in {folder}: the splits there are "
                        f"{', '.join(present) or 'none (run sanity.sh first)'}; pass --split with one "
                        "of them")
    variants = variant_arms(seeds)
    all_arms = (*SANITY_ARMS[:2], *variants, *SANITY_ARMS[2:])

    def read(path: Path):  # a score the table cannot read: one line naming it
        data = read_json(path)
        problem = data is not None and path.name != "config.json" and _wm_problem(data)
        if problem:
            raise UserError(f"{path}: {problem}, so it is no result of `eval.py wm`; write it again, "
                            "or remove it")
        return data

    lines = []
    for kind in HELDOUT_KINDS:
        base = {b: read(held / "baselines" / f"{b}_{kind}.json") for b, _ in SANITY_BASELINES}
        arms = {a: [r for d in seeds if (r := read(held / d.name / f"eval_{a}_{kind}.json"))]
                for a, _ in all_arms}
        first = next((r for r in [*base.values(), *(x for v in arms.values() for x in v)] if r), None)
        if first is None:
            continue
        cfg = first.get("config", {})
        beyond_n = first["per_kind"]["beyond_template"]["n"]
        unseen_n = first["per_kind"].get("beyond_template_unseen", {}).get("n")
        held_file = first.get("transitions")  # as the table records it: relative to the repository
        held_file = repo_path(held_file) if isinstance(held_file, str) else held_file
        scores = {**{n: [base[b]] for b, n in SANITY_BASELINES if base[b]},
                  **{n: arms[a] for a, n in all_arms if arms[a]}}
        lines += [f"### {kind} triplets: {first['n']} of `{first.get('split') or '?'}` "
                  f"(`{held_file}`), {beyond_n} beyond the template rule"
                  + (f" ({unseen_n} of them list objects the prompt never names)" if unseen_n is not None
                     else ""), "",
                  (f"{cfg['eval_samples']} predictions per triplet sampled at T {cfg.get('temperature', 0)}"
                   if cfg.get("eval_samples") else "one greedy prediction per triplet")
                  + f" (the rules: one), reward 1 iff 1 - cos < {tau_d_used(scores)}"
                  + (f" and ROUGE-1 F >= {cfg['rouge_gate']}" if cfg.get("rouge_gate") else "")
                  + f"; the share of predictions with reward 1. Arms: mean ± sd over {len(seeds)} "
                  "independent seeds (each seed's value in brackets)."
                  + (f" {trained}" if (trained := tau_d_trained(seeds, all_arms)) else ""), "",
                  "| | " + " | ".join(c for c, _ in SANITY_COLUMNS) + " |",
                  "|---|" + "---|" * len(SANITY_COLUMNS)]
        for b, name in SANITY_BASELINES:
            if base[b]:
                lines.append(f"| {name} | " + " | ".join(_spread([get(base[b])]).split(" ±")[0]
                                                         for _, get in SANITY_COLUMNS)
                             + " |")
        for a, name in all_arms:
            if arms[a]:
                lines.append(f"| {name} | " + " | ".join(_spread([get(r) for r in arms[a]])
                                                         for _, get in SANITY_COLUMNS)
                             + " |")
        for a, name in (("rwml", "RWML"), *((v, n.replace("+ RWML", "RWML")) for v, n in variants)):
            pairs = [(r, w) for d in seeds if (r := read(held / d.name / f"eval_{a}_{kind}.json"))
                     and (w := read(held / d.name / f"eval_warmup_{kind}.json"))]
            if pairs:
                lines.append(f"| **{name} − warm-up** (paired) | " + " | ".join(
                    _spread([get(r) - get(w) for r, w in pairs if None not in (get(r), get(w))], "+.3f")
                    for _, get in SANITY_COLUMNS) + " |")
        kinds = sorted(first["per_observation_kind"], key=lambda k: -first["per_observation_kind"][k]["n"])
        few = [f"{k} {first['per_observation_kind'][k]['n']}" for k in kinds
               if first["per_observation_kind"][k]["n"] < MIN_RATE_N]
        cols = [(b, n) for b, n in SANITY_BASELINES[:1] if base[b]] + [(a, n) for a, n in all_arms if arms[a]]
        lines += ["", f"By observation kind (kinds with at least {MIN_RATE_N} triplets; mean over seeds):",
                  "", "| kind | n | " + " | ".join(n for _, n in cols) + " |",
                  "|---|---|" + "---|" * len(cols)]
        for k in kinds:
            n = first["per_observation_kind"][k]["n"]
            if n < MIN_RATE_N:
                continue
            vals = []
            for c, _ in cols:
                rs = [base[c]] if c in base else arms[c]
                vals.append(
                    f"{statistics.fmean(r['per_observation_kind'][k]['wm_accuracy'] for r in rs):.3f}")
            lines.append(f"| {k} | {n} | " + " | ".join(vals) + " |")
        lines += (["", f"Too few to quote as a rate: {', '.join(few)}."] if few else []) + [""]
    lines += filter_rows(seeds)
    lines += ["### training", "", "Mean per step, first quarter -> last quarter of the steps: the reward; "
              "the share of predictions that are \"Nothing happens.\", over all targets, over the "
              "\"Nothing happens.\" targets and over the others; then over the whole run: the share of "
              "groups whose rewards are all equal (no gradient), of the mixed groups (those that carry the "
              "gradient) the share whose target is \"Nothing happens.\", and the advantage summed over the "
              "\"Nothing happens.\" predictions in \"Nothing happens.\"-target groups (which push it up) and "
              "in the other groups (which push it down).", "",
              "| seed | RWML reward | predicted \"Nothing happens.\" | on its targets | on other targets | "
              "all-equal groups | mixed groups with a \"Nothing happens.\" target | advantage to it: its "
              "targets / others | COIN reward |", "|---|---|---|---|---|---|---|---|---|"]

    def quarter_rows(rows):
        q = max(1, len(rows) // 4)
        return rows[:q], rows[-q:]

    def quarters(rows, key):
        rows = [r for r in rows if key in r]
        if not rows:
            return "–"
        head, tail = (statistics.fmean(r[key] for r in part) for part in quarter_rows(rows))
        return f"{head:.2f} -> {tail:.2f}"

    def mixed_nothing(rows):
        mixed = [k for r in rows for k, g in zip(r.get("target_kinds", []), r.get("group_rewards", []))
                 if 0 < g < 1]
        return (f"{sum(k == 'nothing_happens' for k in mixed) / len(mixed):.2f} of {len(mixed)}" if mixed
                else "–")

    def drift(rows, G):  # "Nothing happens." predictions on its targets and on others, first -> last quarter
        rows = [r for r in rows if "group_nothing" in r]
        if not rows:
            return "–", "–", "–"
        (h_on, h_off, *_), (t_on, t_off, *_) = (nothing_rates(part, G) for part in quarter_rows(rows))
        _, _, up, down = nothing_rates(rows, G)
        fmt = lambda a, b: f"{'–' if a is None else f'{a:.2f}'} -> {'–' if b is None else f'{b:.2f}'}"  # noqa: E731
        return fmt(h_on, t_on), fmt(h_off, t_off), f"{up:+.1f} / {down:+.1f}"

    for d in seeds:
        metrics = lambda f: read_rows(f, SANITY_ROW_NUMBERS, ("eval_wm_accuracy",), SANITY_ROW_LISTS)  # noqa: E731
        coin = metrics(d / "coin" / "metrics.jsonl")
        for arm, name in (("rwml", "+ RWML"), *variants):
            rw = metrics(d / arm / "metrics.jsonl")
            if arm != "rwml" and not rw:
                continue
            G = (read(d / arm / "config.json") or {}).get("num_generations", 4)
            if not (isinstance(G, int) and G > 0):
                raise UserError(f"{d / arm / 'config.json'}: num_generations {G!r} is not a positive whole "
                                "number; write it again, or remove it")
            zs = [r["frac_reward_zero_std"] for r in rw if "frac_reward_zero_std" in r]  # not step 0's eval
            zero = f"{statistics.fmean(zs):.2f}" if zs else "–"
            label = "" if arm == "rwml" else f" ({name[len('+ RWML, '):]})"
            on, off, push = drift(rw, G)
            lines.append(f"| {d.name[4:]}{label} | {quarters(rw, 'reward')} | "
                         f"{quarters(rw, 'nothing_share')} | {on} | {off} | {zero} | {mixed_nothing(rw)} | "
                         f"{push} | {quarters(coin, 'reward') if arm == 'rwml' else '–'} |")
    if png is not None:
        curves = {name: [[(r["step"], r["eval_wm_accuracy"]) for r in read_rows(
                              d / arm / "metrics.jsonl", SANITY_ROW_NUMBERS, ("eval_wm_accuracy",))
                          if "eval_wm_accuracy" in r] for d in seeds]
                  for arm, name in all_arms if arm.startswith("rwml") or arm == "coin"}
        if plot_curves(curves, png, xlabel="GRPO step", ylabel="held-out world-model accuracy",
                       title=f"RWML and its controls: accuracy on held-out {split} triplets during training"):
            lines += ["", f"Held-out accuracy against step (the runs' --eval-steps rows): {png.name}"]
    return "\n".join(lines) + "\n"


AGENT_ARMS = (("base", "base"), ("rwml", "RWML"), ("policy", "policy RL"),
              ("rwml_policy", "RWML + policy RL"), ("wm_sft_policy", "WM SFT + policy RL"))


def agent_report(folder: Path, png: Path | None = None) -> str:
    """`agent_sanity.sh`'s table: greedy success (%) per arm on dev, test and both (stage 2: over seeds), the
    random baseline; `png`: the dev curve. Stage 2's dev score: its final evaluation, else the curve's end."""
    seeds = seed_folders(folder)
    if not seeds:
        raise UserError(f"no seed*/ folders in {folder}: run agent_sanity.sh first")

    def pct(xs: list[float]) -> str:  # one value as it is; over seeds "mean ± sd (each seed)"
        xs = [100 * x for x in xs]
        if len(xs) < 2:
            return f"{xs[0]:.1f}" if xs else "–"
        return (f"{statistics.fmean(xs):.1f} ± {statistics.stdev(xs):.1f} "
                f"({' / '.join(f'{x:.0f}' for x in xs)})")

    def per_split(f: Path) -> dict:  # {split: its scores}; a result the table cannot read: one line
        parts = (read_json(f) or dict(per_split={})).get("per_split")
        problem = "per_split is missing or not an object" if not isinstance(parts, dict) else next(
            (f"per_split.{sp}: {p}" for sp, x in parts.items()
             if (p := _numbers_problem(x, ("success_rate", "num_episodes")))), None)
        if problem:
            raise UserError(f"{f}: {problem}, so it is no result of `eval.py agent`; write it again, "
                            "or remove it")
        return parts

    def split_rate(f: Path, split: str):
        return per_split(f).get(split, {}).get("success_rate")

    def pooled(f: Path):  # success over every dev and test episode together
        r = per_split(f)
        if not ("dev" in r and "test" in r):
            return None
        n = r["dev"]["num_episodes"] + r["test"]["num_episodes"]
        return sum(r[sp]["success_rate"] * r[sp]["num_episodes"] for sp in ("dev", "test")) / n if n else None

    def curve(d: Path, start: Path) -> list[dict]:
        """Dev success by step: 0 the start's evaluation, last the final one, --eval-steps rows between."""
        rows = read_rows(d / "metrics.jsonl", ("step", "eval_success"), needs_step=("eval_success",))
        last = max((r["step"] for r in rows if "step" in r), default=None)
        final = split_rate(d / "eval_agent.json", "dev")
        between = [r for r in rows if "eval_success" in r and (final is None or r["step"] < last)]
        points = between + ([dict(step=last, eval_success=final)] if final is not None and last else [])
        first = split_rate(start / "eval_agent.json", "dev")
        return ([dict(step=0, eval_success=first)] if points and points[0]["step"] > 0 and first is not None
                else []) + points

    def episodes(f: Path) -> int:
        return per_split(f).get("test", {}).get("num_episodes", 0)

    lines = ["| arm | dev success (%) | test success (%) | dev + test (%) | test episodes | seeds |",
             "|---|---|---|---|---|---|"]
    random_f = folder / "random" / "eval_agent.json"
    if random_f.is_file():
        r = per_split(random_f)  # a split it did not play: "–"
        cells = [_pct(r[sp]["success_rate"], r[sp].get("success_rate_std")) if sp in r else "–"
                 for sp in ("dev", "test")]
        test = r.get("test")
        if test and not (isinstance(test.get("num_games"), int) and test["num_games"] > 0):
            raise UserError(f"{random_f}: per_split.test.num_games is missing or not a positive whole "
                            "number, so it is no result of `eval.py agent`; write it again, or remove it")
        lines.append(f"| uniform random admissible | {' | '.join(cells)} | {_pct(pooled(random_f))} | "
                     + (f"{test['num_episodes']} | {test['num_episodes'] // test['num_games']} |" if test
                        else "– | – |"))
    curves, start = {}, dict(policy="base", rwml_policy="rwml", wm_sft_policy="wm_sft")
    for key, name in AGENT_ARMS:
        if key in ("base", "rwml"):  # one greedy evaluation: nothing to replicate
            f = folder / key / "eval_agent.json"
            cells = [_pct(x) for x in (split_rate(f, "dev"), split_rate(f, "test"), pooled(f))]
            lines.append(f"| {name} | {' | '.join(cells)} | {episodes(f)} | – |")
            continue
        runs = [d / key for d in seeds]
        curves[name] = [curve(d, folder / start[key]) for d in runs]
        dev = [c[-1]["eval_success"] for c in curves[name] if c]  # the final evaluation's, if on dev
        done = [d for d in runs if (d / "eval_agent.json").is_file()]
        test = [split_rate(d / "eval_agent.json", "test") for d in done]
        both = [x for d in done if (x := pooled(d / "eval_agent.json")) is not None]
        lines.append(f"| {name} | {pct(dev)} | {pct(test)} | {pct(both)} | "
                     f"{episodes(done[0] / 'eval_agent.json') if done else 0} | "
                     f"{', '.join(d.parent.name[4:] for d in done) or '–'} |")
    if png is not None:
        plot_curves({name: [[(r["step"], 100 * r["eval_success"]) for r in c] for c in cs]
                     for name, cs in curves.items()},
                    png, xlabel="stage-2 step", ylabel="dev success (%), greedy", top=100,
                    title="stage 2 on TextWorld (choose mode): held-out dev games")
    return "\n".join(lines) + "\n"


FEW_POINTS = 3  # a curve of this many steps or fewer: markers (and error bars), no line joining them


def clipped_band(mean: list[float], sd: list[float], top: float = 1.0) -> tuple[list[float], list[float]]:
    """mean ± sd clipped to the score's range [0, top]: a rate's band never below 0 nor above its top."""
    return [max(0.0, m - d) for m, d in zip(mean, sd)], [min(top, m + d) for m, d in zip(mean, sd)]


def plot_curves(curves: dict[str, list[list[tuple[int, float]]]], png: Path, *, xlabel: str, ylabel: str,
                title: str, top: float = 1.0) -> bool:
    """Score against step per arm: each seed thin, mean ± sd (clipped to [0, top]) where all seeds have the
    step; a curve of FEW_POINTS steps or fewer as markers with error bars; whether drawn."""
    if not any(any(c) for cs in curves.values() for c in cs):
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for i, (name, cs) in enumerate(curves.items()):
        cs, color = [dict(c) for c in cs if c], f"C{i}"
        if not cs:
            continue
        for c in cs:
            ax.plot(list(c), list(c.values()), color=color, alpha=0.35, lw=0.8, marker="o", ms=3,
                    ls="-" if len(c) > FEW_POINTS else "none")
        steps = sorted(set.intersection(*(set(c) for c in cs)))
        mean = [statistics.fmean(c[x] for c in cs) for x in steps]
        sd = [statistics.stdev(c[x] for c in cs) if len(cs) > 1 else 0.0 for x in steps]
        low, high = clipped_band(mean, sd, top)
        label = f"{name} (mean ± sd of {len(cs)} seeds)"
        if len(steps) <= FEW_POINTS:
            yerr = [[m - lo for m, lo in zip(mean, low)], [h - m for m, h in zip(mean, high)]]
            ax.errorbar(steps, mean, yerr=yerr, color=color, fmt="o", ms=6, capsize=4, label=label)
            continue
        ax.plot(steps, mean, color=color, lw=2, marker="o", ms=4, label=label)
        ax.fill_between(steps, low, high, color=color, alpha=0.15, lw=0)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
    ax.title.set_fontsize(9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return True


REPORTS = {  # name -> its line in --help, its config, its positional arguments
    "report": ("the report table of run folders (METHOD.md §9's table), plots beside it", ReportConfig,
               {"runs": dict(nargs="+", help="run folders, one row each, in this order")}),
    "sanity": ("the stage-1 sanity table of lab/sanity.sh's run folder", SanityConfig,
               {"run": dict(help="the run folder of sanity.sh (runs/sanity)")}),
    "agent-table": ("the agent table of lab/agent_sanity.sh's run folder", AgentTableConfig,
                    {"run": dict(help="the run folder of agent_sanity.sh (runs/agent_sanity)")})}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        commands_help("lab/reports.py", {k: v[0] for k, v in REPORTS.items()}, "REPORT",
                      "`lab/reports.py REPORT --help`: its flags")
    if not argv or argv[0] not in REPORTS:
        raise UserError(f"usage: python lab/reports.py {{{','.join(REPORTS)}}} [flags]")
    command, (_, config_cls, positional) = argv[0], REPORTS[argv[0]]
    cfg, rest = parse_config(config_cls, argv[1:], prog=f"lab/reports.py {command}", positional=positional)
    out = Path(cfg.out)
    check_writable(out, folder=False)
    curve = out.with_name(out.stem + "_curve.png")
    if command == "report":
        text = report(cfg, rest["runs"])  # it makes out's folder, for its plots
    else:
        text = (sanity_report(Path(rest["run"]), cfg.split, curve) if command == "sanity"
                else agent_report(Path(rest["run"]), curve))
        out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, text)
    print(text + f"-> {repo_path(out, None)}" + (f" (+ {curve.name})" if command == "agent-table" else ""))


if __name__ == "__main__":
    run_cli(main)
