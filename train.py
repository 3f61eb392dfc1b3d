"""RWML training: one function per stage in the paper's order (METHOD.md §N), and what each prints.

    python train.py                      # the default run (stage `all`) on the bundled defaults
    python train.py collect --num-games 50 --rollouts-per-game 3 --max-turns 30 --out runs/collect
    python train.py wm --transitions runs/collect/transitions.jsonl --max-steps 200 --out runs/wm
    python train.py wm-sft --transitions runs/collect/transitions.jsonl --out runs/wm_sft
    python train.py policy --init rwml --adapter runs/wm/adapter --num-games 8 --out runs/policy

Settings: stages/settings.py, each a flag and a --config key (flags win). Read top to bottom: the
shared parts, a section per stage, `main`. A run's verdict: `python -m readout runs/rwml`."""
from __future__ import annotations

import dataclasses
import functools
import json
import random
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

import engine
import envs
import rwml
from reward import make_reward, reward_control
from eval import HELDOUT_KINDS, baselines_line, before_after_line, probe_line
from caches import heldout_restore, heldout_store
from stages.runs import (WARMUP_STREAM, check_stage, claim_out, collection_summary, collection_todo,
                          filter_cache, kind_mix, log_groups, more_warmup, policy_eval_games,
                          releases_locks, save_checkpoint, save_easiness, save_filter,
                          scores_before, settle_env, split_games, stage_inputs, start_run,
                          swap_checkpoint, telling, walkthroughs, warmup_games, wm_row)
from harness.cli import parse_stage, run_cli
from harness.common import read_jsonl, write_atomic
from envs import RERUN, UserError
from stages.plumbing import (check_io, check_run, close_tracker, config_json, filter_dir,
                             jsonl_writer, keep_rng, log_row, run_header, sample_triplets,
                             triplet_problem, use_4bit, write_eval)
from stages.settings import STAGES, Settings  # every setting: its flag, default
import cost
from cards import (CONTROLS, TRIPLETS_KEPT, card_run, plot_rewards, save_adapter,
                          write_card)

# ------------------------------------ the stages' shared parts: how the agent plays, the triplets
def play_kwargs(cfg) -> dict:  # `rwml.play`'s settings
    return dict(history_len=cfg.history_len, temperature=cfg.temperature, top_p=cfg.top_p,
                max_new_tokens=cfg.max_new_tokens, num_envs=cfg.num_envs,
                actor=envs.load(rwml.ACTORS[cfg.action_mode]))


def make_env(cfg, episodes: int | None = None):
    """The environment (tau2: and its customer, --user-model); at most one game worker per game."""
    return envs.make(cfg.env, domain=cfg.domain, num_workers=cfg.num_workers,
                     max_turns=cfg.max_turns, user_model=cfg.user_model,
                     at_once=None if episodes is None else min(cfg.num_envs, episodes))


# ------------------------------ §2 collect: the model plays the train games; every turn a triplet
def collect(cfg: Settings, out: Path, load, games: list | None = None) -> Path:
    """The model plays; a triplet per turn to `transitions.jsonl` as it happens (reruns resume)."""
    games = games or split_games(cfg)  # bad data or split fails before the model loads
    out.mkdir(parents=True, exist_ok=True)
    if cfg.walkthrough:
        return walkthroughs(cfg, out, games)
    todo, done = collection_todo(cfg, out, games)
    transitions = out / "transitions.jsonl"
    if todo:
        torch.manual_seed(cfg.seed + done)  # a resumed run does not replay the same samples
        with make_env(cfg, len(todo)) as env, open(transitions, "a") as ft, \
                open(out / "episodes.jsonl", "a") as fe:
            model, tok = load()  # after make_env: ALFWorld's game workers fork without the model
            rwml.play(model, tok, env, todo, **play_kwargs(cfg), on_turn=jsonl_writer(ft),
                      on_episode=jsonl_writer(fe), explore_prob=cfg.explore_prob,
                      seed=cfg.seed + done, desc="collect")
    collection_summary(cfg, out)
    return transitions


