"""Score batches of completions with registered reward functions in worker processes.

``RewardPool`` is a small process pool for untrusted, slow or crashing reward code: one
duplex pipe per worker, so the parent always knows which item each worker holds
(``concurrent.futures.ProcessPoolExecutor`` breaks whole when one worker dies). A call
that raises, runs past ``timeout_s`` or kills its worker scores 0 and is counted
(``errors``, ``timeouts``, ``crashes``); dead workers are replaced. Start methods, memory
caps, how functions are sent and the inline mode: docs/rewards.md.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import pickle
import resource
import signal
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from tandem.rl.core.metrics import Tally
from tandem.rl.core.reward_range import reward_problem
from tandem.rl.rewards.registry import RewardFn, get_reward, registered_modules
from tandem.rl.workers.stop_signals import ignore_stop_signals, stop_signals_blocked, stop_workers

__all__ = ["RewardPool", "RewardResult"]

STARTUP_TIMEOUT_S = 120.0  # a worker that is not ready by then is replaced
DEFAULT_MEMORY_MB = 2048  # per worker; a math answer once grew to 2.5 GB within its timeout
MAX_STARTUP_FAILURES = 3  # consecutive failed starts before score() gives up


@dataclass
class RewardResult:
    """Scores of one batch. Lists are indexed by item, ``[N]``."""

    scores: dict[str, list[float]]  # reward name -> [N] raw scores (0 where it failed)
    total: list[float]  # [N] sum of weight * score
    weights: dict[str, float]
    errors: dict[str, int]
    timeouts: dict[str, int]
    crashes: dict[str, int]
    error_examples: dict[str, str] = field(default_factory=dict)  # first message per reward

    def metrics(self, prefix: str = "reward") -> dict[str, float]:
        """Flat metrics: mean total, and per reward its mean and failure counts."""
        return self.tally(prefix).values()

    def tally(self, prefix: str = "reward", *, total: bool = True) -> Tally:
        """The same metrics, declared for combining over ranks: means weighted by the
        number of completions scored, failure counts summed (``total``: with the mean total)."""
        n = len(self.total)
        out = Tally()
        if total:
            out.mean(f"{prefix}/total", sum(self.total) / max(1, n), n)
        for name, vals in self.scores.items():
            out.mean(f"{prefix}/{name}/mean", sum(vals) / max(1, n), n)
            out.sum(f"{prefix}/{name}/errors", self.errors[name])
            out.sum(f"{prefix}/{name}/timeouts", self.timeouts[name])
            out.sum(f"{prefix}/{name}/crashes", self.crashes[name])
        return out


class _RewardTimeout(BaseException):
    """Raised by SIGALRM inside a reward call; BaseException so ``except Exception`` misses it."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise _RewardTimeout()


def _call(
    fn: RewardFn, completion: str, sample: Mapping[str, Any], timeout_s: float
) -> tuple[str, float, str]:
    """Run one reward call -> (status "ok" | "error" | "timeout", value, error message)."""
    armed = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGALRM, _on_alarm) if armed else None
    try:
        try:
            if armed:
                signal.setitimer(signal.ITIMER_REAL, timeout_s)
            value = fn(completion, sample)
        finally:
            if armed:
                signal.setitimer(signal.ITIMER_REAL, 0)
        value = float(value)
        why = reward_problem(value)
        if why is not None:
            return "error", 0.0, f"the reward {why}"
        return "ok", value, ""
    except _RewardTimeout:
        return "timeout", 0.0, ""
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # SystemExit from a reward is an error too
        return "error", 0.0, f"{type(e).__name__}: {e}"
    finally:
        if armed:
            signal.signal(signal.SIGALRM, old)


def _cap_memory(memory_mb: int | None) -> None:
    """Lower the soft RLIMIT_DATA (the hard one stays, so the sandbox launcher can reset it)."""
    if memory_mb is not None:
        _, hard = resource.getrlimit(resource.RLIMIT_DATA)
        want = memory_mb * 1024 * 1024
        soft = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def _worker_main(
    conn: Connection, modules: list[str], timeout_s: float, memory_mb: int | None = None
) -> None:
    """Worker loop: receive pickled chunks of (task_id, fn, completion, sample), reply per task."""
    ignore_stop_signals()  # the trainer's SIGTERM/SIGUSR1/Ctrl-C are not for us (stop_signals.py)
    _cap_memory(memory_mb)
    for mod in modules:
        try:
            # a module's `prepare_worker` pays its lazy imports here, before "ready", so that
            # they never count against a reward's timeout
            getattr(importlib.import_module(mod), "prepare_worker", lambda: None)()
        except Exception:  # pragma: no cover - surfaces as errors of that module's rewards
            pass
    conn.send(("ready", -1, 0.0, str(os.getpid())))
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            chunk = pickle.loads(data)
        except Exception as e:
            conn.send(("bad_chunk", -1, 0.0, f"cannot unpickle work: {type(e).__name__}: {e}"))
            continue
        if chunk is None:
            return
        for task_id, fn, completion, sample in chunk:
            status, value, msg = _call(fn, completion, sample, timeout_s)
            conn.send((status, task_id, value, msg))


