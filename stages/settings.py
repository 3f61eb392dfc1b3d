"""Every setting of train.py and eval.py, declared once (`common.arg`), in groups read together,
and the groups each stage reads (`STAGES`). Defaults: the recipe that shows RWML learning on the
bundled 135M model on a CPU; "(paper: ...)" marks a departure (configs/paper.json undoes them)."""
from __future__ import annotations

from dataclasses import dataclass

import envs
from reward import BUNDLED_EMBEDDER
import engine
from harness.common import again, arg

SEED_MAX = 2**32 - 1  # numpy's bound (transformers' set_seed); torch's is 2**64 - 1
_SEED = dict(check=lambda v: 0 <= v <= SEED_MAX, why=f"must be between 0 and {SEED_MAX}")
_PER_ENV = {  # --help: ALFWorld's value (another environment loads only once --env names it)
    s: f"None: the environment's (alfworld {getattr(envs.Alfworld, s)})" for s in envs.ENV_DEFAULTS}
_SHARE = dict(check=lambda v: 0 <= v <= 1, why="must be between 0 and 1")
_NOT_NEGATIVE = dict(check=lambda v: v >= 0, why="must be 0 or more")
_POSITIVE = dict(check=lambda v: v > 0, why="must be above 0")


@dataclass
class ModelArgs:
    _argument_group_name = "every stage: the model, the environment, the seed, the run's folder"
    model: str = arg(engine.BUNDLED_MODEL, "any HF causal-LM id or local folder",
                     part_of="filter collect score")
    load_in_4bit: bool | None = arg(None, "NF4 base weights (QLoRA); None = on with CUDA and >= 1B "
                                    "parameters", part_of="score")
    env: str = arg("alfworld", "or textworld (generated games), tau2 (tool use; games = tasks); "
                   "its class: its defaults", choices=tuple(envs.ENVIRONMENTS), part_of="episodes")
    seed: int = arg(0, "seeds every random draw of a run", **_SEED, part_of="collect card score")
    out: str = arg("runs/rwml", "the run's folder", resume_free=True)


@dataclass
class AdapterArgs:
    _argument_group_name = "the adapter to start from"
    adapter: str | None = arg(None, "a peft adapter on top (collect: play with it; policy: start "
                              "from it)", part_of="collect")


@dataclass
class PlayArgs:
    _argument_group_name = "how the agent plays (collect, policy, rft; eval.py agent)"
    action_mode: str = arg("generate", "generate: free ReAct replies (paper); choose: a softmax "
                           "over the admissible commands (choose/)", choices=("generate", "choose"),
                           part_of="episodes card:policy")
    split: str | None = arg("train", "the games' split", part_of="collect")
    num_games: int | None = arg(16, "the paper plays every train game (3553); small for a CPU "
                                "sanity run", min=1, part_of="collect:alfworld collect:textworld")
    max_turns: int = arg(10, "environment steps per episode (paper: 30; `eval.py agent` uses 30)",
                         min=1, part_of="collect card:rft card:policy")
    history_len: int = arg(2, "H: past (observation, action) pairs the agent sees (paper: 2)",
                           min=0, part_of="collect")
    max_new_tokens: int = arg(64, "a reply: <think>...</think><action>...</action>", min=1,
                              part_of="collect")


@dataclass
class WorldArgs:
    _argument_group_name = "the games: workers, TextWorld's sizes, tau2's domain and customer"
    num_envs: int = arg(16, "episodes played (and generated for) together", min=1)
    num_workers: int = arg(2, "game processes (0 = play in this process)", min=0, resume_free=True)
    world_size: int = arg(2, "textworld: rooms of a generated game (tw-make's --world-size)", min=1,
                          part_of="collect:textworld")
    nb_objects: int = arg(4, "textworld: objects of a generated game", min=1,
                          part_of="collect:textworld")
    quest_length: int = arg(2, "textworld: steps of the winning quest (at 2 random play wins "
                            "~25 % in 10 steps)", min=1, part_of="collect:textworld")
    domain: str = arg("retail", "tau2: airline | retail | telecom", part_of="collect:tau2",
                      choices=("airline", "retail", "telecom"))  # tau2.py's: not loaded here
    user_model: str | None = arg(None, "tau2's simulated customer: any HF causal LM; None = the "
                                 "agent's model (adapter off)", part_of="collect:tau2")
    num_tasks: int | None = arg(4, "tau2: tasks of the split (None = all; retail train has 74)",
                                check=lambda v: v >= 1, part_of="collect:tau2",
                                why="must be at least 1 (or left out: all tasks)")


