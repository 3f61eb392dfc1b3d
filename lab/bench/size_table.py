"""Computed GPU memory of one RWML GRPO step, per model size, on one 24 GB GPU (README, "On a GPU"):

    python lab/bench/size_table.py                       # the sizes of configs/gpu_24gb.json
    python lab/bench/size_table.py --prompt-tokens 1024  # longer prompts (history_len 2, tau2)

Arithmetic from the published shapes: NF4 base weights (bf16 embeddings), LoRA r16 all-linear in fp32 with
AdamW, a step's sampling KV cache, the training micro-batch with gradient checkpointing. A measured peak
(make gpu-check, a real run) replaces these numbers where one exists.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

GB = 1024 ** 3
# Qwen2.5 instruct checkpoints: hidden, layers, intermediate, heads, kv heads, vocabulary, tied embeddings
SHAPES = {
    "Qwen2.5-0.5B": (896, 24, 4864, 14, 2, 151936, True),
    "Qwen2.5-1.5B": (1536, 28, 8960, 12, 2, 151936, True),
    "Qwen2.5-3B": (2048, 36, 11008, 16, 2, 151936, True),
    "Qwen2.5-7B": (3584, 28, 18944, 28, 4, 152064, False),
}


def step_memory(shape, *, prompt: int, completion: int, sequences: int, micro: int, rank: int,
                chunk: int) -> dict:
    h, layers, inter, heads, kv, vocab, tied = shape
    hd = h // heads
    # per layer: q, k, v, o and the MLP's gate, up, down as (in, out)
    linears = [(h, h), (h, kv * hd), (h, kv * hd), (h, h), (h, inter), (h, inter), (inter, h)]
    base = layers * sum(i * o for i, o in linears)
    embed = vocab * h * (1 if tied else 2)
    weights = base * (0.5 + 4 / 64) + embed * 2  # NF4 + one fp32 absmax per 64 weights; bf16 embeddings
    lora = layers * sum(rank * (i + o) for i, o in linears)
    optim = lora * 16  # fp32 weight, gradient and AdamW's two moments
    kv_cache = sequences * (prompt + completion) * layers * 2 * kv * hd * 2  # bf16 keys and values
    # a micro-batch is one group: its prompt once (shared) and `micro` completions
    tokens = prompt + micro * completion
    checkpoints = tokens * h * 2 * layers  # each layer's input, kept for the backward's recomputation
    # one layer's activations while its backward recomputes it (bf16): norm, q/k/v, attention and o-projection
    # inputs (~11 h per token), the MLP's gate, up, activation and product (4 intermediate per token)
    layer = tokens * (11 * h + 4 * inter) * 2
    dequant = inter * h * 2  # the largest weight dequantized for a matmul
    logits = min(chunk, micro * completion) * vocab * 4 * 3  # a chunk's fp32 logits, log-softmax, gradient
    parts = dict(weights=weights, lora_and_adamw=optim, kv_cache=kv_cache,
                 activations=checkpoints + layer + dequant + logits, cuda_context=0.6 * GB)
    return dict(params=base + embed, **{k: v / GB for k, v in parts.items()},
                total=sum(parts.values()) / GB)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/gpu_24gb.json")
    ap.add_argument("--prompt-tokens", type=int, default=512,
                    help="world-model prompt length (history_len 1)")
    args = ap.parse_args()
    cfg = json.loads((Path(__file__).resolve().parents[2] / args.config).read_text())
    sizes = dict(prompt=args.prompt_tokens, completion=cfg["max_completion_length"],
                 sequences=cfg["prompts_per_step"] * cfg["num_generations"], micro=cfg["micro_batch_size"],
                 rank=cfg.get("lora_r", 16), chunk=cfg.get("logits_chunk_size", 512))
    print(f"# computed, not measured: {args.config}, prompt {args.prompt_tokens} tokens, "
          f"{sizes['sequences']} sequences of <= {sizes['completion']} new tokens per step, micro-batch "
          f"{sizes['micro']}, LoRA r{sizes['rank']} all-linear, 4-bit NF4, gradient checkpointing")
    print("| model | parameters | 4-bit weights | LoRA + AdamW | sampling KV cache | activations | "
          "total (GB) | fits 24 GB |")
    print("|---|---|---|---|---|---|---|---|")
    for name, shape in SHAPES.items():
        m = step_memory(shape, **sizes)
        print(f"| {name} | {m['params'] / 1e9:.2f}B | {m['weights']:.2f} | {m['lora_and_adamw']:.2f} | "
              f"{m['kv_cache']:.2f} | {m['activations']:.2f} | {m['total']:.1f} | "
              f"{'yes' if m['total'] < 22 else 'no'} |")


if __name__ == "__main__":
    main()
