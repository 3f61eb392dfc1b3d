"""Peak memory of one choose-mode stage-2 update, cut by a token budget or by row count alone:

    python lab/bench/choose_update_memory.py 512    # micro_batch_tokens 512 (the default)
    python lab/bench/choose_update_memory.py 0      # rows only: micro_batch_size turns a micro-batch (before)

One process per setting (peak RSS is per process). The bundled model, a fresh LoRA (r 16); one group of 4
episodes of a TextWorld train game, 8 seeded uniform commands each, recorded as choose-mode `play` records
them; the first episode counts as won, so every turn trains. Prints trained turns, seconds, peak RSS.
"""
import json
import random
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: the project's modules

import torch  # noqa: E402

import choose  # noqa: E402
import engine  # noqa: E402
import rwml  # noqa: E402
from stages.settings import GRPOConfig  # noqa: E402
import envs
from worlds import textworld  # noqa: E402


def main() -> None:
    budget = int(sys.argv[1]) if len(sys.argv) > 1 else 512
    torch.manual_seed(0)
    model, tok = engine.load_model(engine.BUNDLED_MODEL)
    model = engine.add_lora(model, r=16, alpha=32)
    game, rng, turns, summaries = textworld.textworld_games("train", 1, seed=0)[0], random.Random(0), [], []
    with envs.make("textworld", num_workers=0, max_turns=8) as env:
        for ep in range(4):
            obs, past = env.reset({0: dict(game=game)})[0]["obs"], []
            for step in range(8):
                prompt, commands = env.choice_prompt(0, past[-1:]), env.admissible(0)
                k = rng.randrange(len(commands))
                prompt_ids, cands = choose.choice_inputs(tok, prompt, commands, env.system)
                r = env.step({0: f"<action>{commands[k]}</action>"})[0]
                turns.append(dict(episode=ep, step=step, prompt_ids=prompt_ids, candidate_ids=cands, choice=k,
                                  response=commands[k]))
                past.append((obs, r["action"]))
                obs = r["obs"]
                if r["done"]:
                    break
            summaries.append(dict(won=ep == 0, steps=step + 1, invalid=0))
    cfg = GRPOConfig(num_generations=4, beta=0.0, micro_batch_tokens=budget)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    t = time.time()
    res = rwml.policy_update(model, tok, opt, turns, summaries, cfg, choose.CHOOSE)
    print(json.dumps(dict(micro_batch_tokens=budget, micro_batch_size=cfg.micro_batch_size,
                          trained_turns=res["trained_turns"], seconds=round(time.time() - t, 1),
                          peak_rss_gb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2))))


if __name__ == "__main__":
    main()
