"""RWML training entry point: one typed config, one function per stage.

    python train.py                      # the whole stage-1 pipeline on the bundled defaults (stage `all`)
    python train.py collect --num-games 50 --rollouts-per-game 3 --max-turns 30 --out runs/collect
    python train.py wm --transitions runs/collect/transitions.jsonl --max-steps 200 --num-generations 4 --out runs/wm
    python train.py wm ... --resume      # continue an interrupted run from its last checkpoint
    python train.py wm ... --reward-control mis|coin                     # the reward controls
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
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import json
import os
import random
import shutil
import sys
import time
import types
import typing
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

import envs
import rwml
from envs import UserError
from reward import BUNDLED_EMBEDDER, SimToRealReward, coin_reward, derangement

STAGES = ("all", "collect", "filter", "wm", "wm-sft", "rft", "policy")
INITS = ("base", "rwml", "wm-sft", "rft")
CHOICES = dict(env=("alfworld", "tau2"), domain=envs.TAU2_DOMAINS, init=INITS, reward_control=("none", "mis", "coin"), reward_metric=("embedding", "rouge"),
               loss_type=("grpo", "dapo", "dr_grpo"), scale_rewards=("group", "batch", "none"),
               report_to=("none", "tensorboard"))


@dataclass
class Config:
    # --- model
    model: str = rwml.BUNDLED_MODEL  # any HF causal-LM id or local folder
    adapter: str | None = None  # collect: play with this peft adapter; policy: start from it (see `init`)
    load_in_4bit: bool | None = None  # NF4 base weights via bitsandbytes (QLoRA); None = on when CUDA is present
    seed: int = 0
    # --- data collection (METHOD.md §2): the base model plays train games at temperature 1.0
    env: str = "alfworld"  # or tau2 (tool use with a simulated customer; then `domain`, and games = tasks)
    domain: str = "retail"  # tau2: airline | retail
    user_model: str | None = None  # tau2's simulated customer: any HF causal LM; None = the agent's model
    split: str = "train"
    num_games: int = 6  # the paper plays every train game (3553); small default for a CPU sanity run
    num_tasks: int | None = 4  # tau2: tasks of the split (None = all; retail train has 74)
    rollouts_per_game: int = 2  # the paper: 3 for ALFWorld
    max_turns: int = 10  # environment step budget per episode (the paper: 30; `eval.py agent` uses 30)
    history_len: int = 2  # H: previous (observation, action) pairs shown to the agent and kept per triplet
    temperature: float = 1.0  # sampling temperature of collection and of GRPO groups
    top_p: float = 1.0
    max_new_tokens: int = 64  # agent reply: <think>...</think><action>...</action>
    num_envs: int = 12  # episodes played (and generated for) together
    num_workers: int = 2  # game processes (0 = play in this process)
    heldout_split: str = "valid_seen"  # `all`: world-model accuracy is measured on games never trained on
    heldout_games: int = 4
    # --- "too easy" filter (METHOD.md §4)
    transitions: str | None = None  # `filter` / `wm`: a collection's transitions.jsonl
    easy_filter: bool = True  # False = the paper's "without easy subsampling" ablation
    filter_split: float = 0.1  # share of triplets that trains the easiness model
    filter_samples: int = 4  # K predictions per training triplet (the paper: 10)
    easy_share: float = 0.3  # tau_easy is set so that this share counts as easy
    easy_keep_prob: float = 0.1  # easy triplets are kept with this probability
    sft_epochs: int = 3
    sft_learning_rate: float = 2e-4
    # --- reward (METHOD.md §3)
    embedder: str = BUNDLED_EMBEDDER  # any sentence-transformers model id or folder
    tau_d: float = 0.1  # reward 1 iff 1 - cos < tau_d; chosen with `python eval.py calibrate` (README)
    reward_metric: str = "embedding"  # or "rouge" (ablation)
    reward_binary: bool = True  # False = the continuous-cosine ablation
    reward_control: str = "none"  # controls (METHOD.md §7): mis = targets deranged across triplets, coin = fair coin
    # --- GRPO (METHOD.md §5); names as in TRL
    wm_reasoning: bool = True  # <think> then <next_state> (the paper); False = <next_state> directly
    max_steps: int = 24  # optimizer steps
    prompts_per_step: int = 2  # world-model prompts per step, each with num_generations completions
    num_generations: int = 4
    max_completion_length: int = 96
    learning_rate: float = 1e-4
    beta: float = 0.01  # KL weight; the reference is the model with the adapter disabled
    epsilon: float = 0.2
    epsilon_high: float | None = None  # DAPO's clip-higher; None = epsilon
    num_iterations: int = 1  # updates per generated batch (mu)
    loss_type: str = "grpo"  # grpo | dapo | dr_grpo
    scale_rewards: str = "group"  # group | batch | none
    max_grad_norm: float = 1.0
    micro_batch_size: int = 4  # completions per forward/backward (gradient accumulation inside a step)
    shared_prompt_forward: bool = True  # training forward: a group's completions share one prompt forward
    logits_chunk_size: int = 512  # completion tokens per vocabulary projection
    gradient_checkpointing: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_target_modules: str = "q_proj,k_proj,v_proj,o_proj"  # or "all-linear"
    # --- stage 2: policy RL on task success (METHOD.md §6); also uses split, num_games, max_turns,
    #     num_generations (episodes per game), max_new_tokens and the GRPO fields above
    init: str = "base"  # what --adapter holds: base (no adapter) | rwml | wm-sft | rft; the KL reference is it, frozen
    games_per_step: int = 2  # games per policy step, drawn from the num_games train games
    # --- logging, checkpoints, output
    save_steps: int = 4
    log_completions_steps: int = 4
    report_to: str = "none"  # or "tensorboard"
    resume: bool = False
    eval_max_triplets: int = 48  # held-out triplets scored before and after (0 = all)
    out: str = "runs/rwml"


def check_choices(cfg) -> None:
    """A value outside a field's choices fails at once, before any model loads, with a did-you-mean."""
    for name, options in CHOICES.items():
        value = getattr(cfg, name, None)
        if value is not None and value not in options:
            close = difflib.get_close_matches(str(value), options, n=1)
            raise UserError(f"unknown --{name.replace('_', '-')} {value!r}; choose one of {', '.join(options)}"
                            + (f" (did you mean {close[0]!r}?)" if close else ""))


