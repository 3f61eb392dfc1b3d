"""RWML -- Reinforcement World Model Learning for LLM agents (Yu et al., arXiv 2602.05842): the
method, on ALFWorld, with the agent writing free-form replies (generate mode, the paper's).

Read top to bottom, in the paper's order, numbered as METHOD.md (next to this file) numbers it;
`§N` points to its notes (what the paper says, our default where it is silent). Settings:
stages/settings.py (a function here reads the fields it names from its `cfg`).
  §2 Data: the model plays, each turn a (history, action, next obs) triplet; world-model prompts
     (the reply starts at <next_state>; the paper's thinks first: --wm-reasoning); filter's split.
  §3 Reward: the sim-to-real gap in a sentence-embedding space, with a ROUGE-1 gate (reward.py).
  §4 "Too easy" subsampling with a separately fine-tuned copy (ours: also the warm-up; mixed only).
  §5 GRPO on world-model prompts; log pi defined plainly (`logprobs`); the KL's reference.
  §6 Stage 2: policy RL on task success, from the RWML model; the paper's actor (`GENERATE`).
  §8 Evaluation: world-model accuracy on held-out triplets.
§7 (the baselines) is in train.py. Skip on a first read: engine/ (models, sampling, SFT, LoRA, log
pi computed fast), choose/ (choose mode's actor), worlds/ (TextWorld, tau2-bench).
"""
from __future__ import annotations

import math
import random
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from typing import TypedDict

import torch
from tqdm.auto import tqdm

import envs
from engine import add_lora, by_length, completion_logprobs, group_logprobs, pack, sample_chat, sft
from envs import UserError, parse_next_state

ALFWORLD_LEN = envs.Alfworld.max_completion_length  # a prediction's tokens in the default run

# ============================================================================== §2 Data: collection
# The base model plays ALFWorld's *training* games at temperature 1.0 (3 rollouts per game in the
# paper). Failures and invalid actions are kept: a world model must also learn "Nothing happens.".
# Each turn: (history s_<=t = last H (obs, action) pairs + current obs, action a_t, next obs s_t+1).

class Triplet(TypedDict, total=False):
    """One turn of play, the method's unit of data (`play`'s `on_turn`; transitions.jsonl)."""
    game: str  # the game file or tau2 task id
    task: str
    task_type: str
    rollout: int
    episode: int  # the episode's index in `play`'s list
    step: int
    history: list[dict]  # the last H {"observation", "action"} pairs, then {"observation": s_t}
    action: str  # a_t as the environment parsed it
    next_obs: str  # s_t+1: the world model's target
    valid: bool
    format_ok: bool
    won: bool
    done: bool
    response: str  # the model's whole reply ("" when `explored`)
    explored: bool  # the action was drawn by `env.explore`, not the model
    env: str  # absent: ALFWorld (`env.turn_fields`: textworld, tau2 and its domain)
    # with record_tokens (stage 2): the prompt, the exact tokens seen and produced (choose: more)
    prompt: str
    prompt_ids: list[int]
    completion_ids: list[int]


@dataclass
class Running:
    """An episode in play: its index in the caller's list, its summary, observation, past pairs."""
    index: int
    summary: dict
    obs: str
    past: list = field(default_factory=list)