def cached_collect(cfg: Settings, out: Path, load, what: str = "the held-out explore triplets",
                   games: list | None = None) -> Path:
    """`collect`, played once per caches.heldout_key, then copied whole from the cache."""
    cache, fresh = heldout_restore(cfg, out, what, games)
    path = collect(cfg, out, load, games)
    heldout_store(cache, out, fresh)
    return path


def warmup_collections(cfg: Settings, out: Path, load) -> str:
    """The warm-up's more triplets: walkthroughs and play of `warmup_games` other train games."""
    more = dataclasses.replace(cfg, num_games=cfg.warmup_games, adapter=None,
                               seed=cfg.seed + WARMUP_STREAM)
    games = warmup_games(cfg)
    walk = collect(dataclasses.replace(more, walkthrough=True), out / "warmup_walk", load, games)
    play = cached_collect(dataclasses.replace(more, walkthrough=False), out / "warmup_play", load,
                          what="the warm-up's more train triplets", games=games)
    probes = cfg.train_probes and walkthroughs(more, out / "warmup_state", games, probes=True)
    return ",".join(str(f) for f in (cfg.warmup_transitions, walk, play, probes) if f)


# ---------- §4 filter: the filter's split, the easiness copy (+ warm-up), too-easy subsampling
def filter_triplets(cfg: Settings, triplets: list[dict], out: Path, load,
                    reward_fn) -> tuple[list[dict], Path | None]:
    """§4, cached in `out`: (kept triplets, the warm-up adapter RWML starts from, or None)."""
    with cost.stage("filter"):
        job, cached = filter_cache(cfg, triplets, out)
        if cached:
            return cached
        seed = job["seed"]
        train, split = rwml.split_triplets(triplets, cfg.filter_split, seed)
        more = more_warmup(cfg)  # --warmup-transitions: more games' triplets for the copy
        keep, info = [True] * len(train), dict(easy_share=None, more_warmup_triplets=len(more))
        if cfg.easy_filter or cfg.warmup:
            model, tok = load()
            with cost.stage("filter sft"):  # an interrupted SFT continues from its last minutes
                out.mkdir(parents=True, exist_ok=True)
                copy, info["sft_losses"] = rwml.filter_copy(
                    model, tok, split, cfg, more=more, seed=seed, resume_file=out / "sft_resume.pt")
            if cfg.warmup:
                save_adapter(copy, out, "warmup_adapter", cfg=cfg, stage="filter", data={
                    "filter-split triplets (SFT)": len(split), "more warm-up triplets": len(more)})
            if cfg.easy_filter or (cfg.mixed_only and cfg.warmup):
                with cost.stage("easiness"):
                    keep, scored = rwml.filter_keep(copy, tok, train, reward_fn, cfg, seed)
                save_easiness(out, train, scored.pop("scores"), scored.pop("easy"), keep)
                info.update(scored)
            copy.unload()  # back to the bare base model; its weights were never touched
        kept = [t for t, k in zip(train, keep) if k]
        info.update(num_triplets=len(triplets), num_train=len(train), num_filter_split=len(split),
                    num_kept=len(kept), kept_kinds=kind_mix(kept))
        save_filter(out, job, info, kept)
        return kept, out / "warmup_adapter" if cfg.warmup else None


# ------------------- §3, §5 wm: RWML, GRPO on world-model prompts with the embedding reward
def start_adapter(cfg, model, adapter: Path | str | None = None):
    """A fresh LoRA (KL reference: the base), or a saved one beside its frozen copy "ref"."""
    if adapter is None:
        return engine.add_lora(model, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout,
                               cfg.lora_target_modules, cfg.gradient_checkpointing)
    from peft import PeftModel
    model = PeftModel.from_pretrained(model, str(adapter), is_trainable=True)
    model.load_adapter(str(adapter), adapter_name="ref", is_trainable=False)
    model.set_adapter("default")  # trainable; "ref" stays frozen
    if cfg.gradient_checkpointing:
        kwargs = dict(use_reentrant=False)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        model.enable_input_require_grads()
    return model