def parse_config(cls, argv: list[str], prog: str, positional: dict | None = None):
    """Flags from a dataclass's fields; JSON file via --config; a typo gets a one-line error with a hint."""
    hints = typing.get_type_hints(cls)
    p = argparse.ArgumentParser(prog=prog, argument_default=argparse.SUPPRESS, allow_abbrev=False)
    for name, kw in (positional or {}).items():
        p.add_argument(name, **kw)
    p.add_argument("--config", help="JSON file with any of the fields below")
    for f in dataclasses.fields(cls):
        typ = hints[f.name]
        if isinstance(typ, types.UnionType):  # `str | None` -> str
            typ = next(t for t in typing.get_args(typ) if t is not type(None))
        flag = "--" + f.name.replace("_", "-")
        if typ is bool:
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, help=f"(default {f.default})")
        else:
            p.add_argument(flag, dest=f.name, type=typ, metavar=typ.__name__.upper(), help=f"(default {f.default})")
    args, unknown = p.parse_known_args(argv)
    known = [f.name for f in dataclasses.fields(cls)]
    for u in unknown:
        close = difflib.get_close_matches(u.split("=")[0].lstrip("-").replace("-", "_"), known, n=1)
        hint = f"; did you mean --{close[0].replace('_', '-')}?" if close else f"; see {prog} --help"
        raise UserError(f"unknown argument {u!r}{hint}")
    values = {}
    if getattr(args, "config", None):
        try:
            values = json.loads(Path(args.config).read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read config file {args.config}: {e}") from None
        values = {k.replace("-", "_"): v for k, v in values.items()}
        for k in values:
            if k not in known:
                close = difflib.get_close_matches(k, known, n=1)
                raise UserError(f"unknown key {k!r} in {args.config}" + (f"; did you mean {close[0]!r}?" if close else ""))
    values.update({k: v for k, v in vars(args).items() if k in known})
    rest = {k: v for k, v in vars(args).items() if k not in known and k != "config"}
    return cls(**values), rest


# ----------------------------------------------------------------------------- files that survive interrupts

def read_jsonl(path: Path) -> list[dict]:
    """Records of a JSON-lines file; a last line cut short by an interrupt is dropped."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def write_atomic(path: Path, text: str) -> None:
    """Write to a temporary file, then rename: readers see the old or the new file, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- stage: collect

def collect(cfg: Config, out: Path, load) -> Path:
    """The model plays `num_games` games of `split`, `rollouts_per_game` times each; a triplet per turn.

    Turns go to `transitions.jsonl` as they happen, finished episodes to `episodes.jsonl`. Rerunning
    the same command continues: finished episodes are kept, an unfinished one is played again.
    `load()` gives (model, tokenizer), called only when there is something to play.
    """
    if cfg.env == "tau2":  # games are the domain's tasks
        tasks = {t.id: t for t in envs.tau2_tasks(cfg.domain, cfg.split, cfg.num_tasks, cfg.seed)}
        games = list(tasks)
    else:
        games = envs.list_games(cfg.split, cfg.num_games, cfg.seed)  # bad data or split fails before the model loads
    if cfg.rollouts_per_game < 1:
        raise UserError(f"--rollouts-per-game must be at least 1, got {cfg.rollouts_per_game}")
    out.mkdir(parents=True, exist_ok=True)
    job = {k: getattr(cfg, k) for k in ("model", "adapter", "seed", "split", "num_games", "rollouts_per_game",
                                        "max_turns", "history_len", "temperature", "top_p", "max_new_tokens")}
    if cfg.env != "alfworld":
        del job["num_games"]
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
    kept = [t for t in read_jsonl(transitions) if (t["game"], t["rollout"]) in finished]
    # rewrite both without a line cut short by an interrupt, and without turns of unfinished episodes
    write_atomic(transitions, "".join(json.dumps(t) + "\n" for t in kept))
    write_atomic(episodes_file, "".join(json.dumps(e) + "\n" for e in done_eps))
    game_id = (lambda g: g) if cfg.env == "tau2" else envs.game_id
    todo = [dict(game=g, rollout=r) for g in games for r in range(cfg.rollouts_per_game) if (game_id(g), r) not in finished]
    print(f"collect: {len(games)} {cfg.split} {'tasks' if cfg.env == 'tau2' else 'games'} x {cfg.rollouts_per_game} rollouts; "
          f"{len(finished)} episodes already done, {len(todo)} to play -> {transitions}")
    if todo and cfg.env == "tau2":
        torch.manual_seed(cfg.seed + len(finished))
        model, tok = load()
        user = rwml.load_model(cfg.user_model) if cfg.user_model else (None, None)
        with open(transitions, "a") as ft, open(episodes_file, "a") as fe:
            def write(f, rec):
                f.write(json.dumps(rec, default=str) + "\n")
                f.flush()

            rwml.play_tau2(model, tok, cfg.domain, [dict(ep, task=tasks[ep["game"]]) for ep in todo],
                           user_model=user[0], user_tokenizer=user[1], history_len=cfg.history_len,
                           max_turns=cfg.max_turns, temperature=cfg.temperature, top_p=cfg.top_p,
                           max_new_tokens=cfg.max_new_tokens, num_envs=cfg.num_envs, on_turn=lambda t: write(ft, t),
                           on_episode=lambda e: write(fe, e), desc="collect tau2")
    elif todo:
        torch.manual_seed(cfg.seed + len(finished))  # a resumed run does not replay the same samples
        with envs.EnvPool(cfg.num_workers, cfg.max_turns) as pool:  # workers fork before the model loads
            model, tok = load()
            with open(transitions, "a") as ft, open(episodes_file, "a") as fe:
                def write(f, rec):
                    f.write(json.dumps(rec) + "\n")
                    f.flush()

                rwml.play(model, tok, pool, todo, history_len=cfg.history_len, max_turns=cfg.max_turns,
                          temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
                          num_envs=cfg.num_envs, on_turn=lambda t: write(ft, t),
                          on_episode=lambda e: write(fe, e), desc="collect")
    eps, trips = read_jsonl(episodes_file), read_jsonl(transitions)
    n = max(len(trips), 1)
    print(f"collect: {len(trips)} triplets from {len(eps)} episodes; success {sum(e['won'] for e in eps)}/{len(eps)}, "
          f"valid actions {sum(t['valid'] for t in trips) / n:.1%}, well-formed replies "
          f"{sum(t['format_ok'] for t in trips) / n:.1%}")
    return transitions


# ----------------------------------------------------------------------------- stage: filter

def filter_triplets(cfg: Config, triplets: list[dict], out: Path, load, reward_fn) -> list[dict]:
    """METHOD.md §4: the 90 / 10 split, then the "too easy" subsampling of the 90 %. Cached in `out`."""
    kept_file, meta_file = out / "kept.jsonl", out / "filter.json"
    job = {k: getattr(cfg, k) for k in ("model", "seed", "easy_filter", "filter_split", "filter_samples", "easy_share",
                                        "easy_keep_prob", "sft_epochs", "sft_learning_rate", "embedder", "tau_d",
                                        "reward_metric", "reward_binary")} | {"num_triplets": len(triplets)}
    if kept_file.exists() and meta_file.exists() and json.loads(meta_file.read_text())["job"] == job:
        kept = read_jsonl(kept_file)
        print(f"filter: reusing {kept_file} ({len(kept)} triplets)")
        return kept
    train, filter_set = rwml.split_triplets(triplets, cfg.filter_split, cfg.seed)
    if not cfg.easy_filter:
        kept, info = train, dict(easy_share=None)
    else:
        model, tok = load()
        # the separate copy: a LoRA adapter of its own, trained, used, then removed again
        copy = rwml.add_lora(model, cfg.lora_r, cfg.lora_alpha, 0.0, cfg.lora_target_modules)
        losses = rwml.sft(copy, tok, [rwml.wm_prompt(t, reasoning=False) for t in filter_set],
                          [f"<next_state>{t['next_obs']}</next_state>" for t in filter_set], system=rwml.wm_system(filter_set[0]),
                          epochs=cfg.sft_epochs, lr=cfg.sft_learning_rate, seed=cfg.seed)
        scores = rwml.easiness(copy, tok, train, reward_fn, k=cfg.filter_samples, temperature=1.0)
        copy.unload()  # back to the bare base model; its weights were never touched
        keep, easy, tau_easy = rwml.easy_subsample(scores, cfg.easy_share, cfg.easy_keep_prob, cfg.seed)
        kept = [t for t, k in zip(train, keep) if k]
        info = dict(sft_losses=losses, tau_easy=tau_easy, easy_share=sum(easy) / max(len(easy), 1),
                    mean_easiness=sum(scores) / max(len(scores), 1))
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(out / "easiness.jsonl", "".join(json.dumps(dict(game=t["game"], step=t["step"], rollout=t["rollout"],
                     easiness=s, easy=e, kept=k)) + "\n" for t, s, e, k in zip(train, scores, easy, keep)))
    info.update(num_triplets=len(triplets), num_train=len(train), num_filter_split=len(filter_set), num_kept=len(kept))
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(kept_file, "".join(json.dumps(t) + "\n" for t in kept))
    write_atomic(meta_file, json.dumps(dict(job=job, **info), indent=2))
    print("filter: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in info.items()
                                 if k != "sft_losses"))
    return kept