def play(model, tokenizer, env, episodes: list[dict], *, actor=None, history_len: int = 2,
         temperature: float = 1.0, top_p: float = 1.0, max_new_tokens: int = 64, num_envs: int = 16,
         on_turn=None, on_episode=None, record_tokens: bool = False, explore_prob: float = 0.0,
         seed: int = 0, desc: str = "episodes") -> list[dict]:
    """Play `episodes` ({"game": a game file, ...}) in `env` (`envs.make`), `num_envs` at once:
    each round, one reply for every running episode in one batch, then a step of each; a finished
    episode's slot goes to the next waiting one. `on_turn(triplet)`, `on_episode(summary)` see
    results as they happen. `record_tokens`: each turn adds its prompt and the exact tokens the
    model saw and sampled, which stage 2 trains on. `explore_prob`: the chance that a turn's reply
    is `env.explore`'s. `actor` writes the replies: `GENERATE` (free-form ReAct replies, the
    paper's; §6) or choose mode's. Returns one summary per episode, in the order given."""
    actor = actor or GENERATE
    if num_envs < 1:
        raise UserError(f"--num-envs must be at least 1, got {num_envs}")
    env.bind_model(model, tokenizer, temperature=temperature, top_p=top_p)  # tau2's customer
    waiting, running, summaries = list(enumerate(episodes)), {}, [None] * len(episodes)
    free_slots, rng = list(range(num_envs))[::-1], random.Random(seed)
    explore_prob = explore_prob if env.can_explore else 0.0
    bar = tqdm(total=len(episodes), desc=desc, unit="ep", dynamic_ncols=True)
    while waiting or running:
        starts = {}
        while waiting and free_slots:
            starts[free_slots.pop()] = waiting.pop(0)
        for slot, s in env.reset({slot: ep for slot, (_, ep) in starts.items()}).items():
            i, ep = starts[slot]
            counts = dict.fromkeys(env.counters, 0)
            summary = dict(ep, game=s["game"], task=s["task"], task_type=s["task_type"], won=False,
                           steps=0, **counts)
            running[slot] = Running(i, summary, s["obs"])
        slots = sorted(running)
        explored = {s: explore_prob > 0 and rng.random() < explore_prob for s in slots}
        asked = [s for s in slots if not explored[s]]  # the model writes these slots' replies
        recent = {s: running[s].past[-history_len:] if history_len else [] for s in slots}
        replies, tokens = actor.act(model, tokenizer, env, asked, recent, temperature=temperature,
                                    top_p=top_p, max_new_tokens=max_new_tokens,
                                    record=record_tokens, rng=rng)
        replies.update({s: env.explore(s, rng) for s in slots if explored[s]})
        results = env.step(replies)
        for s in slots:
            e, r = running[s], results[s]
            summ = e.summary
            if on_turn is not None:
                history = [{"observation": o, "action": a} for o, a in recent[s]]
                history.append({"observation": e.obs})
                turn = dict(env.turn_fields, game=summ["game"], task=summ["task"],
                            task_type=summ["task_type"], rollout=summ.get("rollout", 0),
                            episode=e.index, step=summ["steps"], history=history,
                            action=r["action"], next_obs=r["obs"], valid=r["valid"],
                            format_ok=r["format_ok"], won=r["won"], done=r["done"],
                            response="" if explored[s] else replies[s], explored=explored[s])
                if record_tokens and s in tokens:  # the exact tokens the model saw and produced
                    turn.update(tokens[s])
                on_turn(turn)
            for k, v in r["counts"].items():
                summ[k] += int(v)
            if "explored" in summ:
                summ["explored"] += explored[s]
            summ.update(steps=summ["steps"] + 1, won=r["won"])
            e.past.append((e.obs, r["action"]))
            e.obs = r["obs"]
            if r["done"]:
                summ.update(env.finish(s))
                summaries[e.index] = summ
                if on_episode is not None:
                    on_episode(summ)
                del running[s]
                free_slots.append(s)
                bar.update(1)
        bar.set_postfix(won=sum(bool(x and x["won"]) for x in summaries), running=len(running))
    bar.close()
    return summaries


# ================================================= §2 Data: world-model prompts, the filter's split
# The same LLM that acts now predicts: given the task, the history and an action, what will the
# game say? With --wm-reasoning (the paper's) it reasons in <think>, then writes <next_state>; by
# default (ours) its reply starts at <next_state>. Only the <next_state> text is scored (reward.py).
# System prompt and question: the triplet's environment's (`env`, absent: ALFWorld; its class's).
WM_PREFIX, WM_STOP = "<think>", "</next_state>"


def wm_prefix(reasoning: bool) -> str:
    """The start of the world model's reply, written for it: <think> (the paper's reasoning), or
    the answer tag itself, so that a small model only has to write the observation."""
    return WM_PREFIX if reasoning else "<next_state>"


def wm_system(t: Triplet) -> str:
    return envs.env_class(t.get("env", "alfworld")).wm_system


def wm_prompt(t: Triplet, reasoning: bool = False) -> str:
    """(history s_<=t, action a_t) of a triplet -> the prompt whose answer is s_t+1."""
    question, what, example = envs.env_class(t.get("env", "alfworld")).wm_ask
    lines = [f"The agent's task: {t['task']}"]
    lines += [f"[Observation] {h['observation']}\n[Action] {h['action']}"
              for h in t["history"][:-1]]
    lines += [f"[Current observation] {t['history'][-1]['observation']}", f"[Action] {t['action']}"]
    if reasoning:
        lines += [f"{question} Reply in this exact format: first think briefly inside <think> "
                  f"</think>, then write {what} inside <next_state> </next_state>, for example:",
                  example]
    else:  # no reasoning: the easiness filter's SFT copy (METHOD.md §4), or --no-wm-reasoning
        lines += [f"{question} Write it inside <next_state> </next_state>."]
    return "\n".join(lines)


def wm_answer(t: Triplet) -> str:
    """The supervised answer to `wm_prompt(t, reasoning=False)`, after `wm_prefix(False)`."""
    return f"{t['next_obs']}</next_state>"


def wm_texts(t: Triplet, reasoning: bool) -> tuple[str, str, str, str]:
    """(system prompt, prompt, reply prefix, stop) of a triplet's world-model chat, for what takes
    it as an argument rather than import the method (model cards, verl's export, stages.runs)."""
    return wm_system(t), wm_prompt(t, reasoning), wm_prefix(reasoning), WM_STOP


def sample_predictions(model, tokenizer, triplets: list[Triplet], *, reasoning: bool, n: int = 1,
                       max_new_tokens: int = ALFWORLD_LEN, temperature: float = 1.0,
                       top_p: float = 1.0):
    """`n` predictions per triplet (all of one environment), each ending at </next_state>."""
    return sample_chat(model, tokenizer, [wm_prompt(t, reasoning) for t in triplets], n=n,
                       system=wm_system(triplets[0]), prefix=wm_prefix(reasoning), stop=WM_STOP,
                       max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)


