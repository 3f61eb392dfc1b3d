"""Ours vs TRL's GRPOTrainer on the same RWML world-model GRPO job, side by side, in one run.

    pip install --no-deps -r lab/bench/requirements.txt   # TRL and its data packages (the core needs neither)
    python lab/bench/grpo_vs_trl.py                       # --repeats 3 --steps 3 --model ... --out FILE

The same real world-model prompts (ALFWorld walkthroughs), model, LoRA (q/k/v/o), sampling, GRPO settings,
micro-batch, reward (reward.SimToRealReward) and optimizer steps; no gradient checkpointing. Every run is a
fresh process, the arms alternating; each reports completions/s, trained completion tokens/s (loading
excluded) and peak RSS (and GPU memory); the table: min / median / max and the ratio of medians, ours / TRL.
"""
from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: the project's modules

import engine  # noqa: E402

ARMS = ("ours", "trl")


@dataclass
class BenchConfig:
    model: str = "bundled:SmolLM2-135M-Instruct"
    repeats: int = 3
    steps: int = 3  # optimizer steps per run
    prompts_per_step: int = 2
    num_generations: int = 4
    max_completion_length: int = 96
    micro_batch_size: int = 4  # completions per forward / backward
    beta: float = 0.01
    learning_rate: float = 1e-4
    lora_r: int = 16
    lora_alpha: int = 32
    load_in_4bit: bool = False  # QLoRA (NF4 base) for both arms; meant for a GPU
    seed: int = 0
    out: str = "lab/results/bench_grpo_vs_trl/bench_grpo.txt"


TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def job_triplets(cfg: BenchConfig) -> list[dict]:
    import envs

    trips = envs.walkthrough_triplets("train", num_games=4, seed=cfg.seed)
    need = cfg.steps * cfg.prompts_per_step
    if len(trips) < need:
        raise envs.UserError(f"only {len(trips)} triplets for {need} prompts; lower --steps")
    return trips[:need]


def run_ours(cfg: BenchConfig) -> dict:
    import torch

    import rwml
    from stages.settings import GRPOConfig
    from reward import SimToRealReward

    trips, reward = job_triplets(cfg), SimToRealReward()
    model, tok = engine.load_model(cfg.model, load_in_4bit=cfg.load_in_4bit)
    torch.manual_seed(cfg.seed)
    model = engine.add_lora(model, cfg.lora_r, cfg.lora_alpha, 0.0, ",".join(TARGETS))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.learning_rate,
                            weight_decay=0.0)
    tcfg = GRPOConfig(num_generations=cfg.num_generations, beta=cfg.beta,
                            max_completion_length=cfg.max_completion_length,
                            micro_batch_size=cfg.micro_batch_size, loss_type="grpo", scale_rewards="group",
                            temperature=1.0)
    completions = tokens = 0
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        batch = trips[step * cfg.prompts_per_step:(step + 1) * cfg.prompts_per_step]
        res = rwml.grpo_step(model, tok, opt, batch, reward, tcfg, reasoning=True)  # <think>, as TRL's
        n = len(batch) * cfg.num_generations
        completions, tokens = completions + n, tokens + res["completion_tokens"] * n
    return dict(seconds=time.perf_counter() - t0, completions=completions, tokens=tokens)


def run_trl(cfg: BenchConfig) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
    from trl import GRPOConfig, GRPOTrainer

    import rwml
    from reward import SimToRealReward

    trips, reward = job_triplets(cfg), SimToRealReward()
    path = engine.bundled_smollm2() if cfg.model == engine.BUNDLED_MODEL else cfg.model
    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    extra = dict(quantization_config=BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype,
        bnb_4bit_use_double_quant=True)) if cfg.load_in_4bit else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **extra)
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    # the very prompts ours samples from: chat template + the "<think>" the reply starts with
    data = Dataset.from_list([dict(prompt=engine.chat(tok, rwml.wm_prompt(t, True), rwml.wm_system(t),
                                                    rwml.WM_PREFIX),
                                   targets=t["next_obs"]) for t in trips])
    accumulation = cfg.prompts_per_step * cfg.num_generations // cfg.micro_batch_size
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(output_dir=tmp, use_cpu=not cuda, bf16=cuda,
                          per_device_train_batch_size=cfg.micro_batch_size,
                          gradient_accumulation_steps=accumulation, num_generations=cfg.num_generations,
                          max_completion_length=cfg.max_completion_length, temperature=1.0, top_k=0,
                          top_p=1.0, beta=cfg.beta, epsilon=0.2, loss_type="grpo", scale_rewards="group",
                          num_iterations=1, learning_rate=cfg.learning_rate, lr_scheduler_type="constant",
                          warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, max_steps=cfg.steps,
                          gradient_checkpointing=False, shuffle_dataset=False, logging_steps=1,
                          report_to="none", save_strategy="no", seed=cfg.seed, dataloader_num_workers=0,
                          disable_tqdm=True)
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                              processing_class=tok,
                              peft_config=LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha,
                                                     lora_dropout=0.0, target_modules=TARGETS,
                                                     task_type="CAUSAL_LM"))
        t0 = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - t0
    logs = [r for r in trainer.state.log_history if "completions/mean_length" in r]
    n = cfg.prompts_per_step * cfg.num_generations
    return dict(seconds=seconds, completions=n * cfg.steps,
                tokens=sum(r["completions/mean_length"] * n for r in logs))