def start_training(cfg: Settings, model, start, out: Path, stage: str = "wm"):
    """The adapter (seeded: LoRA init and sampling hang on the seed alone), AdamW, the run state."""
    torch.manual_seed(cfg.seed)
    model = start_adapter(cfg, model, start)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.learning_rate, weight_decay=0.0)
    return (model, optimizer, *start_run(cfg, out, model, optimizer, stage))


def next_batch(state: dict, n: int, size: int, seed: int) -> list[int]:
    """The next `size` triplet indices; an epoch's shuffle depends on (seed, epoch) alone."""
    batch, order = [], None
    while len(batch) < size:
        if state["cursor"] >= n:
            state.update(epoch=state["epoch"] + 1, cursor=0)
            order = None
        if order is None:  # once per epoch, not per triplet
            order = list(range(n))
            random.Random(seed * 1000 + state["epoch"]).shuffle(order)
        batch.append(order[state["cursor"]])
        state["cursor"] += 1
    return batch


def training_loop(cfg, out: Path, model, optimizer, state: dict, writer, desc: str, step,
                  evaluate=None, before_save=None) -> None:
    """What world-model GRPO and stage 2 share: the bar, a metrics row per step, the held-out curve
    (`evaluate(step)`), checkpoints. `step()` runs a batch, yielding each step's row and postfix."""
    last = cfg.max_steps
    bar = tqdm(total=last, initial=state["step"], desc=desc, unit="step", dynamic_ncols=True)
    with open(out / "metrics.jsonl", "a") as metrics:
        if evaluate and cfg.eval_on_start and state["step"] == 0:
            log_row(metrics, writer, dict(step=0, **evaluate(0)))
        while state["step"] < last:
            before = state["step"]
            for row, postfix in step():
                if evaluate and (state["step"] % cfg.eval_steps == 0 or state["step"] >= last):
                    row.update(evaluate(state["step"]))
                log_row(metrics, writer, row)
                bar.update(1)
                bar.set_postfix(postfix)
            if state["step"] // cfg.save_steps > before // cfg.save_steps or state["step"] >= last:
                if before_save:
                    before_save()
                save_checkpoint(out / "checkpoint", model, optimizer, state)
    bar.close()
    close_tracker(writer)