@dataclass
class SamplingArgs:
    _argument_group_name = "sampling: the agent's replies, the GRPO groups"
    temperature: float = arg(1.0, "of collection and of the GRPO groups (training divides by "
                             "it)", **_NOT_NEGATIVE, part_of="collect card:wm card:policy score")
    top_p: float = arg(1.0, "nucleus sampling of the replies and the groups",
                       check=lambda v: 0 < v <= 1, why="must be in (0, 1]", part_of="collect")


@dataclass
class CollectArgs:
    _argument_group_name = "collect (METHOD.md §2): the model plays train games; a turn, a triplet"
    rollouts_per_game: int = arg(1, "the paper: 3 for ALFWorld", min=1, part_of="collect card:rft")
    explore_prob: float = arg(0.85, "share of turns whose action is drawn by kind, not by the "
                              "model (paper: 0)", **_SHARE,
                              part_of="collect:alfworld collect:textworld")
    walkthrough: bool = arg(False, "play each game's expert walkthrough (no model loads)")


@dataclass
class HeldoutArgs:
    _argument_group_name = "all: the held-out games, scored before and after"
    heldout_split: str = arg("valid_unseen", "the test split, never used to tune", resume_free=True)
    heldout_games: int = arg(20, "held-out games; each gives explore and purposeful (walkthrough) "
                             "triplets", min=1, resume_free=True)
    heldout_seed: int = arg(0, "draws the held-out games (0: those every run so far scored; a "
                            "study draws fresh ones with another seed)", min=0, resume_free=True)
    warmup_games: int = arg(32, "all: the warm-up's SFT also trains on the expert walkthroughs "
                            "and the collection policy's play of this many other train games "
                            "(never GRPO's; it brought RWML to the template rule on valid_seen); "
                            "0 = off", min=0)
    train_probes: bool = arg(True, "all: the warm-up's and GRPO's triplets also hold the state "
                             "probes of their train games (revisits, takes, puts)")
    coin_control: bool = arg(False, "also train and score the matched COIN arm (the same warm-up, "
                             "prompts, batches, seed and steps; its own fair coin for a reward): "
                             "line (e); one arm decides nothing (a coin run passed RWML - COIN)")


@dataclass
class WorldModelArgs:
    _argument_group_name = "the world model's answer and its reward (METHOD.md §3)"
    embedder: str = arg(BUNDLED_EMBEDDER, "any sentence-transformers model id or folder",
                        part_of="filter score")
    tau_d: float | None = arg(None, "r = 1 iff 1 - cos(E(prediction), E(real)) < tau_d; "
                              + _PER_ENV["tau_d"], check=lambda v: 0 < v <= 2,
                              why="must be in (0, 2] (a cosine distance)",
                              part_of="filter card:wm score")
    rouge_gate: float | None = arg(None, "> 0: r = 1 also needs ROUGE-1 F >= this (authors' code); "
                                   + _PER_ENV["rouge_gate"], check=lambda v: 0 <= v <= 1,
                                   why="must be between 0 and 1 (0 = off)", part_of="filter score")
    reward_metric: str = arg("embedding", 'or "rouge" (ablation)', choices=("embedding", "rouge"),
                             part_of="filter card:wm score")
    reward_binary: bool = arg(True, "False: the continuous-cosine ablation", part_of="filter score")
    wm_reasoning: bool = arg(False, "<think> then <next_state> (paper: True); off: reply from "
                             "<next_state> on", part_of="score")
    max_completion_length: int | None = arg(None, "tokens per world-model prediction; "
                                            + _PER_ENV["max_completion_length"], min=1,
                                            part_of="filter card:wm score")


