"""What the default run concludes, read from its per-triplet files (wm_eval_*.triplets.jsonl): the
before / after lines, the content-free baselines', the paired differences (a)-(f) with their CIs
(`gain_lines`), the verdict in words; the reward's controls and the matched COIN arm. Never imports
rwml or train.py (coin_control gets train.py's RWML as an argument)."""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import envs
from stages.runs import triplet_key
import engine
from harness import cost
from readout import stats
from stages.cards import TRIPLETS_KEPT, plot_rewards, write_card
from reward import coin_reward, mis_targets
from harness.common import UserError, read_jsonl, write_atomic
from stages.plumbing import swap_checkpoint, write_eval

HELDOUT_KINDS = ("explore", "purposeful")  # this collection policy's triplets; the expert walkthroughs'


def reward_control(cfg, triplets: list[dict], reward_fn, out: Path, coin_seed: int | None = None):
    """(triplets, reward function) under a control: MIS (another triplet's target), COIN (a fair
    coin, `coin_seed`) or TEMPLATE (the rule's sentence)."""
    if cfg.reward_control == "template":
        return [dict(t, next_obs=envs.template_prediction(t["action"])) for t in triplets], reward_fn
    if cfg.reward_control == "mis":
        targets, unchanged = mis_targets([t["next_obs"] for t in triplets], cfg.seed)
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(out / "mis.json",
                     json.dumps(dict(unchanged_share=unchanged, num_triplets=len(triplets)), indent=2))
        print(f"mis: {unchanged:.1%} of triplets keep a target equal to their own (one text is over half "
              "of all)")
        return [dict(t, next_obs=x) for t, x in zip(triplets, targets)], reward_fn
    if cfg.reward_control == "coin":
        return triplets, coin_reward(cfg.seed if coin_seed is None else coin_seed)
    return triplets, reward_fn


COIN_STREAM = 1_000_003  # the matched COIN arm's coin: seed + this, so a coin run's control is another coin


def coin_control(cfg, out: Path, load, reward_fn, start, model, kept: list[dict], heldout: dict, train_wm,
                 evaluate) -> None:
    """`--coin-control`, line (e): RWML's recipe, a fair coin for its reward, matched in all else.
    One arm decides nothing (a coin run passed RWML - COIN on fresh seeds)."""
    model.unload()  # the bare base model again: the control starts from the warm-up as RWML did
    ctrl = out / "coin_control"
    ctrl.mkdir(parents=True, exist_ok=True)
    with cost.stage("coin control grpo"):
        arm = train_wm(dataclasses.replace(cfg, reward_control="coin", eval_steps=0,
                                           resume=cfg.resume or swap_checkpoint(ctrl / "checkpoint")),
                       kept, ctrl, load, reward_fn, start, coin_seed=cfg.seed + COIN_STREAM)
    for kind in HELDOUT_KINDS:
        with cost.stage("coin control eval"):
            write_eval(out / f"wm_eval_coin_{kind}.json",
                       dict(evaluate(cfg, arm, load()[1], heldout[kind]["triplets"], reward_fn),
                            model="COIN (matched)", split=cfg.heldout_split,
                            transitions=heldout[kind]["file"]))
    arm.unload()


def baseline_wm(name: str, triplets: list[dict], reward_fn) -> dict:
    """A content-free baseline (`envs.baseline_prediction`: template, nothing, copy) scored as a model is."""
    preds = [f"<next_state>{envs.baseline_prediction(name, t)}</next_state>" for t in triplets]
    return dict(envs.score_wm(triplets, preds, reward_fn), samples=0, temperature=0.0, model=name)


BASELINE_NAMES = dict(template="template rule", nothing="always \"Nothing happens.\"",
                      copy="copy the observation", rule_copy="rule + copy the last listing seen",
                      tracker="the prompt's state tracker")