# ----------------------------------------------------------------------------- stage: wm (RWML GRPO)

def save_checkpoint(path: Path, model, optimizer, state: dict) -> None:
    """Adapter (the peft way), optimizer, RNG states, data cursor and step, swapped in atomically."""
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, selected_adapters=["default"])  # not the frozen "ref"
    torch.save(dict(state, optimizer=optimizer.state_dict(), torch_rng=torch.get_rng_state(),
                    cuda_rng=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None),
               tmp / "trainer_state.pt")
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(path: Path, model, optimizer) -> dict:
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    if not path.exists() and path.with_name(path.name + ".old").exists():  # killed between the two renames
        path = path.with_name(path.name + ".old")
    set_peft_model_state_dict(model, load_file(path / "adapter_model.safetensors"))
    state = torch.load(path / "trainer_state.pt", weights_only=False)
    optimizer.load_state_dict(state.pop("optimizer"))
    torch.set_rng_state(state.pop("torch_rng"))
    cuda_rng = state.pop("cuda_rng")
    if cuda_rng is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda_rng)
    return state


def _check_at_least(cfg: Config, **bounds) -> None:
    for name, lo in bounds.items():
        if getattr(cfg, name) < lo:
            raise UserError(f"--{name.replace('_', '-')} must be at least {lo}, got {getattr(cfg, name)}")


