"""What the default run concludes from its per-triplet files (wm_eval_*.triplets.jsonl): the
before / after lines, the baselines', the paired differences (a)-(f) with CIs (`gain_lines`), the
verdict in words; the reward's controls. Never imports rwml or train.py."""
from __future__ import annotations

import json
import time
from pathlib import Path

import envs
from stages.runs import triplet_key
import engine
from readout import stats
from stages.cards import TRIPLETS_KEPT, plot_rewards, write_card
from reward import coin_reward, mis_targets
from harness.common import read_jsonl, write_atomic
from envs import UserError
from stages.plumbing import write_eval

HELDOUT_KINDS = ("explore", "purposeful")  # the collection policy's triplets; the walkthroughs'


def reward_control(cfg, triplets: list[dict], reward_fn, out: Path, coin_seed: int | None = None):
    """(triplets, reward function) under a control: MIS (another triplet's target), COIN (a fair
    coin, `coin_seed`) or TEMPLATE (the rule's sentence)."""
    if cfg.reward_control == "template":
        triplets = [dict(t, next_obs=envs.template_prediction(t["action"])) for t in triplets]
    elif cfg.reward_control == "mis":
        targets, unchanged = mis_targets([t["next_obs"] for t in triplets], cfg.seed)
        out.mkdir(parents=True, exist_ok=True)
        info = dict(unchanged_share=unchanged, num_triplets=len(triplets))
        write_atomic(out / "mis.json", json.dumps(info, indent=2))
        print(f"mis: {unchanged:.1%} of triplets keep a target equal to their own (one text is "
              "over half of all)")
        triplets = [dict(t, next_obs=x) for t, x in zip(triplets, targets)]
    elif cfg.reward_control == "coin":
        return triplets, coin_reward(cfg.seed if coin_seed is None else coin_seed)
    return triplets, reward_fn


def baseline_wm(name: str, triplets: list[dict], reward_fn) -> dict:
    """A content-free baseline (`envs.baseline_prediction`) scored as a model is."""
    preds = [f"<next_state>{envs.baseline_prediction(name, t)}</next_state>" for t in triplets]
    return dict(envs.score_wm(triplets, preds, reward_fn), samples=0, temperature=0.0, model=name)


BASELINE_NAMES = dict(template="template rule", nothing="always \"Nothing happens.\"",
                      copy="copy the observation", rule_copy="rule + copy the last listing seen",
                      tracker="the prompt's state tracker")


def baselines_line(cfg, out: Path, kind: str, trips: list[dict], file: str, reward_fn) -> None:
    """The model-free baselines on a held-out set: wm_eval_<rule>_<kind>.json each, and one line."""
    rules = {name: baseline_wm(name, trips, reward_fn) for name in envs.BASELINES}
    for name, r in rules.items():
        write_eval(out / f"wm_eval_{name}_{kind}.json",
                   dict(r, split=cfg.heldout_split, transitions=file))
    each = (f"{BASELINE_NAMES[n]} {r['wm_accuracy']:.3f} / {r['exact_match']:.3f}"
            for n, r in rules.items())
    print(f"{kind} ({file}): model-free baselines, reward / exact match: " + ", ".join(each))


PROBE_ARMS = ("template", "rule_copy", "tracker")
CHANGES = ("take_revisit", "put_revisit")  # what a take or a put changed: rule + copy cannot say it


def probe_line(out: Path, start) -> str:
    """The state probes by type: start -> RWML, beside the rule, rule + copy, the tracker."""
    got = {a: json.loads((out / f"wm_eval_{a}_state.json").read_text())
           for a in ("before", "rwml", *PROBE_ARMS)}

    def cell(p: str | None) -> str:
        r = {a: (g["per_probe"][p] if p else g) for a, g in got.items()}
        arms = ", ".join(f"{r[a]['exact_match']:.2f}" for a in PROBE_ARMS)
        return (f"{p or 'all'} ({r['rwml']['n']}) {r['before']['exact_match']:.2f} -> "
                f"{r['rwml']['exact_match']:.2f} | {arms}")
    name = "the warm-up" if start else "the base model"
    return (f"state probes, exact match by type: {name} -> RWML | the rule, rule + copy, the "
            "tracker: " + "; ".join(cell(p) for p in [*got["rwml"].get("per_probe", {}), None]))


def before_after_line(before: dict, after: dict) -> str:
    change_b, change_a = before["per_kind"]["change"], after["per_kind"]["change"]
    beyond_b, beyond_a = before["per_kind"]["beyond_template"], after["per_kind"]["beyond_template"]
    return (f"world-model accuracy {before['wm_accuracy']:.3f} -> {after['wm_accuracy']:.3f} "
            f'({before["n"]} triplets); without "Nothing happens." {change_b["wm_accuracy"]:.3f} '
            f"-> {change_a['wm_accuracy']:.3f} ({change_b['n']}); beyond the template rule "
            f"{beyond_b['wm_accuracy']:.3f} -> {beyond_a['wm_accuracy']:.3f} ({beyond_b['n']}); "
            f"mean cosine {before['mean_cosine']:.3f} -> {after['mean_cosine']:.3f}; strict: exact "
            f"match {before['exact_match']:.3f} -> {after['exact_match']:.3f}, item F1 "
            f"{_f1(before)} -> {_f1(after)} ({before['item_n']} listing targets)")


def _f1(r: dict) -> str:
    return "-" if r.get("item_f1") is None else f"{r['item_f1']:.3f}"


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


def all_summary(cfg, out: Path, lines: list[str], held: dict[str, str], kept: int, start,
                t0: float) -> str:
    """`all`'s end: the adapter's card (each held-out kind's line, the template rule's beside), the
    gain lines, time and folder. Returns the verdict: the run's last line, after the cost line."""
    rule = {k: json.loads((out / f"wm_eval_template_{k}.json").read_text()) for k in held}
    cards = [f"held-out {k} ({cfg.heldout_split}, {cfg.heldout_games} games), before = "
             f"{'the warm-up' if start else 'the base model'}: the content-free template rule "
             f"{rule[k]['wm_accuracy']:.3f}, {line}" for k, line in held.items()]
    write_card(out / "adapter", cfg, "all", data={TRIPLETS_KEPT: kept},
               bundled=cfg.model == engine.BUNDLED_MODEL, heldout=cards + lines[-1:])
    plot_rewards(out / "metrics.jsonl", out / "reward_curve.png", "RWML world-model GRPO")
    print("\n".join(lines[:-1]) + f"\n{(time.time() - t0) / 60:.1f} min -> {out} (per-triplet "
          f"outputs: {out}/wm_eval_*.triplets.jsonl)")
    return lines[-1]