def split_triplets(triplets: list[Triplet], frac: float = 0.35, seed: int = 0) -> tuple[list, list]:
    """The paper's 90 / 10 split (ours 65 / 35, --filter-split): (RWML training triplets, triplets
    that train the easiness filter's copy, which is also the warm-up)."""
    if len(triplets) < 2:
        raise UserError(f"need at least 2 triplets to split, got {len(triplets)}; "
                        "collect more games")
    order = list(range(len(triplets)))
    random.Random(seed).shuffle(order)
    n = min(max(1, round(frac * len(triplets))), len(triplets) - 1)
    return [triplets[i] for i in sorted(order[n:])], [triplets[i] for i in sorted(order[:n])]


# ======================================================================================== §3 Reward
# r_WM = 1 iff 1 - cos(E(pred), E(real)) < tau_d and ROUGE-1 F(pred, real) >= the gate (the
# authors' code), E a sentence-embedding model: reward.py. Unset tau_d, gate, cap: the env class's.


# ======================================================================== §4 "Too easy" subsampling
# A separate copy (its own LoRA adapter, removed afterwards) is fine-tuned on the filter's split
# (the paper's 10 %, ours 35 %) to predict s_t+1 directly. Its K samples per training triplet give
# easiness = mean r_WM; the paper keeps the easiest ~30 % with probability 0.1 (else Qwen2.5-7B
# collapses, its Table 4). Ours: the copy is also the warm-up; GRPO gets only mixed triplets.

