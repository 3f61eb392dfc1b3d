"""Support (skip on a first read): what the default run (`python train.py`, train.train_all) concludes, read
from its per-triplet files (wm_eval_*.triplets.jsonl): the before / after line per held-out kind, the
content-free baselines' line, the paired differences (a)-(e) with their CIs (`gain_lines`), the verdict in
words, and the adapter's card; the reward's controls (MIS, COIN: `reward_control`) and the matched COIN arm
of --coin-control (one arm decides nothing).

Imports the environments (the baselines, the breakdown by kind), the reward's controls, the statistics, the
cards and runs.py; never rwml or train.py (coin_control gets train.py's RWML as an argument).
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import envs
from integrations.runs import triplet_key
from support import cost, engine, stats
from support.cards import TRIPLETS_KEPT, plot_rewards, write_card
from reward import coin_reward, mis_targets
from support.common import UserError, read_jsonl, write_atomic
from support.plumbing import swap_checkpoint, write_eval

HELDOUT_KINDS = ("explore", "purposeful")  # this collection policy's triplets; the expert walkthroughs'


def reward_control(cfg, triplets: list[dict], reward_fn, out: Path, coin_seed: int | None = None):
    """(triplets, reward function) under a control: MIS (another triplet's target) or COIN (a fair coin,
    seeded by `coin_seed`, else the run's seed)."""
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
    """The matched COIN arm (issue 56): RWML's recipe with a fair coin for a reward, from the same warm-up, on
    the same prompts in the same batches with the same sampling seed, scored on the same held-out triplets
    (wm_eval_coin_<kind>), line (e), `--coin-control`. One arm's coin moves too far from run to run to decide
    anything (a coin run passed RWML - COIN: lab/results/fresh_seeds). Resumes as `all` does. `train_wm`,
    `evaluate`: train.py's RWML and its held-out scoring."""
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


def baselines_line(cfg, out: Path, kind: str, trips: list[dict], file: str, reward_fn) -> None:
    """The content-free baselines on a held-out set: wm_eval_<rule>_<kind>.json each, and one line."""
    rules = {name: baseline_wm(name, trips, reward_fn) for name in envs.BASELINES}
    for name, r in rules.items():
        write_eval(out / f"wm_eval_{name}_{kind}.json", dict(r, split=cfg.heldout_split, transitions=file))
    print(f"{kind} ({file}): content-free baselines: template rule {rules['template']['wm_accuracy']:.3f}, "
          f"always \"Nothing happens.\" {rules['nothing']['wm_accuracy']:.3f}, copy the observation "
          f"{rules['copy']['wm_accuracy']:.3f}")


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


# What `python train.py` prints last: differences of per-triplet means (a triplet's predictions averaged),
# read from a run's per-triplet files (wm_eval_*.triplets.jsonl), paired by triplet, each with a 95 % CI over
# games (stats.py), the items that changed each way and two exact tests beside it (few items change: the
# bootstrap alone is then coarse), and the CI's half-width.
def compare(out: Path, arm: str, base: str, kind: str | tuple, key: str, rows=None) -> dict:
    """`arm` - `base` on held-out set(s) `kind` (wm_eval_<arm>_<kind>.triplets.jsonl; kinds pooled share their
    games), paired by triplet; `rows` keeps a subset of the base's rows (e.g. the targets the rule misses)."""
    pairs = []
    for kind in (kind,) if isinstance(kind, str) else kind:
        x, y = (read_jsonl(out / f"wm_eval_{w}_{kind}.triplets.jsonl") for w in (arm, base))
        by_key = {json.dumps(triplet_key(r)): r for r in x}
        if len(by_key) != len(x) or sorted(by_key) != sorted(json.dumps(triplet_key(r)) for r in y):
            raise UserError(f"wm_eval_{arm}_{kind} and wm_eval_{base}_{kind} in {out} are not scores of the "
                            "same triplets: score both on one transitions file")
        pairs += [(by_key[json.dumps(triplet_key(r))], r) for r in y if rows is None or rows(r)]
    mean = [[sum(map(float, r[key])) / len(r[key]) for r in side] for side in zip(*pairs)] or [[], []]
    games = [str(b["game"]) for _, b in pairs]
    ci = stats.paired_bootstrap(*mean, games) if pairs else None
    return dict(ci or {}, ci=ci, n=len(pairs), before=sum(mean[1]) / max(len(pairs), 1),
                after=sum(mean[0]) / max(len(pairs), 1), **stats.exact_tests(*mean, games))


def said(c: dict) -> str:
    """A paired difference in words: the estimate, its 95 % CI over games, the verdict, the items that changed
    each way, the exact tests, the CI's half-width."""
    if not c["n"]:
        return "no triplets"
    return (f"{c['diff']:+.3f} [{c['lo']:+.3f}, {c['hi']:+.3f}] {stats.verdict(c)}; {c['up']} up, "
            f"{c['down']} down (exact: sign-flip over games p {c['p_games']:.3f}, McNemar p "
            f"{c['p_items']:.3f}); CI half-width {(c['hi'] - c['lo']) / 2:.3f}")


def gain_lines(out: Path, start) -> list[str]:
    """(a) the sim-to-real reward on RWML's own training prompts, before -> after: whether training followed
    the reward; (b) held-out RWML - start per kind and both kinds pooled, reward and exact match: what it
    generalised; (c) RWML - the content-free template rule: whether it is a world model at all; (d) beyond the
    rule, the targets whose answer the prompt holds; (e) RWML - the matched COIN arm (`--coin-control`); then
    the verdict in words (`world_model_verdict`)."""
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
        lines.append(f"(c) held-out {kind}, RWML {rule[kind]['after']:.3f} - the template rule "
                     f"{rule[kind]['before']:.3f} (exact match): {said(rule[kind])}; reward {said(r)}")
    def held(t):  # rows written before the tracker: its complement was unseen_objects
        return t.get("tracker_hit", not t["unseen_objects"])
    for kind in HELDOUT_KINDS:
        shown, unseen = (compare(out, "rwml", "before", kind, "exact",
                                 rows=lambda t, h=h: not t["template_hit"] and held(t) == h)
                         for h in (True, False))
        lines.append(f"(d) held-out {kind}, the rule's misses whose answer the prompt holds (the "
                     f"state tracker reproduces it) ({shown['n']}): RWML - {name}, exact match "
                     f"{said(shown)}; the others, which the prompt does not determine "
                     f"({unseen['n']}): {name} {unseen['before']:.3f}, RWML {unseen['after']:.3f}")
    for kind in HELDOUT_KINDS if (out / "wm_eval_coin_explore.triplets.jsonl").is_file() else ():
        r, c = (compare(out, "rwml", "coin", kind, k) for k in ("rewards", "exact"))
        lines.append(f"(e) held-out {kind}, RWML {c['after']:.3f} - the matched COIN arm {c['before']:.3f} "
                     f"(exact match): {said(c)}; reward {said(r)}")
    return lines + [world_model_verdict(a, both, rule)]


def world_model_verdict(a: dict, both: dict, rule: dict) -> str:
    """The last line (issue 56). First half: did training raise (a) and held-out exact match, both kinds
    pooled (b); never whether the reward rather than GRPO on its own samples did: a coin passed both on fresh
    seed 52; seeds paired with coin runs say it (lab/verdict_designs.py --pairs). Second half: a world model
    above the content-free rule where RWML - the rule holds on every kind; a rule copy and a flip fail."""
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
    line += ("; not shown, and one run cannot show, that the reward rather than self-training on its own "
             "samples did it (a coin-reward run passed both on a fresh seed; over seeds: README); ")
    each = ", ".join(f"{k} {ci(c)}" for k, c in rule.items())
    return line + ("this run shows a world model above the content-free template rule (RWML - the rule, "
                   f"exact match, holds on every held-out kind: {each})" if all(
                       stats.verdict(c) == "holds" for c in rule.values()) else
                   "this run shows no world model above the content-free template rule (RWML - the rule, "
                   f"exact match: {each}): what it learned, the rule's 25 lines already say")


def all_summary(cfg, out: Path, lines: list[str], held: dict[str, str], kept: int, start, t0: float) -> None:
    """`all`'s end: the adapter's card (each held-out kind's line, the template rule's beside), and the gain
    lines, the verdict, its time and its folder."""
    rule = {k: json.loads((out / f"wm_eval_template_{k}.json").read_text())["wm_accuracy"] for k in held}
    write_card(out / "adapter", cfg, "all", data={TRIPLETS_KEPT: kept},
               bundled=cfg.model == engine.BUNDLED_MODEL,
               heldout=[f"held-out {k} ({cfg.heldout_split}, {cfg.heldout_games} games), before = "
                        f"{'the warm-up' if start else 'the base model'}: the content-free template rule "
                        f"{rule[k]:.3f}, {line}" for k, line in held.items()] + lines[-1:])
    plot_rewards(out / "metrics.jsonl", out / "reward_curve.png", "RWML world-model GRPO")  # + before / after
    print("\n".join(lines) + f"\n{(time.time() - t0) / 60:.1f} min -> {out} (per-triplet outputs: "
          f"{out}/wm_eval_*.triplets.jsonl)")
