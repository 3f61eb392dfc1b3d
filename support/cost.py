"""Support (skip on a first read): a run's time and peak memory, of the whole run and of each stage.

    with cost.run(out):               # train.py main: at the end one line on stdout and out/cost.json
        with cost.stage("collect"):   # any stage, nested or not, entered once or many times
            ...

Peak RSS per stage is the stage's own, not the process's running maximum, and the kernel's high-water mark
is never reset (resetting it, /proc/self/clear_refs "5", would also hide the true peak from getrusage and
from `/usr/bin/time -v`): a stage during which the process's high-water mark (VmHWM) rose peaked exactly
there; any other stage's peak is the highest RSS a background thread sampled during it (every 50 ms;
activations live for seconds). A stage that encloses others gets the highest of theirs and its own. The
whole run's peak is the exact high-water mark. Without /proc only getrusage's ru_maxrss exists, which never
goes down: stage figures are then "peak so far" (`stage_peaks` says which). Game worker processes are
counted apart (`workers_peak_rss_gb`: the largest worker that has ended, getrusage RUSAGE_CHILDREN), as
`/usr/bin/time -v` counts the largest process of a tree. On CUDA also torch.cuda.max_memory_allocated,
whose peak is reset at each boundary.

Importing this module also tunes glibc's allocator (`tune_allocator`), and every stage boundary hands the
heap's free pages back (`_trim`): without that, freed activations stay in RSS (lab/NOTEBOOK.md, the allocator)
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
_STATUS = Path("/proc/self/status")


def _status(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _hwm_bytes() -> int:
    """This process's peak RSS so far: VmHWM, or getrusage's ru_maxrss without /proc (the same number)."""
    hwm = _status("VmHWM:")
    if hwm is None:
        hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return hwm


def _rss_bytes() -> int:
    return _status("VmRSS:") or 0


def _workers_bytes() -> int:
    """The largest RSS of any child process that has ended and been waited for."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def _glibc():
    """The C library when it is glibc (Linux), else None: its malloc is the one tuned below."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _glibc()
MMAP_THRESHOLD = int(os.environ.get("RWML_MMAP", 1 << 20))  # bytes (lab/NOTEBOOK.md: the allocator)


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
    counted in (or added to) the next one's peak. RWML_TRIM=0: off (lab/NOTEBOOK.md's table)."""
    if _LIBC is not None and os.environ.get("RWML_TRIM", "1") == "1":
        _LIBC.malloc_trim(0)


tune_allocator()


def _cuda():
    torch = sys.modules.get("torch")  # never imports torch itself
    ok = torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized()
    return torch.cuda if ok else None


class Tracker:
    def __init__(self, interval: float = 0.05):
        self.t0, self.stages, self.open = time.time(), {}, []
        self.proc = _status("VmRSS:") is not None
        self.last_hwm, self.sampled, self.cuda_peak = _hwm_bytes(), 0, 0
        self.workers0 = _workers_bytes()
        self._stop = threading.Event()
        if self.proc:
            threading.Thread(target=self._sample, args=(interval,), daemon=True).start()

    def _sample(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.sampled = max(self.sampled, _rss_bytes())

    def close(self) -> None:
        self._stop.set()

    def _segment(self) -> None:
        """Close the memory segment since the last boundary: its peak goes to every open stage."""
        _trim()
        hwm, cuda = _hwm_bytes(), _cuda()
        sampled, self.sampled = self.sampled, 0
        # a new record in this segment is its exact peak; else the highest sample (or the record so far)
        rss = hwm if hwm > self.last_hwm or not self.proc else max(sampled, _rss_bytes())
        self.last_hwm = hwm
        gpu = cuda.max_memory_allocated() if cuda else 0
        self.cuda_peak = max(self.cuda_peak, gpu)
        for s in self.open:
            s["peak"], s["cuda_peak"] = max(s["peak"], rss), max(s["cuda_peak"], gpu)
        if cuda:
            cuda.reset_peak_memory_stats()

    @contextmanager
    def stage(self, name: str):
        self._segment()
        t, w = time.time(), _workers_bytes()
        s = self.stages.setdefault(name, dict(seconds=0.0, peak=0, cuda_peak=0, calls=0, workers=None,
                                              first=t))
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
        out = dict(seconds=round(time.time() - self.t0, 1), peak_rss_gb=gb(_hwm_bytes()),
                   workers_peak_rss_gb=gb(workers) if workers > self.workers0 else None,
                   stage_peaks="exact or sampled" if self.proc else "running maximum", pid=os.getpid(),
                   stages={})
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
    if summary["stage_peaks"] == "running maximum":
        head += " (stage peaks: running maximum)"
    return " | ".join([head] + [f"{name} {one(s)}" for name, s in summary["stages"].items()])


def _minutes(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 60 else f"{seconds / 60:.1f} min"


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