def easiness(model, tokenizer, triplets: list[Triplet], reward_fn, *, k: int = 4,
             max_new_tokens: int = ALFWORLD_LEN, temperature: float = 1.0,
             batch_size: int = 32) -> list[float]:
    """Mean reward of `k` sampled direct predictions (no reasoning) per triplet. `max_new_tokens`
    must leave room for the longest target (train.py passes max_completion_length): a prediction
    cut short has no closing tag and scores 0, so a long target could never count as easy."""
    per = max(1, batch_size // k)
    order = by_length([wm_prompt(t, reasoning=False) for t in triplets])
    scores = [0.0] * len(triplets)
    for i in tqdm(range(0, len(triplets), per), desc="easiness", unit="batch", dynamic_ncols=True):
        chunk = [triplets[j] for j in order[i:i + per]]
        outs = sample_predictions(model, tokenizer, chunk, reasoning=False, n=k,
                                  max_new_tokens=max_new_tokens, temperature=temperature).texts
        r = reward_fn(outs, [t["next_obs"] for t in chunk for _ in range(k)])
        for j, idx in enumerate(order[i:i + per]):
            scores[idx] = sum(r[j * k:(j + 1) * k]) / k
    return scores


def easy_threshold(scores: list[float], easy_share: float = 0.3) -> float | None:
    """tau_easy for the rule "easy iff easiness >= tau_easy": K samples give K + 1 values, so no
    threshold gives `easy_share` exactly; the value whose share at or above it is closest (the
    smaller on a tie). Never 0: nobody is easy when every sample failed."""
    values = sorted({s for s in scores if s > 0})
    if not values:
        return None
    share = {v: sum(s >= v for s in scores) / len(scores) for v in values}
    return min(values, key=lambda v: (abs(share[v] - easy_share), v))


def easy_subsample(scores: list[float], easy_share: float = 0.3, keep_prob: float = 0.1,
                   seed: int = 0) -> tuple[list[bool], list[bool], float | None]:
    """(keep, easy, tau_easy): easy ones (`easy_threshold`) kept with probability `keep_prob`."""
    tau_easy = easy_threshold(scores, easy_share)
    easy = [tau_easy is not None and s >= tau_easy for s in scores]
    rng = random.Random(seed)
    keep = [not e or rng.random() < keep_prob for e in easy]
    return keep, easy, tau_easy


def filter_copy(model, tokenizer, split: list[Triplet], cfg, *, more: list[Triplet] = (),
                seed: int = 0, resume_file=None):
    """The separate copy (a LoRA adapter) fine-tuned on the filter's split and `more` triplets never
    GRPO's (ours: other train games'; 1 epoch, else 3). Returns (the copy, each epoch's loss)."""
    torch.manual_seed(seed)
    copy = add_lora(model, cfg.lora_r, cfg.lora_alpha, 0.0, cfg.lora_target_modules)
    rows = list(split) + list(more)
    losses = sft(copy, tokenizer, [wm_prompt(t, reasoning=False) for t in rows],
                 [wm_answer(t) for t in rows], system=wm_system(rows[0]), prefix=wm_prefix(False),
                 epochs=cfg.sft_epochs or (1 if more else 3), lr=cfg.sft_learning_rate, seed=seed,
                 resume_file=resume_file)
    return copy, losses


def filter_keep(copy, tokenizer, train: list[Triplet], reward_fn, cfg,
                seed: int = 0) -> tuple[list, dict]:
    """Which training triplets GRPO gets, by the copy's easiness (cfg.filter_samples predictions
    each): cfg.easy_filter, the paper's subsampling; cfg.mixed_only (ours, with the warm-up): only
    triplets whose K predictions were mixed, the only ones whose groups carry a gradient."""
    scores = easiness(copy, tokenizer, train, reward_fn, k=cfg.filter_samples,
                      max_new_tokens=cfg.max_completion_length, temperature=1.0)
    keep = [True] * len(train)
    info = dict(scores=scores, easy=[False] * len(train), easy_share=None,
                mean_easiness=sum(scores) / len(scores),
                easiness_counts={f"{v:g}": scores.count(v) for v in sorted(set(scores))})
    if cfg.easy_filter:
        keep, info["easy"], tau_easy = easy_subsample(scores, cfg.easy_share, cfg.easy_keep_prob,
                                                      seed)
        info.update(tau_easy=tau_easy, easy_share=sum(info["easy"]) / max(len(train), 1),
                    target_easy_share=cfg.easy_share)
    if cfg.mixed_only and cfg.warmup:  # all K right or all K wrong: no gradient in its groups
        info.update(mixed_share=sum(0 < e < 1 for e in scores) / len(scores))
        if any(mixed := [k and 0 < e < 1 for k, e in zip(keep, scores)]):
            keep = mixed
        else:  # RWML would have nothing to train on (a tiny or untrained model): say so, keep all
            print("filter: no triplet's K predictions were mixed; --mixed-only keeps all",
                  file=sys.stderr)
    return keep, info


# ========================================================================================== §5 GRPO
#   A_i  = r_i - mean(r_group)       ours (Dr. GRPO); the paper's / std(r_group) (scale_rewards)
#   loss = sum_i,t w_it [-min(rho_t A_i, clip(rho_t, 1 - eps, 1 + eps_high) A_i)
#                        + beta KL_k3(pi_theta || pi_ref)],
#   rho_t = pi_theta(token) / pi_old(token)
#   w_it = 1 / (B * max_completion_length) (ours, dr_grpo; the paper's grpo: 1 / (|o_i| * B))
# With num_iterations 1 (the default) pi_old is pi_theta at the update itself: rho is 1, the clip
# never binds (it does from 2), and the gradient is plain REINFORCE with a group baseline. pi_ref:
# the adapter's start (the warm-up adapter, else the bare base model), `reference_policy`.

@dataclass
class Batch:
    """One GRPO update's data: per row a sampled completion, its advantage, its tokens' loss
    weights. A group's rows are next to each other. (Choose mode's: choose.ChoiceBatch.)"""
    input_ids: torch.Tensor  # [B, P + C]: the left-padded prompt, then the completion
    attention_mask: torch.Tensor  # [B, P + C]
    completion_mask: torch.Tensor  # [B, C]: 1 on the sampled tokens
    advantages: torch.Tensor  # [B]
    weights: torch.Tensor  # [B, C]
    prompt_ids: torch.Tensor | None = None  # [B / G, P]: each group's prompt once
    prompt_mask: torch.Tensor | None = None
    group_size: int = 1  # G when prompt_ids is set


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "none"):
    """Group-normalised advantages (TRL's `scale_rewards`: group / batch / none; unbiased std)."""
    grouped = rewards.view(-1, num_generations)
    adv = (grouped - grouped.mean(1, keepdim=True)).view(-1)
    if scale_rewards == "group":
        return adv / (grouped.std(1).repeat_interleave(num_generations) + 1e-4)
    if scale_rewards == "batch":
        return adv / (rewards.std() + 1e-4)
    if scale_rewards == "none":
        return adv
    raise UserError(f"unknown scale_rewards {scale_rewards!r}; choose group, batch or none")


def token_weights(mask: torch.Tensor, loss_type: str, max_completion_length: int) -> torch.Tensor:
    """Per-token weights that turn a sum over tokens into each loss_type's average (whole batch).
    grpo: mean over each sequence's tokens, then over sequences; dapo: mean over all tokens of the
    batch; dr_grpo: sum / (sequences x max_completion_length), no length bias."""
    mask = mask.float()
    if loss_type == "grpo":
        return mask / mask.sum(1, keepdim=True).clamp(min=1) / mask.shape[0]
    if loss_type == "dapo":
        return mask / mask.sum().clamp(min=1)
    if loss_type == "dr_grpo":
        return mask / (mask.shape[0] * max_completion_length)
    raise UserError(f"unknown loss_type {loss_type!r}; choose grpo, dapo or dr_grpo")


