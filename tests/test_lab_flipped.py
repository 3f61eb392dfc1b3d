"""lab/flipped_sign.py, the broken RWML the quick check must not pass: GRPO's advantages
negated in its own process only, train.py's command line otherwise unchanged."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_flipped_copy_negates_every_advantage_and_leaves_the_real_one_alone():
    script = "\n".join([
        "import runpy, torch, rwml",
        "real = rwml.group_advantages",
        "runpy.run_path('lab/flipped_sign.py', run_name='not_main')",
        "r = torch.tensor([1.0, 0.0, 0.0, 0.0])",
        "print(rwml.group_advantages(r, 4, 'none').tolist(), real(r, 4, 'none').tolist())"])
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                         env={"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr[-1500:]
    flipped, real = eval(run.stdout.strip().splitlines()[-1].replace("] [", "], ["))
    assert real == [0.75, -0.25, -0.25, -0.25] and flipped == [-0.75, 0.25, 0.25, 0.25]


def test_its_command_line_is_train_pys():
    run = subprocess.run([sys.executable, "lab/flipped_sign.py", "wm", "--help"], cwd=ROOT, text=True,
                         capture_output=True, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0 and "--reward-control" in run.stdout, run.stderr[-1500:]