@dataclass
class FilterArgs:
    _argument_group_name = "\"too easy\" filter (METHOD.md §4): a split's SFT copy scores the rest"
    transitions: str | None = arg(None, "a collected transitions.jsonl (filter/wm/wm-sft/export)")
    filter_dir: str | None = arg(None, "where the filter's outputs are kept and reused (None = "
                                 "<out>/filter)", resume_free=True)
    filter_seed: int | None = arg(None, "seed of the split, the SFT copy and its scores (None = "
                                  "seed): runs with other seeds can then share one filter and one "
                                  "warm-up", **_SEED, part_of="card:filter")
    easy_filter: bool = arg(False, '"too easy" subsampling (paper: True); off: RWML forgot take / '
                            'close / move', part_of="filter")
    filter_split: float = arg(0.35, "share of triplets that trains the SFT copy, never seen by "
                              "GRPO (paper: 0.1)", check=lambda v: 0 < v < 1,
                              why="the share of triplets that trains the SFT copy must be between "
                                  "0 and 1", part_of="filter card:filter")
    filter_samples: int = arg(4, "K predictions per train triplet (paper: 10)", min=1,
                              part_of="filter")
    easy_share: float = arg(0.3, "tau_easy: set so this share is easy", **_SHARE, part_of="filter")
    easy_keep_prob: float = arg(0.1, "chance an easy triplet is kept", **_SHARE, part_of="filter")
    mixed_only: bool = arg(True, "keep only the triplets whose K warm-up predictions were neither "
                           "all right nor all wrong: only their GRPO groups carry a gradient "
                           "(ours, with warmup)", part_of="filter")
    warmup: bool = arg(True, "RWML starts from the SFT copy (format warm-up), its KL reference "
                       "(paper: no)", part_of="filter")
    warmup_transitions: str | None = arg(None, "more triplets the warm-up's SFT trains on besides "
                                         "its split, never GRPO's: transitions.jsonl files, "
                                         "comma-separated (e.g. walkthroughs, the collection "
                                         "policy's play of more train games)", part_of="filter")


@dataclass
class StepArgs:
    _argument_group_name = "the optimizer's steps"
    learning_rate: float = arg(1e-4, "AdamW's, constant", **_POSITIVE,
                               part_of="card:wm card:wm-sft card:policy")
    max_steps: int = arg(20, "optimizer steps", min=1, resume_free=True,
                         part_of="card:wm card:wm-sft card:policy")
    prompts_per_step: int = arg(4, "world-model prompts per step, each with num_generations "
                                "completions", min=1, part_of="card:wm card:wm-sft")


@dataclass
class GRPOArgs:
    _argument_group_name = "GRPO (METHOD.md §5): TRL's names; TRL's defaults if the paper is silent"
    num_generations: int = arg(4, "completions per prompt, a group (TRL: 8; 4: a step affords 4 "
                               "prompts; README)", min=2, part_of="card:wm card:policy")
    beta: float = arg(0.1, "KL weight; the reference is the warm-up adapter, else the bare base "
                      "model (TRL: 0)", **_NOT_NEGATIVE, part_of="card:wm card:policy")
    loss_type: str = arg("dr_grpo", "how token losses are averaged (paper: grpo)",
                         choices=("grpo", "dapo", "dr_grpo"), part_of="card:wm")
    scale_rewards: str = arg("none", "the std that divides advantages (paper: group)",
                             choices=("group", "batch", "none"))
    epsilon: float = arg(0.2, "clip range of the probability ratio", **_NOT_NEGATIVE)
    epsilon_high: float | None = arg(None, "DAPO's clip-higher; None = epsilon",
                                     check=lambda v: v >= 0,
                                     why="must be 0 or more (or left out: --epsilon)")
    num_iterations: int = arg(1, "updates per generated batch (mu)", min=1)
    max_grad_norm: float = arg(1.0, "gradient clipping", **_NOT_NEGATIVE)