def kl_k3(ref_logp: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi_theta || pi_ref), the k3 estimator: unbiased, never negative."""
    return torch.exp(ref_logp - logp) - (ref_logp - logp) - 1


def grpo_loss(logp, old_logp, ref_logp, advantages, weights, *, beta: float, epsilon: float = 0.2,
              epsilon_high: float | None = None) -> torch.Tensor:
    """The clipped surrogate plus beta * KL per token, averaged by `weights` (`token_weights`).
    Per-token tensors are [B, C]; advantages is [B]."""
    ratio, a = torch.exp(logp - old_logp), advantages.unsqueeze(1)
    clipped = ratio.clamp(1 - epsilon, 1 + (epsilon if epsilon_high is None else epsilon_high))
    per_token = -torch.min(ratio * a, clipped * a)
    if beta:
        per_token = per_token + beta * kl_k3(ref_logp, logp)
    return (per_token * weights).sum()


def grpo_step(model, tokenizer, optimizer, triplets: list[Triplet], reward_fn, cfg, *,
              reasoning: bool = False) -> dict:
    """One RWML step on world-model prompts: a group of predictions per prompt, scored against the
    real next observations, normalised within groups; `num_iterations` updates."""
    G = cfg.num_generations
    # 1. a group of G predictions o_1..o_G per prompt, sampled from pi_theta (the update's pi_old)
    model.eval()  # sampling
    roll = sample_predictions(model, tokenizer, triplets, reasoning=reasoning, n=G,
                              max_new_tokens=cfg.max_completion_length, temperature=cfg.temperature,
                              top_p=cfg.top_p)
    # 2. r_i = r_WM(o_i, s_t+1), each against its triplet's real next observation (§3)
    targets = [t["next_obs"] for t in triplets for _ in range(G)]
    rewards = torch.tensor(reward_fn(roll.texts, targets), dtype=torch.float)
    # 3. A_i = r_i - mean(r_group) (/ std(r_group) with scale_rewards group), token weights w_it
    ids, attn, cmask = roll.input_ids, roll.attention_mask, roll.completion_mask
    advantages = group_advantages(rewards, G, cfg.scale_rewards)
    batch = Batch(input_ids=ids, attention_mask=attn, completion_mask=cmask, advantages=advantages,
                  weights=token_weights(cmask, cfg.loss_type, cfg.max_completion_length))
    if cfg.shared_prompt_forward:  # a group's completions share its prompt's forward, as sampled
        P = ids.shape[1] - cmask.shape[1]
        batch = replace(batch, prompt_ids=ids[::G, :P], prompt_mask=attn[::G, :P], group_size=G)
    # 4. num_iterations optimizer steps on the clipped loss with KL (`grpo_update`)
    stats = grpo_update(model, optimizer, batch, cfg)
    grouped, lengths = rewards.view(-1, G), cmask.sum(1).float()  # lengths: TRL's completions/*
    clipped = float((lengths >= cfg.max_completion_length).float().mean())
    parsed = sum(parse_next_state(t) is not None for t in roll.texts)
    return dict(reward_mean=float(rewards.mean()),
                reward_std=float(rewards.std()) if G > 1 else 0.0,
                frac_reward_zero_std=float((grouped.std(1) == 0).float().mean()),
                group_rewards=grouped.mean(1).tolist(),  # per prompt: mixed ones carry a gradient
                format_rate=parsed / len(roll.texts),
                completion_tokens=float(lengths.mean()), updates=stats, sample=roll.texts[0],
                sample_target=triplets[0]["next_obs"], sample_reward=float(rewards[0]),
                # every group whole, prompt by prompt: G completions, their rewards and advantages
                completions=roll.texts, rewards=rewards.tolist(), advantages=advantages.tolist(),
                **{"completions/min_length": float(lengths.min()),
                   "completions/max_length": float(lengths.max()),
                   "completions/clipped_ratio": clipped})


def grpo_update(model, optimizer, batch: Batch, cfg, actor=None) -> list[dict]:
    """`num_iterations` optimizer steps on one batch, in micro-batches; a non-finite loss or
    gradient skips its update. `actor`: whose log pi the batch holds (§6; default `GENERATE`)."""
    actor = actor or GENERATE
    # cut on the batch's own device (the cut reads its lengths), then each to the model's
    cut = actor.micro_batches(batch, cfg.micro_batch_size, getattr(cfg, "micro_batch_tokens", 0))
    micro = [to_device(mb, model.device) for mb in cut]
    model.eval()
    with torch.no_grad():  # pi_old: with one update it is pi_theta, ratio 1, no forward needed
        old = [actor.logprobs(model, mb, cfg) for mb in micro] if cfg.num_iterations > 1 else None
        ref = None
        if cfg.beta:  # pi_ref: the adapter's start, without a second copy of the weights
            with reference_policy(model):
                ref = [actor.logprobs(model, mb, cfg) for mb in micro]
    model.train()
    stats = []
    for _ in range(cfg.num_iterations):
        parts = []
        for j, mb in enumerate(micro):
            logp = actor.logprobs(model, mb, cfg)
            old_logp = old[j] if old else logp.detach()
            ref_logp = ref[j] if ref else None
            loss = grpo_loss(logp, old_logp, ref_logp, mb.advantages, mb.weights, beta=cfg.beta,
                             epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high)
            if not torch.isfinite(loss):
                parts = None  # skip this update
                break
            loss.backward()
            kl = None if ref_logp is None else kl_k3(ref_logp, logp.detach())  # TRL's diagnostics
            diag = loss_stats(logp.detach(), old_logp, kl, mb.advantages, mb.weights, cfg.epsilon,
                              cfg.epsilon_high)
            parts.append(dict(loss=loss.item(), tokens=mb.completion_mask.sum().item(), **diag))
        stats.append(optimizer_step(model, optimizer, cfg.max_grad_norm, parts))
    model.eval()
    return stats


def micro_batches(batch: Batch, size: int, max_tokens: int = 512) -> list[Batch]:
    """Consecutive slices of whole groups: at most `size` rows and, with `max_tokens`, at most that
    many padded tokens in the forward (shared prompt: groups x (prompt + G completions), else rows
    x (prompt + completion)) once all-padding columns are dropped; a bigger group goes alone."""
    G, B = batch.group_size, len(batch.input_ids)
    C = batch.completion_mask.shape[1]
    P = batch.input_ids.shape[1] - C
    plen, clen = batch.attention_mask[:, :P].sum(1).tolist(), batch.completion_mask.sum(1).tolist()
    rows_cap = G * max(1, size // G)
    bounds, start, wp, wc = [], 0, 0, 0
    for g in range(0, B, G):
        p, c = max(wp, *plen[g:g + G]), max(wc, *clen[g:g + G])
        rows = g + G - start
        tokens = rows // G * (p + G * c) if G > 1 else rows * (p + c)
        if g > start and (rows > rows_cap or 0 < max_tokens < tokens):
            bounds.append((start, g))
            start, p, c = g, max(plen[g:g + G]), max(clen[g:g + G])
        wp, wc = p, c
    bounds.append((start, B))
    return [_trimmed(batch, i, j, G, P) for i, j in bounds]


def _trimmed(batch: Batch, i: int, j: int, G: int, P: int) -> Batch:
    """Rows i:j of `batch` without their all-padding prompt and completion columns."""
    attn, cmask = batch.attention_mask[i:j], batch.completion_mask[i:j]
    lead = P - int(attn[:, :P].sum(1).max())  # prompt columns that are all padding
    keep_c = max(int(cmask.sum(1).max()), 1)
    mb = replace(batch, input_ids=batch.input_ids[i:j, lead:P + keep_c],
                 attention_mask=attn[:, lead:P + keep_c], completion_mask=cmask[:, :keep_c],
                 weights=batch.weights[i:j, :keep_c], advantages=batch.advantages[i:j])
    if G > 1:
        mb = replace(mb, prompt_ids=batch.prompt_ids[i // G:j // G, lead:],
                     prompt_mask=batch.prompt_mask[i // G:j // G, lead:])
    return mb


def to_device(batch: Batch, device) -> Batch:
    """The one place a batch meets the model's device (rewards, advantages, weights: CPU-built)."""
    return replace(batch, **{f.name: v.to(device) for f in fields(batch)
                             if torch.is_tensor(v := getattr(batch, f.name))})