def start_run(cfg: Config, out: Path, model, optimizer) -> tuple[dict, object]:
    """Resume from `out/checkpoint` (with --resume) or refuse to overwrite a run; write config.json;
    open TensorBoard if asked. Returns (state, writer or None)."""
    ckpt = out / "checkpoint"
    has_ckpt = ckpt.exists() or ckpt.with_name("checkpoint.old").exists()
    state = dict(step=0, epoch=0, cursor=0)
    if has_ckpt and not cfg.resume:
        raise UserError(f"{out} already holds a run; pass --resume to continue it, or use another --out")
    if has_ckpt:
        state = load_checkpoint(ckpt, model, optimizer)
        print(f"resumed from {ckpt} at step {state['step']}")
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "config.json", json.dumps(dataclasses.asdict(cfg), indent=2))
    writer = None
    if cfg.report_to == "tensorboard":
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UserError("--report-to tensorboard needs the tensorboard package: pip install tensorboard") from None
        writer = SummaryWriter(str(out / "tensorboard"))
    elif cfg.report_to != "none":
        raise UserError(f"unknown --report-to {cfg.report_to!r}; choose none or tensorboard")
    return state, writer


def log_row(metrics, writer, row: dict) -> None:
    metrics.write(json.dumps(row) + "\n")
    metrics.flush()
    if writer:
        for k, v in row.items():
            if isinstance(v, (int, float)) and k != "step":
                writer.add_scalar(f"train/{k}", v, row["step"])


