"""RWML training entry point: one typed config, one function per stage.

    python train.py                      # the whole stage-1 pipeline on the bundled defaults (stage `all`)
    python train.py collect --num-games 50 --rollouts-per-game 3 --max-turns 30 --out runs/collect
    python train.py wm --transitions runs/collect/transitions.jsonl --max-steps 200 --out runs/wm
    python train.py wm ... --resume      # continue an interrupted run from its last checkpoint
    python train.py wm ... --reward-control mis|coin                     # the reward controls
    python train.py wm ... --trainer trl  # the same stage in TRL's GRPOTrainer; on N GPUs:
    accelerate launch --num_processes N train.py wm ... --trainer trl [--use-vllm]
    python train.py wm-sft --transitions runs/collect/transitions.jsonl --out runs/wm_sft
    python train.py policy --init rwml --adapter runs/wm/adapter --num-games 8 --out runs/policy
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
run), then the command line (`main`). The plumbing under it (parsing and validation, files, checkpoints,
trackers, model cards, --trainer trl, export) is plumbing.py.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

import cost
import engine
import envs
import rwml
import worlds
from bridges import check_parquet, export_verl, train_wm_trl
from envs import RERUN, UserError
from plumbing import (_CARD_RUN, CONTROLS, TRIPLETS_KEPT, check_adapter, check_at_least, check_config,
                      check_context, check_resume, check_single_process, check_tracker, check_writable,
                      close_tracker, commands_help, file_problem, group_table, keep_rng, lock_out, log_row,
                      parse_config, plot_rewards, process_state, read_jsonl, read_transitions, releases_locks,
                      run_cli, run_header, sample_triplets, save_adapter, save_checkpoint, start_run,
                      swap_checkpoint, use_4bit, whole_groups, wm_prompt_fits, write_atomic, write_card,
                      write_eval, write_jsonl)
from reward import BUNDLED_EMBEDDER, SimToRealReward, coin_reward, mis_targets

# ----------------------------------------- The configuration: every hyperparameter, typed (each field a flag)

STAGES = {  # name -> its line in `train.py --help`
    "all": "collect (train + held-out games), then wm; held-out accuracy before / after",
    "collect": "the model plays the games; every turn -> a triplet (METHOD.md §2)",
    "filter": "split, SFT copy, \"too easy\" subsampling; the warm-up adapter (METHOD.md §4)",
    "wm": "RWML: world-model GRPO, sim-to-real reward; runs filter first (METHOD.md §3, §5)",
    "wm-sft": "baseline: next-observation SFT on the same triplets (METHOD.md §7)",
    "rft": "baseline: SFT on the model's own successful episodes (METHOD.md §7)",
    "policy": "stage 2: multi-turn GRPO on task success, from base / RWML / WM SFT / RFT (METHOD.md §6)",
    "export": ("the filtered triplets as verl's GRPO parquet (runs filter first); reward: "
               "bridges.compute_score"),
}

INITS = ("base", "rwml", "wm-sft", "rft")

CHOICES = dict(env=("alfworld", "textworld", "tau2"), action_mode=envs.ACTION_MODES,
               policy=("model", "random"), domain=worlds.TAU2_DOMAINS, init=INITS,
               reward_control=("none", "mis", "coin"), reward_metric=("embedding", "rouge"),
               loss_type=("grpo", "dapo", "dr_grpo"), scale_rewards=("group", "batch", "none"),
               report_to=("none", "tensorboard", "wandb"), trainer=("ours", "trl"), format=("verl",))


@dataclass
class ModelConfig:
    model: str = engine.BUNDLED_MODEL  # any HF causal-LM id or local folder
    adapter: str | None = None  # a peft adapter on top (collect: play with it;
    #                             policy: start from it, see init)
    load_in_4bit: bool | None = None  # NF4 base weights via bitsandbytes (QLoRA); None = on where it pays:
    #                                   CUDA present and a model of >= 1B parameters (read from its config)
    seed: int = 0


@dataclass
class AgentConfig:
    """How the model plays: in collection, in stage 2 and in `eval.py agent`."""
    env: str = "alfworld"  # or textworld (generated games, see world_size) or tau2 (tool use; then `domain`,
    #                        games = tasks)
    action_mode: str = "generate"  # generate: free-form ReAct replies (paper) | choose: pi(a|s) = softmax
    #                                over admissible commands
    world_size: int = 2  # textworld: rooms of a generated game (tw-make's --world-size)
    nb_objects: int = 4  # textworld: objects of a generated game
    quest_length: int = 2  # textworld: steps of the winning quest
    #                        (at 2 a random admissible policy wins ~25 % in 10 steps)
    domain: str = "retail"  # tau2: airline | retail | telecom
    user_model: str | None = None  # tau2's simulated customer: any HF causal LM; None = the agent's model
    split: str | None = "train"
    num_games: int | None = 16  # the paper plays every train game (3553); small default for a CPU sanity run
    num_tasks: int | None = 4  # tau2: tasks of the split (None = all; retail train has 74)
    max_turns: int = 10  # environment step budget per episode (paper: 30; `eval.py agent` uses 30)
    history_len: int = 1  # H: previous (observation, action) pairs the agent sees, kept per triplet
    #                       (paper: 2)
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
    wm_reasoning: bool = False  # <think> then <next_state> (paper: True); off: reply from <next_state> on
    eval_samples: int = 4  # held-out predictions per triplet, sampled at `temperature` (0 = one greedy)


@dataclass
class Config(rwml.GRPOConfig, WorldModelConfig, AgentConfig, ModelConfig):
    """Every hyperparameter of every stage. Defaults: the small-model recipe that shows RWML learning on the
    bundled 135M model on a CPU; each departure from the paper is marked "(paper: ...)" and undone by
    configs/paper.json (README, "Departures from the paper")."""
    # --- data collection: the model plays train games at `temperature`; every turn is a triplet
    rollouts_per_game: int = 1  # the paper: 3 for ALFWorld
    explore_prob: float = 0.85  # share of turns whose action is drawn by kind, not by the model (paper: 0)
    heldout_split: str = "valid_unseen"  # `all`: the test split, never used to choose anything (valid_seen:
    #                                      the dev split)
    heldout_games: int = 20  # held-out games; each gives explore triplets (this collection policy) and
    #                          purposeful ones (its expert walkthrough)
    walkthrough: bool = False  # collect: play each game's expert walkthrough, not the model (no model loads)
    # --- "too easy" filter: an SFT copy on the filter split scores the rest
    transitions: str | None = None  # `filter` / `wm` / `wm-sft`: a collection's transitions.jsonl
    filter_dir: str | None = None  # where the filter's outputs are kept and reused (None = <out>/filter)
    filter_seed: int | None = None  # seed of the split, the SFT copy and its scores (None = seed): runs with
    #                                 other seeds can then share one filter and one warm-up
    easy_filter: bool = False  # "too easy" subsampling (paper: True); off: on valid_seen it dropped every
    #                            take / close / move target and RWML forgot them (README, the drift)
    filter_split: float = 0.35  # share of triplets that trains the SFT copy, never seen by GRPO (paper: 0.1)
    filter_samples: int = 4  # K predictions per training triplet (paper: 10)
    easy_share: float = 0.3  # tau_easy is set so that about this share counts as easy
    easy_keep_prob: float = 0.1  # easy triplets are kept with this probability
    warmup: bool = True  # RWML starts from the SFT copy (format warm-up), its KL reference (paper: False)
    sft_epochs: int = 3
    sft_learning_rate: float = 5e-4
    # --- RWML: GRPO on world-model prompts (the GRPO fields above), with a LoRA adapter
    reward_control: str = "none"  # controls: mis = another triplet's next observation, coin = a fair coin
    max_steps: int = 20  # optimizer steps
    loss_type: str = "dr_grpo"  # grpo | dapo | dr_grpo (paper: grpo); with scale_rewards none it held off the
    #                             drift to "Nothing happens." on valid_seen (README)
    scale_rewards: str = "none"  # group | batch | none: the std that divides advantages (paper: group)
    prompts_per_step: int = 4  # world-model prompts per step, each with num_generations completions
    stratify_prompts: bool = False  # each step's prompts stratified by target kind (README: the drift)
    gradient_checkpointing: bool = False  # recompute activations in backward: less memory, more time; GRPO
    #                                       then runs whole rows (results/README)
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_target_modules: str = "all-linear"  # or e.g. "q_proj,k_proj,v_proj,o_proj" (paper: full fine-tuning)
    trainer: str = "ours"  # ours | trl: stage wm in TRL's GRPOTrainer, also under accelerate launch (README)
    use_vllm: bool = False  # --trainer trl: generation in vLLM, colocated (TRL's use_vllm; needs vllm)
    format: str = "verl"  # `export`: the filtered triplets as verl's GRPO parquet
    #                       (reward: bridges.compute_score)
    # --- stage 2: policy RL on task success; also uses the agent's fields
    #     (num_generations: episodes per game)
    init: str = "base"  # what --adapter holds: base (no adapter) | rwml | wm-sft | rft;
    #                     the KL reference is it, frozen
    games_per_step: int = 2  # games per policy step, drawn from the num_games train games
    eval_steps: int = 0  # the learning curve: a held-out evaluation every this many steps and at the end
    #                      (0 = off); policy: greedy success on eval_games games; wm / all: world-model
    #                      accuracy on held-out triplets (all: its explore set; wm: eval_transitions)
    eval_on_start: bool = False  # and once before step 1 (TRL's eval_on_start)
    eval_games: int = 10  # policy: held-out games of eval_split for it
    eval_split: str | None = None  # policy: None = the dev split, valid_seen (ALFWorld) or dev (TextWorld)
    eval_transitions: str | None = None  # wm: held-out triplets for the curve (eval_max_triplets of them)
    # --- logging, checkpoints, output
    eval_max_triplets: int = 48  # held-out triplets of each kind scored before and after (0 = all)
    save_steps: int = 4
    log_completions_steps: int = 4
    report_to: str = "none"  # or tensorboard (<out>/tensorboard) or wandb
    #                          (WANDB_MODE=offline works without network)
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
        job.update(env=cfg.env, world_size=cfg.world_size, nb_objects=cfg.nb_objects,
                   quest_length=cfg.quest_length)
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
    print(f"collect: {len(games)} {cfg.split} games x {cfg.rollouts_per_game} rollouts; {len(finished)} "
          f"episodes already done, {len(todo)} to play -> {transitions}")
    if todo:
        torch.manual_seed(cfg.seed + len(finished))  # a resumed run does not replay the same samples
        with make_env(cfg, len(todo)) as env, open(transitions, "a") as ft, open(episodes_file, "a") as fe:
            model, tok = load()  # after make_env: ALFWorld's game workers fork without the model
            user = engine.load_model(cfg.user_model) if cfg.user_model else (None, None)

            def write(f, rec):
                f.write(json.dumps(rec, default=str) + "\n")
                f.flush()

            rwml.play(model, tok, env, todo, history_len=cfg.history_len, temperature=cfg.temperature,
                      top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens, num_envs=cfg.num_envs,
                      on_turn=lambda t: write(ft, t), on_episode=lambda e: write(fe, e),
                      explore_prob=cfg.explore_prob, seed=cfg.seed + len(finished),
                      user_model=user[0], user_tokenizer=user[1], desc="collect", action_mode=cfg.action_mode)
    eps, trips = read_jsonl(episodes_file), read_jsonl(transitions)
    n = max(len(trips), 1)
    own = [t for t in trips if not t.get("explored")]
    print(f"collect: {len(trips)} triplets from {len(eps)} episodes ({len(trips) - len(own)} explored "
          f"turns); success {sum(e['won'] for e in eps)}/{len(eps)}, "
          f"valid actions {sum(t['valid'] for t in trips) / n:.1%}, the model's own replies "
          f"well formed {sum(t['format_ok'] for t in own) / max(len(own), 1):.1%}")
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
    job = dict(walkthrough=True, split=cfg.split, seed=cfg.seed, num_games=cfg.num_games,
               history_len=cfg.history_len)
    # a rerun: done already
    if transitions.is_file() and meta.is_file() and json.loads(meta.read_text()) == job:
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

FILTER_JOB = ("model", "easy_filter", "filter_split", "filter_samples", "easy_share", "easy_keep_prob",
              "warmup", "sft_epochs", "sft_learning_rate", "embedder", "tau_d", "reward_metric",
              "reward_binary", "max_completion_length", "lora_r", "lora_alpha", "lora_target_modules")


def filter_triplets(cfg: Config, triplets: list[dict], out: Path, load,
                    reward_fn) -> tuple[list[dict], Path | None]:
    with cost.stage("filter"):
        return _filter_triplets(cfg, triplets, out, load, reward_fn)


def _filter_triplets(cfg: Config, triplets: list[dict], out: Path, load,
                     reward_fn) -> tuple[list[dict], Path | None]:
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
            and (not cfg.warmup
                 or ((warm / "adapter_config.json").is_file()
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
        copy = engine.add_lora(model, cfg.lora_r, cfg.lora_alpha, 0.0, cfg.lora_target_modules)
        with cost.stage("filter sft"):
            info["sft_losses"] = engine.sft(copy, tok, [rwml.wm_prompt(t, reasoning=False) for t in filter_set],
                                          [rwml.wm_answer(t) for t in filter_set],
                                          system=rwml.wm_system(filter_set[0]),
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
        info.update(tau_easy=tau_easy, easy_share=sum(easy) / max(len(easy), 1),
                    target_easy_share=cfg.easy_share, mean_easiness=sum(scores) / max(len(scores), 1),
                    easiness_counts={f"{v:g}": scores.count(v) for v in sorted(set(scores))})
        out.mkdir(parents=True, exist_ok=True)
        rows = [dict(game=t.get("game"), step=t.get("step"), rollout=t.get("rollout"), next_obs=t["next_obs"],
                     easiness=s, easy=e, kept=k) for t, s, e, k in zip(train, scores, easy, keep)]
        write_jsonl(out / "easiness.jsonl", rows)
    else:
        kept = train
    if cfg.easy_filter or cfg.warmup:
        copy.unload()  # back to the bare base model; its weights were never touched
    info.update(num_triplets=len(triplets), num_train=len(train), num_filter_split=len(filter_set),
                num_kept=len(kept), kept_kinds=kind_mix(kept))
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(kept_file, kept)
    write_atomic(meta_file, json.dumps(dict(job=job, **info), indent=2))
    print("filter: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                 for k, v in info.items() if k not in ("sft_losses", "easiness_counts")))
    return kept, warm if cfg.warmup else None


# ------------------------------------- §3, §5 wm: RWML, GRPO on world-model prompts with the embedding reward

def make_reward(cfg: WorldModelConfig) -> SimToRealReward:
    return SimToRealReward(cfg.embedder, cfg.tau_d, cfg.reward_metric, cfg.reward_binary)


def start_adapter(cfg: Config, model, adapter: Path | str | None = None):
    """The adapter a stage trains: a fresh LoRA (the KL reference is then the bare base model, adapter
    disabled), or a saved one (the warm-up, or an RWML / WM-SFT / RFT adapter for stage 2) that trains on,
    with a frozen copy of it named "ref" (TRL's name) as the KL reference (`engine.reference_policy`)."""
    if adapter is None:
        return engine.add_lora(model, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules,
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
        write_atomic(out / "mis.json",
                     json.dumps(dict(unchanged_share=unchanged, num_triplets=len(triplets)), indent=2))
        print(f"mis: {unchanged:.1%} of triplets keep a target equal to their own (one text is over half "
              "of all)")
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
            batch = [triplets[i]
                     for i in next_batch(state, len(triplets), cfg.prompts_per_step, cfg.seed, kinds)]
            t0 = time.time()
            res = rwml.grpo_step(model, tok, optimizer, batch, reward_fn, cfg, reasoning=cfg.wm_reasoning)
            seconds = (time.time() - t0) / len(res["updates"])
            for u in res["updates"]:
                if state["step"] >= cfg.max_steps:
                    break
                state["step"] += 1
                log_row(metrics, writer, dict(step=state["step"], epoch=state["epoch"], **{
                    k: res[k] for k in ("reward_mean", "reward_std", "frac_reward_zero_std", "format_rate",
                                        "completion_tokens", "completions/min_length",
                                        "completions/max_length", "completions/clipped_ratio",
                                        "nothing_share")},
                    **u, lr=cfg.learning_rate, seconds=round(seconds, 2),
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
            if (state["step"] % cfg.log_completions_steps < len(res["updates"])
                    or state["step"] == len(res["updates"])):
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
    # the model RWML starts from: the warm-up or the base
    if not all(f.exists() for f in before_files.values()):
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
        print(f"{kind} ({heldout[kind]['file']}): content-free baselines: template rule "
              f"{rules['template']['wm_accuracy']:.3f}, always \"Nothing happens.\" "
              f"{rules['nothing']['wm_accuracy']:.3f}, copy the observation "
              f"{rules['copy']['wm_accuracy']:.3f}")
        lines.append(f"{kind}: " + before_after_line(before, after))
    write_card(out / "adapter", cfg, "all", data={TRIPLETS_KEPT: len(kept)},
               heldout=[f"held-out ({cfg.heldout_split}, {cfg.heldout_games} games), before = "
                        f"{'the warm-up' if start else 'the base model'}: {line}" for line in lines],
               bundled=cfg.model == engine.BUNDLED_MODEL)
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
        raise UserError(f"--heldout-split {cfg.heldout_split} shares {len(train & held)} games with the "
                        f"train games (--split {cfg.split}); use valid_unseen (the test split) or "
                        "valid_seen (the dev split)")


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


def wm_curve_triplets(cfg: Config) -> list[dict] | None:
    """`wm --eval-steps N`: eval_max_triplets of --eval-transitions (drawn with a fixed seed), or a clear
    error."""
    if not cfg.eval_steps:
        return None
    if not cfg.eval_transitions:
        raise UserError("wm --eval-steps scores held-out triplets along the way: give them with "
                        "--eval-transitions (a transitions.jsonl of held-out games, e.g. train.py collect "
                        "--split valid_seen)")
    return sample_triplets(read_transitions(cfg.eval_transitions, wm_prompt_fits(cfg)), cfg.eval_max_triplets)


def evaluate_heldout(cfg: Config, model, tok, heldout: list[dict], reward_fn) -> dict:
    torch.manual_seed(cfg.seed)  # the same sampling noise before and after
    return rwml.evaluate_wm(model, tok, heldout, reward_fn, reasoning=cfg.wm_reasoning,
                            samples=cfg.eval_samples, temperature=cfg.temperature,
                            max_new_tokens=cfg.max_completion_length)


def before_after_line(before: dict, after: dict) -> str:
    change_b, change_a = before["per_kind"]["change"], after["per_kind"]["change"]
    beyond_b, beyond_a = before["per_kind"]["beyond_template"], after["per_kind"]["beyond_template"]
    return (f"world-model accuracy {before['wm_accuracy']:.3f} -> {after['wm_accuracy']:.3f} "
            f"({before['n']} triplets); without \"Nothing happens.\" {change_b['wm_accuracy']:.3f} -> "
            f"{change_a['wm_accuracy']:.3f} ({change_b['n']}); beyond the template rule "
            f"{beyond_b['wm_accuracy']:.3f} -> {beyond_a['wm_accuracy']:.3f} ({beyond_b['n']}); mean cosine "
            f"{before['mean_cosine']:.3f} -> {after['mean_cosine']:.3f}")


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
    # before any model loads: a bad split fails now
    heldout = policy_eval_games(cfg) if cfg.eval_steps else []
    with make_env(cfg, min(cfg.games_per_step, len(games)) * cfg.num_generations) as env:
        model, tok = load()  # after make_env: ALFWorld's game workers fork without the model
        torch.manual_seed(cfg.seed)
        model = start_adapter(cfg, model, None if cfg.init == "base" else cfg.adapter)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                      lr=cfg.learning_rate, weight_decay=0.0)
        state, writer = start_run(cfg, out, model, optimizer, "policy")
        # a completion: a reply
        policy_grpo = dataclasses.replace(cfg, max_completion_length=cfg.max_new_tokens)
        bar = tqdm(total=cfg.max_steps, initial=state["step"], desc=f"policy grpo ({cfg.init})", unit="step",
                   dynamic_ncols=True)
        with open(out / "metrics.jsonl", "a") as metrics:
            if heldout and cfg.eval_on_start and state["step"] == 0:  # the curve's first point: the start
                log_row(metrics, writer,
                        dict(step=0, **heldout_success(model, tok, env, heldout, cfg, out, 0)))
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
                row = dict(step=state["step"],
                           **{k: v for k, v in res.items() if k not in ("updates", "sample")},
                           **u, lr=cfg.learning_rate, seconds=round(time.time() - t0, 2))
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
    plot_rewards(out / "metrics.jsonl", out / "reward_curve.png",
                 f"policy GRPO from {cfg.init}: success per step")
    print(f"policy: {state['step']} steps from {cfg.init}; adapter -> {adapter}; "
          f"metrics -> {out / 'metrics.jsonl'}")
    return model


def policy_eval_games(cfg: Config) -> list:
    """The held-out games of stage 2's learning curve: eval_games of eval_split (never the train split)."""
    split = cfg.eval_split or dict(alfworld="valid_seen", textworld="dev").get(cfg.env)
    if split is None:
        raise UserError(f"--eval-steps plays held-out games, which --env {cfg.env} has no dev split of; "
                        "use --eval-steps 0 and eval.py afterwards")
    if split == cfg.split:
        raise UserError(f"--eval-split {split} is the split stage 2 trains on; pick a held-out one "
                        "(e.g. dev)")
    return envs.games(cfg.env, split, cfg.eval_games, 0, cfg.domain,
                      (cfg.world_size, cfg.nb_objects, cfg.quest_length))


def heldout_success(model, tok, env, games: list, cfg: Config, out: Path, step: int) -> dict:
    """Greedy held-out success of the current policy (as `eval.py agent` plays it); each episode goes to
    <out>/eval_episodes.jsonl with its step, so that every point of the curve can be audited."""
    model.eval()
    with keep_rng(), cost.stage("policy eval"):
        played = rwml.play(model, tok, env, [dict(game=g) for g in games], history_len=cfg.history_len,
                           temperature=0.0 if cfg.action_mode == "choose" else cfg.temperature,
                           top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens, num_envs=cfg.num_envs,
                           action_mode=cfg.action_mode, desc=f"eval step {step}", seed=cfg.seed)
    with open(out / "eval_episodes.jsonl", "a") as f:
        for e in played:
            f.write(json.dumps(dict(e, step=step), default=str) + "\n")
    steps = sum(e["steps"] for e in played) or 1
    return dict(eval_success=sum(e["won"] for e in played) / len(played), eval_mean_steps=steps / len(played),
                eval_invalid=sum(e["invalid"] for e in played) / steps)


def split_games(cfg: Config) -> list:
    """The games a stage plays: `num_games` ALFWorld game files of `split`, or `num_tasks` tau2 tasks."""
    return envs.games(cfg.env, cfg.split, cfg.num_tasks if cfg.env == "tau2" else cfg.num_games, cfg.seed,
                      cfg.domain, (cfg.world_size, cfg.nb_objects, cfg.quest_length))


def play_kwargs(cfg: Config) -> dict:
    """How the agent plays (`rwml.play`'s settings) in collection-like stages."""
    return dict(history_len=cfg.history_len, temperature=cfg.temperature, top_p=cfg.top_p,
                max_new_tokens=cfg.max_new_tokens, num_envs=cfg.num_envs, action_mode=cfg.action_mode)


def make_env(cfg: Config, episodes: int | None = None):
    at_once = None if episodes is None else min(cfg.num_envs, episodes)  # no more game workers than games
    return envs.make(cfg.env, domain=cfg.domain, num_workers=cfg.num_workers, max_turns=cfg.max_turns,
                     at_once=at_once)


# ---------------------------------------------------------------------------------- §7 baselines: WM SFT, RFT

def sft_adapter(cfg: Config, model, tok, prompts: list[str], answers: list[str], system: str, out: Path, *,
                prefix: str = "", start: Path | None = None, epochs: int | None = None, batch_size: int = 8,
                shuffle: bool = True, lr: float | None = None, data: dict | None = None, **info):
    """The SFT baselines: plain SFT of a fresh LoRA adapter (or of `start`) at `lr` (default
    sft_learning_rate), saved with config.json and sft.json (losses, info); `data`: the card's counts."""
    torch.manual_seed(cfg.seed)
    model = start_adapter(cfg, model, start)
    with cost.stage("sft"):
        losses = engine.sft(model, tok, prompts, answers, system=system, prefix=prefix,
                          epochs=epochs or cfg.sft_epochs, lr=lr or cfg.sft_learning_rate,
                          batch_size=batch_size, seed=cfg.seed, shuffle=shuffle)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "config.json", json.dumps(dataclasses.asdict(cfg), indent=2))
    write_atomic(out / "sft.json", json.dumps(dict(losses=losses, **info), indent=2))
    return model, losses, save_adapter(model, out, cfg=cfg, data=data)


def train_wm_sft(cfg: Config, triplets: list[dict], out: Path, load, reward_fn):
    """WM SFT, the paper's baseline, matched to RWML: plain next-observation SFT (no reasoning) on the
    triplets RWML trains on (the same filter output), in RWML's data order, `max_steps` updates of
    `prompts_per_step` triplets at RWML's learning_rate, from RWML's start (the warm-up adapter, or a fresh
    one)."""
    kept, start = filter_triplets(cfg, triplets, filter_dir(cfg, out), load, reward_fn)
    if not kept:
        raise UserError("no training triplets left after filtering; collect more games")
    state = dict(epoch=0, cursor=0)
    kinds = target_kinds(cfg, kept)
    stream = [kept[i] for _ in range(cfg.max_steps)
              for i in next_batch(state, len(kept), cfg.prompts_per_step, cfg.seed, kinds)]
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
        raise UserError(f"RFT: none of the {len(summaries)} episodes succeeded, so there is nothing to "
                        "fine-tune on; play more games (--num-games, --rollouts-per-game, --max-turns) "
                        "or use a stronger --model")
    system = dict(tau2=worlds.Tau2.system, textworld=worlds.TextWorld.system).get(cfg.env, envs.Alfworld.system)
    model, _, adapter = sft_adapter(cfg, model, tok, [t["prompt"] for t in keep],
                                    [t["response"] for t in keep], system, out, episodes=len(summaries),
                                    successes=len(won), turns=len(keep),
                                    data={"episodes played": len(summaries), "successful episodes": len(won),
                                          "turns trained on": len(keep)})
    print(f"rft: {len(won)}/{len(summaries)} episodes succeeded, SFT on their {len(keep)} turns; "
          f"adapter -> {adapter}")
    return model


# -------------------------------------------------- The command line: the stages, their fields, their checks

# The fields each stage reads, for its --help (every stage accepts them all, as a config file may hold any):
# a config class stands for its fields; a field named under no stage shows under every one.
_REWARD = ("embedder", "tau_d", "reward_metric", "reward_binary")
_RUN = ("save_steps", "report_to", "resume", "out")
_LORA = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "gradient_checkpointing")
_COLLECT = ("rollouts_per_game", "explore_prob", "walkthrough", "temperature", "top_p")
_HELDOUT = ("heldout_split", "heldout_games", "eval_max_triplets")
_FILTER = ("transitions", "filter_dir", "filter_seed", "easy_filter", "filter_split", "filter_samples",
           "easy_share", "easy_keep_prob", "warmup", "sft_epochs", "sft_learning_rate",
           "max_completion_length", "lora_r", "lora_alpha", "lora_target_modules")
_RWML = ("reward_control", "max_steps", "prompts_per_step", "stratify_prompts", "log_completions_steps",
         "eval_steps", "eval_on_start", "eval_transitions", "eval_max_triplets", "eval_samples")
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
            raise UserError(f"unknown --{name.replace('_', '-')} {value!r}; choose one of "
                            f"{', '.join(options)}" + envs.did_you_mean(value, options))


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
    trips = (read_transitions(cfg.transitions, wm_prompt_fits(cfg))
             if stage in ("wm-sft", "filter", "wm", "export") else None)
    # wm --eval-steps: its held-out triplets read now (a bad --eval-transitions is one line, not after the
    # filter)
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
            loaded.append(engine.load_model(cfg.model, cfg.adapter if stage == "collect" else None,
                                          load_in_4bit=four_bit))
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
            if cfg.trainer == "trl":
                with process_state().main_process_first():  # mis.json: one writer at a time
                    kept, reward_fn = reward_control(cfg, kept, reward_fn, out)
            with cost.stage("grpo"):
                (train_wm_trl if cfg.trainer == "trl" else train_wm)(cfg, kept, out, load, reward_fn, start,
                                                                     **extra)
        return
    train_all(cfg, out, load, reward_fn, t0)


if __name__ == "__main__":
    run_cli(main, f"interrupted: {RERUN}")
