"""Stage 1 through TRL's GRPOTrainer, the lab's worked example (`lab/trl_grpo.py`, train.py wm's flags): in
one process, and in two processes under accelerate launch (gloo on CPU), where both must end with the same
adapter."""
import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from stages import plumbing
import train
import trl_grpo
from envs import UserError
from stages.plumbing import read_jsonl

ROOT = Path(__file__).resolve().parent.parent
needs_trl = pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in ("trl", "datasets")),
                               reason="TRL is optional: pip install --no-deps -r lab/bench/requirements.txt")


def letters_reward(completions, targets):
    """A fixed, continuous function of the completion text (its share of letters): rewards that differ
    within a group of a random tiny model's completions, where r_WM would be 0 throughout."""
    return [sum(ch.isalpha() for ch in c) / max(len(c), 1) for c in completions]


def wm_args(tiny_model, transitions, out, *extra):
    return ["--model", tiny_model, "--transitions", transitions, "--no-easy-filter",
            "--sft-epochs", "1", "--max-steps", "2", "--prompts-per-step", "2", "--num-generations", "2",
            "--max-completion-length", "8", "--micro-batch-size", "2", "--learning-rate", "1e-2",
            "--out", str(out), *extra]


@needs_trl
def test_trl_wm_from_the_warmup_saves_an_adapter_eval_reads(tiny_model, transitions, tmp_path, monkeypatch):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import eval as evaluate

    monkeypatch.setattr(train, "make_reward", lambda cfg: letters_reward)
    out = tmp_path / "run"
    trl_grpo.main(wm_args(tiny_model, transitions, out))  # warm-up on: TRL trains the filter's SFT copy on
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    # as ours
    assert all(set(plumbing.WM_METRICS) <= r.keys() for r in rows), set(plumbing.WM_METRICS) - rows[0].keys()
    samples = read_jsonl(out / "samples.jsonl")
    assert samples[0]["completion"].startswith("<next_state>")  # our prefix
    for g in samples[0]["groups"]:  # whole groups, as our trainer logs them
        assert len(g["completions"]) == len(g["rewards"]) == len(g["advantages"]) == 2
        assert g["rewards"] == letters_reward(g["completions"], None) and g["action"] in g["prompt_tail"]
        assert all((a > 0) == (r > min(g["rewards"])) for r, a in zip(g["rewards"], g["advantages"]))
    assert samples[0]["groups"] and samples[0]["completion"] == samples[0]["groups"][0]["completions"][0]
    warm = load_file(out / "filter" / "warmup_adapter" / "adapter_model.safetensors")
    trained = load_file(out / "adapter" / "adapter_model.safetensors")
    assert warm.keys() == trained.keys() and any((warm[k] != trained[k]).any() for k in warm)
    card = (out / "adapter" / "README.md").read_text()  # our card, as our trainer's: the query snippet too
    assert "trained in TRL's GRPOTrainer (lab/trl_grpo.py)" in card and "## Query this world model" in card
    # TRL's checkpoint holds our card, not peft's template naming the local model as base_model
    assert not (out / "trl" / "README.md").exists()
    checkpoint = (out / "trl" / "checkpoint-2" / "README.md").read_text()
    assert "TRL's checkpoint at step 2: `--resume` continues from it" in checkpoint
    assert "in TRL's GRPOTrainer" in checkpoint and tiny_model not in checkpoint
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), out / "adapter")
    assert any("lora_A" in n for n, _ in model.named_parameters())
    evaluate.main(["wm", "--model", tiny_model, "--adapter", str(out / "adapter"), "--transitions",
                   transitions, "--eval-max-triplets", "2", "--eval-samples", "1",
                   "--max-completion-length", "4", "--out", str(tmp_path / "wm.json")])
    assert json.loads((tmp_path / "wm.json").read_text())["n"] == 2
    with pytest.raises(UserError, match="--resume"):  # TRL's checkpoint in <out>/trl is a run, as ours
        trl_grpo.main(wm_args(tiny_model, transitions, out))


def test_trl_rejects_what_it_cannot_run(tiny_model, transitions, tmp_path, monkeypatch):
    """Before any model loads: a field TRL has no counterpart for, the held-out learning curve, a typo, and
    TRL missing are one-line errors; train.py has no TRL flag left."""
    for extra, message in [(["--logits-chunk-size", "64"], "--logits-chunk-size 64 has no counterpart in"),
                           (["--no-shared-prompt-forward"], "--shared-prompt-forward False has no"),
                           (["--eval-steps", "2"], "--eval-steps 2: the held-out learning curve is train"),
                           (["--use-vlm"], "did you mean --use-vllm")]:
        with pytest.raises(UserError, match=message):
            trl_grpo.main(wm_args(tiny_model, transitions, tmp_path, *extra))
    with pytest.raises(UserError, match="unknown argument '--use-vllm'"):
        train.main(["wm", "--use-vllm", "--out", str(tmp_path)])
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trl"
                        else find_spec(name, *a))
    with pytest.raises(UserError, match=r"pip install --no-deps -r lab/bench/requirements.txt"):
        trl_grpo.main(wm_args(tiny_model, transitions, tmp_path))
    assert not (tmp_path / "filter").exists()


RANK_SCRIPT = """
import hashlib, sys
sys.path[:0] = [{root!r}, {root!r} + "/lab"]
import train
import trl_grpo

def letters_reward(completions, targets):  # as in test_trl.py
    return [sum(ch.isalpha() for ch in c) / max(len(c), 1) for c in completions]


train.make_reward = lambda cfg: letters_reward
runs = []
train_wm_trl = trl_grpo.train_wm_trl
trl_grpo.train_wm_trl = lambda cfg, kept, out, *a: runs.append((out, train_wm_trl(cfg, kept, out, *a)))
trl_grpo.main(sys.argv[1:])
out, model = runs[0]
from peft import get_peft_model_state_dict

weights = get_peft_model_state_dict(model)
digest = hashlib.sha256(b"".join(k.encode() + weights[k].detach().cpu().contiguous().numpy().tobytes()
                                 for k in sorted(weights))).hexdigest()
moved = any(v.abs().sum() > 0 for k, v in weights.items() if "lora_B" in k)
rank = trl_grpo.process_state().process_index
(out / f"rank{{rank}}.txt").open("w").write(f"{{digest}} {{moved}}")
"""


@needs_trl
def test_two_processes_under_accelerate_end_with_the_same_adapter(tiny_model, transitions, tmp_path):
    """accelerate launch, 2 processes on CPU (gloo): DDP averages the gradients, so after 2 steps on different
    completions every process holds the same, trained adapter; the main process saved it."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT.format(root=str(ROOT)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "run"
    # --multi_gpu launches the processes (torchrun); with no GPU visible each picks the CPU and gloo
    # (accelerate's --cpu starts one process unless mpirun does the rest)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
           str(port), str(script), *wm_args(tiny_model, transitions, out, "--no-warmup")]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "wm (trl, 2 processes): 2 steps" in r.stdout
    ranks = [(out / f"rank{i}.txt").read_text().split() for i in range(2)]
    assert ranks[0] == ranks[1] and ranks[0][1] == "True"  # identical, and trained
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
