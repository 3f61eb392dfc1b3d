"""RWML training: one config, one function per stage, in the paper's order (METHOD.md §N).

    python train.py                      # the default run (stage `all`) on the bundled defaults
    python train.py collect --num-games 50 --rollouts-per-game 3 --max-turns 30 --out runs/collect
    python train.py wm --transitions runs/collect/transitions.jsonl --max-steps 200 --out runs/wm
    python train.py wm ... --resume | --reward-control mis|coin | --trainer trl (TRL's GRPOTrainer)
    python train.py wm-sft --transitions runs/collect/transitions.jsonl --out runs/wm_sft
    python train.py policy --init rwml --adapter runs/wm/adapter --num-games 8 --out runs/policy

Every field of `Config` is a flag (`num_games` -> `--num-games`) and a key of a `--config` JSON file
(defaults < file < flags); so are the support modules' settings (`Settings`). Read top to bottom: the config,
one section per stage (collect, filter, wm, all = the default run, policy, wm-sft, rft), then `main`. The
command line's machinery (parsing, checks, files, checkpoints, cards) is plumbing.py; TRL, verl: bridges.py.
"""
from __future__ import annotations

import dataclasses
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

import bridges
import cost
import engine
import envs
import rwml
import worlds
from envs import RERUN, UserError
from plumbing import (CONTROLS, STAGES, TRIPLETS_KEPT, RunConfig, all_summary, baselines_line,
                      before_after_line, card_run, check_heldout, check_init, check_run, claim_out,
                      close_tracker, collection_summary, collection_todo, filter_cache, filter_dir,
                      heldout_success, heldout_triplets, jsonl_writer, keep_rng, kind_mix, log_groups,
                      log_row, make_env, parse_stage, play_kwargs, plot_rewards, policy_eval_games,
                      read_jsonl, releases_locks, reward_control, run_cli, run_header, save_adapter,
                      save_checkpoint, save_filter, sft_adapter, split_games, stage_inputs, start_adapter,
                      start_run, swap_checkpoint, telling, use_4bit, walkthroughs, wm_row, write_eval,
                      write_jsonl)
from reward import BUNDLED_EMBEDDER, SimToRealReward

# ------------------------------------------------------- The configuration: what a user sets (each a flag)

@dataclass
class ModelConfig:
    model: str = engine.BUNDLED_MODEL  # any HF causal-LM id or local folder
    adapter: str | None = None  # a peft adapter on top (collect: play with it; policy: start from it)
    seed: int = 0  # seeds every random draw of a run


@dataclass
class AgentConfig:
    """How the model plays: in collection, in stage 2 and in `eval.py agent`."""
    env: str = "alfworld"  # or textworld (generated games) or tau2 (tool use; games = tasks): worlds.py
    action_mode: str = "generate"  # generate: free ReAct replies (paper) | choose: softmax over admissible
    split: str | None = "train"  # the games' split
    num_games: int | None = 16  # the paper plays every train game (3553); small default for a CPU sanity run
    max_turns: int = 10  # environment step budget per episode (paper: 30; `eval.py agent` uses 30)
    history_len: int = 1  # H: previous (observation, action) pairs the agent sees, per triplet (paper: 2)
    max_new_tokens: int = 64  # agent reply: <think>...</think><action>...</action>


@dataclass
class WorldModelConfig:
    """The world model's answer and its reward: 1 iff 1 - cos(E(prediction), E(real)) < tau_d."""
    embedder: str = BUNDLED_EMBEDDER  # any sentence-transformers model id or folder
    tau_d: float | None = None  # None: the environment's (ENV_DEFAULTS; lab/results/reward_audit)
    reward_metric: str = "embedding"  # or "rouge" (ablation)
    reward_binary: bool = True  # False = the continuous-cosine ablation
    wm_reasoning: bool = False  # <think> then <next_state> (paper: True); off: reply from <next_state> on
    eval_samples: int = 4  # held-out predictions per triplet, sampled at `temperature` (0 = one greedy)