def baselines_line(cfg, out: Path, kind: str, trips: list[dict], file: str, reward_fn) -> None:
    """The model-free baselines on a held-out set: wm_eval_<rule>_<kind>.json each, and one line."""
    rules = {name: baseline_wm(name, trips, reward_fn) for name in envs.BASELINES}
    for name, r in rules.items():
        write_eval(out / f"wm_eval_{name}_{kind}.json", dict(r, split=cfg.heldout_split, transitions=file))
    print(f"{kind} ({file}): model-free baselines, reward / exact match: " + ", ".join(
        f"{BASELINE_NAMES[n]} {r['wm_accuracy']:.3f} / {r['exact_match']:.3f}" for n, r in rules.items()))


PROBE_ARMS = ("template", "rule_copy", "tracker")
CHANGES = ("take_revisit", "put_revisit")  # what a take or a put changed: rule + copy cannot say it


def probe_line(out: Path, start) -> str:
    """The state probes by type: start -> RWML, beside the rule, rule + copy, the tracker."""
    got = {a: json.loads((out / f"wm_eval_{a}_state.json").read_text())
           for a in ("before", "rwml", *PROBE_ARMS)}
    types = list(got["rwml"].get("per_probe", {}))

    def cell(p: str | None) -> str:
        r = {a: (g["per_probe"][p] if p else g) for a, g in got.items()}
        arms = ", ".join(f"{r[a]['exact_match']:.2f}" for a in PROBE_ARMS)
        return (f"{p or 'all'} ({r['rwml']['n']}) {r['before']['exact_match']:.2f} -> "
                f"{r['rwml']['exact_match']:.2f} | {arms}")
    name = "the warm-up" if start else "the base model"
    return (f"state probes, exact match by type: {name} -> RWML | the rule, rule + copy, the tracker: "
            + "; ".join(cell(p) for p in [*types, None]))


def before_after_line(before: dict, after: dict) -> str:
    change_b, change_a = before["per_kind"]["change"], after["per_kind"]["change"]
    beyond_b, beyond_a = before["per_kind"]["beyond_template"], after["per_kind"]["beyond_template"]
    return (f"world-model accuracy {before['wm_accuracy']:.3f} -> {after['wm_accuracy']:.3f} "
            f"({before['n']} triplets); without \"Nothing happens.\" {change_b['wm_accuracy']:.3f} -> "
            f"{change_a['wm_accuracy']:.3f} ({change_b['n']}); beyond the template rule "
            f"{beyond_b['wm_accuracy']:.3f} -> {beyond_a['wm_accuracy']:.3f} ({beyond_b['n']}); mean cosine "
            f"{before['mean_cosine']:.3f} -> {after['mean_cosine']:.3f}; strict: exact match "
            f"{before['exact_match']:.3f} -> {after['exact_match']:.3f}, item F1 {_f1(before)} -> "
            f"{_f1(after)} ({before['item_n']} listing targets)")


def _f1(r: dict) -> str:
    return "-" if r.get("item_f1") is None else f"{r['item_f1']:.3f}"


# What `python train.py` prints last: differences of per-triplet means (a triplet's predictions averaged)
def compare(out: Path, arm: str, base: str, kind: str | tuple, key: str, rows=None) -> dict:
    """`arm` - `base` on held-out set(s) `kind` (wm_eval_<arm>_<kind>.triplets.jsonl; kinds pooled share their
    games), paired by triplet; `rows` keeps a subset of the base's rows (e.g. the targets the rule misses)."""
    pairs = []
    for kind in (kind,) if isinstance(kind, str) else kind:
        x, y = (scored_rows(out / f"wm_eval_{w}_{kind}.triplets.jsonl", key, rows) for w in (arm, base))
        by_key = {json.dumps(triplet_key(r)): r for r in x}
        if len(by_key) != len(x) or sorted(by_key) != sorted(json.dumps(triplet_key(r)) for r in y):
            raise UserError(f"{out}/wm_eval_{arm}_{kind}.triplets.jsonl and wm_eval_{base}_{kind}.triplets"
                            f".jsonl are not scores of the same triplets (one cut or edited); {AGAIN}")
        pairs += [(by_key[json.dumps(triplet_key(r))], r) for r in y if rows is None or rows(r)]
    mean = [[sum(map(float, r[key])) / len(r[key]) for r in side] for side in zip(*pairs)] or [[], []]
    games = [str(b["game"]) for _, b in pairs]
    ci = stats.paired_bootstrap(*mean, games) if pairs else None
    return dict(ci or {}, ci=ci, n=len(pairs), before=sum(mean[1]) / max(len(pairs), 1),
                after=sum(mean[0]) / max(len(pairs), 1))