def train_wm(cfg: Settings, triplets: list, out: Path, load, reward_fn, start: Path | None = None,
             heldout: list[dict] | None = None, coin_seed: int | None = None):
    """RWML: GRPO of a LoRA adapter on world-model prompts, from `start` (the warm-up) or a fresh
    one; with eval_steps, accuracy on `heldout` along the way. Returns the peft model."""
    if not triplets:
        raise UserError("no training triplets left after filtering; collect more games")
    triplets, reward_fn = reward_control(cfg, triplets, reward_fn, out, coin_seed)
    model, tok = load()
    model, opt, state, writer = start_training(cfg, model, start, out)  # the seed alone decides
    control = f"; {CONTROLS[cfg.reward_control]}" if cfg.reward_control in CONTROLS else ""
    print(run_header(model, cfg, f"wm: RWML GRPO on {len(triplets)} triplets (the filter's output)"
                     + control, f"{cfg.prompts_per_step} prompts", start, state["step"]))
    coin = getattr(reward_fn, "rng", None)
    if coin is not None and "reward_rng" in state:
        coin.setstate(state["reward_rng"])

    def evaluate(step: int) -> dict:  # held-out world-model accuracy, as `all` scores it
        with keep_rng(), cost.stage("wm eval"):
            r = rwml.evaluate_heldout(cfg, model, tok, heldout, reward_fn)
        return dict(eval_wm_accuracy=r["wm_accuracy"], eval_mean_cosine=r["mean_cosine"],
                    eval_beyond_template=r["per_kind"]["beyond_template"]["wm_accuracy"])

    def step():  # one batch of prompts: num_iterations updates on its groups
        picked = next_batch(state, len(triplets), cfg.prompts_per_step, cfg.seed)
        batch = [triplets[i] for i in picked]
        t0 = time.time()
        res = rwml.grpo_step(model, tok, opt, batch, reward_fn, cfg, reasoning=cfg.wm_reasoning)
        seconds = (time.time() - t0) / len(res["updates"])
        for u in res["updates"]:
            if state["step"] >= cfg.max_steps:
                break
            state["step"] += 1
            if u["skipped"]:
                tqdm.write(f"wm: step {state['step']}: non-finite loss or gradient, update skipped")
            yield wm_row(state, res, u, batch, cfg.learning_rate, seconds), dict(
                reward=f"{res['reward_mean']:.2f}", fmt=f"{res['format_rate']:.2f}",
                loss=f"{u['loss']:.3f}", kl=f"{u['kl']:.4f}")
        k = len(res["updates"])  # whole groups to samples.jsonl: first batch, then every few steps
        if state["step"] % cfg.log_completions_steps < k or state["step"] == k:
            with open(out / "samples.jsonl", "a") as samples:
                log_groups(samples, cfg, state["step"], batch,
                           [rwml.wm_prompt(t, cfg.wm_reasoning) for t in batch], res)

    def before_save():  # the coin's stream resumes where it stopped
        if coin is not None:
            state["reward_rng"] = coin.getstate()

    training_loop(cfg, out, model, opt, state, writer, "rwml grpo", step,
                  evaluate if heldout and cfg.eval_steps else None, before_save)
    adapter = save_adapter(model, out, cfg=cfg, data={TRIPLETS_KEPT: len(triplets)})
    plot_rewards(out / "metrics.jsonl", out / "reward_curve.png", "RWML world-model GRPO")
    print(f"wm: {state['step']} steps; adapter -> {adapter}; metrics -> {out / 'metrics.jsonl'}")
    return model


# ----------------- all: the default run (python train.py), held-out accuracy before and after
def train_all(cfg: Settings, out: Path, load, reward_fn, t0: float) -> str:
    """The default run: collect train and held-out games, filter (+ warm-up), RWML, held-out
    accuracy before / after beside the content-free baselines. Returns the last line: how
    to read its verdict (readout/)."""
    with cost.stage("heldout collect"):
        heldout = heldout_triplets(cfg, out, load)
    with cost.stage("collect"):
        trips = read_jsonl(collect(cfg, out / "collect", load))
        if cfg.train_probes:  # and the state probes of the same train games (no model)
            probes = walkthroughs(cfg, out / "collect_state", split_games(cfg), probes=True)
            trips += read_jsonl(probes)
    warm = cfg  # the warm-up also trains on more games' triplets (config.json: the command's)
    if cfg.warmup and cfg.warmup_games:
        with cost.stage("warm-up collect"):
            more = warmup_collections(cfg, out, load)
            warm = dataclasses.replace(cfg, warmup_transitions=more)
    kept, start = filter_triplets(warm, trips, filter_dir(cfg, out), load, reward_fn)
    sets = dict(heldout, train=dict(triplets=kept, file=str(filter_dir(cfg, out) / "kept.jsonl")))
    before_files = scores_before(cfg, out, sets, start, load, reward_fn)  # RWML's start's
    resume = cfg.resume or swap_checkpoint(out / "checkpoint")  # `all` continues where it stopped
    with cost.stage("grpo"):
        model = train_wm(dataclasses.replace(cfg, resume=resume), kept, out, load, reward_fn, start,
                         heldout=heldout["explore"]["triplets"])
    print(f"\n{cfg.heldout_split} ({cfg.heldout_games} games never trained on), tau_d {cfg.tau_d}"
          + (f" and ROUGE-1 >= {cfg.rouge_gate}" if cfg.rouge_gate else "")
          + f", {cfg.eval_samples or 'one greedy'} prediction(s) per triplet; before = "
          f"{'the warm-up' if start else 'the base model'}, after = RWML ({cfg.max_steps} steps)")
    held, rules = {}, {}
    for kind, s in sets.items():
        split = cfg.split if kind == "train" else cfg.heldout_split
        with cost.stage("eval after"):
            after = dict(rwml.evaluate_heldout(cfg, model, load()[1], s["triplets"], reward_fn),
                         model="RWML", split=split, transitions=s["file"])
        write_eval(out / f"wm_eval_rwml_{kind}.json", after)
        if kind != "train":
            rule = baselines_line(cfg, out, kind, s["triplets"], s["file"], reward_fn)["template"]
            rules[kind], held[kind] = rule["wm_accuracy"], before_after_line(
                json.loads(before_files[kind].read_text()), after)
            print(f"{kind}: {held[kind]}")
    print(probe_line(out, start))
    if cfg.coin_control:
        coin_control(cfg, out, load, reward_fn, start, model, kept, heldout)
    card_all(cfg, out, held, rules, len(kept), start)
    print(f"{(time.time() - t0) / 60:.1f} min -> {out} (per-triplet outputs: {out}/wm_eval_*"
          ".triplets.jsonl)")
    return (f"the paired differences (95 % CIs over games) and the verdict in words: "
            f"python -m readout {out}")


