"""GPU smoke check: every CUDA path of the project once, on random models built from a config (no download).

    python lab/bench/gpu_check.py            # on CUDA: Qwen2.5-0.5B- and 1.5B-shaped models, 4-bit NF4
    python lab/bench/gpu_check.py --device cpu --shapes tiny-llama   # the same checks on the CPU (the tests)
    python lab/bench/gpu_check.py --shapes tiny-qwen3,tiny-gemma2,tiny-gemma3   # other architectures

Per shape: 4-bit load, LoRA, the log-prob fast paths, shared-prefill sampling vs generate, a stage-1 GRPO
step, a stage-2 update from the saved adapter, the adapter reloaded the peft way, peak GPU memory. One line
per check, then "gpu-check: all passed" or the failures.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repo root; lab/ holds bench/
sys.path[:0] = [str(ROOT), str(ROOT / "lab")]

import torch  # noqa: E402
from bench.random_models import build  # noqa: E402

import engine  # noqa: E402
import envs  # noqa: E402
import rwml  # noqa: E402
import train  # noqa: E402

TRIPLETS = [  # ALFWorld-shaped world-model triplets (no game files needed on the GPU machine)
    dict(task="put a clean mug in the coffeemachine", action="go to countertop 1",
         next_obs="You arrive at countertop 1. On the countertop 1, you see a mug 1.",
         history=[{"observation": "You are in the middle of a room."}]),
    dict(task="put a clean mug in the coffeemachine", action="take mug 1 from countertop 1",
         next_obs="You pick up the mug 1 from the countertop 1.",
         history=[{"observation": "You arrive at countertop 1. On the countertop 1, you see a mug 1."}]),
]


def parity_reward(completions, targets=None, **kw):
    """A random model never writes a real observation: a fixed function of the text gives mixed groups."""
    return [float(sum(map(ord, c)) % 2) for c in completions]


def check_shape(shape: str, device: str, four_bit: bool, work: Path, log) -> list[str]:
    failures = []

    def check(name, ok, detail=""):
        log(f"  {'ok  ' if ok else 'FAIL'} {name}" + (f": {detail}" if detail else ""))
        if not ok:
            failures.append(f"{shape}: {name}")

    cuda, t0 = device.startswith("cuda"), time.time()
    folder = build(work / shape, shape, dtype=torch.bfloat16 if cuda else None)
    log(f"{shape}: built in {time.time() - t0:.0f} s")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    model, tok = engine.load_model(str(folder), device=device, load_in_4bit=four_bit)
    n4 = sum(type(m).__name__ == "Linear4bit" for m in model.modules())
    check("load" + (" in 4-bit NF4" if four_bit else ""), not four_bit or n4 > 0,
          f"{n4} Linear4bit layers, {model.device}")
    cfg = train.Settings(model=str(folder), num_generations=4, max_completion_length=24, micro_batch_size=8,
                       beta=0.01, lora_target_modules="all-linear", learning_rate=1e-4, max_new_tokens=16)
    torch.manual_seed(0)
    model = train.start_adapter(cfg, model)
    check("LoRA on all linear layers", any(p.requires_grad for p in model.parameters()))
    fast = engine.fast_paths(model)  # bf16 / 4-bit may round the fast paths away from the model's own logits
    check("fast paths (chunked projection, shared prompt cache)", fast.head and fast.shared_prompt, str(fast))

    texts = [engine.chat(tok, rwml.wm_prompt(t, False), envs.Alfworld.wm_system, rwml.wm_prefix(False))
             for t in TRIPLETS]
    shared = engine.sample(model, tok, texts, n=3, max_new_tokens=12, temperature=0.0).input_ids
    batch = tok([t for t in texts for _ in range(3)], return_tensors="pt", padding=True,
                add_special_tokens=False).to(device)
    # before the checkpoint's generation_config (its end-of-turn ids) is off
    cfg_plain = engine.sampling_config(model, tok, temperature=0.0, top_p=1.0, max_new_tokens=12)
    with engine.checkpoint_generation_config_off(model):
        plain = model.generate(**batch, generation_config=cfg_plain)
    agree = (shared == plain).float().mean().item() if shared.shape == plain.shape else 0.0
    # bf16 / 4-bit kernels may round a cached and an uncached forward apart: require most tokens equal
    check("shared-prefill sampling vs plain generate (greedy)", agree > 0.9, f"{agree:.1%} of tokens equal")

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.learning_rate)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    torch.manual_seed(1)
    res = rwml.grpo_step(model, tok, opt, TRIPLETS, parity_reward, cfg, reasoning=False)
    u = res["updates"][0]
    moved = any(not torch.equal(p, before[n]) for n, p in model.named_parameters() if p.requires_grad)
    check("stage-1 GRPO step", not u["skipped"] and moved, f"reward {res['reward_mean']:.2f}, "
          f"loss {u['loss']:.4f}, kl {u['kl']:.5f}, grad norm {u['grad_norm']:.3f}")
    adapter = train.save_adapter(model, work / shape, "adapter")

    base = model.unload()  # the bare base again; stage 2 starts from the saved adapter, "ref" its frozen copy
    model = train.start_adapter(cfg, base, adapter)
    prompt_ids = [tok(engine.chat(tok, "Your task is to: put a mug in the sink", envs.Alfworld.system,
                            envs.AGENT_PREFIX))["input_ids"]]
    turns = [dict(episode=e, prompt_ids=prompt_ids[0],
                  completion_ids=tok(f"go.</think><action>{a}</action>")["input_ids"],
                  response=a) for e, a in enumerate(["go to sinkbasin 1", "look"])]
    summaries = [dict(won=True, steps=1, invalid=0), dict(won=False, steps=1, invalid=0)]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.learning_rate)
    res = rwml.policy_update(model, tok, opt, turns, summaries, dataclasses.replace(cfg, num_generations=2))
    u = res["updates"][0]
    check("stage-2 update from the saved adapter", not u["skipped"] and res["trained_turns"] == 2,
          f"loss {u['loss']:.4f}, kl {u['kl']:.5f} (0 at the start: the reference is the start adapter)")

    from peft import PeftModel

    probe = tok(texts[:1], return_tensors="pt", add_special_tokens=False).to(device)
    with torch.no_grad():
        want = model.base_model(**probe).logits.float()
    saved = train.save_adapter(model, work / shape, "adapter2")
    fresh, _ = engine.load_model(str(folder), device=device, load_in_4bit=four_bit)
    reloaded = PeftModel.from_pretrained(fresh, str(saved))
    with torch.no_grad():
        got = reloaded(**probe).logits.float()
    err = (got - want).abs().max().item()
    check("adapter saved and reloaded with PeftModel.from_pretrained", err < 1e-2,
          f"max logit difference {err:.2e}")
    if cuda:
        log(f"  peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB "
            f"({torch.cuda.get_device_name()})")
    log(f"  {shape}: {time.time() - t0:.0f} s")
    del model, reloaded, fresh, base
    if cuda:
        torch.cuda.empty_cache()
    return failures


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shapes", default="qwen2.5-0.5b,qwen2.5-1.5b")
    p.add_argument("--no-4bit", action="store_true", help="full-precision base weights")
    p.add_argument("--out", help="also write the output to this file")
    args = p.parse_args(argv)
    lines = []

    def log(line):
        print(line, flush=True)
        lines.append(line)

    log(f"gpu-check on {args.device}: torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"shapes {args.shapes}")
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(","):
            try:
                failures += check_shape(shape, args.device, not args.no_4bit, Path(tmp), log)
            except Exception:  # one shape's crash is reported and the next shape still runs
                log(traceback.format_exc())
                failures.append(f"{shape}: crashed")
    log("gpu-check: all passed" if not failures else "gpu-check: FAILED " + "; ".join(failures))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
