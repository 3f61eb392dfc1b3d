"""Support (skip on a first read): choose mode, the policy as a softmax over a turn's admissible commands
(`rwml.play`'s action_mode choose, and random: a uniform admissible command, a baseline), and its stage 2.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine import chat, group_logprobs
from envs import UserError

if TYPE_CHECKING:
    from rwml import Batch, Triplet

# ================================================= §6 Stage 2, choose mode: a policy over admissible commands
# Small LMs act without invalid actions when the policy is the LM's likelihood of each admissible command,
# normalised over the admissible set (GLAM: Carta et al., ICML 2023). The reply is written for the model up
# to "<action>"; a candidate is the tokens of "<command></action>" (the closing tag ends the command, so
# "go to cabinet 1" is not scored as a prefix of "go to cabinet 10"):
#   score(a) = sum_t log p_theta(a_t | prompt, a_<t),   pi(a|s) = softmax_a(score(a) / T)
# Summed: the exact log-probability of the command's text under the LM (a length-normalised score was
# measured and dropped: lab/results/choice_score_sum_vs_mean/).
# Batched: a turn's prompt runs once and every candidate runs on its key/value cache (`group_logprobs`).

CHOICE_PREFIX, CHOICE_END = "<action>", "</action>"


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
    """One command per prompt, drawn from pi(a|s) (greedy at temperature 0). A state that several episodes
    share (a game's sampled episodes all start alike) is scored once."""
    out, scored = [], {}
    for prompt, commands in zip(prompts, admissible):
        key = (prompt, tuple(commands))
        if key not in scored:
            prompt_ids, candidate_ids = choice_inputs(tokenizer, prompt, commands, system)
            scored[key] = prompt_ids, candidate_ids, choice_logprobs(
                candidate_scores(model, prompt_ids, candidate_ids), temperature)
        prompt_ids, candidate_ids, logp = scored[key]
        k = int(logp.argmax()) if temperature <= 0 else int(torch.multinomial(logp.exp().float(), 1))
        out.append(Choice(k, f"{CHOICE_PREFIX}{commands[k]}{CHOICE_END}", prompt_ids, candidate_ids,
                          logp.tolist()))
    return out


def choice_batch(turns: list[Triplet], advantages: torch.Tensor, loss_type: str,
                 keep_zero_advantage: bool = True) -> Batch:
    """Choose-mode turns (`play(record_tokens=True, action_mode="choose")`) -> one update's batch: per turn
    its (prompt, candidates, choice), its episode's advantage, and a single "token" (the choice) whose
    loss weight follows `token_weights` as in generate mode."""
    from rwml import Batch, token_weights  # (rwml imports this module)

    adv = advantages[torch.tensor([t["episode"] for t in turns], dtype=torch.long)]
    cmask = torch.ones(len(turns), 1, dtype=torch.long)
    choices, weights = [(t["prompt_ids"], t["candidate_ids"], t["choice"]) for t in turns], \
        token_weights(cmask, loss_type, 1)
    if not keep_zero_advantage:
        keep = adv != 0
        choices = [c for c, k in zip(choices, keep.tolist()) if k]
        cmask, adv, weights = cmask[keep], adv[keep], weights[keep]
    return Batch(choices=choices, completion_mask=cmask, advantages=adv, weights=weights)


def choice_inputs(tokenizer, prompt: str, commands: list[str], system: str | None) -> tuple[list, list]:
    """(prompt token ids up to the reply's "<action>", one token list per "<command></action>")."""
    text = chat(tokenizer, prompt, system, CHOICE_PREFIX)
    return (tokenizer(text, add_special_tokens=False)["input_ids"],
            [tokenizer(c + CHOICE_END, add_special_tokens=False)["input_ids"] for c in commands])


def candidate_scores(model, prompt_ids: list[int], candidate_ids: list[list[int]], *,
                     chunk_size: int = 512) -> torch.Tensor:
    """score(a) for each candidate ([n]; with gradients when they are on): its tokens' log-probs after the
    prompt, at temperature 1, summed. One forward of the prompt, all candidates on its cache."""
    dev, n, C = model.device, len(candidate_ids), max(map(len, candidate_ids))
    ids, mask = torch.zeros(n, C, dtype=torch.long), torch.zeros(n, C, dtype=torch.long)
    for j, c in enumerate(candidate_ids):
        ids[j, :len(c)], mask[j, :len(c)] = torch.tensor(c, dtype=torch.long), 1
    prompt = torch.tensor([prompt_ids], dtype=torch.long, device=dev)
    return group_logprobs(model, prompt, torch.ones_like(prompt), ids.to(dev), mask.to(dev),
                          chunk_size=chunk_size).sum(1)


def chosen_logprobs(model, choices: list, temperature: float, chunk_size: int = 512) -> torch.Tensor:
    """[B, 1]: log pi(a|s) of each row's choice (`Batch.choices`: prompt ids, candidate ids, the chosen
    index), with gradients: `rwml.batch_logprobs` in choose mode."""
    return torch.stack([choice_logprobs(candidate_scores(model, p, c, chunk_size=chunk_size), temperature)[k]
                        for p, c, k in choices]).unsqueeze(1)


# ------------------------------------------------------------------------ `play` outside generate mode
def check_mode(env, action_mode: str) -> None:
    """`play`'s action mode: generate (the paper's), choose, or random (a uniform admissible command: a
    baseline); the last two need an environment that lists a turn's admissible commands."""
    if action_mode not in ("generate", "choose", "random"):
        raise UserError(f"unknown action mode {action_mode!r}; choose generate, choose or random")
    if action_mode != "generate" and not getattr(env, "can_choose", False):
        raise UserError(f"--action-mode {action_mode} picks among a turn's admissible commands, which this "
                        "environment does not list; use --action-mode generate")


def act(model, tokenizer, env, asked: list[int], recent: dict, action_mode: str, temperature: float,
        rng) -> tuple[dict, dict]:
    """One round of `play` in choose or random mode: (reply, recorded tokens) of each `asked` slot. choose:
    a command drawn from pi(a|s) (`choose_actions`; greedy at temperature 0), recorded with every
    admissible command's tokens (`candidate_ids`) and the `choice`; random: `rng`'s pick, nothing recorded."""
    if action_mode == "random":
        return {s: f"{CHOICE_PREFIX}{rng.choice(env.admissible(s))}{CHOICE_END}" for s in asked}, {}
    prompts = {s: env.choice_prompt(s, recent[s]) for s in asked}
    picks = choose_actions(model, tokenizer, list(prompts.values()), [env.admissible(s) for s in asked],
                           system=env.system, temperature=temperature)
    tokens = {s: dict(prompt=prompts[s], prompt_ids=c.prompt_ids, candidate_ids=c.candidate_ids,
                      choice=c.index, completion_ids=c.candidate_ids[c.index]) for s, c in zip(asked, picks)}
    return {s: c.reply for s, c in zip(asked, picks)}, tokens
