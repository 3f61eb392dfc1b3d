"""A run's time and peak memory, of the whole run and of each stage.

    with cost.run(out):               # train.py: at the end one line on stdout and out/cost.json
        with cost.stage("collect"):   # any stage, nested or not, entered once or many times
            ...

A stage's peak RSS is its own: the highest RSS a thread samples every 50 ms while it is open
(activations live for seconds); an enclosing stage holds its children's. The run's peak is the
kernel's high-water mark (getrusage, as `/usr/bin/time -v`), the largest ended game worker apart.
On CUDA, also torch.cuda.max_memory_allocated, reset at each stage's start. Importing this module
tunes glibc's allocator; each stage's edges trim the heap: else freed activations stay in RSS.
"""
from __future__ import annotations

import ctypes
import json
import os
import resource
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import psutil

GB = 1024 ** 3
_KB = 1 if sys.platform == "darwin" else 1024  # ru_maxrss's unit: bytes on macOS, KiB on Linux
_WORKERS = resource.RUSAGE_CHILDREN  # _peak(_WORKERS): the largest game worker that has ended


def _peak(who: int = resource.RUSAGE_SELF) -> int:
    return resource.getrusage(who).ru_maxrss * _KB


_C = ctypes.CDLL(None)
_LIBC = _C if hasattr(_C, "mallopt") and hasattr(_C, "malloc_trim") else None  # glibc only
MMAP_THRESHOLD = int(os.environ.get("RWML_MMAP", 1 << 20))  # bytes: glibc's mmap threshold


def tune_allocator() -> None:
    """glibc's mmap threshold grows with every large block freed (to 32 MB): activations of a few MB
    then fragment the heap and stay in RSS once freed (a GRPO step: 2.95 GB peak for 2.2 in use). A
    fixed 1 MB maps and unmaps them, at no cost in time; MALLOC_MMAP_THRESHOLD_ wins."""
    if _LIBC is not None and "MALLOC_MMAP_THRESHOLD_" not in os.environ and MMAP_THRESHOLD > 0:
        _LIBC.mallopt(-3, MMAP_THRESHOLD)  # M_MMAP_THRESHOLD


def _trim() -> None:
    """The heap's free pages back to the OS, out of the next stage's peak (RWML_TRIM=0: off)."""
    if _LIBC is not None and os.environ.get("RWML_TRIM", "1") == "1":
        _LIBC.malloc_trim(0)


tune_allocator()


def _cuda():
    torch = sys.modules.get("torch")  # never imports torch itself
    ok = torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized()
    return torch.cuda if ok else None


class Tracker:
    """The open stages and their use so far; a daemon thread raises their peaks every `interval`."""

    def __init__(self, interval: float = 0.05):
        self.t0, self.stages, self.open, self.workers0 = time.time(), {}, [], _peak(_WORKERS)
        self._stop = threading.Event()
        threading.Thread(target=self._sample, args=(interval,), daemon=True).start()

    def _sample(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self._raise()

    def _raise(self) -> None:
        rss, cuda = psutil.Process().memory_info().rss, _cuda()
        gpu = cuda.max_memory_allocated() if cuda else 0
        for s in list(self.open):
            s["peak"], s["cuda_peak"] = max(s["peak"], rss), max(s["cuda_peak"], gpu)

    def close(self) -> None:
        self._stop.set()

    @contextmanager
    def stage(self, name: str):
        _trim()
        if cuda := _cuda():
            cuda.reset_peak_memory_stats()
        t, w = time.time(), _peak(_WORKERS)
        s = self.stages.setdefault(
            name, dict(seconds=0.0, peak=0, cuda_peak=0, calls=0, workers=None, first=t))
        self.open.append(s)
        self._raise()
        try:
            yield
        finally:
            self._raise()
            self.open = [o for o in self.open if o is not s]
            for o in self.open:  # the enclosing stages hold this one's peak
                o["peak"] = max(o["peak"], s["peak"])
                o["cuda_peak"] = max(o["cuda_peak"], s["cuda_peak"])
            _trim()
            s["seconds"] += time.time() - t
            s["calls"] += 1
            if _peak(_WORKERS) > w:  # a worker that ended in this stage: the largest yet
                s["workers"] = _peak(_WORKERS)

    def summary(self) -> dict:
        def gb(b):
            return round(b / GB, 3)

        workers = _peak(_WORKERS)
        stages = self.stages.values()
        cuda = any(s["cuda_peak"] for s in stages) or _cuda()
        # the high-water mark can trail a sampled RSS by the kernel's per-thread counters (a few MB)
        peak = max([_peak()] + [s["peak"] for s in stages])
        out = dict(seconds=round(time.time() - self.t0, 1), peak_rss_gb=gb(peak),
                   workers_peak_rss_gb=gb(workers) if workers > self.workers0 else None,
                   pid=os.getpid(), stages={})
        if cuda:
            out["cuda_max_allocated_gb"] = gb(max([s["cuda_peak"] for s in stages] or [0]))
        for name, s in self.stages.items():
            row = dict(seconds=round(s["seconds"], 1), peak_rss_gb=gb(s["peak"]), calls=s["calls"])
            if s["workers"]:
                row["workers_peak_rss_gb"] = gb(s["workers"])
            if cuda:
                row["cuda_max_allocated_gb"] = gb(s["cuda_peak"])
            out["stages"][name] = row
        return out


def line(summary: dict) -> str:
    """One line: the run's time and peak, then each stage's."""
    def one(s):
        minutes = f"{s['seconds']:.1f} s" if s["seconds"] < 60 else f"{s['seconds'] / 60:.1f} min"
        gpu = s.get("cuda_max_allocated_gb")
        gpu = f" (GPU {gpu:.2f} GB)" if gpu is not None else ""
        return f"{minutes} {s['peak_rss_gb']:.2f} GB{gpu}"

    head = f"cost: {one(summary)} peak RSS"
    if summary.get("workers_peak_rss_gb"):
        head += f", largest worker {summary['workers_peak_rss_gb']:.2f} GB"
    return " | ".join([head] + [f"{name} {one(s)}" for name, s in summary["stages"].items()])


_TRACKER = Tracker()


def stage(name: str):
    """A stage of the current run (a context manager): its time and peak go into the cost line."""
    return _TRACKER.stage(name)


@contextmanager
def run(folder: Path | None, since: float | None = None):
    """A whole run: at its end (errors, Ctrl-C too) the cost line and `folder`/cost.json. `since`:
    the command's start; stages since then count (a model's conversion)."""
    global _TRACKER
    before, _TRACKER = _TRACKER, Tracker()
    before.close()
    if since is not None:
        _TRACKER.t0 = since
        _TRACKER.stages = {k: s for k, s in before.stages.items() if s["first"] >= since}
    try:
        yield _TRACKER
    finally:
        summary = _TRACKER.summary()
        _TRACKER.close()
        _TRACKER = Tracker()  # what runs until the next run (its checks) is that run's
        print(line(summary), flush=True)
        if folder is not None and Path(folder).is_dir():
            tmp = Path(folder) / f"cost.json.tmp{os.getpid()}"  # accelerate: one writer per process
            tmp.write_text(json.dumps(summary, indent=2))
            os.replace(tmp, Path(folder) / "cost.json")
