"""Peak RAM and time of one GRPO update, side by side: a naive full-logits step vs ours.

    python bench/memory.py [--model bundled:SmolLM2-135M-Instruct] [--sequences 8] [--length 512]

naive: one forward over the whole batch with the model's full logits ([B, T, vocab] in fp32: 0.8 GB for
8 x 512 x 49152), log_softmax, backward -- what a plain GRPO loop does. ours (rwml.py): micro-batches
(`micro_batch_size`), the decoder's hidden states, and the vocabulary projection only on completion
tokens, in checkpointed chunks. Same model, LoRA r=16 on q,k,v,o, same tokens, AdamW step. Each arm runs
in a fresh process so that its peak RSS is its own; the losses are printed to show the maths agree.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's modules

def one_step(arm: str, model_name: str, sequences: int, length: int, completion: int, micro: int) -> dict:
    import torch

    import rwml

    model, tok = rwml.load_model(model_name)
    model = rwml.add_lora(model)
    torch.manual_seed(0)
    ids = torch.randint(100, len(tok) - 100, (sequences, length))
    attn = torch.ones_like(ids)
    cmask = torch.ones(sequences, completion, dtype=torch.long)
    adv = torch.linspace(-1, 2, sequences)  # not symmetric: the loss is not 0
    weights = rwml.token_weights(cmask, "grpo", completion)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    model.train()
    t = time.time()
    loss_total = 0.0
    if arm == "naive":
        logits = model(input_ids=ids, attention_mask=attn).logits
        logp = logits[:, -completion - 1:-1].float().log_softmax(-1).gather(-1, ids[:, -completion:, None]).squeeze(-1)
        loss = rwml.grpo_loss(logp, logp.detach(), None, adv, weights)
        loss.backward()
        loss_total = loss.item()
    else:
        for i in range(0, sequences, micro):
            s = slice(i, i + micro)
            logp = rwml.completion_logprobs(model, ids[s], attn[s], cmask[s])
            loss = rwml.grpo_loss(logp, logp.detach(), None, adv[s], weights[s])
            loss.backward()
            loss_total += loss.item()
    opt.step()
    seconds = time.time() - t
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2  # Linux: KiB
    return dict(arm=arm, peak_rss_gb=round(peak_gb, 2), seconds=round(seconds, 1), loss=loss_total)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--model", default="bundled:SmolLM2-135M-Instruct")
    p.add_argument("--sequences", type=int, default=8)
    p.add_argument("--length", type=int, default=512, help="tokens per sequence (prompt + completion)")
    p.add_argument("--completion", type=int, default=128, help="completion tokens per sequence")
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--arm", choices=("naive", "ours"), help=argparse.SUPPRESS)  # the child process
    a = p.parse_args()
    if a.arm:
        print(json.dumps(one_step(a.arm, a.model, a.sequences, a.length, a.completion, a.micro_batch_size)))
        return
    rows = []
    for arm in ("naive", "ours"):
        r = subprocess.run([sys.executable, __file__, "--arm", arm, "--model", a.model, "--sequences", str(a.sequences),
                            "--length", str(a.length), "--completion", str(a.completion),
                            "--micro-batch-size", str(a.micro_batch_size)], capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"error: the {arm} arm failed: {r.stderr.strip().splitlines()[-1]}")
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
        print(f"{arm:>6}: peak RSS {rows[-1]['peak_rss_gb']:.2f} GB, {rows[-1]['seconds']:.1f} s, loss {rows[-1]['loss']:.6f}",
              flush=True)
    naive, ours = rows
    print(f"\n{a.sequences} sequences x {a.length} tokens ({a.completion} completion), LoRA r=16 q,k,v,o, "
          f"micro-batch {a.micro_batch_size}")
    print(f"peak RSS ours / naive: {ours['peak_rss_gb'] / naive['peak_rss_gb']:.2f}  "
          f"({ours['peak_rss_gb']:.2f} GB vs {naive['peak_rss_gb']:.2f} GB)")
    print(f"time ours / naive:     {ours['seconds'] / naive['seconds']:.2f}")
    print(f"same loss:             {abs(ours['loss'] - naive['loss']) < 1e-4 * max(1.0, abs(naive['loss']))}")


if __name__ == "__main__":
    main()