# Where the flag is unset, per environment (departures table): tau_d = the largest that, on the reward
# audit's dev half, rewards >= 90 % of fact-keeping rewrites of real observations and refuses >= 90 % of
# one-fact edits (0.1 refused half); the cap = the observations' 95th-percentile length + 10 %, to 16s.
ENV_DEFAULTS = dict(alfworld=dict(tau_d=0.01, max_completion_length=64),
                    textworld=dict(tau_d=0.02, max_completion_length=128))  # tau2: not audited, 0.1 and 64


def env_default(env: str, name: str):
    return ENV_DEFAULTS.get(env, {}).get(name, dict(tau_d=0.1, max_completion_length=64)[name])


@dataclass
class Config(rwml.GRPOParams, WorldModelConfig, AgentConfig, ModelConfig):
    """What a user sets. Defaults: the small-model recipe that shows RWML learning on the bundled 135M model
    on a CPU; each departure from the paper is marked "(paper: ...)" and undone by configs/paper.json."""
    # --- collect: the model plays train games at `temperature`; every turn is a triplet
    rollouts_per_game: int = 1  # the paper: 3 for ALFWorld
    explore_prob: float = 0.85  # share of turns whose action is drawn by kind, not by the model (paper: 0)
    heldout_split: str = "valid_unseen"  # `all`: the test split, never used to choose anything
    heldout_games: int = 20  # held-out games; each gives explore and purposeful (walkthrough) triplets
    # --- "too easy" filter: an SFT copy on the filter split scores the rest
    transitions: str | None = None  # `filter` / `wm` / `wm-sft`: a collection's transitions.jsonl
    easy_filter: bool = False  # "too easy" subsampling (paper: True); off: RWML forgot take / close / move
    filter_split: float = 0.35  # share of triplets that trains the SFT copy, never seen by GRPO (paper: 0.1)
    filter_samples: int = 4  # K predictions per training triplet (paper: 10)
    easy_share: float = 0.3  # tau_easy is set so that about this share counts as easy
    easy_keep_prob: float = 0.1  # easy triplets are kept with this probability
    warmup: bool = True  # RWML starts from the SFT copy (format warm-up), its KL reference (paper: False)
    # --- RWML: GRPO on world-model prompts (the GRPO fields above), with a LoRA adapter
    reward_control: str = "none"  # controls: mis = another triplet's next observation, coin = a fair coin
    max_steps: int = 20  # optimizer steps
    prompts_per_step: int = 4  # world-model prompts per step, each with num_generations completions
    # --- stage 2: policy RL on task success (num_generations: episodes per game)
    init: str = "base"  # what --adapter holds: base (none) | rwml | wm-sft | rft; the KL reference, frozen
    games_per_step: int = 2  # games per policy step, drawn from the num_games train games
    max_completion_length: int | None = None  # tokens per world-model prediction; None: the environment's
    # --- the run
    out: str = "runs/rwml"  # the run's folder

    def __post_init__(self):
        for name in ("tau_d", "max_completion_length"):
            if getattr(self, name) is None:
                setattr(self, name, env_default(self.env, name))


@dataclass
class Settings(Config, rwml.GRPOConfig, worlds.WorldConfig, bridges.BridgeConfig, RunConfig):
    """Every setting a stage reads: Config, and the support modules' settings, each also a flag: GRPO's at
    TRL's defaults and the engine's (rwml.GRPOConfig), the other environments', the bridges', the run's."""


# ------------------------------------------ §2 collect: the model plays the train games; every turn a triplet

def collect(cfg: Settings, out: Path, load) -> Path:
    """The model plays `num_games` games of `split`, `rollouts_per_game` times each; a triplet per turn, to
    `transitions.jsonl` as it happens (a rerun continues: `collection_todo`). `load()`: (model, tokenizer)."""
    games = split_games(cfg)  # bad data or split fails before the model loads
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
            user = engine.load_model(cfg.user_model) if cfg.user_model else (None, None)
            rwml.play(model, tok, env, todo, **play_kwargs(cfg), on_turn=jsonl_writer(ft),
                      on_episode=jsonl_writer(fe), explore_prob=cfg.explore_prob, seed=cfg.seed + done,
                      user_model=user[0], user_tokenizer=user[1], desc="collect")
    collection_summary(cfg, out)
    return transitions