def card_all(cfg: Settings, out: Path, held: dict, rules: dict, kept: int, start) -> None:
    """`all`'s adapter card: each held-out kind's line, the template rule's beside it; the curve."""
    lines = [f"held-out {k} ({cfg.heldout_split}, {cfg.heldout_games} games), before = "
             f"{'the warm-up' if start else 'the base model'}: the content-free template rule "
             f"{rules[k]:.3f}, {line}" for k, line in held.items()]
    write_card(out / "adapter", cfg, "all", data={TRIPLETS_KEPT: kept},
               bundled=cfg.model == engine.BUNDLED_MODEL, heldout=lines)
    plot_rewards(out / "metrics.jsonl", out / "reward_curve.png", "RWML world-model GRPO")


COIN_STREAM = 1_000_003  # COIN's coin: seed + this (a coin run's control is another coin)


def coin_control(cfg, out: Path, load, reward_fn, start, model, kept: list[dict],
                 heldout: dict) -> None:
    """`--coin-control`, line (e): RWML's recipe, a fair coin for its reward, else matched."""
    model.unload()  # the bare base model again: the control starts from the warm-up as RWML did
    ctrl = out / "coin_control"
    ctrl.mkdir(parents=True, exist_ok=True)
    with cost.stage("coin control grpo"):
        resume = cfg.resume or swap_checkpoint(ctrl / "checkpoint")
        coin = dataclasses.replace(cfg, reward_control="coin", eval_steps=0, resume=resume)
        arm = train_wm(coin, kept, ctrl, load, reward_fn, start, coin_seed=cfg.seed + COIN_STREAM)
    for kind in HELDOUT_KINDS:
        with cost.stage("coin control eval"):
            trips = heldout[kind]["triplets"]
            scores = rwml.evaluate_heldout(cfg, arm, load()[1], trips, reward_fn)
            write_eval(out / f"wm_eval_coin_{kind}.json",
                       dict(scores, model="COIN (matched)", split=cfg.heldout_split,
                            transitions=heldout[kind]["file"]))
    arm.unload()