def optimizer_step(model, optimizer, max_grad_norm: float, parts: list[dict] | None) -> dict:
    """Clip and step after the micro-batches' backward (`parts`: their statistics; None when a loss
    was not finite); the update's statistics, token-weighted."""
    params = [p for p in model.parameters() if p.requires_grad]
    clip = torch.nn.utils.clip_grad_norm_
    grad_norm = float("nan") if parts is None else float(clip(params, max_grad_norm))
    ok = math.isfinite(grad_norm)
    if ok:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    parts = parts or []
    tokens = max(sum(p["tokens"] for p in parts), 1)
    return dict(loss=sum(p["loss"] for p in parts) if ok else float("nan"),
                kl=sum(p["kl"] * p["tokens"] for p in parts) / tokens,
                clip_ratio=sum(p["clip_ratio"] * p["tokens"] for p in parts) / tokens,
                grad_norm=grad_norm, skipped=not ok)


@torch.no_grad()
def loss_stats(logp, old_logp, kl, advantages, weights, epsilon: float = 0.2,
               epsilon_high: float | None = None) -> dict:
    """An update's diagnostics over its live tokens, TRL's: the mean of `kl` (`kl_k3` per token;
    None: no KL term) and the clip ratio: a token counts as clipped when the clipped term wins, i.e.
    its ratio left [1 - eps, 1 + eps_high] in the direction its advantage pushes."""
    ratio, a, live = torch.exp(logp - old_logp), advantages.unsqueeze(1), (weights > 0).float()
    high = 1 + (epsilon if epsilon_high is None else epsilon_high)
    clipped = ((ratio < 1 - epsilon) & (a < 0)) | ((ratio > high) & (a > 0))
    kl = torch.zeros_like(logp) if kl is None else kl
    n = live.sum().clamp(min=1)
    return dict(kl=float((kl * live).sum() / n), clip_ratio=float((clipped * live).sum() / n))