@dataclass
class EngineArgs:
    _argument_group_name = "the engine's speed (stages that train with GRPO)"
    micro_batch_size: int = arg(8, "completions per forward/backward (gradient accumulation inside "
                                   "a step)", min=1, resume_free=True)
    micro_batch_tokens: int = arg(512, "and at most this many padded tokens (0: no limit; a bigger "
                                       "group alone)", part_of="no-trl")
    shared_prompt_forward: bool = arg(True, "training forward: a group's completions share one "
                                            "prompt forward", resume_free=True, part_of="no-trl")
    logits_chunk_size: int = arg(512, "completion tokens per vocabulary projection", min=1,
                                 resume_free=True, part_of="no-trl")


@dataclass
class LoraArgs:
    _argument_group_name = "the LoRA adapter every stage trains"
    lora_r: int = arg(16, "LoRA rank (paper: full fine-tuning)", min=1, part_of="filter card")
    lora_alpha: int = arg(32, "LoRA scale alpha / r", min=1, part_of="filter card")
    lora_dropout: float = arg(0.0, "LoRA dropout", **_SHARE)
    lora_target_modules: str = arg("all-linear", 'or e.g. "q_proj,k_proj,v_proj,o_proj"',
                                   part_of="filter")
    gradient_checkpointing: bool = arg(False, "recompute activations in backward: less memory, "
                                              "more time", resume_free=True)


@dataclass
class SFTArgs:
    _argument_group_name = "SFT: the filter's copy (the warm-up) and RFT"
    sft_epochs: int | None = arg(None, "epochs of the SFT copy (the warm-up) and of RFT; None = 3, "
                                       "or 1 when the warm-up has more triplets (warmup_games, "
                                       "...)", min=1, part_of="filter card:filter card:rft")
    sft_learning_rate: float = arg(5e-4, "their learning rate", **_POSITIVE,
                                   part_of="filter card:filter card:rft")


@dataclass
class GRPOConfig(GRPOArgs, SamplingArgs, EngineArgs):
    """What rwml.grpo_step and policy_step read alone (tests, benches); a run passes Settings."""
    max_completion_length: int = again(WorldModelArgs, "max_completion_length",  # ALFWorld's
                                       envs.Alfworld.max_completion_length)


@dataclass
class RWMLArgs:
    _argument_group_name = "RWML (METHOD.md §3, §5): GRPO on world-model prompts, a LoRA adapter"
    reward_control: str = arg("none", "controls: mis = another triplet's next observation, coin = "
                              "a fair coin, template = the template rule's sentence (the grammar, "
                              "no state)", choices=("none", "mis", "coin", "template"))
    log_completions_steps: int = arg(4, "a step's whole groups to samples.jsonl and the log every "
                                     "this many", min=1, resume_free=True)
    eval_samples: int = arg(0, "held-out predictions per triplet, sampled at `temperature` (0 = "
                            "one greedy)", min=0, resume_free=True, part_of="score")
    eval_max_triplets: int = arg(96, "held-out triplets of each kind scored before and after (0 = "
                                 "all)", min=0, resume_free=True)
    eval_transitions: str | None = arg(None, "wm: held-out triplets for the curve "
                                       "(eval_max_triplets of them)", resume_free=True)


@dataclass
class RunArgs:
    _argument_group_name = "the training run: checkpoints, trackers, the learning curve"
    resume: bool = arg(False, "continue --out's run from its last checkpoint", resume_free=True)
    save_steps: int = arg(4, "a checkpoint every this many steps (and at the end)", min=1,
                          resume_free=True)
    report_to: str = arg("none", "or tensorboard (<out>/tensorboard) or wandb (WANDB_MODE=offline: "
                         "no network)", choices=("none", "tensorboard", "wandb"), resume_free=True)
    eval_steps: int = arg(0, "the learning curve: a held-out evaluation every this many steps and "
                          "at the end (0 = off); policy: greedy success on eval_games games; wm / "
                          "all: world-model accuracy on held-out triplets (all: its explore set; "
                          "wm: eval_transitions)", min=0, resume_free=True)
    eval_on_start: bool = arg(False, "also before step 1 (TRL's eval_on_start)", resume_free=True)