def save_adapter(model, out: Path) -> Path:
    """The trained adapter alone, the peft way (`PeftModel.from_pretrained(base, out / "adapter")`)."""
    adapter, tmp = out / "adapter", out / "adapter.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, selected_adapters=["default"])
    shutil.rmtree(adapter, ignore_errors=True)
    tmp.rename(adapter)
    return adapter


def train_wm(cfg: Config, triplets: list[dict], out: Path, load, reward_fn):
    """RWML: GRPO of a LoRA adapter on world-model prompts. Returns the peft model."""
    _check_at_least(cfg, max_steps=1, prompts_per_step=1, num_generations=2, micro_batch_size=1, num_iterations=1,
                    save_steps=1, max_completion_length=1)
    if not triplets:
        raise UserError("no training triplets left after filtering; collect more games")
    if cfg.reward_control == "mis":  # each triplet is scored against another triplet's next observation
        perm = derangement(len(triplets), cfg.seed)
        triplets = [dict(t, next_obs=triplets[j]["next_obs"]) for t, j in zip(triplets, perm)]
    elif cfg.reward_control == "coin":
        reward_fn = coin_reward(cfg.seed)
    elif cfg.reward_control != "none":
        raise UserError(f"unknown --reward-control {cfg.reward_control!r}; choose none, mis or coin")
    model, tok = load()
    torch.manual_seed(cfg.seed)  # the LoRA init and the sampling depend on the seed alone
    model = rwml.add_lora(model, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules,
                          cfg.gradient_checkpointing)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.learning_rate,
                                  weight_decay=0.0)
    state, writer = start_run(cfg, out, model, optimizer)

    def order(epoch):  # the data order of an epoch depends only on (seed, epoch): resumable by cursor
        idx = list(range(len(triplets)))
        random.Random(cfg.seed * 1000 + epoch).shuffle(idx)
        return idx

    bar = tqdm(total=cfg.max_steps, initial=state["step"], desc="rwml grpo", unit="step", dynamic_ncols=True)
    with open(out / "metrics.jsonl", "a") as metrics, open(out / "samples.jsonl", "a") as samples:
        while state["step"] < cfg.max_steps:
            batch = []
            while len(batch) < cfg.prompts_per_step:
                idx = order(state["epoch"])
                if state["cursor"] >= len(idx):
                    state.update(epoch=state["epoch"] + 1, cursor=0)
                    continue
                batch.append(triplets[idx[state["cursor"]]])
                state["cursor"] += 1
            t0 = time.time()
            res = rwml.grpo_step(model, tok, optimizer, batch, reward_fn, cfg)
            seconds = (time.time() - t0) / len(res["updates"])
            for u in res["updates"]:
                if state["step"] >= cfg.max_steps:
                    break
                state["step"] += 1
                log_row(metrics, writer, dict(step=state["step"], epoch=state["epoch"], **{k: res[k] for k in (
                    "reward_mean", "reward_std", "frac_reward_zero_std", "format_rate", "completion_tokens")},
                    **u, lr=cfg.learning_rate, seconds=round(seconds, 2)))
                if u["skipped"]:
                    tqdm.write(f"wm: step {state['step']}: non-finite loss or gradient, update skipped")
                bar.update(1)
                bar.set_postfix(reward=f"{res['reward_mean']:.2f}", fmt=f"{res['format_rate']:.2f}",
                                loss=f"{u['loss']:.3f}", kl=f"{u['kl']:.4f}")
            if state["step"] % cfg.log_completions_steps < len(res["updates"]) or state["step"] == len(res["updates"]):
                sample = dict(step=state["step"], action=batch[0]["action"], completion=res["sample"],
                              target=res["sample_target"], reward=res["sample_reward"])
                samples.write(json.dumps(sample) + "\n")
                samples.flush()
                tqdm.write(f"[step {state['step']}] action: {sample['action']!r}\n  predicted: "
                           f"{sample['completion'][-300:]!r}\n  real: {sample['target']!r}  reward {sample['reward']:.0f}")
            if state["step"] % cfg.save_steps < len(res["updates"]) or state["step"] >= cfg.max_steps:
                save_checkpoint(out / "checkpoint", model, optimizer, state)
    bar.close()
    if writer:
        writer.close()
    adapter = save_adapter(model, out)
    plot_rewards(out / "metrics.jsonl", out / "reward_curve.png", "RWML world-model GRPO")
    print(f"wm: {state['step']} steps; adapter -> {adapter}; metrics -> {out / 'metrics.jsonl'}")
    return model