AGAIN = ("delete the wm_eval_* files named and rerun the `python train.py` that wrote them, with the same "
         "settings: it scores them again")


def scored_rows(path: Path, key: str, rows=None) -> list[dict]:
    """A per-triplet file's rows, each with its game and a non-empty list of numbers `key` (and what the
    subset `rows` reads), or a line naming the file: a row cut or edited by hand is no score."""
    need = ("template_hit", "unseen_objects") if rows else ()
    for n, r in enumerate(found := read_jsonl(path), 1):
        v = r.get(key) if isinstance(r, dict) else None
        if not (isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v)) or any(
                k not in r for k in ("game", *need)):
            raise UserError(f"{path}, row {n}: not a score (a non-empty list of numbers {key!r}, a game"
                            + "".join(f", {k}" for k in need) + f"); {AGAIN}")
    return found


def said(c: dict) -> str:
    """A paired difference in words (stats.said): the estimate, its 95 % CI over games, the verdict, the items
    that changed each way, the sign-flip test over games."""
    return stats.said(c) if c["n"] else "no triplets"


def gain_lines(out: Path, start) -> list[str]:
    """(a) the reward on RWML's own prompts; (b) held-out RWML - start; (c) RWML - the template
    rule; (d) beyond the rule; (f) the state probes; (e) RWML - COIN; the verdict in words."""
    a, strict = (compare(out, "rwml", "before", "train", k) for k in ("rewards", "exact"))
    name = "the warm-up" if start else "the base model"
    lines = [f"(a) the sim-to-real reward on RWML's own {a['n']} training prompts ({a['units']} games): "
             f"{name} {a['before']:.3f} -> RWML {a['after']:.3f}, {said(a)} (95 % CI over games); exact "
             f"match {strict['before']:.3f} -> {strict['after']:.3f}, {said(strict)}"]
    rule, both = {}, compare(out, "rwml", "before", HELDOUT_KINDS, "exact")
    for kind in HELDOUT_KINDS:
        r, e = compare(out, "rwml", "before", kind, "rewards"), compare(out, "rwml", "before", kind, "exact")
        lines.append(f"(b) held-out {kind}, RWML - {name} ({r['n']} triplets, {r['units']} games): reward "
                     f"{said(r)}; exact match {said(e)}")
    lines.append(f"(b) held-out, both kinds pooled ({both['n']} triplets), exact match: {said(both)}")
    if not all((out / f"wm_eval_template_{k}.triplets.jsonl").is_file() for k in HELDOUT_KINDS):
        return lines  # a run scored without the baselines (a lab re-score of (a), (b) alone)
    for kind in HELDOUT_KINDS:
        r, rule[kind] = (compare(out, "rwml", "template", kind, k) for k in ("rewards", "exact"))
        same = (r["diff"], r["lo"], r["hi"]) == (rule[kind]["diff"], rule[kind]["lo"], rule[kind]["hi"])
        lines.append(f"(c) held-out {kind}, RWML {rule[kind]['after']:.3f} - the template rule "
                     f"{rule[kind]['before']:.3f} (exact match): {said(rule[kind])}; reward "
                     + ("the same" if same else said(r)))

    for kind in HELDOUT_KINDS:
        if "tracker_hit" not in (read_jsonl(out / f"wm_eval_before_{kind}.triplets.jsonl")[:1] or [{}])[0]:
            lines.append(f"(d) held-out {kind}: not split, its rows were scored before the state tracker")
            continue  # the older split (unseen_objects) counted "you see nothing" as in the prompt
        shown, unseen = (compare(out, "rwml", "before", kind, "exact",
                                 rows=lambda t, h=h: not t["template_hit"] and t["tracker_hit"] == h)
                         for h in (True, False))
        lines.append(f"(d) held-out {kind}, the rule's misses whose answer the prompt holds (the "
                     f"state tracker reproduces it) ({shown['n']}): RWML - {name}, exact match "
                     f"{said(shown)}; the others, which the prompt does not determine "
                     f"({unseen['n']}): {name} {unseen['before']:.3f}, RWML {unseen['after']:.3f}")
    state = {}
    if (out / "wm_eval_rwml_state.triplets.jsonl").is_file():
        state = dict(gain=compare(out, "rwml", "before", "state", "exact"),
                     rule=compare(out, "rwml", "template", "state", "exact"),
                     copy=compare(out, "rwml", "rule_copy", "state", "exact",
                                  rows=lambda t: t.get("probe") in CHANGES))
        lines.append(f"(f) state probes ({state['gain']['n']} triplets, {state['gain']['units']} games), "
                     f"exact match: RWML - {name} {said(state['gain'])}; RWML {state['rule']['after']:.3f} - "
                     f"the rule {state['rule']['before']:.3f}: {said(state['rule'])}; after a take or a put "
                     f"({state['copy']['n']}), RWML {state['copy']['after']:.3f} - rule + copy "
                     f"{state['copy']['before']:.3f}: {said(state['copy'])}")
    for kind in HELDOUT_KINDS if (out / "wm_eval_coin_explore.triplets.jsonl").is_file() else ():
        r, c = (compare(out, "rwml", "coin", kind, k) for k in ("rewards", "exact"))
        lines.append(f"(e) held-out {kind}, RWML {c['after']:.3f} - the matched COIN arm {c['before']:.3f} "
                     f"(exact match): {said(c)}; reward {said(r)}")
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
    line += ("; not shown, and one run cannot show, that the reward did it rather than GRPO with any reward "
             "(GRPO with a coin for a reward passed both on a fresh seed; over seeds: lab/over_seeds.sh); ")
    each = ", ".join(f"{k} {ci(c)}" for k, c in rule.items())
    return line + ("this run shows a world model above the content-free template rule (RWML - the rule, "
                   f"exact match, holds on every held-out kind: {each})" if all(
                       stats.verdict(c) == "holds" for c in rule.values()) else
                   "this run shows no world model above the content-free template rule (RWML - the rule, "
                   f"exact match: {each}): what it learned, the rule's 25 lines already say") + (
                       state_words(state) if state else "")


