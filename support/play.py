"""Support (skip on a first read): the batched play loop under rwml.play: `num_envs` episodes at once, one
batch of replies per round (the actor's), a step of each, a finished episode's slot to the next waiting one;
every turn a triplet for `on_turn`, every finished episode a summary for `on_episode`. Knows no environment
and no actor: it calls the methods they have (worlds.py's interface, rwml.Generate's `act`)."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from support.common import UserError


@dataclass
class Running:
    """An episode in play: its index in the caller's list, its summary, current observation, past pairs."""
    index: int
    summary: dict
    obs: str
    past: list = field(default_factory=list)


def play(model, tokenizer, env, episodes: list[dict], *, actor, history_len: int = 2,
         temperature: float = 1.0, top_p: float = 1.0, max_new_tokens: int = 128, num_envs: int = 8,
         on_turn=None, on_episode=None, record_tokens: bool = False, explore_prob: float = 0.0, seed: int = 0,
         desc: str = "episodes") -> list[dict]:
    """Play `episodes` ({"game": an ALFWorld game file, ...}) in `env` (`worlds.make`), `num_envs` at once:
    each round, one reply for every running episode in one batch, then a step of each; a finished episode's
    slot goes to the next waiting one. `on_turn(triplet)` and `on_episode(summary)` see results as they
    happen. `record_tokens`: each turn adds its prompt and the exact tokens the model saw and sampled
    (`prompt_ids`, `completion_ids`), which stage 2 trains on. `explore_prob` (ALFWorld collection): the
    chance that a turn's reply is `env.explore`'s, not the model's (`explored`). `actor` writes the replies:
    rwml.GENERATE (free-form ReAct replies, the paper's; §6), or choose mode's. Returns one summary per
    episode, in the order given."""
    if num_envs < 1:
        raise UserError(f"--num-envs must be at least 1, got {num_envs}")
    env.bind_model(model, tokenizer, temperature=temperature, top_p=top_p)  # tau2: the model of its customer
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
            summary = dict(ep, game=s["game"], task=s["task"], task_type=s["task_type"], won=False, steps=0,
                           **counts)
            running[slot] = Running(i, summary, s["obs"])
        slots = sorted(running)
        explored = {s: explore_prob > 0 and rng.random() < explore_prob for s in slots}
        asked = [s for s in slots if not explored[s]]  # the model writes these slots' replies
        recent = {s: running[s].past[-history_len:] if history_len else [] for s in slots}
        replies, tokens = actor.act(model, tokenizer, env, asked, recent, temperature=temperature,
                                    top_p=top_p, max_new_tokens=max_new_tokens, record=record_tokens, rng=rng)
        replies.update({s: env.explore(s, rng) for s in slots if explored[s]})
        results = env.step(replies)
        for s in slots:
            e, r = running[s], results[s]
            summ = e.summary
            if on_turn is not None:
                history = [{"observation": o, "action": a} for o, a in recent[s]] + [{"observation": e.obs}]
                turn = dict(env.turn_fields, game=summ["game"], task=summ["task"],
                            task_type=summ["task_type"], rollout=summ.get("rollout", 0), episode=e.index,
                            step=summ["steps"], history=history, action=r["action"], next_obs=r["obs"],
                            valid=r["valid"], format_ok=r["format_ok"], won=r["won"], done=r["done"],
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