# ----------------------------------------------------------------------------- baselines: WM SFT, RFT (METHOD.md §7)

def sft_adapter(cfg: Config, model, tok, prompts: list[str], answers: list[str], system: str, out: Path, **info):
    """The SFT baselines: a fresh LoRA adapter, plain SFT, saved with config.json and sft.json (losses, info)."""
    torch.manual_seed(cfg.seed)
    model = rwml.add_lora(model, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules,
                          cfg.gradient_checkpointing)
    losses = rwml.sft(model, tok, prompts, answers, system=system, epochs=cfg.sft_epochs, lr=cfg.sft_learning_rate,
                      seed=cfg.seed)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "config.json", json.dumps(dataclasses.asdict(cfg), indent=2))
    write_atomic(out / "sft.json", json.dumps(dict(losses=losses, **info), indent=2))
    return model, losses, save_adapter(model, out)


def train_wm_sft(cfg: Config, triplets: list[dict], out: Path, load):
    """WM SFT: plain next-observation SFT (no reasoning) of a fresh LoRA adapter on the same 90 % split
    RWML draws from (without the easy filter, which exists for RL)."""
    train, _ = rwml.split_triplets(triplets, cfg.filter_split, cfg.seed)
    model, tok = load()
    model, losses, adapter = sft_adapter(cfg, model, tok, [rwml.wm_prompt(t, reasoning=False) for t in train],
                                         [f"<next_state>{t['next_obs']}</next_state>" for t in train],
                                         rwml.wm_system(train[0]), out, num_triplets=len(train))
    print(f"wm-sft: {len(train)} triplets x {cfg.sft_epochs} epochs, loss {losses[0]:.3f} -> {losses[-1]:.3f}; "
          f"adapter -> {adapter}")
    return model


def train_rft(cfg: Config, out: Path, load):
    """RFT: the model plays the train games (tau2: tasks) rollouts_per_game times; SFT on its successes."""
    turns = []
    games, workers = split_games(cfg)
    with envs.EnvPool(workers, cfg.max_turns) if workers is not None else contextlib.nullcontext() as pool:
        model, tok = load()  # ALFWorld's workers fork before the model loads
        torch.manual_seed(cfg.seed)
        summaries = rwml.rollouts(model, tok, pool, games, cfg.rollouts_per_game, cfg, on_turn=turns.append,
                                  desc="rft rollouts")
    won = {i for i, s in enumerate(summaries) if s["won"]}
    keep = [t for t in turns if t["episode"] in won]
    if not keep:
        raise UserError(f"RFT: none of the {len(summaries)} episodes succeeded, so there is nothing to fine-tune on; "
                        "play more games (--num-games, --rollouts-per-game, --max-turns) or use a stronger --model")
    system = rwml.TAU2_AGENT_SYSTEM if cfg.env == "tau2" else rwml.AGENT_SYSTEM
    model, _, adapter = sft_adapter(cfg, model, tok, [t["prompt"] for t in keep], [t["response"] for t in keep], system,
                                    out, episodes=len(summaries), successes=len(won), turns=len(keep))
    print(f"rft: {len(won)}/{len(summaries)} episodes succeeded, SFT on their {len(keep)} turns; adapter -> {adapter}")
    return model


