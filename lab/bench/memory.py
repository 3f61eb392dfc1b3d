"""Peak RAM and speed of one training update, side by side: the warm-up SFT step and the GRPO step, ours vs
the naive full-logits path (and, for SFT, TRL's SFTTrainer), on the same job.

    OMP_NUM_THREADS=1 python lab/bench/memory.py [--model bundled:SmolLM2-135M-Instruct] [--job JOB|both]

SFT: one optimizer step on the 8 longest real world-model prompts of the warm-up (history 1, no reasoning).
naive: one forward with [B, T, vocab] fp32 logits; ours: engine.sft (token-budget micro-batches, answer-only
chunked projection); trl: SFTTrainer, completion_only_loss, fp32. GRPO: one update of `--sequences` random
sequences, naive vs rwml.grpo_update. sample: the held-out evaluation's sampling batch (4 prompts x 4 at 64
tokens), model.generate vs ours. LoRA r 16 all-linear, AdamW; each arm in a fresh process; peak RSS is
VmHWM reset just before the update, "+" what the update added. tests/test_memory.py runs the child mode.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: the project's modules

import engine  # noqa: E402
from stages.settings import EngineArgs  # noqa: E402


def vm(field: str) -> int:
    """A field of /proc/self/status in bytes (VmRSS, VmHWM)."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field))
    return int(line.split()[1]) * 1024


def one_step(job: str, arm: str, model_name: str, a) -> dict:
    import torch

    import cost  # noqa: F401 -- tunes glibc's allocator, as a run does
    import envs
    import rwml
    from stages.settings import GRPOConfig

    model, tok = engine.load_model(model_name)
    torch.manual_seed(0)
    model = engine.add_lora(model, 16, 32, 0.0, "all-linear")
    engine.fast_paths(model)  # the once-per-model check, outside the measured update
    params = [p for p in model.parameters() if p.requires_grad]
    if job == "sft":
        trips = envs.walkthrough_triplets(num_games=6, history_len=1)  # the 8 longest world-model prompts
        trips = sorted(trips, key=lambda t: -len(rwml.wm_prompt(t, reasoning=False)))[:8]
        system, prefix = rwml.wm_system(trips[0]), rwml.wm_prefix(False)
        prompts = [rwml.wm_prompt(t, reasoning=False) for t in trips]
        answers = [rwml.wm_answer(t) for t in trips]
        texts = [engine.chat(tok, p, system, prefix) for p in prompts]
        rows = [(tok(t, add_special_tokens=False)["input_ids"],
                 tok(x + tok.eos_token, add_special_tokens=False)["input_ids"])
                for t, x in zip(texts, answers)]
        tokens = sum(len(p) + len(c) for p, c in rows)
        if arm == "ours":
            def step():
                return engine.sft(model, tok, prompts, answers, system=system, prefix=prefix, epochs=1,
                                  lr=a.lr, batch_size=len(prompts), shuffle=False, max_tokens=a.max_tokens)[0]
        elif arm == "naive":
            def step():
                opt = torch.optim.AdamW(params, lr=a.lr)
                model.train()
                ids, attn, cmask = engine.pack(*zip(*rows), tok.pad_token_id)
                C = cmask.shape[1]
                logits = model(input_ids=ids, attention_mask=attn,
                               position_ids=(attn.cumsum(-1) - 1).clamp(min=0)).logits
                logp = logits[:, -C - 1:-1].float().log_softmax(-1).gather(-1, ids[:, -C:, None]).squeeze(-1)
                loss = -(logp * cmask).sum() / cmask.sum()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                return loss.item()
        else:
            step = trl_sft_step(model, tok, texts, [x + tok.eos_token for x in answers], a.lr)
    elif job == "sample":  # the held-out evaluation's batch: the 4 longest prompts x 4 samples, 64 tokens
        trips = envs.walkthrough_triplets(num_games=6, history_len=1)
        trips = sorted(trips, key=lambda t: -len(rwml.wm_prompt(t, reasoning=False)))[:4]
        tokens = 16 * 64
        if arm == "ours":
            def step():
                roll = rwml.sample_predictions(model, tok, trips, reasoning=False, n=4, max_new_tokens=64)
                return float(roll.completion_mask.sum())
        else:  # transformers' generate on the 16 rows, every prompt run in full
            def step():
                texts = [engine.chat(tok, rwml.wm_prompt(t, False), rwml.wm_system(t), rwml.wm_prefix(False))
                         for t in trips for _ in range(4)]
                batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
                gen = engine.sampling_config(model, tok, temperature=1.0, top_p=1.0, max_new_tokens=64)
                with torch.no_grad(), engine.checkpoint_generation_config_off(model):
                    return float(model.generate(**batch, generation_config=gen).shape[1])
    else:
        ids = torch.randint(100, len(tok) - 100, (a.sequences, a.length))
        cmask = torch.ones(a.sequences, a.completion, dtype=torch.long)
        batch = rwml.Batch(input_ids=ids, attention_mask=torch.ones_like(ids), completion_mask=cmask,
                           advantages=torch.linspace(-1, 2, a.sequences),  # not symmetric: loss is not 0
                           weights=rwml.token_weights(cmask, "grpo", a.completion))
        tokens = ids.numel()
        cfg = GRPOConfig(micro_batch_size=a.micro_batch_size, micro_batch_tokens=a.micro_batch_tokens,
                               beta=0.0)
        opt = torch.optim.AdamW(params, lr=1e-5)
        if arm == "ours":
            def step():
                return rwml.grpo_update(model, opt, batch, cfg)[0]["loss"]
        else:
            def step():
                model.train()
                C = a.completion
                logits = model(input_ids=ids, attention_mask=batch.attention_mask).logits
                logp = logits[:, -C - 1:-1].float().log_softmax(-1).gather(-1, ids[:, -C:, None]).squeeze(-1)
                loss = rwml.grpo_loss(logp, logp.detach(), None, batch.advantages, batch.weights, beta=0.0)
                loss.backward()
                opt.step()
                return loss.item()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := RSS now (Linux): the peak of this update alone
    before, t = vm("VmRSS:"), time.time()
    loss = step()
    seconds, peak = time.time() - t, vm("VmHWM:")
    added = peak - before
    return dict(job=job, arm=arm, peak_rss_gb=round(peak / 2 ** 30, 3), added_gb=round(added / 2 ** 30, 3),
                seconds=round(seconds, 2), tokens=tokens, tokens_per_s=round(tokens / seconds, 1), loss=loss,
                threads=torch.get_num_threads())