# -------------------------- §4 filter: the 90 / 10 split, the easiness copy (+ warm-up), too-easy subsampling

def filter_triplets(cfg: Settings, triplets: list[dict], out: Path, load,
                    reward_fn) -> tuple[list[dict], Path | None]:
    with cost.stage("filter"):
        return _filter_triplets(cfg, triplets, out, load, reward_fn)


def _filter_triplets(cfg: Settings, triplets: list[dict], out: Path, load, reward_fn):
    """"Too easy" subsampling: `filter_split` of the triplets trains a separate LoRA copy (SFT, no reasoning);
    its K predictions per other triplet give easiness = mean r_WM; easy iff easiness >= tau_easy (about
    `easy_share` easy); easy ones are kept with probability `easy_keep_prob`. With `warmup` the copy is kept
    (out/warmup_adapter): RWML, its baselines and controls start from it (and it is the KL reference).
    Cached in `out`. Returns (kept triplets, warm-up adapter or None)."""
    job, cached = filter_cache(cfg, triplets, out)
    if cached:
        return cached
    seed = job["seed"]
    train, filter_set = rwml.split_triplets(triplets, cfg.filter_split, seed)
    info = dict(easy_share=None)
    if cfg.easy_filter or cfg.warmup:
        model, tok = load()
        torch.manual_seed(seed)
        # the separate copy: a LoRA adapter of its own, trained, used, then removed (kept on disk for warmup)
        copy = engine.add_lora(model, cfg.lora_r, cfg.lora_alpha, 0.0, cfg.lora_target_modules)
        with cost.stage("filter sft"):
            info["sft_losses"] = engine.sft(
                copy, tok, [rwml.wm_prompt(t, reasoning=False) for t in filter_set],
                [rwml.wm_answer(t) for t in filter_set], system=rwml.wm_system(filter_set[0]),
                prefix=rwml.wm_prefix(False), epochs=cfg.sft_epochs, lr=cfg.sft_learning_rate, seed=seed)
        if cfg.warmup:
            out.mkdir(parents=True, exist_ok=True)
            save_adapter(copy, out, "warmup_adapter", cfg=cfg, stage="filter",
                         data={"filter-split triplets (SFT)": len(filter_set)})
    kept = train
    if cfg.easy_filter:
        with cost.stage("easiness"):
            scores = rwml.easiness(copy, tok, train, reward_fn, k=cfg.filter_samples,
                                   max_new_tokens=cfg.max_completion_length, temperature=1.0)
        keep, easy, tau_easy = rwml.easy_subsample(scores, cfg.easy_share, cfg.easy_keep_prob, seed)
        kept = [t for t, k in zip(train, keep) if k]
        info.update(tau_easy=tau_easy, easy_share=sum(easy) / max(len(easy), 1),
                    target_easy_share=cfg.easy_share, mean_easiness=sum(scores) / max(len(scores), 1),
                    easiness_counts={f"{v:g}": scores.count(v) for v in sorted(set(scores))})
        out.mkdir(parents=True, exist_ok=True)
        write_jsonl(out / "easiness.jsonl", [
            dict(game=t.get("game"), step=t.get("step"), rollout=t.get("rollout"), next_obs=t["next_obs"],
                 easiness=s, easy=e, kept=k) for t, s, e, k in zip(train, scores, easy, keep)])
    if cfg.easy_filter or cfg.warmup:
        copy.unload()  # back to the bare base model; its weights were never touched
    save_filter(out, job, dict(info, num_triplets=len(triplets), num_train=len(train), num_filter_split=len(
        filter_set), num_kept=len(kept), kept_kinds=kind_mix(kept)), kept)
    return kept, out / "warmup_adapter" if cfg.warmup else None


# ------------------------------------- §3, §5 wm: RWML, GRPO on world-model prompts with the embedding reward

def make_reward(cfg: WorldModelConfig) -> SimToRealReward:
    return SimToRealReward(cfg.embedder, cfg.tau_d, cfg.reward_metric, cfg.reward_binary)