def split_games(cfg: Config) -> tuple[list, int | None]:
    """The games a stage plays (ALFWorld game files, or tau2 tasks) and the number of ALFWorld game
    workers (None for tau2, whose tools run in-process)."""
    if cfg.env == "tau2":
        return envs.tau2_tasks(cfg.domain, cfg.split, cfg.num_tasks, cfg.seed), None
    return envs.list_games(cfg.split, cfg.num_games, cfg.seed), cfg.num_workers


# ----------------------------------------------------------------------------- stage 2: policy RL (METHOD.md §6)

def init_policy(cfg: Config, model):
    """The policy to train and its KL reference: from the base model, a fresh adapter (reference = adapter
    disabled); from an RWML / WM-SFT / RFT adapter, that adapter trains on and a frozen copy of it, named
    "ref", is pi_ref (`rwml.reference_policy`)."""
    if cfg.init == "base":
        return rwml.add_lora(model, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules,
                             cfg.gradient_checkpointing)
    model.load_adapter(cfg.adapter, adapter_name="ref", is_trainable=False)
    model.set_adapter("default")  # the adapter loaded with the model, trainable
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(use_reentrant=False))
        model.enable_input_require_grads()
    return model


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
    _check_at_least(cfg, max_steps=1, games_per_step=1, num_generations=2, micro_batch_size=1, num_iterations=1,
                    save_steps=1, max_new_tokens=1)
    games, workers = split_games(cfg)
    with envs.EnvPool(workers, cfg.max_turns) if workers is not None else contextlib.nullcontext() as pool:
        model, tok = load()  # ALFWorld's workers fork before the model loads
        torch.manual_seed(cfg.seed)
        model = init_policy(cfg, model)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.learning_rate,
                                      weight_decay=0.0)
        state, writer = start_run(cfg, out, model, optimizer)
        bar = tqdm(total=cfg.max_steps, initial=state["step"], desc=f"policy grpo ({cfg.init})", unit="step",
                   dynamic_ncols=True)
        with open(out / "metrics.jsonl", "a") as metrics:
            while state["step"] < cfg.max_steps:
                # the games of a step depend only on (seed, step): a resumed run plays the same ones
                step_games = random.Random(cfg.seed * 1000 + state["step"]).sample(games, min(cfg.games_per_step, len(games)))
                t0 = time.time()
                res = rwml.policy_step(model, tok, optimizer, pool, step_games, cfg)
                state["step"] += 1
                u = res["updates"][-1]
                log_row(metrics, writer, dict(step=state["step"], **{k: v for k, v in res.items() if k not in ("updates", "sample")},
                                              **u, lr=cfg.learning_rate, seconds=round(time.time() - t0, 2)))
                bar.update(1)
                bar.set_postfix(success=f"{res['reward_mean']:.2f}", invalid=f"{res['invalid_action_rate']:.2f}",
                                trained=res["trained_turns"], kl=f"{u['kl']:.4f}")
                if state["step"] % cfg.save_steps == 0 or state["step"] >= cfg.max_steps:
                    save_checkpoint(out / "checkpoint", model, optimizer, state)
        bar.close()
    if writer:
        writer.close()
    adapter = save_adapter(model, out)
    plot_rewards(out / "metrics.jsonl", out / "reward_curve.png", f"policy GRPO from {cfg.init}: success per step")
    print(f"policy: {state['step']} steps from {cfg.init}; adapter -> {adapter}; metrics -> {out / 'metrics.jsonl'}")
    return model