def heldout_triplets(cfg, out: Path, load) -> dict[str, dict]:
    """`all`'s held-out sets (explore, purposeful, state), the same games for every seed."""
    held = dataclasses.replace(cfg, split=cfg.heldout_split, num_games=cfg.heldout_games,
                               rollouts_per_game=1, seed=cfg.heldout_seed, adapter=None)
    play = dataclasses.replace(held, walkthrough=False)
    sets, paths = {}, dict(  # the walkthroughs and the state probes first: they need no model
        purposeful=walkthroughs(held, out / "heldout_purposeful", split_games(held)),
        state=walkthroughs(held, out / "heldout_state", split_games(held), probes=True),
        explore=cached_collect(play, out / "heldout", load))
    for kind, path in paths.items():
        if not (trips := read_jsonl(path)):
            raise UserError(f"no held-out {kind} triplets in {path}; use more --heldout-games")
        sets[kind] = dict(triplets=sample_triplets(trips, cfg.eval_max_triplets), file=str(path))
    return sets


# -------------------------------------------------- §6 policy: stage 2, GRPO on task success
def train_policy(cfg: Settings, out: Path, load):
    """Stage 2: multi-turn GRPO on task success (terminal reward won, gamma 1, budget max_turns)."""
    games = split_games(cfg)
    held = policy_eval_games(cfg) if cfg.eval_steps else []  # before any model: a bad split fails
    with make_env(cfg, min(cfg.games_per_step, len(games)) * cfg.num_generations) as env:
        model, tok = load()  # after make_env: ALFWorld's game workers fork without the model
        start = None if cfg.init == "base" else cfg.adapter
        model, optimizer, state, writer = start_training(cfg, model, start, out, "policy")
        policy_grpo = dataclasses.replace(cfg, max_completion_length=cfg.max_new_tokens)  # a reply

        def step():  # one step: games_per_step games, num_generations episodes each
            step_games = random.Random(cfg.seed * 1000 + state["step"]).sample(
                games, min(cfg.games_per_step, len(games)))  # (seed, step) alone: resumes replay
            t0 = time.time()
            with cost.stage("policy grpo"):
                res = rwml.policy_step(model, tok, optimizer, env, step_games, policy_grpo,
                                       envs.load(rwml.ACTORS[cfg.action_mode]),
                                       history_len=cfg.history_len, num_envs=cfg.num_envs)
            state["step"] += 1
            u = res["updates"][-1]
            stats = {k: v for k, v in res.items() if k not in ("updates", "sample")}
            yield dict(step=state["step"], **stats, **u, learning_rate=cfg.learning_rate,
                       seconds=round(time.time() - t0, 2)), dict(
                success=f"{res['reward_mean']:.2f}", invalid=f"{res['invalid_action_rate']:.2f}",
                trained=res["trained_turns"], kl=f"{u['kl']:.4f}")

        training_loop(cfg, out, model, optimizer, state, writer, f"policy grpo ({cfg.init})", step,
                      held and (lambda s: heldout_success(model, tok, env, held, cfg, out, s)))
    adapter = save_adapter(model, out)
    plot_rewards(out / "metrics.jsonl", out / "reward_curve.png",
                 f"policy GRPO from {cfg.init}: success")
    print(f"policy: {state['step']} steps from {cfg.init}; adapter -> {adapter}; "
          f"metrics -> {out / 'metrics.jsonl'}")
    return model


def heldout_success(model, tok, env, games: list, cfg, out: Path, step: int) -> dict:
    """Held-out success as `eval.py agent` plays it; episodes to eval_episodes.jsonl (audit)."""
    model.eval()
    with keep_rng(), cost.stage("policy eval"):
        played = rwml.play(model, tok, env, [dict(game=g) for g in games],
                           **dict(play_kwargs(cfg), temperature=0.0 if cfg.action_mode == "choose"
                                  else cfg.temperature), desc=f"eval step {step}", seed=cfg.seed)
    with open(out / "eval_episodes.jsonl", "a") as f:
        f.writelines(json.dumps(dict(e, step=step), default=str) + "\n" for e in played)
    steps = sum(e["steps"] for e in played) or 1
    return dict(eval_success=sum(e["won"] for e in played) / len(played),
                eval_mean_steps=steps / len(played),
                eval_invalid=sum(e["invalid"] for e in played) / steps)


