"""Lab, a worked example: RWML's world-model GRPO (`train.py wm`) in TRL's GRPOTrainer, also on several GPUs.

    python lab/trl_grpo.py --transitions runs/collect/transitions.jsonl --max-steps 200 --out runs/wm_trl
    accelerate launch --num_processes N lab/trl_grpo.py --transitions ... --out ... [--use-vllm]

It reads `train.py wm`'s flags (`python lab/trl_grpo.py --help`) and runs its filter (and warm-up), reward
control, prompts, reward, start and KL reference: only the loop is TRL's, with our settings under TRL's names
(`train_wm_trl`). What differs from ours: TRL's own data order; TRL tokenizes the prompt (a tokenizer that
adds BOS to text gets a second one after the template's); without vLLM, generation stops at end of turn
only, so the tokens after </next_state> train too (the reward reads the text up to the first </next_state>,
as ours). Checkpoints are TRL's, in <out>/trl (`--resume` continues); metrics.jsonl holds TRL's log rows.
Needs TRL: pip install --no-deps -r lab/bench/requirements.txt (tests/test_trl.py runs it, one process and
two under accelerate; lab/bench/grpo_vs_trl.py times a step of each).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo's modules

import rwml  # noqa: E402
import train  # noqa: E402
from stages import plumbing  # noqa: E402
from reward import reward_control  # noqa: E402
from stages.runs import check_settings, check_stage, claim_out, releases_locks, settle_env, stage_inputs  # noqa: E402
from envs import parse_next_state  # noqa: E402
import engine  # noqa: E402
import cost
from harness.cli import parse_stage, run_cli  # noqa: E402
from harness.common import arg, write_atomic, write_jsonl
from envs import RERUN, UserError
from stages.plumbing import (PROMPT_TAIL, check_io, check_run, config_json, filter_dir,
                              group_table, run_header, use_4bit)
from cards import TRIPLETS_KEPT, card_folder, card_run, plot_rewards, save_adapter

CARD = "trained in TRL's GRPOTrainer (lab/trl_grpo.py)"


def process_state():
    """accelerate's view of this process (of `accelerate launch`'s, or alone); no CUDA: gloo."""
    from accelerate import PartialState
    return PartialState(cpu=not torch.cuda.is_available())


@dataclass
class TRLArgs:
    _argument_group_name = "TRL"
    use_vllm: bool = arg(False, "generation in vLLM, colocated (TRL's use_vllm; needs vllm)")


@dataclass
class Settings(train.Settings, TRLArgs):
    """`train.py wm`'s settings and TRL's."""


STAGE = {"wm": ("RWML's world-model GRPO in TRL's GRPOTrainer (lab/trl_grpo.py)",
                (*train.STAGES["wm"][1], TRLArgs))}


def check(cfg) -> None:
    """`train.py wm`'s checks, then what TRL cannot run: our speed-ups it lacks, the held-out learning curve,
    TRL or vLLM missing; each a one-line error before any model loads."""
    check_stage(cfg, "wm")
    for f in dataclasses.fields(cfg):
        if "no-trl" in f.metadata.get("part_of", ()) and getattr(cfg, f.name) != f.default:
            raise UserError(f"--{f.name.replace('_', '-')} {getattr(cfg, f.name)!r} has no counterpart in "
                            "TRL's GRPOTrainer; leave it out")
    if cfg.eval_steps:
        raise UserError(f"--eval-steps {cfg.eval_steps}: the held-out learning curve is train.py's; TRL's "
                        "loop would log no held-out rows: leave --eval-steps out")
    if importlib.util.find_spec("trl") is None or importlib.util.find_spec("datasets") is None:
        raise UserError("lab/trl_grpo.py needs TRL: pip install --no-deps -r lab/bench/requirements.txt")
    if cfg.use_vllm and importlib.util.find_spec("vllm") is None:
        raise UserError("--use-vllm needs vLLM, which is not installed: pip install vllm, or leave it out")


@releases_locks
def main(argv: list[str] | None = None) -> None:
    _, cfg, given = parse_stage(["wm", *(sys.argv[1:] if argv is None else argv)], STAGE, Settings)
    cfg = settle_env("wm", cfg, given)
    out = Path(cfg.out)
    check_run(cfg, processes=True)  # accelerate launch: every process runs this, TRL shares the work
    check(cfg)
    check_io(cfg)
    trips, _ = stage_inputs(cfg, "wm", plumbing.triplet_problem(cfg))
    claim_out(cfg, out, "trl")
    if found := next(out.glob("checkpoint*"), None):
        raise UserError(f"{out} holds a run of train.py ({found}), which TRL cannot continue; use another "
                        "--out")
    loaded, state = [], process_state()

    def load():
        if not loaded:
            loaded.append(engine.load_model(cfg.model, load_in_4bit=use_4bit(cfg)))
        return loaded[0]

    with cost.run(out), card_run("wm", cfg):
        reward_fn = train.make_reward(cfg)
        with state.main_process_first():  # the main process first; the others reuse its cache
            kept, start = train.filter_triplets(cfg, trips, filter_dir(cfg, out), load, reward_fn)
        with state.main_process_first():  # mis.json: one writer at a time
            kept, reward_fn = reward_control(cfg, kept, reward_fn, out)
        with cost.stage("grpo"):
            train_wm_trl(cfg, kept, out, load, reward_fn, start)


def train_wm_trl(cfg, triplets: list[dict], out: Path, load, reward_fn, start: Path | None):
    """RWML through TRL's GRPOTrainer, in one process or in each of `accelerate launch`'s: the triplets (the
    filter's output, after any reward control), prompts, reward, start (the warm-up adapter or a fresh LoRA)
    and KL reference of `train.py wm`, its settings under TRL's names. Returns the peft model."""
    from datasets import Dataset
    from peft import PeftModel
    from transformers import TrainerCallback
    from transformers.trainer_utils import get_last_checkpoint
    from trl import GRPOConfig, GRPOTrainer

    if not triplets:
        raise UserError("no training triplets left after filtering; collect more games")
    state, cuda = process_state(), torch.cuda.is_available()
    per_step, n = cfg.prompts_per_step * cfg.num_generations, state.num_processes
    if n > 1 and getattr(reward_fn, "rng", None) is not None:  # COIN: each process flips coins of its own
        reward_fn.rng.seed(cfg.seed * 1000 + state.process_index)
    # ours: prompts_per_step x num_generations completions a step, micro_batch_size per forward; TRL: per
    # process micro-batches x processes x accumulation steps (micro_batch_size is an upper bound here too)
    micro = min(cfg.micro_batch_size, max(per_step // n, 1))
    if per_step % (micro * n):
        raise UserError(f"--prompts-per-step x --num-generations = {per_step} completions a step do not "
                        f"split into {n} processes x --micro-batch-size {micro}; change one of them")
    trl_dir = out / "trl"
    last = get_last_checkpoint(str(trl_dir)) if trl_dir.is_dir() else None
    if last and not cfg.resume:
        raise UserError(f"{out} already holds a run; pass --resume to continue it, or use another --out")
    if last:
        check_settings(cfg, out)
    if state.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(out / "config.json", config_json(cfg))
    chats = [rwml.wm_texts(t, cfg.wm_reasoning) for t in triplets]  # (system, prompt, reply prefix, stop)
    prefix, stop = chats[0][2:]
    model, tok = load()
    # our prompt text: chat template, system prompt and the reply's prefix, which TRL's completions then lack
    prompts = [engine.chat(tok, user, system, prefix) for system, user, _, _ in chats]
    data = Dataset.from_dict(dict(prompt=prompts, targets=[t["next_obs"] for t in triplets],
                                  action=[t["action"] for t in triplets],
                                  prompt_tail=[user[-PROMPT_TAIL:] for _, user, _, _ in chats]))
    G = cfg.num_generations

    def reward(completions, targets, action, prompt_tail, trainer_state, **_):
        texts = [prefix + (c[:c.index(stop) + len(stop)] if stop in c else c) for c in completions]
        rewards = reward_fn(texts, targets)
        step = trainer_state.global_step + 1  # the step these completions train
        if state.is_main_process and (step % cfg.log_completions_steps == 0 or step == 1):
            # TRL's sampler puts a prompt's G completions next to each other: whole groups, as ours logs them
            # (the main process's share of them under accelerate; advantages as TRL computes them on one
            # process)
            k = len(texts) // G * G
            adv = rwml.group_advantages(torch.tensor(rewards[:k]), G, cfg.scale_rewards).tolist() if k else []
            groups = [dict(prompt_tail=prompt_tail[i], action=action[i], target=targets[i],
                           completions=texts[i:i + G], rewards=rewards[i:i + G],
                           advantages=[round(a, 4) for a in adv[i:i + G]])
                      for i in range(0, k, G)]
            with open(out / "samples.jsonl", "a") as f:
                f.write(json.dumps(dict(step=step, action=action[0], completion=texts[0], target=targets[0],
                                        reward=rewards[0], groups=groups)) + "\n")
            if groups:
                tqdm.write(group_table(step, groups, parse_next_state))
        return rewards

    reward.__name__ = getattr(reward_fn, "__name__", "reward")  # TRL logs rewards/<name>/mean
    args = GRPOConfig(
        output_dir=str(trl_dir), seed=cfg.seed, max_steps=cfg.max_steps, learning_rate=cfg.learning_rate,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,  # ours: AdamW at a constant rate
        num_generations=cfg.num_generations, max_completion_length=cfg.max_completion_length,
        temperature=cfg.temperature, top_p=cfg.top_p, top_k=0, beta=cfg.beta, epsilon=cfg.epsilon,
        epsilon_high=cfg.epsilon_high, num_iterations=cfg.num_iterations, loss_type=cfg.loss_type,
        scale_rewards=cfg.scale_rewards, max_grad_norm=cfg.max_grad_norm, per_device_train_batch_size=micro,
        gradient_accumulation_steps=per_step // (micro * n), save_steps=cfg.save_steps, save_total_limit=1,
        # transformers 5's name of gradient_checkpointing
        activation_checkpointing=cfg.gradient_checkpointing,
        activation_checkpointing_kwargs=dict(use_reentrant=False),
        logging_steps=1, report_to=cfg.report_to, use_cpu=not cuda, bf16=cuda, use_vllm=cfg.use_vllm,
        vllm_mode="colocate",  # vLLM can stop at </next_state> as ours does, keeping it in the text
        generation_kwargs=dict(stop=[stop], include_stop_str_in_output=True) if cfg.use_vllm else None)
    torch.manual_seed(cfg.seed)
    if start:  # the warm-up adapter trains on; TRL copies it to a frozen "ref" adapter, the KL reference
        model = PeftModel.from_pretrained(model, str(start), is_trainable=True)
    else:  # a fresh LoRA, as ours (its B = 0: the reference TRL copies from it is the base model)
        model = engine.add_lora(model, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules)
    if state.is_main_process:
        print(run_header(model, cfg, f"wm (trl, {n} processes): RWML GRPO on {len(triplets)} triplets",
                         f"{cfg.prompts_per_step} prompts", start))
    class Cards(TrainerCallback):  # TRL's checkpoint gets our card (peft's template named the local cache)
        def on_save(self, args, state, control, **_):
            (trl_dir / "README.md").unlink(missing_ok=True)  # TRL's card of its folder: ours is in adapter/
            if state.is_world_process_zero and (ckpt := trl_dir / f"checkpoint-{state.global_step}").is_dir():
                card_folder(ckpt, extra=[f"TRL's checkpoint at step {state.global_step}: `--resume` "
                                         "continues from it; the finished adapter: ../../adapter", CARD])

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                          processing_class=tok, callbacks=[Cards()])
    trainer.train(resume_from_checkpoint=last)
    model = trainer.model
    if state.is_main_process:
        adapter = save_adapter(model, out, cfg=cfg, data={TRIPLETS_KEPT: len(triplets)}, extra=[CARD])
        write_jsonl(out / "metrics.jsonl", [r for r in trainer.state.log_history if "reward" in r])
        plot_rewards(out / "metrics.jsonl", out / "reward_curve.png", "RWML world-model GRPO (TRL)")
        print(f"wm (trl, {n} processes): {trainer.state.global_step} steps; adapter -> {adapter}")
    state.wait_for_everyone()
    return model


if __name__ == "__main__":
    run_cli(main, f"interrupted: {RERUN}")
