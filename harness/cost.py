"""A run's time and peak memory, of the whole run and of each stage.

    with cost.run(out):               # train.py main: at the end one line on stdout and out/cost.json
        with cost.stage("collect"):   # any stage, nested or not, entered once or many times
            ...

A stage's peak RSS is its own: the highest RSS a background thread sampled while it was open (every 50 ms;
activations live for seconds), so a stage after a big one reports less and an enclosing stage the highest of
its own and its children's. The whole run's peak is the kernel's high-water mark (VmHWM, never reset: what
getrusage and `/usr/bin/time -v` report), or a stage's sample where the kernel's count trails it. Game worker
processes are counted apart (the largest that has ended: getrusage RUSAGE_CHILDREN), as `/usr/bin/time -v`
counts the largest process of a tree. On CUDA, also torch.cuda.max_memory_allocated, reset at each stage's
start.

Importing this module also tunes glibc's allocator (`tune_allocator`), and every stage boundary hands the
heap's free pages back (`_trim`): without that, freed activations stay in RSS
"""
from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

GB = 1024 ** 3
_KB = 1 if sys.platform == "darwin" else 1024  # ru_maxrss's unit: bytes on macOS, KiB on Linux


def _status(field: str) -> int:
    """A field of /proc/self/status in bytes (VmRSS, VmHWM); without /proc, getrusage's peak so far."""
    try:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * _KB


def _workers_bytes() -> int:
    """The largest RSS of any child process that has ended and been waited for."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * _KB


def _glibc():
    """The C library when it is glibc (Linux), else None: its malloc is the one tuned below."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _glibc()
MMAP_THRESHOLD = int(os.environ.get("RWML_MMAP", 1 << 20))  # bytes: glibc's mmap threshold


def tune_allocator() -> None:
    """glibc serves a block below its mmap threshold from its heap, and that threshold grows with every
    large block freed (up to 32 MB): activations of a few MB then fill the heap, fragment it and stay in
    RSS after they are freed (the GRPO step: 2.95 GB peak RSS for a working set of about 2.2). A fixed
    threshold of 1 MB maps such blocks and unmaps them when freed, at no measured cost in time. A user's own
    MALLOC_MMAP_THRESHOLD_ wins."""
    if _LIBC is not None and "MALLOC_MMAP_THRESHOLD_" not in os.environ and MMAP_THRESHOLD > 0:
        _LIBC.mallopt(-3, MMAP_THRESHOLD)  # M_MMAP_THRESHOLD


def _trim() -> None:
    """Give the heap's free pages back to the OS at a stage boundary, so that one stage's leftovers are not
    counted in the next one's peak. RWML_TRIM=0: off."""
    if _LIBC is not None and os.environ.get("RWML_TRIM", "1") == "1":
        _LIBC.malloc_trim(0)


tune_allocator()


def _cuda():
    torch = sys.modules.get("torch")  # never imports torch itself
    ok = torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized()
    return torch.cuda if ok else None


class Tracker:
    """The open stages and what each has used so far; a daemon thread raises their peaks every `interval`."""

    def __init__(self, interval: float = 0.05):
        self.t0, self.stages, self.open, self.workers0 = time.time(), {}, [], _workers_bytes()
        self._stop = threading.Event()
        threading.Thread(target=self._sample, args=(interval,), daemon=True).start()

    def _sample(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self._raise()

    def _raise(self) -> None:
        rss, cuda = _status("VmRSS:"), _cuda()
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
        t, w = time.time(), _workers_bytes()
        s = self.stages.setdefault(name, dict(seconds=0.0, peak=0, cuda_peak=0, calls=0, workers=None,
                                              first=t))
        self.open.append(s)
        self._raise()
        try:
            yield
        finally:
            self._raise()
            self.open = [o for o in self.open if o is not s]
            for o in self.open:  # the enclosing stages hold this one's peak
                o["peak"], o["cuda_peak"] = max(o["peak"], s["peak"]), max(o["cuda_peak"], s["cuda_peak"])
            _trim()
            s["seconds"] += time.time() - t
            s["calls"] += 1
            if _workers_bytes() > w:  # a worker that ended in this stage was the largest so far
                s["workers"] = _workers_bytes()

    def summary(self) -> dict:
        def gb(b):
            return round(b / GB, 3)

        workers, cuda = _workers_bytes(), any(s["cuda_peak"] for s in self.stages.values()) or _cuda()
        # VmHWM can trail a sampled VmRSS by the kernel's per-thread counters (a few MB): the larger wins
        peak = max([_status("VmHWM:")] + [s["peak"] for s in self.stages.values()])
        out = dict(seconds=round(time.time() - self.t0, 1), peak_rss_gb=gb(peak),
                   workers_peak_rss_gb=gb(workers) if workers > self.workers0 else None, pid=os.getpid(),
                   stages={})
        if cuda:
            out["cuda_max_allocated_gb"] = gb(max([s["cuda_peak"] for s in self.stages.values()] or [0]))
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
    """A stage of the current run (a context manager): its time and peak memory go into the cost line."""
    return _TRACKER.stage(name)


@contextmanager
def run(folder: Path | None, since: float | None = None):
    """A whole run: a fresh tracker; at the end (also after an error or Ctrl-C) the cost line on stdout and
    `folder`/cost.json when that folder exists. `since`: when the run's command started: its clock starts
    then, and stages since then count (the bundled model's conversion while the inputs were checked)."""
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
            tmp = Path(folder) / f"cost.json.tmp{os.getpid()}"  # accelerate launch: one writer per process
            tmp.write_text(json.dumps(summary, indent=2))
            os.replace(tmp, Path(folder) / "cost.json")
