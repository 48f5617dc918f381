"""A CPU worker-process pool for environment steps, polled without blocking.

The rollout driver submits one task per finished assistant turn and keeps the
generator decoding the other sequences; every generator step it calls
``poll(0)`` to collect finished steps, and ``poll(None)`` (block) only when no
sequence is schedulable. Hence a futures-style API with explicit tickets rather
than a blocking ``map``.

Why not ``concurrent.futures.ProcessPoolExecutor``: one dead worker breaks that
whole pool and every task in it, and a hung task cannot be killed. Here each
worker has its own duplex pipe and holds at most one task, so the parent always
knows which task a worker runs:

* an exception inside the task  -> outcome ``"error"`` (the worker lives on);
* a worker that dies (``os._exit``, segfault, ``kill -9``) -> the task is re-run
  on a fresh worker up to ``max_attempts`` times (safe because episodes travel by
  value: the retry starts from the state before the step), then ``"crash"``;
* a task running longer than ``step_timeout_s`` -> its worker is killed and
  replaced, outcome ``"timeout"`` (not retried: a hang tends to repeat). The clock
  starts when the worker has unpickled the task, which on a fresh worker imports the
  task's module (seconds on a fresh checkout of a busy machine): that is start-up work,
  bounded by ``STARTUP_TIMEOUT_S``. Charged to the step, it timed out every first task,
  and every first task of the replacement workers.

Workers use the "spawn" start method (the parent holds torch/OpenMP threads, so
"fork" is unsafe) and import nothing of torch. Tasks are top-level functions and
picklable arguments. ``num_workers=0`` runs each task inline at submit time (for
debugging; no overlap, no protection from crashes or hangs).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Literal

from tandem.rl.workers.stop_signals import ignore_stop_signals, stop_signals_blocked, stop_workers

__all__ = ["EnvOutcome", "EnvPool"]

Status = Literal["ok", "error", "timeout", "crash"]
STARTUP_TIMEOUT_S = 120.0
MAX_STARTUP_FAILURES = 3


@dataclass
class EnvOutcome:
    """The end of one task. ``seconds``: time it ran in the worker (wall time for
    timeouts and crashes); ``value`` is the task's return value when ``"ok"``."""

    ticket: int
    status: Status
    value: Any = None
    error: str = ""
    seconds: float = 0.0
    attempts: int = 1


@dataclass
class _Task:
    ticket: int
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    attempts: int = 0


@dataclass
class _Worker:
    proc: Any  # multiprocessing BaseProcess
    conn: Connection
    started_at: float
    ready: bool = False
    task: _Task | None = None
    task_started: float = 0.0  # sent to the worker
    running_since: float | None = None  # the worker has unpickled it and runs it


def _worker_main(conn: Connection) -> None:
    """Receive pickled (ticket, fn, args); reply ("ok"|"error", ticket, value, seconds)."""
    ignore_stop_signals()  # the trainer's SIGTERM/SIGUSR1/Ctrl-C are not for us (stop_signals.py)
    conn.send(("ready", -1, os.getpid(), 0.0))
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return
        t0 = time.perf_counter()
        try:
            msg = pickle.loads(data)
            if msg is None:
                return
            ticket, fn, args = msg
        except Exception as e:  # cannot even read the task: report it against no ticket
            conn.send(("error", -1, f"cannot unpickle task: {type(e).__name__}: {e}", 0.0))
            continue
        conn.send(("started", ticket, None, 0.0))  # the step's clock starts here
        t0 = time.perf_counter()
        try:
            value = fn(*args)
            reply = ("ok", ticket, value, time.perf_counter() - t0)
            try:
                conn.send(reply)
                continue
            except Exception as e:  # the result does not pickle
                err = f"result cannot be sent back: {type(e).__name__}: {e}"
        except BaseException as e:  # SystemExit from a task is an error too
            err = f"{type(e).__name__}: {e}"
        conn.send(("error", ticket, err, time.perf_counter() - t0))