def batch_logprobs(model, mb: Batch, cfg) -> torch.Tensor:
    """`logprobs` of a micro-batch's completion tokens, computed faster: each group's prompt once,
    or every row in chunks of the vocabulary projection; each shortcut checked once per model
    against the full logits, which replace it where they disagree (the engine's `fast_paths`)."""
    ids, cmask = mb.input_ids, mb.completion_mask
    if mb.group_size > 1:
        completions = ids[:, ids.shape[1] - cmask.shape[1]:]
        return group_logprobs(model, mb.prompt_ids, mb.prompt_mask, completions, cmask,
                              temperature=cfg.temperature, chunk_size=cfg.logits_chunk_size)
    return completion_logprobs(model, ids, mb.attention_mask, cmask, temperature=cfg.temperature,
                               chunk_size=cfg.logits_chunk_size)


def logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
             completion_mask: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """log pi_theta(o_t | q, o_<t) of every completion token, defined plainly: rows are [left-padded
    prompt | completion] (C = completion_mask's width), positions count each row's own tokens from
    0; the logits at position j predict token j + 1, divided by the sampling temperature;
    log-softmax, the sampled token's entry. [B, C], 0 off the completion. `batch_logprobs` computes
    the same faster; tests/test_grpo.py holds each of the engine's paths to this."""
    C = completion_mask.shape[1]
    positions = (attention_mask.cumsum(1) - 1).clamp(min=0)  # left padding: each text starts at 0
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions)
    logits = out.logits[:, -C - 1:-1].float() / temperature  # the positions predicting completions
    return logits.log_softmax(-1).gather(-1, input_ids[:, -C:, None]).squeeze(-1) * completion_mask


@contextmanager
def reference_policy(model):
    """pi_ref for the KL term, without a second copy of the weights: the frozen adapter "ref" if any
    (train.start_adapter: RWML's warm-up; stage 2's RWML, WM-SFT or RFT adapter), else the model
    with its adapter disabled (a fresh LoRA: the base model)."""
    if "ref" in getattr(model, "peft_config", {}):
        active = model.active_adapter
        model.set_adapter("ref", inference_mode=True)
        try:
            yield
        finally:
            model.set_adapter(active)  # trainable again; "ref" stays frozen
    else:
        with model.disable_adapter():
            yield


# ============================================================ §6 Stage 2: policy RL on task success
# Ordinary multi-turn GRPO on task success, from the RWML adapter (or the base model, or WM SFT).
# For each game, num_generations episodes from the same start; the reward is the terminal success
# (gamma = 1), an episode's group-normalised advantage goes to each of its action-writing turns.
# A turn is one training sequence [prompt | the model's reply]: observations live in the prompt, so
# environment tokens are never trained on. The world-model reward is never mixed in ("Dark Room").

def policy_batch(turns: list[Triplet], advantages: torch.Tensor, pad_token_id: int, loss_type: str,
                 max_completion_length: int, keep_zero_advantage: bool = True):
    """Turns recorded by `play(record_tokens=True)` -> Batch's (input_ids, attention_mask,
    completion_mask, advantages: each its episode's, weights: the whole batch's); without
    `keep_zero_advantage`, turns with advantage 0 dropped (exact when beta = 0: they add 0)."""
    ids, attn, cmask = pack([t["prompt_ids"] for t in turns], [t["completion_ids"] for t in turns],
                            pad_token_id)
    adv = advantages[torch.tensor([t["episode"] for t in turns], dtype=torch.long)]
    weights = token_weights(cmask, loss_type, max_completion_length)
    if not keep_zero_advantage:
        rows = adv != 0
        width = int(cmask[rows].sum(1).max()) if rows.any() else 0  # completion columns left
        cols = ids.shape[1] - cmask.shape[1] + width
        ids, attn, adv = ids[rows, :cols], attn[rows, :cols], adv[rows]
        cmask, weights = cmask[rows, :width], weights[rows, :width]
    return ids, attn, cmask, adv, weights


def rollouts(model, tokenizer, env, games: list, n: int, **play_kwargs) -> list[dict]:
    """`n` episodes of each game in `env` (`envs.make`), the exact tokens recorded (`play`'s)."""
    model.eval()
    episodes = [dict(game=g, group=i, rollout=k) for i, g in enumerate(games) for k in range(n)]
    return play(model, tokenizer, env, episodes, record_tokens=True, **play_kwargs)


def policy_step(model, tokenizer, optimizer, env, games: list, cfg, actor=None,
                **play_kwargs) -> dict:
    """One stage-2 step: num_generations episodes of each game, sampled at cfg's temperature with
    replies of at most max_completion_length tokens; terminal reward won; GRPO on every turn."""
    turns = []
    summaries = rollouts(model, tokenizer, env, games, cfg.num_generations, actor=actor,
                         temperature=cfg.temperature, top_p=cfg.top_p, on_turn=turns.append,
                         max_new_tokens=cfg.max_completion_length, desc="policy rollouts",
                         **play_kwargs)
    return policy_update(model, tokenizer, optimizer, turns, summaries, cfg, actor)


