"""Support (skip on a first read): the speed of the game engine, behind envs.py's games (same outputs):
`use_engine_cache` caches the TextWorld engine's measured hot spots; `EnvPool` plays many episodes' games
in forked worker processes, which exit with their parent. Torch-free and cheap to import; the game class
comes in as a parameter (envs.Game, worlds.TwGame), so this module imports no environment.
"""
from __future__ import annotations

import copy
import functools
import multiprocessing as mp
import os
import signal
import sys
import time
from contextlib import suppress

from support.common import RERUN, UserError

_ORIGINALS: dict = {}


def use_engine_cache(enabled: bool = True) -> None:
    """Cache TextWorld's two measured hot spots (same outputs; tests/test_envs.py): every step re-parses the
    same grammar strings with tatsu, and every load and reset translates the same PDDL problem to SAS."""
    import fast_downward
    import textworld.envs.pddl.textgen as textgen
    import textworld.logic

    if not _ORIGINALS:
        _ORIGINALS.update(parse=textgen._parse_and_convert,
                          query=textworld.logic.Rule.__dict__["parse_conjunctive_query"],
                          pddl2sas=fast_downward.pddl2sas)
    if not enabled:
        textgen._parse_and_convert = _ORIGINALS["parse"]
        textworld.logic.Rule.parse_conjunctive_query = _ORIGINALS["query"]
        fast_downward.pddl2sas = _ORIGINALS["pddl2sas"]
        return

    # deep copies of the memoised parses: the engine mutates parsed symbols while deriving
    parse = functools.lru_cache(maxsize=None)(lambda text, rule: _ORIGINALS["parse"](text, rule_name=rule))
    textgen._parse_and_convert = lambda text, rule_name, **kw: copy.deepcopy(parse(text, rule_name))
    # a parsed query is only read (matched against the state), so one shared copy is safe
    query = functools.lru_cache(maxsize=None)(_ORIGINALS["query"].__func__)
    textworld.logic.Rule.parse_conjunctive_query = classmethod(query)
    sas = {}  # the translated task is only read by PddlState; the dict keeps it across resets

    def pddl2sas(domain, problem, verbose=False, optimize=False):
        key = (domain, problem, optimize)
        if key not in sas:
            sas[key] = _ORIGINALS["pddl2sas"](domain, problem, verbose=verbose, optimize=optimize)
        return sas[key]

    fast_downward.pddl2sas = pddl2sas