class EnvPool:
    """Worker processes running environment steps; see the module docstring."""

    def __init__(
        self,
        num_workers: int = 4,
        *,
        step_timeout_s: float = 300.0,
        max_attempts: int = 2,
        start_method: str = "spawn",
    ) -> None:
        if num_workers < 0:
            raise ValueError(f"EnvPool: num_workers must be >= 0, got {num_workers}")
        if step_timeout_s <= 0 or max_attempts < 1:
            raise ValueError("EnvPool: step_timeout_s must be > 0 and max_attempts >= 1")
        if start_method == "fork":
            raise ValueError(
                "EnvPool: 'fork' is unsafe under torch threads; use 'spawn' or 'forkserver'"
            )
        self.num_workers = num_workers
        self.step_timeout_s = step_timeout_s
        self.max_attempts = max_attempts
        self._ctx = mp.get_context(start_method)
        self._workers: list[_Worker] = []
        self._queue: deque[_Task] = deque()
        self._done: list[EnvOutcome] = []
        self._next_ticket = 0
        self._startup_failures = 0
        self.counts = {"crashes": 0, "timeouts": 0, "errors": 0, "restarts": 0}
        for _ in range(num_workers):
            self._workers.append(self._start_worker())
        self._finalizer = weakref.finalize(self, stop_workers, self._workers)

    # ---- lifecycle ----------------------------------------------------------------------------
    def _start_worker(self) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(target=_worker_main, args=(child,), daemon=True, name="tandem-env")
        with stop_signals_blocked():
            proc.start()
        child.close()
        return _Worker(proc, parent, time.monotonic())

    def _replace(self, w: _Worker) -> None:
        if w.proc.is_alive():
            w.proc.kill()
        w.proc.join(timeout=5.0)
        w.conn.close()
        self._workers[self._workers.index(w)] = self._start_worker()
        self.counts["restarts"] += 1

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Block until every worker has started (so start-up is not charged to a rollout)."""
        deadline = time.monotonic() + timeout_s
        while not all(w.ready for w in self._workers):
            if time.monotonic() > deadline:
                raise RuntimeError(f"EnvPool: workers not ready after {timeout_s:.0f} s")
            self._collect(0.05)

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        self._finalizer()

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- work -----------------------------------------------------------------------------------
    def submit(self, fn: Callable[..., Any], *args: Any) -> int:
        """Queue ``fn(*args)`` (a top-level function, picklable args); returns its ticket."""
        ticket = self._next_ticket
        self._next_ticket += 1
        task = _Task(ticket, fn, args)
        if self.num_workers == 0:
            self._run_inline(task)
        else:
            self._queue.append(task)
            self._dispatch()
        return ticket

    def _run_inline(self, task: _Task) -> None:
        t0 = time.perf_counter()
        try:
            value = task.fn(*task.args)
            self._done.append(
                EnvOutcome(task.ticket, "ok", value, seconds=time.perf_counter() - t0)
            )
        except Exception as e:
            self.counts["errors"] += 1
            self._done.append(
                EnvOutcome(
                    task.ticket, "error", None, f"{type(e).__name__}: {e}", time.perf_counter() - t0
                )
            )

    @property
    def submitted(self) -> int:
        """Tasks submitted over the pool's life."""
        return self._next_ticket

    @property
    def num_pending(self) -> int:
        """Tasks submitted and not yet returned by ``poll``."""
        return len(self._queue) + sum(w.task is not None for w in self._workers) + len(self._done)

    def poll(self, timeout: float | None = 0.0) -> list[EnvOutcome]:
        """Finished tasks. ``timeout=0``: never block; ``None``: block until at least one
        finishes (returns [] at once if nothing is pending); else wait at most that long."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._dispatch()
            self._collect(0.0)
            if self._done or self.num_pending == 0:
                break
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                break
            wait_s = self._next_timeout(now)
            if deadline is not None:
                wait_s = min(wait_s, deadline - now)
            self._collect(max(0.0, wait_s))
            if self._done:
                break
        out, self._done = self._done, []
        return out

    def _deadline(self, w: _Worker) -> float:
        """When ``w``'s task times out: ``step_timeout_s`` after it started running, or
        ``STARTUP_TIMEOUT_S`` after it was sent while the worker still loads it."""
        if w.running_since is None:
            return w.task_started + STARTUP_TIMEOUT_S
        return w.running_since + self.step_timeout_s

    def _next_timeout(self, now: float) -> float:
        """Seconds until the earliest running task times out (or a start-up check is due)."""
        limits = [self._deadline(w) - now for w in self._workers if w.task]
        limits += [w.started_at + STARTUP_TIMEOUT_S - now for w in self._workers if not w.ready]
        return max(0.0, min(limits, default=1.0))

    def _dispatch(self) -> None:
        for w in self._workers:
            if not self._queue:
                return
            if w.ready and w.task is None:
                task = self._queue.popleft()
                task.attempts += 1
                try:
                    w.conn.send_bytes(pickle.dumps((task.ticket, task.fn, task.args)))
                except (pickle.PicklingError, TypeError, AttributeError) as e:
                    self.counts["errors"] += 1
                    self._done.append(
                        EnvOutcome(
                            task.ticket,
                            "error",
                            None,
                            f"task cannot be pickled: {type(e).__name__}: {e}",
                        )
                    )
                    continue
                except (OSError, ValueError):  # worker died between checks: retry elsewhere
                    task.attempts -= 1
                    self._queue.appendleft(task)
                    continue
                w.task, w.task_started, w.running_since = task, time.monotonic(), None

    def _collect(self, wait_s: float) -> None:
        """Read replies, then handle dead workers and timeouts."""
        objs: list[Any] = [w.conn for w in self._workers] + [w.proc.sentinel for w in self._workers]
        if not objs:
            return
        ready = set(wait(objs, timeout=wait_s))
        for w in list(self._workers):
            broken = False
            if w.conn in ready:
                broken = self._drain(w)
            if broken or w.proc.sentinel in ready or not w.proc.is_alive():
                self._on_dead(w)
        now = time.monotonic()
        for w in list(self._workers):
            if w.task is not None and now > self._deadline(w) and w.conn.poll():
                if self._drain(w):  # a reply that came in since the wait: not a timeout
                    self._on_dead(w)
                    continue
            if w.task is not None and now > self._deadline(w):
                task, w.task = w.task, None
                self.counts["timeouts"] += 1
                loading = w.running_since is None
                why = (
                    f"the worker did not load the task in {STARTUP_TIMEOUT_S:g} s"
                    if loading
                    else f"step took longer than {self.step_timeout_s:g} s"
                )
                since = w.task_started if loading else w.running_since
                self._done.append(
                    EnvOutcome(task.ticket, "timeout", None, why, now - since, task.attempts)
                )
                self._replace(w)
            elif not w.ready and now - w.started_at > STARTUP_TIMEOUT_S:
                self._on_startup_failure(w)

    def _drain(self, w: _Worker) -> bool:
        """Handle every message waiting from ``w``; True when its pipe is broken."""
        try:
            while w.conn.poll():
                kind, ticket, value, seconds = w.conn.recv()
                if kind == "ready":
                    w.ready = True
                    self._startup_failures = 0
                    continue
                if kind == "started":
                    if w.task is not None and w.task.ticket == ticket:
                        w.running_since = time.monotonic()
                    continue
                task, w.task = w.task, None
                if task is None or task.ticket != ticket:
                    continue  # a reply for no task (unreadable work): nothing to hand back
                if kind == "ok":
                    self._done.append(
                        EnvOutcome(ticket, "ok", value, seconds=seconds, attempts=task.attempts)
                    )
                else:
                    self.counts["errors"] += 1
                    self._done.append(
                        EnvOutcome(ticket, "error", None, str(value), seconds, task.attempts)
                    )
        except (EOFError, OSError):
            return True
        return False

    def _on_dead(self, w: _Worker) -> None:
        task, w.task = w.task, None
        if not w.ready:
            self._on_startup_failure(w)
            return
        if task is not None:
            self.counts["crashes"] += 1
            if task.attempts < self.max_attempts:
                self._queue.appendleft(task)
            else:
                w.proc.join(timeout=1.0)  # the pipe can close before the exit status is reaped
                code = w.proc.exitcode
                self._done.append(
                    EnvOutcome(
                        task.ticket,
                        "crash",
                        None,
                        f"worker died (exit code {code}) during the step",
                        time.monotonic() - w.task_started,
                        task.attempts,
                    )
                )
        self._replace(w)

    def _on_startup_failure(self, w: _Worker) -> None:
        self._startup_failures += 1
        if self._startup_failures > MAX_STARTUP_FAILURES * max(1, self.num_workers):
            raise RuntimeError("EnvPool: environment workers keep failing to start")
        self._replace(w)