def start_training(cfg: Settings, model, start, out: Path, stage: str = "wm"):
    """The adapter (seeded: the LoRA init and the sampling depend on the seed alone), AdamW, the run state."""
    torch.manual_seed(cfg.seed)
    model = start_adapter(cfg, model, start)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.learning_rate,
                                  weight_decay=0.0)
    return (model, optimizer, *start_run(cfg, out, model, optimizer, stage))


def next_batch(state: dict, n: int, size: int, seed: int) -> list[int]:
    """The next `size` triplet indices of a run's data stream; advances state's epoch and cursor. An epoch's
    order, a shuffle, depends only on (seed, epoch): a resumed run, and the matched WM-SFT control, see the
    same."""
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


def train_wm(cfg: Settings, triplets: list[dict], out: Path, load, reward_fn, start: Path | None = None,
             heldout: list[dict] | None = None):
    """RWML: GRPO of a LoRA adapter on world-model prompts, from `start` (the warm-up adapter) or a fresh
    adapter; with eval_steps, world-model accuracy on `heldout` triplets along the way (eval/* metrics).
    Returns the peft model."""
    if not triplets:
        raise UserError("no training triplets left after filtering; collect more games")
    triplets, reward_fn = reward_control(cfg, triplets, reward_fn, out)
    model, tok = load()
    model, optimizer, state, writer = start_training(cfg, model, start, out)  # the seed alone decides
    print(run_header(model, cfg, f"wm: RWML GRPO on {len(triplets)} triplets (the filter's output)"
                     + (f"; {CONTROLS[cfg.reward_control]}" if cfg.reward_control in CONTROLS else ""),
                     f"{cfg.prompts_per_step} prompts", start, state["step"]))
    coin = getattr(reward_fn, "rng", None)
    if coin is not None and "reward_rng" in state:
        coin.setstate(state["reward_rng"])
    curve = heldout if cfg.eval_steps else None

    def evaluate(step: int) -> dict:  # world-model accuracy on the held-out triplets, as `all` scores them
        with keep_rng(), cost.stage("wm eval"):
            r = evaluate_heldout(cfg, model, tok, curve, reward_fn)
        return dict(eval_wm_accuracy=r["wm_accuracy"], eval_mean_cosine=r["mean_cosine"],
                    eval_beyond_template=r["per_kind"]["beyond_template"]["wm_accuracy"])

    bar = tqdm(total=cfg.max_steps, initial=state["step"], desc="rwml grpo", unit="step", dynamic_ncols=True)
    with open(out / "metrics.jsonl", "a") as metrics, open(out / "samples.jsonl", "a") as samples:
        if curve and cfg.eval_on_start and state["step"] == 0:
            log_row(metrics, writer, dict(step=0, **evaluate(0)))
        while state["step"] < cfg.max_steps:
            batch = [triplets[i] for i in next_batch(state, len(triplets), cfg.prompts_per_step, cfg.seed)]
            t0 = time.time()
            res = rwml.grpo_step(model, tok, optimizer, batch, reward_fn, cfg, reasoning=cfg.wm_reasoning)
            seconds = (time.time() - t0) / len(res["updates"])
            for u in res["updates"]:
                if state["step"] >= cfg.max_steps:
                    break
                state["step"] += 1
                log_row(metrics, writer, dict(
                    wm_row(state, res, u, batch, cfg.learning_rate, seconds),
                    **(evaluate(state["step"]) if curve and (state["step"] % cfg.eval_steps == 0
                                                             or state["step"] >= cfg.max_steps) else {})))
                if u["skipped"]:
                    tqdm.write(f"wm: step {state['step']}: non-finite loss or gradient, update skipped")
                bar.update(1)
                bar.set_postfix(reward=f"{res['reward_mean']:.2f}", fmt=f"{res['format_rate']:.2f}",
                                loss=f"{u['loss']:.3f}", kl=f"{u['kl']:.4f}")
            if (state["step"] % cfg.log_completions_steps < len(res["updates"])
                    or state["step"] == len(res["updates"])):
                log_groups(samples, cfg, state["step"], batch, res)
            if state["step"] % cfg.save_steps < len(res["updates"]) or state["step"] >= cfg.max_steps:
                if coin is not None:
                    state["reward_rng"] = coin.getstate()
                save_checkpoint(out / "checkpoint", model, optimizer, state)
    bar.close()
    close_tracker(writer)
    adapter = save_adapter(model, out, cfg=cfg, data={TRIPLETS_KEPT: len(triplets)})
    plot_rewards(out / "metrics.jsonl", out / "reward_curve.png", "RWML world-model GRPO")
    print(f"wm: {state['step']} steps; adapter -> {adapter}; metrics -> {out / 'metrics.jsonl'}")
    return model