def plot_rewards(metrics_file: Path, png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_jsonl(metrics_file)
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
    ax.set_xlabel("optimizer step")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def make_reward(cfg: Config) -> SimToRealReward:
    return SimToRealReward(cfg.embedder, cfg.tau_d, cfg.reward_metric, cfg.reward_binary)


def read_transitions(path: str | None) -> list[dict]:
    if not path:
        raise UserError("--transitions is required: the transitions.jsonl of a collection (python train.py collect)")
    if not Path(path).is_file():
        raise UserError(f"transitions file not found: {path}")
    trips = read_jsonl(Path(path))
    if not trips or not {"history", "action", "next_obs"} <= trips[0].keys():
        raise UserError(f"{path} holds no triplets (expected JSON lines with history, action, next_obs)")
    return trips


# ----------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    stage = argv[0] if argv and not argv[0].startswith("-") else "all"
    if stage not in STAGES:
        close = difflib.get_close_matches(stage, STAGES, n=1)
        raise UserError(f"unknown stage {stage!r}; choose one of {', '.join(STAGES)}"
                        + (f" (did you mean {close[0]!r}?)" if close else ""))
    cfg, _ = parse_config(Config, argv[1:] if argv and argv[0] == stage else argv, prog=f"train.py {stage}")
    check_choices(cfg)
    out, t0 = Path(cfg.out), time.time()
    four_bit = torch.cuda.is_available() if cfg.load_in_4bit is None else cfg.load_in_4bit
    loaded = []

    def load():  # one model for all stages of this process, loaded at first need
        if not loaded:
            adapter = cfg.adapter if stage in ("collect", "policy") else None
            loaded.append(rwml.load_model(cfg.model, adapter, load_in_4bit=four_bit, trainable_adapter=stage == "policy"))
        return loaded[0]

    if stage == "collect":
        collect(cfg, out, load)
        return
    if stage == "policy":
        train_policy(cfg, out, load)
        return
    if stage == "rft":
        train_rft(cfg, out, load)
        return
    if stage == "wm-sft":
        train_wm_sft(cfg, read_transitions(cfg.transitions), out, load)
        return
    reward_fn = make_reward(cfg)
    if stage in ("filter", "wm"):
        trips = read_transitions(cfg.transitions)
        kept = filter_triplets(cfg, trips, out / "filter", load, reward_fn)
        if stage == "wm":
            train_wm(cfg, kept, out, load, reward_fn)
        return
    # all: collect on train games, collect held-out games, RWML, world-model accuracy before / after
    trips = read_jsonl(collect(cfg, out / "collect", load))
    heldout_cfg = dataclasses.replace(cfg, split=cfg.heldout_split, num_games=cfg.heldout_games, rollouts_per_game=1)
    heldout = read_jsonl(collect(heldout_cfg, out / "heldout", load))
    if cfg.eval_max_triplets:
        heldout = [heldout[i] for i in sorted(random.Random(cfg.seed).sample(
            range(len(heldout)), min(cfg.eval_max_triplets, len(heldout))))]
    kept = filter_triplets(cfg, trips, out / "filter", load, reward_fn)
    model, tok = load()
    base_file = out / "wm_eval_base.json"
    if not base_file.exists():
        write_atomic(base_file, json.dumps(rwml.evaluate_wm(model, tok, heldout, reward_fn, reasoning=cfg.wm_reasoning,
                                                           max_new_tokens=cfg.max_completion_length), indent=2))
    model = train_wm(dataclasses.replace(cfg, resume=cfg.resume or (out / "checkpoint").exists()), kept, out, load,
                     reward_fn)
    after = rwml.evaluate_wm(model, tok, heldout, reward_fn, reasoning=cfg.wm_reasoning,
                             max_new_tokens=cfg.max_completion_length)
    write_atomic(out / "wm_eval_rwml.json", json.dumps(after, indent=2))
    before = json.loads(base_file.read_text())
    print(f"\nheld-out world-model accuracy ({cfg.heldout_split}, {before['n']} triplets, tau_d {cfg.tau_d}):")
    for name, r in (("base", before), ("RWML", after)):
        print(f"  {name:<5} wm_accuracy {r['wm_accuracy']:.3f}  mean_cosine {r['mean_cosine']:.3f}  "
              f"exact_match {r['exact_match']:.3f}  format {r['format_rate']:.3f}")
    print(f"all: done in {(time.time() - t0) / 60:.1f} min -> {out}")


def run_cli(main, on_interrupt: str = "interrupted") -> None:
    """Bad input is one line on stderr and exit status 1, never a traceback."""
    try:
        main()
    except UserError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit(on_interrupt)


if __name__ == "__main__":
    run_cli(main, "interrupted: rerun the same command (with --resume for `wm`) to continue where it stopped")