def policy_update(model, tokenizer, optimizer, turns: list[Triplet], summaries: list[dict], cfg,
                  actor=None) -> dict:
    """GRPO on recorded episodes: `summaries` in groups of num_generations episodes of one game,
    `turns` as `play(record_tokens=True)` gives them, by `actor` (default GENERATE); reward: won."""
    G, actor = cfg.num_generations, actor or GENERATE
    rewards = torch.tensor([float(s["won"]) for s in summaries])  # gamma = 1: the final reward
    adv = group_advantages(rewards, G, cfg.scale_rewards)
    batch = actor.batch(turns, adv, cfg, tokenizer)
    cmask = batch.completion_mask
    if len(batch.advantages):
        stats = grpo_update(model, optimizer, batch, cfg, actor)
    else:  # every group all-equal and no KL term: the loss is exactly 0, nothing to compute
        nothing = dict(loss=0.0, kl=0.0, clip_ratio=0.0, grad_norm=0.0, skipped=False)
        stats = [nothing] * cfg.num_iterations
    steps = sum(s["steps"] for s in summaries) or 1
    return dict(reward_mean=float(rewards.mean()),
                reward_std=float(rewards.std()) if G > 1 else 0.0,
                frac_reward_zero_std=float((rewards.view(-1, G).std(1) == 0).float().mean()),
                invalid_action_rate=sum(s["invalid"] for s in summaries) / steps,
                mean_steps=steps / len(summaries), num_turns=len(turns),
                trained_turns=len(batch.advantages),
                completion_tokens=float(cmask.sum(1).float().mean()) if len(cmask) else 0.0,
                updates=stats, sample=turns[0]["response"] if turns else "")


class Generate:
    """The paper's actor (generate mode): a free-form ReAct reply, <think> then <action>, sampled
    for every asked slot in one batch; stage 2 trains log pi of its tokens. Others: choose/."""

    def act(self, model, tokenizer, env, slots: list[int], recent: dict, *, temperature: float,
            top_p: float, max_new_tokens: int, record: bool, **_) -> tuple[dict, dict]:
        """(reply, recorded tokens) of each slot; recorded: its prompt, the exact tokens sampled."""
        prompts = [env.prompt(s, recent[s]) for s in slots]
        roll = sample_chat(model, tokenizer, prompts, system=env.system, prefix=envs.AGENT_PREFIX,
                           stop=env.stop, max_new_tokens=max_new_tokens, temperature=temperature,
                           top_p=top_p) if slots else None
        tokens = {s: dict(prompt=prompts[j], prompt_ids=roll.prompt_ids[j],
                          completion_ids=roll.completion_ids[j])
                  for j, s in enumerate(slots) if record}
        return {s: roll.texts[j] for j, s in enumerate(slots)}, tokens

    @staticmethod
    def batch(turns: list[Triplet], advantages: torch.Tensor, cfg, tokenizer) -> Batch:
        return Batch(*policy_batch(turns, advantages, tokenizer.pad_token_id, cfg.loss_type,
                                   cfg.max_completion_length, keep_zero_advantage=bool(cfg.beta)))

    micro_batches, logprobs = staticmethod(micro_batches), staticmethod(batch_logprobs)


GENERATE = Generate()
# --action-mode -> who writes the agent's replies, "module:name" loaded at first use (envs.load)
ACTORS = dict(generate="rwml:GENERATE", choose="choose:CHOOSE", random="choose:RANDOM")


# ============================================================== §8 Evaluation: world-model accuracy

def evaluate_wm(model, tokenizer, triplets: list[Triplet], reward_fn, *,
                max_new_tokens: int = ALFWORLD_LEN, batch_size: int = 16, reasoning: bool = False,
                samples: int = 0, temperature: float = 1.0) -> dict:
    """World-model accuracy on held-out triplets: the share with r_WM = 1, beside mean cosine, exact
    match, item F1 and format rate, overall and by kind (envs.score_wm). `samples` = 0: one greedy
    prediction per triplet; k > 0: k sampled at `temperature` (the quantity GRPO raises)."""
    k, per = max(samples, 1), max(1, batch_size // max(samples, 1))
    order = by_length([wm_prompt(t, reasoning) for t in triplets])
    preds = [""] * (len(triplets) * k)
    for i in tqdm(range(0, len(triplets), per), desc="wm eval", unit="batch", dynamic_ncols=True):
        chunk = [triplets[j] for j in order[i:i + per]]
        texts = sample_predictions(model, tokenizer, chunk, reasoning=reasoning, n=k,
                                   max_new_tokens=max_new_tokens,
                                   temperature=temperature if samples else 0.0).texts
        for j, idx in enumerate(order[i:i + per]):
            preds[idx * k:(idx + 1) * k] = texts[j * k:(j + 1) * k]
    out = envs.score_wm(triplets, preds, reward_fn, k)
    out.update(samples=samples, temperature=temperature if samples else 0.0)
    return out


def evaluate_heldout(cfg, model, tokenizer, triplets: list[Triplet], reward_fn) -> dict:
    """`evaluate_wm` with a run's settings, seeded: "before" and "after" draw the same noise."""
    torch.manual_seed(cfg.seed)
    return evaluate_wm(model, tokenizer, triplets, reward_fn, reasoning=cfg.wm_reasoning,
                       samples=cfg.eval_samples, temperature=cfg.temperature,
                       max_new_tokens=cfg.max_completion_length)