# --------------------------------- all: the default run (python train.py), held-out accuracy before and after

HELDOUT_KINDS = ("explore", "purposeful")  # this collection policy's triplets; the expert walkthroughs'


def train_all(cfg: Settings, out: Path, load, reward_fn, t0: float) -> None:
    """The default run, `python train.py`: collect on train games, collect held-out games (both kinds),
    filter (+ warm-up), RWML, held-out accuracy before / after, beside the content-free baselines."""
    with cost.stage("heldout collect"):
        heldout = heldout_triplets(cfg, out, load, collect)
    with cost.stage("collect"):
        trips = read_jsonl(collect(cfg, out / "collect", load))
    kept, start = filter_triplets(cfg, trips, filter_dir(cfg, out), load, reward_fn)
    before_files = {kind: out / f"wm_eval_before_{kind}.json" for kind in HELDOUT_KINDS}
    if not all(f.exists() for f in before_files.values()):  # the model RWML starts from: warm-up or base
        model, tok = load()
        if start:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, str(start))
        with cost.stage("eval before"):
            for kind, f in before_files.items():
                write_eval(f, dict(evaluate_heldout(cfg, model, tok, heldout[kind]["triplets"], reward_fn),
                                   model="warm-up" if start else "base", split=cfg.heldout_split,
                                   transitions=heldout[kind]["file"]))
        if start:
            model.unload()  # the bare base model again, for train_wm
    resume = cfg.resume or swap_checkpoint(out / "checkpoint")  # `all` continues where it stopped
    with cost.stage("grpo"):
        model = train_wm(dataclasses.replace(cfg, resume=resume), kept, out, load, reward_fn, start,
                         heldout=heldout["explore"]["triplets"])
    print(f"\n{cfg.heldout_split} (the test split: {cfg.heldout_games} games never trained on), "
          f"tau_d {cfg.tau_d}, {cfg.eval_samples or 'one greedy'} prediction(s) per triplet; before = "
          f"{'the warm-up' if start else 'the base model'}, after = RWML ({cfg.max_steps} steps)")
    lines = []
    for kind in HELDOUT_KINDS:
        trips_k, file = heldout[kind]["triplets"], heldout[kind]["file"]
        with cost.stage("eval after"):
            after = dict(evaluate_heldout(cfg, model, load()[1], trips_k, reward_fn), model="RWML",
                         split=cfg.heldout_split, transitions=file)
        write_eval(out / f"wm_eval_rwml_{kind}.json", after)
        baselines_line(cfg, out, kind, trips_k, file, reward_fn)
        lines.append(f"{kind}: " + before_after_line(json.loads(before_files[kind].read_text()), after))
    all_summary(cfg, out, lines, len(kept), start, t0)  # the adapter's card, and what `train.py` prints last


def evaluate_heldout(cfg: Settings, model, tok, heldout: list[dict], reward_fn) -> dict:
    torch.manual_seed(cfg.seed)  # the same sampling noise before and after
    return rwml.evaluate_wm(model, tok, heldout, reward_fn, reasoning=cfg.wm_reasoning,
                            samples=cfg.eval_samples, temperature=cfg.temperature,
                            max_new_tokens=cfg.max_completion_length)


# ------------------------------------------------------------------- §6 policy: stage 2, GRPO on task success