def _serve(conn, max_turns: int, parent_pid: int, parent_ends: list, game_cls) -> None:
    """Worker loop: owns the games of its slots; answers lists of (slot, op, arg) in order. Exits with its
    parent, however the parent exits; leaves Ctrl-C to the parent, which says it in one line."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C signals the whole process group
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # so may SIGTERM (kill -TERM -PGID); the parent says it
    if sys.platform.startswith("linux"):  # SIGKILL when the forking thread ends (kill -9, out of memory)
        with suppress(OSError, AttributeError):  # elsewhere: the parent check below, within a second
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    for end in parent_ends:  # forked copies of the parent's pipe ends: they would keep the pipes open
        end.close()          # after the parent dies, and this worker would wait for a message forever
    use_engine_cache()
    games = {}
    while True:
        while not conn.poll(1.0):
            if os.getppid() != parent_pid:  # the parent is gone (and no signal came)
                return
        try:
            jobs = conn.recv()
        except EOFError:  # the parent closed its end
            return
        if jobs is None:
            return
        out = []
        for slot, op, arg in jobs:
            try:
                game = games.setdefault(slot, game_cls(max_turns))
                out.append(game.reset(arg) if op == "reset" else game.step(arg))
            except Exception as e:  # sent back, raised in the parent with the worker's message
                out.append(e)
        conn.send(out)


class EnvPool:
    """Games (`game_cls(max_turns)`: envs.Game, worlds.TwGame) in `num_workers` processes (0 = in this
    process); slot s lives in worker s % num_workers. Calls take {slot: argument} for any subset of slots,
    the workers in parallel; a worker that dies or sends no answer for `timeout` seconds ends the call with
    a UserError."""

    def __init__(self, num_workers: int = 2, max_turns: int = 30, timeout: float = 300.0, *, game_cls):
        if num_workers < 0:
            raise UserError(f"--num-workers must be 0 or more, got {num_workers}")
        self.num_workers, self.max_turns, self.timeout = num_workers, max_turns, timeout
        self.game_cls, self.local, self.conns, self.procs = game_cls, {}, [], []
        self.loading: dict[int, list[str]] = {}  # worker -> the game files its current call loads
        if not num_workers:
            use_engine_cache()
        # fork: workers need no model, and spawn would re-import the caller's torch-heavy script
        ctx = mp.get_context("fork")
        for _ in range(num_workers):
            parent, child = ctx.Pipe()
            ends = self.conns + [parent]  # the parent's ends so far, which the fork copies
            p = ctx.Process(target=_serve, args=(child, max_turns, os.getpid(), ends, game_cls), daemon=True)
            p.start()
            child.close()  # only the worker holds its end: when the worker dies, reading here gives EOF
            self.conns.append(parent)
            self.procs.append(p)

    def _call(self, op: str, args: dict[int, str]) -> dict[int, dict]:
        """Send each worker its slots' jobs, read every answer, then raise any error (no dirty pipe)."""
        if not self.num_workers:
            return {s: self._local(s, op, a) for s, a in args.items()}
        jobs = [[] for _ in self.conns]
        for slot, arg in args.items():
            jobs[slot % self.num_workers].append((slot, op, arg))
        self.loading = {i: [str(a) for _, o, a in job if o == "reset"] for i, job in enumerate(jobs)}
        for i, job in enumerate(jobs):
            if job:
                try:
                    self.conns[i].send(job)
                except OSError:  # BrokenPipeError: the worker is gone
                    raise UserError(self._dead(i)) from None
        out = {}
        for i, job in enumerate(jobs):
            if job:
                out.update((slot, result) for (slot, _, _), result in zip(job, self._answer(i)))
        for result in out.values():
            if isinstance(result, Exception):
                raise result
        return out

    def _answer(self, i: int) -> list:
        """Worker i's answer, waited for while the worker is alive, at most `timeout` seconds."""
        conn, proc = self.conns[i], self.procs[i]
        deadline = time.monotonic() + self.timeout
        try:
            while not conn.poll(min(1.0, self.timeout)):
                if not proc.is_alive():
                    raise EOFError
                if time.monotonic() > deadline:
                    raise UserError(f"game worker {i} (pid {proc.pid}) sent no answer in {self.timeout:g} s "
                                    f"(a hung game engine?); {RERUN}")
            return conn.recv()
        except (EOFError, OSError):
            raise UserError(self._dead(i)) from None

    def _dead(self, i: int) -> str:
        proc = self.procs[i]
        proc.join(timeout=1)
        code = proc.exitcode
        how = "" if code is None else f" (signal {-code})" if code < 0 else f" (exit status {code})"
        if games := self.loading.get(i):  # a damaged game file kills its engine: the same at every rerun
            return (f"game worker {i} (pid {proc.pid}) died{how} loading {', '.join(games)}; {RERUN}; if it "
                    "dies the same way again, that game's files are damaged (a TextWorld game: delete its "
                    "folder, it is generated again)")
        return f"game worker {i} (pid {proc.pid}) died{how}, e.g. killed or out of memory; {RERUN}"

    def _local(self, slot, op, arg):
        game = self.local.setdefault(slot, self.game_cls(self.max_turns))
        return game.reset(arg) if op == "reset" else game.step(arg)

    def reset(self, games: dict[int, str]) -> dict[int, dict]:
        return self._call("reset", games)

    def step(self, commands: dict[int, str]) -> dict[int, dict]:
        return self._call("step", commands)

    def close(self) -> None:
        for conn in self.conns:
            with suppress(OSError):  # the worker is gone
                conn.send(None)
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        self.conns, self.procs = [], []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