@dataclass
class _Worker:
    proc: Any  # multiprocessing BaseProcess
    conn: Connection
    started_at: float
    ready: bool = False
    inflight: deque[int] = field(default_factory=deque)  # task ids sent, in run order
    head_start: float = 0.0  # when the head of ``inflight`` started running


def _drain(conn: Connection) -> tuple[list[tuple[str, int, float, str]], bool]:
    """All messages waiting on ``conn``, and whether the pipe is broken (worker gone)."""
    messages = []
    try:
        while conn.poll():
            messages.append(conn.recv())
    except (EOFError, OSError):
        return messages, True
    return messages, False


class RewardPool:
    """Score completions with named reward functions on ``num_workers`` processes.

    Args:
        num_workers: worker processes; 0 runs inline (see module doc).
        timeout_s: per-call time limit.
        rewards: names that will be scored, checked now (unknown name -> RegistryError).
        reward_kwargs: per-reward config bound with ``functools.partial``, e.g.
            ``{"format": {"pattern": r"..."}}``; checked now against the signature.
        kill_grace_s: how long after ``timeout_s`` a call that ignored SIGALRM may
            run before its worker is killed.
        max_chunk: most calls sent to a worker at once (fewer round trips).
        start_method: "spawn" or "forkserver".
        memory_mb: per-worker memory cap (soft RLIMIT_DATA); None = no cap.
    """

    def __init__(
        self,
        num_workers: int,
        timeout_s: float,
        *,
        rewards: Sequence[str] = (),
        reward_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
        kill_grace_s: float = 1.0,
        max_chunk: int = 16,
        start_method: str = "spawn",
        memory_mb: int | None = DEFAULT_MEMORY_MB,
    ) -> None:
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if start_method not in ("spawn", "forkserver"):
            raise ValueError(
                f"start_method must be 'spawn' or 'forkserver' (not fork), got {start_method!r}"
            )
        if memory_mb is not None and memory_mb <= 0:
            raise ValueError(f"memory_mb must be > 0 or None, got {memory_mb}")
        self.num_workers = num_workers
        self.memory_mb = memory_mb
        self.timeout_s = float(timeout_s)
        self.kill_grace_s = float(kill_grace_s)
        self.max_chunk = max(1, int(max_chunk))
        self._kwargs = {name: dict(kw) for name, kw in (reward_kwargs or {}).items()}
        for name in list(rewards) + list(self._kwargs):
            self._resolve(name)
        self._ctx = mp.get_context(start_method)
        self._workers: list[_Worker] = []
        self._startup_failures = 0
        self._closed = False
        for _ in range(num_workers):
            self._workers.append(self._start_worker())
        self._finalizer = weakref.finalize(self, stop_workers, self._workers)

    # -- lifecycle -----------------------------------------------------------------

    def _resolve(self, name: str) -> RewardFn:
        return get_reward(name, **self._kwargs.get(name, {}))

    def _start_worker(self) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(
            target=_worker_main,
            args=(child, registered_modules(), self.timeout_s, self.memory_mb),
            name="reward-worker",
            daemon=True,
        )
        with stop_signals_blocked():
            proc.start()
        child.close()
        return _Worker(proc=proc, conn=parent, started_at=time.monotonic())

    def _replace(self, w: _Worker) -> _Worker:
        """Kill, reap and restart the worker in ``w``'s slot."""
        if w.proc.is_alive():
            w.proc.kill()
        w.proc.join(timeout=5.0)
        w.conn.close()
        if not w.ready:
            self._startup_failures += 1
            if self._startup_failures > MAX_STARTUP_FAILURES:
                raise RuntimeError(
                    f"reward workers failed to start {self._startup_failures} times in a row"
                )
        new = self._start_worker()
        self._workers[self._workers.index(w)] = new
        return new

    def worker_pids(self) -> list[int]:
        """Process ids of the current workers (for tests and debugging)."""
        return [w.proc.pid for w in self._workers]

    def close(self) -> None:
        """Stop and reap all workers; idempotent."""
        if not self._closed:
            self._closed = True
            self._finalizer()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- scoring -------------------------------------------------------------------

    def score(
        self,
        fn_names_and_weights: Sequence[tuple[str, float]],
        completions: Sequence[str],
        samples: Sequence[Mapping[str, Any]],
    ) -> RewardResult:
        """Score every completion with every named reward; see the class and module docs."""
        if self._closed:
            raise RuntimeError("RewardPool is closed")
        if len(completions) != len(samples):
            raise ValueError(f"{len(completions)} completions but {len(samples)} samples")
        names = [name for name, _ in fn_names_and_weights]
        if len(set(names)) != len(names):
            raise ValueError(f"a reward is listed twice: {names}")
        fns = [self._resolve(name) for name in names]
        n = len(completions)
        out = RewardResult(
            scores={name: [0.0] * n for name in names},
            total=[0.0] * n,
            weights={name: float(w) for name, w in fn_names_and_weights},
            errors=dict.fromkeys(names, 0),
            timeouts=dict.fromkeys(names, 0),
            crashes=dict.fromkeys(names, 0),
        )

        def record(task_id: int, status: str, value: float, msg: str = "") -> None:
            name = names[task_id // n]
            if status == "ok":
                out.scores[name][task_id % n] = value
                return
            {"error": out.errors, "timeout": out.timeouts, "crash": out.crashes}[status][name] += 1
            if msg and name not in out.error_examples:
                out.error_examples[name] = msg

        if n and fns:
            if self.num_workers == 0:
                for t in range(len(fns) * n):
                    status, value, msg = _call(
                        fns[t // n], completions[t % n], samples[t % n], self.timeout_s
                    )
                    record(t, status, value, msg)
            else:
                try:
                    self._run(fns, completions, samples, record)
                except BaseException:  # e.g. Ctrl-C: stale results must not reach the next batch
                    for w in list(self._workers):
                        if w.inflight:
                            w.inflight.clear()
                            self._replace(w)
                    raise
        for name in names:
            w = out.weights[name]
            out.total = [tot + w * s for tot, s in zip(out.total, out.scores[name], strict=True)]
        return out

    def _run(
        self,
        fns: list[RewardFn],
        completions: Sequence[str],
        samples: Sequence[Mapping[str, Any]],
        record: Callable[[int, str, float, str], None],
    ) -> None:
        """Run task ids ``fn_index * N + item_index`` on the workers until all are recorded."""
        n = len(completions)
        pending: deque[int] = deque(range(len(fns) * n))
        left = len(pending)
        hard_limit = self.timeout_s + self.kill_grace_s

        def finish_head(w: _Worker, status: str, value: float = 0.0, msg: str = "") -> None:
            nonlocal left
            record(w.inflight.popleft(), status, value, msg)
            left -= 1

        def requeue_and_replace(w: _Worker) -> None:
            pending.extendleft(reversed(w.inflight))  # queued behind the failed call: run again
            w.inflight.clear()
            self._replace(w)

        while left:
            for w in list(self._workers):  # dispatch to idle ready workers
                if w.ready and not w.inflight and pending:
                    idle = sum(1 for v in self._workers if v.ready and not v.inflight)
                    size = min(self.max_chunk, len(pending), max(1, -(-len(pending) // idle)))
                    ids = [pending.popleft() for _ in range(size)]
                    chunk = [(t, fns[t // n], completions[t % n], samples[t % n]) for t in ids]
                    data = pickle.dumps(chunk)
                    w.inflight.extend(ids)
                    w.head_start = time.monotonic()
                    try:
                        w.conn.send_bytes(data)
                    except OSError:  # died while idle: nothing ran yet
                        requeue_and_replace(w)

            now = time.monotonic()
            deadlines = [
                (w.head_start + hard_limit) if w.ready else (w.started_at + STARTUP_TIMEOUT_S)
                for w in self._workers
                if w.inflight or not w.ready
            ]
            wait_s = max(0.0, min(deadlines) - now) if deadlines else None
            handles = [w.conn for w in self._workers] + [w.proc.sentinel for w in self._workers]
            ready = set(wait(handles, wait_s))
            now = time.monotonic()

            for w in list(self._workers):
                dead = w.proc.sentinel in ready
                if w.conn in ready or dead:
                    messages, broken = _drain(w.conn)
                    dead = dead or broken
                    for status, task_id, value, msg in messages:
                        if status == "ready":
                            w.ready = True
                            self._startup_failures = 0
                        elif status == "bad_chunk":
                            while w.inflight:
                                finish_head(w, "error", msg=msg)
                        else:
                            assert w.inflight[0] == task_id, (task_id, w.inflight)
                            finish_head(w, status, value, msg)
                            w.head_start = now
                if dead or not w.proc.is_alive():
                    if w.inflight:
                        w.proc.join(timeout=1.0)  # reap it, for the exit code
                        finish_head(w, "crash", msg=f"worker died (exit code {w.proc.exitcode})")
                    requeue_and_replace(w)
                elif w.inflight and now - w.head_start > hard_limit:
                    finish_head(w, "timeout")
                    requeue_and_replace(w)
                elif not w.ready and now - w.started_at > STARTUP_TIMEOUT_S:
                    self._replace(w)