def train_policy(cfg: Settings, out: Path, load):
    """Stage 2: multi-turn GRPO on task success (terminal reward won, gamma = 1, step budget max_turns)."""
    check_init(cfg)
    games = split_games(cfg)
    heldout = policy_eval_games(cfg) if cfg.eval_steps else []  # before any model loads: a bad split fails
    with make_env(cfg, min(cfg.games_per_step, len(games)) * cfg.num_generations) as env:
        model, tok = load()  # after make_env: ALFWorld's game workers fork without the model
        start = None if cfg.init == "base" else cfg.adapter
        model, optimizer, state, writer = start_training(cfg, model, start, out, "policy")
        policy_grpo = dataclasses.replace(cfg, max_completion_length=cfg.max_new_tokens)  # completion: reply
        bar = tqdm(total=cfg.max_steps, initial=state["step"], desc=f"policy grpo ({cfg.init})", unit="step",
                   dynamic_ncols=True)
        with open(out / "metrics.jsonl", "a") as metrics:
            if heldout and cfg.eval_on_start and state["step"] == 0:  # the curve's first point: the start
                log_row(metrics, writer, dict(step=0, **heldout_success(model, tok, env, heldout, cfg, out,
                                                                        0)))
            while state["step"] < cfg.max_steps:
                # the games of a step depend only on (seed, step): a resumed run plays the same ones
                step_games = random.Random(cfg.seed * 1000 + state["step"]).sample(
                    games, min(cfg.games_per_step, len(games)))
                t0 = time.time()
                with cost.stage("policy grpo"):  # rwml.policy_step: "policy rollouts", "policy update"
                    res = rwml.policy_step(model, tok, optimizer, env, step_games, policy_grpo,
                                           history_len=cfg.history_len, num_envs=cfg.num_envs,
                                           action_mode=cfg.action_mode)
                state["step"] += 1
                u = res["updates"][-1]
                stats = {k: v for k, v in res.items() if k not in ("updates", "sample")}
                row = dict(step=state["step"], **stats, **u, learning_rate=cfg.learning_rate,
                           seconds=round(time.time() - t0, 2))
                if heldout and (state["step"] % cfg.eval_steps == 0 or state["step"] >= cfg.max_steps):
                    row.update(heldout_success(model, tok, env, heldout, cfg, out, state["step"]))
                log_row(metrics, writer, row)
                bar.update(1)
                bar.set_postfix(success=f"{res['reward_mean']:.2f}",
                                invalid=f"{res['invalid_action_rate']:.2f}", trained=res["trained_turns"],
                                kl=f"{u['kl']:.4f}")
                if state["step"] % cfg.save_steps == 0 or state["step"] >= cfg.max_steps:
                    save_checkpoint(out / "checkpoint", model, optimizer, state)
        bar.close()
    close_tracker(writer)
    adapter = save_adapter(model, out)
    plot_rewards(out / "metrics.jsonl", out / "reward_curve.png", f"policy GRPO from {cfg.init}: success per "
                 "step")
    print(f"policy: {state['step']} steps from {cfg.init}; adapter -> {adapter}; "
          f"metrics -> {out / 'metrics.jsonl'}")
    return model


# ---------------------------------------------------------------------------------- §7 baselines: WM SFT, RFT

def train_wm_sft(cfg: Settings, triplets: list[dict], out: Path, load, reward_fn):
    """WM SFT, the paper's baseline, matched to RWML: next-observation SFT (no reasoning) on RWML's triplets
    in RWML's order, `max_steps` updates of `prompts_per_step` at its learning_rate, from RWML's start."""
    kept, start = filter_triplets(cfg, triplets, filter_dir(cfg, out), load, reward_fn)
    if not kept:
        raise UserError("no training triplets left after filtering; collect more games")
    state = dict(epoch=0, cursor=0)
    stream = [kept[i] for _ in range(cfg.max_steps)
              for i in next_batch(state, len(kept), cfg.prompts_per_step, cfg.seed)]
    model, tok = load()
    model, losses, adapter = sft_adapter(cfg, model, tok,
                                         [rwml.wm_prompt(t, reasoning=False) for t in stream],
                                         [rwml.wm_answer(t) for t in stream], rwml.wm_system(stream[0]), out,
                                         prefix=rwml.wm_prefix(False), start=start, epochs=1,
                                         batch_size=cfg.prompts_per_step, shuffle=False, lr=cfg.learning_rate,
                                         data={TRIPLETS_KEPT: len(kept), "updates": cfg.max_steps},
                                         num_triplets=len(kept), learning_rate=cfg.learning_rate,
                                         updates=cfg.max_steps, start_adapter=str(start) if start else None)
    print(f"wm-sft: {cfg.max_steps} updates of {cfg.prompts_per_step} triplets (of {len(kept)}) from "
          f"{'the warm-up adapter' if start else 'a fresh adapter'}, mean loss {losses[0]:.3f}; "
          f"adapter -> {adapter}")
    return model