# ------------------------------------------------------------- §7 baselines: WM SFT, RFT
def train_wm_sft(cfg: Settings, triplets: list[dict], out: Path, load, reward_fn):
    """The WM SFT baseline, matched to RWML: next-observation SFT (no reasoning) on its triplets in
    its order, `max_steps` updates of `prompts_per_step` at its learning_rate, from its start."""
    kept, start = filter_triplets(cfg, triplets, filter_dir(cfg, out), load, reward_fn)
    if not kept:
        raise UserError("no training triplets left after filtering; collect more games")
    state = dict(epoch=0, cursor=0)
    stream = [kept[i] for _ in range(cfg.max_steps)
              for i in next_batch(state, len(kept), cfg.prompts_per_step, cfg.seed)]
    model, tok = load()
    model, losses, adapter = sft_adapter(
        cfg, model, tok, [rwml.wm_prompt(t, False) for t in stream],
        [rwml.wm_answer(t) for t in stream], rwml.wm_system(stream[0]), out,
        prefix=rwml.wm_prefix(False), start=start, epochs=1, shuffle=False, lr=cfg.learning_rate,
        batch_size=cfg.prompts_per_step, data={TRIPLETS_KEPT: len(kept), "updates": cfg.max_steps},
        num_triplets=len(kept), learning_rate=cfg.learning_rate, updates=cfg.max_steps,
        start_adapter=str(start) if start else None)
    print(f"wm-sft: {cfg.max_steps} updates of {cfg.prompts_per_step} triplets (of {len(kept)}) "
          f"from {'the warm-up adapter' if start else 'a fresh adapter'}, mean loss "
          f"{losses[0]:.3f}; adapter -> {adapter}")
    return model


def train_rft(cfg: Settings, out: Path, load):
    """RFT: the model plays each train game rollouts_per_game times; SFT on its won episodes."""
    turns, games = [], split_games(cfg)
    with make_env(cfg, len(games) * cfg.rollouts_per_game) as env:
        model, tok = load()  # after make_env: ALFWorld's game workers fork without the model
        torch.manual_seed(cfg.seed)
        with cost.stage("rft rollouts"):
            played = rwml.rollouts(model, tok, env, games, cfg.rollouts_per_game,
                                   on_turn=turns.append, desc="rft rollouts", **play_kwargs(cfg))
    won = {i for i, s in enumerate(played) if s["won"]}
    keep = [t for t in turns if t["episode"] in won]
    if not keep:
        raise UserError(f"RFT: none of the {len(played)} episodes succeeded, so there is "
                        "nothing to fine-tune on; play more games (--num-games, "
                        "--rollouts-per-game, --max-turns) or use a stronger --model")
    system = envs.env_class(cfg.env).system  # the agent's system prompt, as the turns were played
    model, _, adapter = sft_adapter(
        cfg, model, tok, [t["prompt"] for t in keep], [t["response"] for t in keep], system, out,
        episodes=len(played), successes=len(won), turns=len(keep),
        data={"episodes played": len(played), "successful episodes": len(won),
              "turns trained on": len(keep)})
    print(f"rft: {len(won)}/{len(played)} episodes succeeded, SFT on their {len(keep)} turns; "
          f"adapter -> {adapter}")
    return model