def state_words(s: dict) -> str:
    """What the world model knows of the room beyond the rule's sentences, from the state probes."""
    def held(c):
        return stats.verdict(c) == "holds"
    tracks = ("it writes the state the prompt holds beyond the rule's sentences" if held(s["rule"]) else
              "it writes no more of the state the prompt holds than the rule's sentences")
    changes = ("and what a take or a put changed beyond copying the last listing" if held(s["copy"]) else
               "and not what a take or a put changed beyond copying the last listing")
    return (f"; on the state probes (exact match RWML {s['rule']['after']:.3f}, the rule "
            f"{s['rule']['before']:.3f}, the tracker 1.000) {tracks}, {changes}")


def all_summary(cfg, out: Path, lines: list[str], held: dict[str, str], kept: int, start, t0: float) -> str:
    """`all`'s end: the adapter's card (each held-out kind's line, the template rule's beside), and the gain
    lines, its time and its folder. Returns the verdict: the run's last line, after the cost line."""
    rule = {k: json.loads((out / f"wm_eval_template_{k}.json").read_text())["wm_accuracy"] for k in held}
    write_card(out / "adapter", cfg, "all", data={TRIPLETS_KEPT: kept},
               bundled=cfg.model == engine.BUNDLED_MODEL,
               heldout=[f"held-out {k} ({cfg.heldout_split}, {cfg.heldout_games} games), before = "
                        f"{'the warm-up' if start else 'the base model'}: the content-free template rule "
                        f"{rule[k]:.3f}, {line}" for k, line in held.items()] + lines[-1:])
    plot_rewards(out / "metrics.jsonl", out / "reward_curve.png", "RWML world-model GRPO")  # + before / after
    print("\n".join(lines[:-1]) + f"\n{(time.time() - t0) / 60:.1f} min -> {out} (per-triplet outputs: "
          f"{out}/wm_eval_*.triplets.jsonl)")
    return lines[-1]