def train_rft(cfg: Settings, out: Path, load):
    """RFT: the model plays the train games (tau2: tasks) rollouts_per_game times; SFT on its successes."""
    turns = []
    games = split_games(cfg)
    with make_env(cfg, len(games) * cfg.rollouts_per_game) as env:
        model, tok = load()  # after make_env: ALFWorld's game workers fork without the model
        torch.manual_seed(cfg.seed)
        with cost.stage("rft rollouts"):
            summaries = rwml.rollouts(model, tok, env, games, cfg.rollouts_per_game, on_turn=turns.append,
                                      desc="rft rollouts", **play_kwargs(cfg))
    won = {i for i, s in enumerate(summaries) if s["won"]}
    keep = [t for t in turns if t["episode"] in won]
    if not keep:
        raise UserError(f"RFT: none of the {len(summaries)} episodes succeeded, so there is nothing to "
                        "fine-tune on; play more games (--num-games, --rollouts-per-game, --max-turns) "
                        "or use a stronger --model")
    system = dict(tau2=worlds.Tau2.system, textworld=worlds.TextWorld.system).get(cfg.env,
                                                                                   envs.Alfworld.system)
    model, _, adapter = sft_adapter(cfg, model, tok, [t["prompt"] for t in keep],
                                    [t["response"] for t in keep], system, out, episodes=len(summaries),
                                    successes=len(won), turns=len(keep),
                                    data={"episodes played": len(summaries), "successful episodes": len(won),
                                          "turns trained on": len(keep)})
    print(f"rft: {len(won)}/{len(summaries)} episodes succeeded, SFT on their {len(keep)} turns; "
          f"adapter -> {adapter}")
    return model


# ---------------------------------------------------------------------- The command line: a stage and its run

@releases_locks
def main(argv: list[str] | None = None) -> None:
    stage, cfg = parse_stage(sys.argv[1:] if argv is None else argv, STAGES, Settings)
    out, t0 = Path(cfg.out), time.time()
    check_run(cfg, stage, dict(policy=check_init, all=check_heldout,  # before anything slow
                               export=bridges.check_export).get(stage))
    trips, curve = stage_inputs(cfg, stage)  # the triplets it trains on and, wm --eval-steps, scores
    claim_out(cfg, out, stage)  # the --out lock, and --resume's checks
    with cost.run(out):  # at the end: the cost line, and out/cost.json
        run_stage(stage, cfg, out, t0, trips, curve)


def run_stage(stage: str, cfg: Settings, out: Path, t0: float, trips: list[dict] | None,
              curve: list[dict] | None = None) -> None:
    """One stage, with one model for all its parts, loaded at first need (`load`)."""
    four_bit, loaded = use_4bit(cfg), []

    def load():
        if not loaded:
            loaded.append(engine.load_model(cfg.model, cfg.adapter if stage == "collect" else None,
                                            load_in_4bit=four_bit))
        return loaded[0]

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
            train_all(cfg, out, load, make_reward(cfg), t0)
        elif stage == "export":  # the filter, then verl's train and held-out parquets
            bridges.export_verl(cfg, trips, out, load, cfg.easy_filter and make_reward(cfg), filter_triplets)
        elif cfg.trainer == "trl":  # filter / wm in TRL's GRPOTrainer
            bridges.wm_trl(stage, cfg, trips, out, load, make_reward(cfg), filter_triplets, reward_control)
        else:  # filter, wm
            reward_fn = make_reward(cfg)
            kept, start = filter_triplets(cfg, trips, filter_dir(cfg, out), load, reward_fn)
            if stage == "wm":
                with cost.stage("grpo"):
                    train_wm(cfg, kept, out, load, reward_fn, start, heldout=curve)


if __name__ == "__main__":
    run_cli(main, f"interrupted: {RERUN}")
