"""The GPU smoke check's own paths, run on the CPU at a tiny shape (the GPU machine runs it at real
shapes)."""
from bench import gpu_check


def test_gpu_check_passes_on_cpu_with_4bit(tmp_path):
    out = tmp_path / "gpu_check.txt"
    assert gpu_check.main(["--device", "cpu", "--shapes", "tiny-llama", "--out", str(out)]) == 0
    text = out.read_text()
    assert "gpu-check: all passed" in text and text.count(" ok ") >= 6 and "Linear4bit" in text