@dataclass
class PolicyArgs:
    _argument_group_name = "stage 2 (METHOD.md §6): policy RL on success, num_generations per game"
    init: str = arg("base", "what --adapter holds (base: none), the frozen KL reference",
                    choices=("base", "rwml", "wm-sft", "rft"), part_of="card:policy")
    games_per_step: int = arg(2, "games per policy step (of the num_games train games)", min=1,
                              part_of="card:policy")
    eval_games: int = arg(10, "held-out games of the learning curve", min=1, resume_free=True)
    eval_split: str | None = arg(None, "their split; None = the environment's dev split (its "
                                 "class's `splits`)", resume_free=True)


@dataclass
class VerlArgs:
    _argument_group_name = "verl (export)"
    format: str = arg("verl", "the filtered triplets as verl's GRPO parquet (reward: "
                      "compute_score)", choices=("verl",))
    export_warmup: bool = arg(False, "also train and save the warm-up adapter (unused by verl)")


@dataclass
class Settings(ModelArgs, AdapterArgs, PlayArgs, WorldArgs, SamplingArgs, CollectArgs,
               HeldoutArgs, WorldModelArgs, FilterArgs, SFTArgs, LoraArgs, GRPOArgs,
               EngineArgs, StepArgs, RWMLArgs, RunArgs, PolicyArgs, VerlArgs):
    """Every setting of every stage: what `train.py` parses (a stage reads its groups, `STAGES`)."""

    def __post_init__(self):  # unset: its environment's, loaded by name (unknown: check_fields)
        env = envs.env_class(self.env) if self.env in envs.ENVIRONMENTS else None
        for name in envs.ENV_DEFAULTS:
            if getattr(self, name) is None and env is not None:
                setattr(self, name, getattr(env, name))


_PLAY = (PlayArgs, WorldArgs, SamplingArgs)  # the agent plays
_WM = (WorldModelArgs, FilterArgs, SFTArgs, LoraArgs)  # a world model
_GRPO = (GRPOArgs, EngineArgs, StepArgs)
STAGES = {  # name -> its line in `train.py --help`, the setting groups it reads (--help, warnings)
    "all": ("collect (train + held-out games), then wm; held-out accuracy before / after",
            (ModelArgs, *_PLAY, CollectArgs, HeldoutArgs, *_WM, *_GRPO, RWMLArgs, RunArgs)),
    "collect": ("the model plays the games; every turn -> a triplet (METHOD.md §2)",
                (ModelArgs, AdapterArgs, *_PLAY, CollectArgs)),
    "filter": ("split, SFT copy, \"too easy\" subsampling; the warm-up adapter (METHOD.md §4)",
               (ModelArgs, *_WM)),
    "wm": ("RWML: world-model GRPO, sim-to-real reward; runs filter first (METHOD.md §3, §5)",
           (ModelArgs, *_WM, SamplingArgs, *_GRPO, RWMLArgs, RunArgs)),
    "wm-sft": ("baseline: next-observation SFT on the same triplets (METHOD.md §7)",
               (ModelArgs, *_WM, StepArgs)),
    "rft": ("baseline: SFT on the model's own successful episodes (METHOD.md §7)",
            (ModelArgs, *_PLAY, CollectArgs, SFTArgs, LoraArgs)),
    "policy": ("stage 2: multi-turn GRPO on task success, from base / RWML / WM SFT / RFT "
               "(METHOD.md §6)", (ModelArgs, AdapterArgs, *_PLAY, GRPOArgs, EngineArgs,
                                  LoraArgs, StepArgs, RunArgs, PolicyArgs)),
    "export": ("verl's GRPO parquets: the kept triplets and the held-out filter split (runs filter "
               "first, no warm-up); reward: verl_bridge/reward.py's compute_score",
               (ModelArgs, *_WM, VerlArgs)),
}
