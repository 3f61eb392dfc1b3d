"""Choose mode, the policy as a softmax over a turn's admissible commands, and random, a uniform
admissible command (a baseline): the actors `rwml.play` and stage 2 (METHOD.md §6) take instead of
free-form replies.

Small LMs act without invalid actions when the policy is the LM's likelihood of each admissible
command, normalised over the admissible set (GLAM: Carta et al., ICML 2023). The reply is written
for the model up to "<action>"; a candidate is the tokens of "<command></action>" (the closing tag
ends the command, so "go to cabinet 1" is not scored as a prefix of "go to cabinet 10"):
  score(a) = sum_t log p_theta(a_t | prompt, a_<t),   pi(a|s) = softmax_a(score(a) / T)
Summed: the exact log-probability of the command's text under the LM (a length-normalised score was
measured and dropped: it chose no better). Batched: a turn's prompt runs once and every candidate
runs on its key/value cache (`group_logprobs`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from envs import UserError
from engine import chat, group_logprobs

CHOICE_PREFIX, CHOICE_END = "<action>", "</action>"


@dataclass
class Choice:
    """One turn's pick: the candidate `index`, the `reply` the environment parses, and the exact
    tokens stage 2 trains on (the prompt up to "<action>", every candidate's tokens); `logprobs`:
    log pi(a|s)."""
    index: int
    reply: str
    prompt_ids: list[int]
    candidate_ids: list[list[int]]
    logprobs: list[float]


def choice_logprobs(scores: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log pi(a|s) over the candidates: the log-softmax of score / T, normaliser included (T 0:
    greedy play, whose probabilities are reported at T 1)."""
    return torch.log_softmax(scores / (temperature if temperature > 0 else 1.0), -1)


@torch.no_grad()
def choose_actions(model, tokenizer, prompts: list[str], admissible: list[list[str]], *,
                   system: str | None, temperature: float = 1.0) -> list[Choice]:
    """One command per prompt, drawn from pi(a|s) (greedy at temperature 0). A state that several
    episodes share (a game's sampled episodes all start alike) is scored once."""
    out, scored = [], {}
    for prompt, commands in zip(prompts, admissible):
        key = (prompt, tuple(commands))
        if key not in scored:
            prompt_ids, candidate_ids = choice_inputs(tokenizer, prompt, commands, system)
            scored[key] = prompt_ids, candidate_ids, choice_logprobs(
                candidate_scores(model, prompt_ids, candidate_ids), temperature)
        prompt_ids, candidate_ids, logp = scored[key]
        k = int(logp.argmax() if temperature <= 0 else torch.multinomial(logp.exp().float(), 1))
        out.append(Choice(k, f"{CHOICE_PREFIX}{commands[k]}{CHOICE_END}", prompt_ids, candidate_ids,
                          logp.tolist()))
    return out


def choice_inputs(tokenizer, prompt: str, commands: list[str], system: str | None):
    """(prompt token ids up to the reply's "<action>", one token list per "<command></action>")."""
    text = chat(tokenizer, prompt, system, CHOICE_PREFIX)
    return (tokenizer(text, add_special_tokens=False)["input_ids"],
            [tokenizer(c + CHOICE_END, add_special_tokens=False)["input_ids"] for c in commands])


def candidate_scores(model, prompt_ids: list[int], candidate_ids: list[list[int]], *,
                     chunk_size: int = 512) -> torch.Tensor:
    """score(a) for each candidate ([n]; with gradients when they are on): its tokens' log-probs
    after the prompt at temperature 1, summed; the prompt runs once, all candidates on its cache."""
    dev, n, C = model.device, len(candidate_ids), max(map(len, candidate_ids))
    ids, mask = torch.zeros(n, C, dtype=torch.long), torch.zeros(n, C, dtype=torch.long)
    for j, c in enumerate(candidate_ids):
        ids[j, :len(c)], mask[j, :len(c)] = torch.tensor(c, dtype=torch.long), 1
    prompt = torch.tensor([prompt_ids], dtype=torch.long, device=dev)
    return group_logprobs(model, prompt, torch.ones_like(prompt), ids.to(dev), mask.to(dev),
                          chunk_size=chunk_size).sum(1)


@dataclass
class ChoiceBatch:
    """One stage-2 update's data in choose mode (`rwml.grpo_update`): per row a turn's (prompt ids,
    candidate ids, chosen index), its episode's advantage, and a single "token", the choice."""
    choices: list
    completion_mask: torch.Tensor  # [B, 1]
    advantages: torch.Tensor  # [B]
    weights: torch.Tensor  # [B, 1]


class Choose:
    """The choose-mode actor: `act` draws each asked slot's command from pi(a|s) (`choose_actions`;
    greedy at temperature 0) and records every admissible command's tokens (`candidate_ids`) and the
    `choice`; stage 2 trains log pi(a|s) of the choices (`batch`, `micro_batches`, `logprobs`)."""

    def act(self, model, tokenizer, env, slots: list[int], recent: dict, *, temperature: float, rng,
            **_) -> tuple[dict, dict]:
        check_admissible(env)
        prompts = {s: env.choice_prompt(s, recent[s]) for s in slots}
        admissible = [env.admissible(s) for s in slots]
        picks = choose_actions(model, tokenizer, list(prompts.values()), admissible,
                               system=env.system, temperature=temperature)
        tokens = {s: dict(prompt=prompts[s], prompt_ids=c.prompt_ids, candidate_ids=c.candidate_ids,
                          choice=c.index, completion_ids=c.candidate_ids[c.index])
                  for s, c in zip(slots, picks)}
        return {s: c.reply for s, c in zip(slots, picks)}, tokens

    @staticmethod
    def batch(turns: list[dict], advantages: torch.Tensor, cfg, tokenizer=None) -> ChoiceBatch:
        """Choose-mode turns (`play(record_tokens=True)`) -> a batch, each with its episode's
        advantage. A row has one "token": every loss's weight (`rwml.token_weights`) is 1 / B."""
        adv = advantages[torch.tensor([t["episode"] for t in turns], dtype=torch.long)]
        cmask = torch.ones(len(turns), 1, dtype=torch.long)
        choices = [(t["prompt_ids"], t["candidate_ids"], t["choice"]) for t in turns]
        weights = cmask.float() / len(turns)
        if not cfg.beta:  # advantage-0 turns add nothing to the loss (rwml.policy_batch drops them)
            keep = adv != 0
            choices = [c for c, k in zip(choices, keep.tolist()) if k]
            cmask, adv, weights = cmask[keep], adv[keep], weights[keep]
        return ChoiceBatch(choices=choices, completion_mask=cmask, advantages=adv, weights=weights)

    @staticmethod
    def micro_batches(batch: ChoiceBatch, size: int, max_tokens: int = 0) -> list[ChoiceBatch]:
        """Consecutive rows: at most `size` and, with `max_tokens`, at most that many tokens (a
        turn's prompt and every candidate); a turn that needs more goes alone."""
        B = len(batch.advantages)
        cost = [len(p) + sum(map(len, c)) for p, c, _ in batch.choices]
        bounds, start = [], 0
        for i in range(1, B + 1):
            if i == B or i - start >= max(size, 1) or 0 < max_tokens < sum(cost[start:i + 1]):
                bounds.append((start, i))
                start = i
        return [ChoiceBatch(batch.choices[i:j], batch.completion_mask[i:j],
                            batch.advantages[i:j], batch.weights[i:j]) for i, j in bounds]

    @staticmethod
    def logprobs(model, mb: ChoiceBatch, cfg) -> torch.Tensor:
        """[B, 1]: log pi(a|s) of each row's choice, with gradients: what stage 2 trains."""
        rows = [choice_logprobs(candidate_scores(model, p, c, chunk_size=cfg.logits_chunk_size),
                                cfg.temperature)[k] for p, c, k in mb.choices]
        return torch.stack(rows).unsqueeze(1)


class Random:
    """The random actor (a baseline, never trained): a uniform admissible command per asked slot."""

    def act(self, model, tokenizer, env, slots: list[int], recent: dict, *, rng,
            **_) -> tuple[dict, dict]:
        check_admissible(env)
        return {s: f"{CHOICE_PREFIX}{rng.choice(env.admissible(s))}{CHOICE_END}" for s in slots}, {}


def check_admissible(env) -> None:
    """Choose and random pick among a turn's admissible commands, which tau2 does not list."""
    if not getattr(env, "can_choose", False):
        raise UserError("--action-mode choose (or --policy random) picks among a turn's "
                        "admissible commands, which this environment does not list; "
                        "use --action-mode generate")


CHOOSE, RANDOM = Choose(), Random()
