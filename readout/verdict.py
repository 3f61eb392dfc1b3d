"""What a run concludes, read from its folder: the paired differences (a)-(f) of its per-triplet
files (wm_eval_*.triplets.jsonl) with 95 % CIs over games (`gain_lines`) and the verdict in words.

    python -m readout runs/rwml          # after `python train.py`: the lines and the verdict
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from eval import HELDOUT_KINDS
from stages.runs import triplet_key
from readout import stats
from harness.common import read_jsonl
from envs import UserError

CHANGES = ("take_revisit", "put_revisit")  # what a take or a put changed: rule + copy cannot say it


def compare(out: Path, arm: str, base: str, kind: str | tuple, key: str, rows=None) -> dict:
    """`arm` - `base` on held-out set(s) `kind` (wm_eval_<arm>_<kind>.triplets.jsonl; pooled kinds
    share games), by triplet (its predictions' mean); `rows` keeps a subset of the base's rows."""
    pairs = []
    for kind in (kind,) if isinstance(kind, str) else kind:
        files = [f"wm_eval_{w}_{kind}.triplets.jsonl" for w in (arm, base)]
        x, y = (scored_rows(out / f, key, rows) for f in files)
        by_key = {json.dumps(triplet_key(r)): r for r in x}
        if len(by_key) != len(x) or sorted(by_key) != sorted(json.dumps(triplet_key(r)) for r in y):
            raise UserError(f"{out}/{files[0]} and {files[1]} are not scores of the same triplets "
                            f"(one cut or edited); {AGAIN}")
        pairs += [(by_key[json.dumps(triplet_key(r))], r) for r in y if rows is None or rows(r)]
    mean = [[sum(map(float, r[key])) / len(r[key]) for r in s] for s in zip(*pairs)] or [[], []]
    ci = stats.paired_bootstrap(*mean, [str(b["game"]) for _, b in pairs]) if pairs else None
    return dict(ci or {}, ci=ci, n=len(pairs), before=sum(mean[1]) / max(len(pairs), 1),
                after=sum(mean[0]) / max(len(pairs), 1))


AGAIN = ("delete the wm_eval_* files named and rerun the `python train.py` that wrote them, with "
         "the same settings: it scores them again")


def scored_rows(path: Path, key: str, rows=None) -> list[dict]:
    """A per-triplet file's rows, each with its game and a non-empty list of numbers `key` (and what
    the subset `rows` reads), or a line naming the file: a row cut or edited by hand is no score."""
    need = ("template_hit", "unseen_objects") if rows else ()
    for n, r in enumerate(found := read_jsonl(path), 1):
        v = r.get(key) if isinstance(r, dict) else None
        if not (isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v)) or any(
                k not in r for k in ("game", *need)):
            raise UserError(f"{path}, row {n}: not a score (a non-empty list of numbers {key!r}, a "
                            "game" + "".join(f", {k}" for k in need) + f"); {AGAIN}")
    return found


def said(c: dict) -> str:
    return stats.said(c) if c["n"] else "no triplets"


def gain_lines(out: Path, start) -> list[str]:
    """(a) the reward on RWML's own prompts; (b) held-out RWML - start; (c) RWML - the template
    rule; (d) beyond the rule; (f) the state probes; (e) RWML - COIN; the verdict in words."""
    def rwml_minus(base: str, kind: str | tuple, key: str, rows=None) -> dict:
        return compare(out, "rwml", base, kind, key, rows)
    a, strict = (rwml_minus("before", "train", k) for k in ("rewards", "exact"))
    name = "the warm-up" if start else "the base model"
    lines = [f"(a) the sim-to-real reward on RWML's own {a['n']} training prompts ({a['units']} "
             f"games): {name} {a['before']:.3f} -> RWML {a['after']:.3f}, {said(a)} (95 % CI over "
             f"games); exact match {strict['before']:.3f} -> {strict['after']:.3f}, {said(strict)}"]
    rule, both = {}, rwml_minus("before", HELDOUT_KINDS, "exact")
    for kind in HELDOUT_KINDS:
        r, e = (rwml_minus("before", kind, k) for k in ("rewards", "exact"))
        lines.append(f"(b) held-out {kind}, RWML - {name} ({r['n']} triplets, {r['units']} games): "
                     f"reward {said(r)}; exact match {said(e)}")
    lines.append(f"(b) held-out, both kinds pooled ({both['n']} triplets), exact match: "
                 f"{said(both)}")
    if not all((out / f"wm_eval_template_{k}.triplets.jsonl").is_file() for k in HELDOUT_KINDS):
        return lines  # a run scored without the baselines (a lab re-score of (a), (b) alone)
    for kind in HELDOUT_KINDS:
        r, rule[kind] = (rwml_minus("template", kind, k) for k in ("rewards", "exact"))
        same = all(r[k] == rule[kind][k] for k in ("diff", "lo", "hi"))
        lines.append(f"(c) held-out {kind}, RWML {rule[kind]['after']:.3f} - the template rule "
                     f"{rule[kind]['before']:.3f} (exact match): {said(rule[kind])}; reward "
                     + ("the same" if same else said(r)))
    for kind in HELDOUT_KINDS:
        scored = read_jsonl(out / f"wm_eval_before_{kind}.triplets.jsonl")
        if not scored or "tracker_hit" not in scored[0]:
            lines.append(f"(d) held-out {kind}: not split, its rows were scored before the state "
                         "tracker")
            continue  # the older split (unseen_objects) counted "you see nothing" as in the prompt
        shown, unseen = (rwml_minus("before", kind, "exact", lambda t, h=h: not t["template_hit"]
                                    and t["tracker_hit"] == h) for h in (True, False))
        lines.append(f"(d) held-out {kind}, the rule's misses whose answer the prompt holds (the "
                     f"state tracker reproduces it) ({shown['n']}): RWML - {name}, exact match "
                     f"{said(shown)}; the others, which the prompt does not determine "
                     f"({unseen['n']}): {name} {unseen['before']:.3f}, RWML {unseen['after']:.3f}")
    state = {}
    if (out / "wm_eval_rwml_state.triplets.jsonl").is_file():
        gain = rwml_minus("before", "state", "exact")
        over = rwml_minus("template", "state", "exact")
        copy = rwml_minus("rule_copy", "state", "exact", lambda t: t.get("probe") in CHANGES)
        state = dict(gain=gain, rule=over, copy=copy)
        lines.append(f"(f) state probes ({gain['n']} triplets, {gain['units']} games), exact "
                     f"match: RWML - {name} {said(gain)}; RWML {over['after']:.3f} - the rule "
                     f"{over['before']:.3f}: {said(over)}; after a take or a put ({copy['n']}), "
                     f"RWML {copy['after']:.3f} - rule + copy {copy['before']:.3f}: {said(copy)}")
    for kind in HELDOUT_KINDS if (out / "wm_eval_coin_explore.triplets.jsonl").is_file() else ():
        r, c = (rwml_minus("coin", kind, k) for k in ("rewards", "exact"))
        lines.append(f"(e) held-out {kind}, RWML {c['after']:.3f} - the matched COIN arm "
                     f"{c['before']:.3f} (exact match): {said(c)}; reward {said(r)}")
    return lines + [world_model_verdict(a, both, rule, state)]


def world_model_verdict(a: dict, both: dict, rule: dict, state: dict | None = None) -> str:
    """The last line: did training raise (a) and held-out exact match (b), never whether the reward
    did; a world model above the rule where RWML - the rule holds on every kind."""
    def ci(c: dict) -> str:
        return f"{c['diff']:+.3f} [{c['lo']:+.3f}, {c['hi']:+.3f}]"
    trained, held = (bool(c.get("ci")) and stats.verdict(c) == "holds" for c in (a, both))
    pa, pb = f"(a) {ci(a)}", f"(b) both kinds pooled, exact match {ci(both)}"
    where = "the reward where RWML trained"
    line = "verdict: " + (
        f"training raised {where} ({pa}) and held-out accuracy ({pb})" if trained and held else
        f"training raised held-out accuracy ({pb}); {where}: not shown ({pa})" if held else
        f"training raised {where} ({pa}); held-out accuracy: not shown ({pb})" if trained else
        f"not shown that training raised {where} ({pa}) or held-out accuracy ({pb})")
    line += ("; not shown, and one run cannot show, that the reward did it rather than GRPO with "
             "any reward (GRPO with a coin for a reward passed both on a fresh seed; over seeds: "
             "lab/over_seeds.sh); ")
    each = ", ".join(f"{k} {ci(c)}" for k, c in rule.items())
    above = all(stats.verdict(c) == "holds" for c in rule.values())
    line += ("this run shows a world model above the content-free template rule (RWML - the "
             f"rule, exact match, holds on every held-out kind: {each})" if above else
             "this run shows no world model above the content-free template rule (RWML - the "
             f"rule, exact match: {each}): what it learned, the rule's 25 lines already say")
    return line + (state_words(state) if state else "")


def state_words(s: dict) -> str:
    """What the world model knows of the room beyond the rule's sentences, from the state probes."""
    beyond, changed = (stats.verdict(s[k]) == "holds" for k in ("rule", "copy"))
    tracks = ("it writes the state the prompt holds beyond the rule's sentences" if beyond else
              "it writes no more of the state the prompt holds than the rule's sentences")
    changes = ("and what a take or a put changed beyond copying the last listing" if changed else
               "and not what a take or a put changed beyond copying the last listing")
    return (f"; on the state probes (exact match RWML {s['rule']['after']:.3f}, the rule "
            f"{s['rule']['before']:.3f}, the tracker 1.000) {tracks}, {changes}")


def main(argv: list[str] | None = None) -> None:
    """`python -m readout RUN [RUN ...]`: each run folder's lines (a)-(f) and its verdict."""
    p = argparse.ArgumentParser("python -m readout", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", metavar="RUN", type=Path, help="a `python train.py` --out")
    runs = p.parse_args(argv).runs
    for run in runs:
        try:
            warmup = json.loads((run / "config.json").read_text())["warmup"]
            (run / "wm_eval_rwml_train.triplets.jsonl").stat()  # RWML scored: the run finished
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"{run} holds no finished `python train.py` run ({str(e)[:80]}); give "
                            "the --out folder of one (rerun an unfinished one)") from None
        print(f"{run}:\n" * (len(runs) > 1) + "\n".join(gain_lines(run, warmup)), flush=True)