def machine() -> str:
    import os

    import torch
    cpu = (next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")), "unknown CPU")
           if Path("/proc/cpuinfo").exists() else "unknown CPU")
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ", no GPU"
    return f"{cpu}, {os.cpu_count()} cores{gpu}, torch {torch.__version__}"


def table(runs: list[dict], cfg: BenchConfig) -> str:
    keys = [("completions_per_s", "completions/s", "{:.3f}"), ("tokens_per_s", "trained tokens/s", "{:.1f}"),
            ("peak_rss_gb", "peak RSS (GB)", "{:.2f}")]
    if any("peak_gpu_gb" in r for r in runs):
        keys.append(("peak_gpu_gb", "peak GPU (GB)", "{:.2f}"))
    med = {arm: {k: statistics.median(r[k] for r in runs if r["arm"] == arm) for k, _, _ in keys}
           for arm in ARMS}
    lines = [f"# python lab/bench/grpo_vs_trl.py --repeats {cfg.repeats} --steps {cfg.steps} "
             f"(model {cfg.model}, {cfg.prompts_per_step} prompts x {cfg.num_generations} completions "
             f"per step, max {cfg.max_completion_length} tokens, micro-batch {cfg.micro_batch_size}, "
             f"beta {cfg.beta}, LoRA r={cfg.lora_r} on q/k/v/o"
             + (", 4-bit NF4" if cfg.load_in_4bit else "") + ")", f"# machine: {machine()}",
             "| arm | " + " | ".join(f"{name} min / median / max" for _, name, _ in keys) + " |",
             "|---|" + "---|" * len(keys)]
    for arm in ARMS:
        cells = [" / ".join(fmt.format(f(xs)) for f in (min, statistics.median, max))
                 for k, _, fmt in keys for xs in [[r[k] for r in runs if r["arm"] == arm]]]
        lines.append(f"| {'ours (rwml.grpo_step)' if arm == 'ours' else 'TRL GRPOTrainer'} | "
                     + " | ".join(cells) + " |")
    lines.append("| **ours / TRL** (medians) | "
                 + " | ".join(f"**{med['ours'][k] / med['trl'][k]:.2f}x**" for k, _, _ in keys) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    from harness.cli import parse_config

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--run"]:  # a child process: one arm, one JSON line on stdout
        import torch

        arm, cfg = argv[1], BenchConfig(**json.loads(argv[2]))
        res = (run_ours if arm == "ours" else run_trl)(cfg)
        gpu = dict(peak_gpu_gb=torch.cuda.max_memory_allocated() / 2**30) if torch.cuda.is_available() else {}
        res.update(peak_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, **gpu,  # KiB
                   arm=arm, completions_per_s=res["completions"] / res["seconds"],
                   tokens_per_s=res["tokens"] / res["seconds"])
        print("RESULT " + json.dumps(res))
        return
    cfg, _ = parse_config(BenchConfig, argv, prog="lab/bench/grpo_vs_trl.py")
    try:
        import trl  # noqa: F401 (is it installed?)
    except ImportError:
        from envs import UserError

        raise UserError("TRL is not installed: pip install --no-deps -r lab/bench/requirements.txt") from None
    runs = []
    for rep in range(cfg.repeats):
        for arm in ARMS if rep % 2 == 0 else ARMS[::-1]:  # alternate which arm goes first
            print(f"run {rep + 1}/{cfg.repeats}: {arm} ...", flush=True)
            proc = subprocess.run([sys.executable, __file__, "--run", arm, json.dumps(asdict(cfg))],
                                  capture_output=True, text=True)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if proc.returncode or line is None:
                sys.exit(f"error: the {arm} run failed:\n{proc.stderr[-3000:]}")
            runs.append(r := json.loads(line[7:]))
            print(f"  {r['completions_per_s']:.3f} completions/s, {r['tokens_per_s']:.1f} tokens/s, "
                  f"peak RSS {r['peak_rss_gb']:.2f} GB, {r['seconds']:.1f} s", flush=True)
    text = table(runs, cfg)
    print(text)
    Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
    Path(cfg.out).write_text(text + "\n# runs\n" + "".join(json.dumps(r) + "\n" for r in runs))


if __name__ == "__main__":
    from harness.cli import run_cli

    run_cli(main)