def trl_sft_step(model, tok, prompts: list[str], completions: list[str], lr: float):
    """TRL's SFTTrainer on the same batch: built outside the measurement, one step of train() inside it."""
    import tempfile

    import torch
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    tmp = tempfile.mkdtemp()
    # bf16 off (SFTConfig turns it on: slow on a CPU, not the fp32 of the other arms); checkpointing on
    args = SFTConfig(output_dir=tmp, max_steps=1, bf16=False, per_device_train_batch_size=len(prompts),
                     gradient_accumulation_steps=1, learning_rate=lr, lr_scheduler_type="constant",
                     warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, completion_only_loss=True,
                     max_length=None, report_to="none", save_strategy="no", logging_steps=1,
                     use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0, seed=0)
    trainer = SFTTrainer(model=model, args=args, processing_class=tok,
                         train_dataset=Dataset.from_dict(dict(prompt=prompts, completion=completions)))

    def step():
        trainer.train()
        return next(r["loss"] for r in trainer.state.log_history if "loss" in r)
    return step


ARMS = dict(sft=("naive", "ours", "trl"), grpo=("naive", "ours"), sample=("generate", "ours"))


def main() -> None:

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--model", default="bundled:SmolLM2-135M-Instruct")
    p.add_argument("--job", choices=("sft", "grpo", "sample", "both"), default="both")
    p.add_argument("--lr", type=float, default=5e-4, help="SFT learning rate (train.py's sft_learning_rate)")
    p.add_argument("--max-tokens", type=int, default=engine.SFT_MAX_TOKENS,
                   help="ours: SFT tokens per micro-batch")
    p.add_argument("--sequences", type=int, default=16, help="GRPO: completions in the update")
    p.add_argument("--length", type=int, default=400, help="GRPO: tokens per sequence (prompt + completion)")
    p.add_argument("--completion", type=int, default=64, help="GRPO: completion tokens per sequence")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--micro-batch-tokens", type=int, default=EngineArgs.micro_batch_tokens)
    p.add_argument("--arm", help=argparse.SUPPRESS)  # the child process: job:arm
    a = p.parse_args()
    if a.arm:
        job, arm = a.arm.split(":")
        print(json.dumps(one_step(job, arm, a.model, a)))
        return
    for job in (("sft", "grpo", "sample") if a.job == "both" else (a.job,)):
        rows = {}
        for arm in ARMS[job]:
            r = subprocess.run([sys.executable, __file__, "--arm", f"{job}:{arm}", *sys.argv[1:]],
                               capture_output=True, text=True)
            if r.returncode:
                sys.exit(f"error: the {job} {arm} arm failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
            rows[arm] = row = json.loads(r.stdout.strip().splitlines()[-1])
            print(f"{job:>4} {arm:>5}: peak RSS {row['peak_rss_gb']:.2f} GB (+{row['added_gb']:.2f} GB), "
                  f"{row['seconds']:.1f} s, {row['tokens_per_s']:.0f} tokens/s, "
                  f"loss {row['loss']:.6f}", flush=True)
        ours = rows["ours"]
        for other in (o for o in ARMS[job] if o != "ours"):
            o = rows[other]
            print(f"{job:>4} ours / {other}: peak RSS {ours['peak_rss_gb'] / o['peak_rss_gb']:.2f}, "
                  f"added {ours['added_gb'] / max(o['added_gb'], 1e-9):.2f}, "
                  f"tokens/s {ours['tokens_per_s'] / o['tokens_per_s']:.2f}"
                  + ("" if job == "sample" else  # sample: no loss to compare
                     f", same loss {abs(ours['loss'] - o['loss']) < 1e-4 * max(1.0, abs(o['loss']))}"),
                  flush=True)
    print(f"\n{a.model}, LoRA r 16 all-linear, {ours['threads']} thread(s); "
          "SFT: 8 longest real world-model prompts, "
          f"ours in micro-batches of <= {a.max_tokens} tokens; GRPO: {a.sequences} x {a.length} tokens "
          f"({a.completion} completion), micro-batch {a.micro_batch_size} / {a.micro_batch_tokens} tokens")


if __name__ == "__main__":
    main()