def sft_adapter(cfg, model, tok, prompts: list[str], answers: list[str], system: str, out: Path, *,
                prefix="", start: Path | None = None, epochs: int | None = None, batch_size=8,
                shuffle=True, lr: float | None = None, data: dict | None = None, **info):
    """Plain SFT of a fresh LoRA (or of `start`), saved with config.json, sft.json, a model card."""
    torch.manual_seed(cfg.seed)
    model = start_adapter(cfg, model, start)
    with cost.stage("sft"):
        losses = engine.sft(model, tok, prompts, answers, system=system, prefix=prefix,
                            epochs=epochs or cfg.sft_epochs or 3, lr=lr or cfg.sft_learning_rate,
                            batch_size=batch_size, seed=cfg.seed, shuffle=shuffle)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "config.json", config_json(cfg))
    write_atomic(out / "sft.json", json.dumps(dict(losses=losses, **info), indent=2))
    return model, losses, save_adapter(model, out, cfg=cfg, data=data)


# --------------------------------------------------- The command line: a stage and its run
@releases_locks
def main(argv: list[str] | None = None) -> None:
    stage, cfg, given = parse_stage(sys.argv[1:] if argv is None else argv, STAGES, Settings)
    cfg = settle_env(stage, cfg, given)  # the settings completed: the triplets' environment
    out, t0 = Path(cfg.out), time.time()
    check_run(cfg)  # before anything slow: the settings, then the stage's, then the files
    check_stage(cfg, stage)
    copy = engine.MODEL_CACHE / engine.BUNDLED_COPY
    if cfg.model == engine.BUNDLED_MODEL and not copy.is_dir():  # converted once per machine
        with cost.stage("model conversion"):  # ~1 min, in the cost line
            engine.bundled_smollm2()
    check_io(cfg)
    trips, curve = stage_inputs(cfg, stage, triplet_problem(cfg))  # data, wm's curve
    claim_out(cfg, out, stage)  # the --out lock, and --resume's checks
    with cost.run(out, since=t0):  # at the end: the cost line (from t0, the checks too), cost.json
        last = run_stage(stage, cfg, out, t0, trips, curve)
    if last:  # `all`: the command that reads its verdict, the last line
        print(last)


def run_stage(stage: str, cfg: Settings, out: Path, t0: float, trips: list[dict] | None,
              curve: list[dict] | None = None) -> str | None:
    """One stage, one model for all its parts, loaded at first need (`load`); `all`: a last line."""
    four_bit = use_4bit(cfg)

    @functools.cache
    def load():
        return engine.load_model(cfg.model, cfg.adapter if stage == "collect" else None,
                                 load_in_4bit=four_bit)

    with card_run(stage, cfg):  # what the model cards of this stage's adapters say
        if stage == "collect":
            with cost.stage("collect"):
                collect(cfg, out, load)
        elif stage == "policy":
            train_policy(cfg, out, telling(load, cfg))  # the header once it loads
        elif stage == "rft":
            train_rft(cfg, out, load)
        elif stage == "wm-sft":
            train_wm_sft(cfg, trips, out, load, make_reward(cfg))
        elif stage == "all":
            return train_all(cfg, out, load, make_reward(cfg), t0)
        elif stage == "export":  # the filter (its warm-up with --export-warmup), verl's parquets
            exp = dataclasses.replace(cfg, warmup=cfg.export_warmup)
            reward = (exp.easy_filter or exp.mixed_only and exp.warmup) and make_reward(exp)
            kept, _ = filter_triplets(exp, trips, filter_dir(exp, out), load, reward)
            seed = exp.seed if exp.filter_seed is None else exp.filter_seed
            split = rwml.split_triplets(trips, exp.filter_split, seed)[1]  # the filter's own split
            envs.load("verl_bridge.export:export_verl")(exp, kept, split, out)  # verl's, by name
        else:  # filter, wm
            reward_fn = make_reward(cfg)
            kept, start = filter_triplets(cfg, trips, filter_dir(cfg, out), load, reward_fn)
            if stage == "wm":
                with cost.stage("grpo"):
                    train_wm(cfg, kept, out, load, reward_fn, start, heldout=curve)


if __name__ == "__main__":
    run_cli(main, f"interrupted: {RERUN}")
