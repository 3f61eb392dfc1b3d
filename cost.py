"""Where a run's time and memory went: wall time and peak memory of the whole run and of each stage.

    with cost.run(out):               # train.py main: at the end one line on stdout and out/cost.json
        with cost.stage("collect"):   # any stage, nested or not, entered once or many times
            ...

Peak RSS per stage is honest, not the process's running maximum: on Linux the kernel's high-water mark
(VmHWM) is read and reset (/proc/self/clear_refs, "5") at every stage boundary, so a stage's peak is its
own; a stage that encloses others gets the highest of theirs and its own. Elsewhere (no /proc) only
getrusage's ru_maxrss exists, which never goes down: a stage's figure is then "peak so far" and the file
says so (`per_stage_peak`). Game worker processes are counted apart (`workers_peak_rss_gb`: the largest
worker that has ended, getrusage RUSAGE_CHILDREN), as `/usr/bin/time -v` counts the largest process of a
tree. On CUDA also torch.cuda.max_memory_allocated, reset the same way.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time
from contextlib import contextmanager
from pathlib import Path

GB = 1024 ** 3
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _hwm_bytes() -> int:
    """This process's peak RSS since the last reset: VmHWM, or ru_maxrss (never reset) without /proc."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def _reset_hwm() -> bool:
    """VmHWM := current RSS (Linux >= 4.0). False where that is not possible."""
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def _workers_bytes() -> int:
    """The largest RSS of any child process that has ended and been waited for."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def _cuda():
    torch = sys.modules.get("torch")  # never imports torch itself
    return torch.cuda if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized() else None


class Tracker:
    def __init__(self):
        self.t0, self.stages, self.open = time.time(), {}, []
        self.resets = _reset_hwm()
        self.peak, self.cuda_peak = 0, 0  # the whole run's, over every segment
        self.workers0 = _workers_bytes()

    def _segment(self) -> None:
        """Close the memory segment since the last boundary: its peaks go to every open stage; reset."""
        rss, cuda = _hwm_bytes(), _cuda()
        gpu = cuda.max_memory_allocated() if cuda else 0
        self.peak, self.cuda_peak = max(self.peak, rss), max(self.cuda_peak, gpu)
        for s in self.open:
            s["peak"], s["cuda_peak"] = max(s["peak"], rss), max(s["cuda_peak"], gpu)
        if self.resets:
            _reset_hwm()
        if cuda:
            cuda.reset_peak_memory_stats()

    @contextmanager
    def stage(self, name: str):
        self._segment()
        s = self.stages.setdefault(name, dict(seconds=0.0, peak=0, cuda_peak=0, calls=0, workers=None))
        t, w = time.time(), _workers_bytes()
        self.open.append(s)
        try:
            yield
        finally:
            self._segment()
            del self.open[next(i for i, o in enumerate(self.open) if o is s)]  # by identity
            s["seconds"] += time.time() - t
            s["calls"] += 1
            if _workers_bytes() > w:  # a worker that ended in this stage was the largest so far
                s["workers"] = _workers_bytes()

    def summary(self) -> dict:
        self._segment()

        def gb(b):
            return round(b / GB, 3)

        workers = _workers_bytes()
        out = dict(seconds=round(time.time() - self.t0, 1), peak_rss_gb=gb(self.peak),
                   workers_peak_rss_gb=gb(workers) if workers > self.workers0 else None,
                   per_stage_peak=self.resets, pid=os.getpid(), stages={})
        if _cuda() or self.cuda_peak:
            out["cuda_max_allocated_gb"] = gb(self.cuda_peak)
        for name, s in self.stages.items():
            row = dict(seconds=round(s["seconds"], 1), peak_rss_gb=gb(s["peak"]), calls=s["calls"])
            if s["workers"]:
                row["workers_peak_rss_gb"] = gb(s["workers"])
            if out.get("cuda_max_allocated_gb") is not None:
                row["cuda_max_allocated_gb"] = gb(s["cuda_peak"])
            out["stages"][name] = row
        return out


def line(summary: dict) -> str:
    """One line: the run's time and peak, then each stage's."""
    def one(s):
        text = f"{_minutes(s['seconds'])} {s['peak_rss_gb']:.2f} GB"
        if s.get("cuda_max_allocated_gb") is not None:
            text += f" (GPU {s['cuda_max_allocated_gb']:.2f} GB)"
        return text

    head = f"cost: {one(summary)} peak RSS"
    if summary.get("workers_peak_rss_gb"):
        head += f", largest worker {summary['workers_peak_rss_gb']:.2f} GB"
    if not summary["per_stage_peak"]:
        head += " (stage peaks: running maximum)"
    return " | ".join([head] + [f"{name} {one(s)}" for name, s in summary["stages"].items()])


def _minutes(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 60 else f"{seconds / 60:.1f} min"


_TRACKER = Tracker()


def stage(name: str):
    """A stage of the current run (a context manager): its time and peak memory go into the cost line."""
    return _TRACKER.stage(name)


@contextmanager
def run(folder: Path | None):
    """A whole run: a fresh tracker; at the end (also after an error or Ctrl-C) the cost line on stdout and
    `folder`/cost.json when that folder exists."""
    global _TRACKER
    _TRACKER = Tracker()
    try:
        yield _TRACKER
    finally:
        summary = _TRACKER.summary()
        print(line(summary), flush=True)
        if folder is not None and Path(folder).is_dir():
            tmp = Path(folder) / "cost.json.tmp"
            tmp.write_text(json.dumps(summary, indent=2))
            os.replace(tmp, Path(folder) / "cost.json")
