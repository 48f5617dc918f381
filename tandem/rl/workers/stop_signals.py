"""Pool worker processes do not die of the trainer's stop signals, and stop cleanly when asked.

A stop signal is meant for the trainer: it checkpoints at the end of the step
(tandem/rl/fault/signals.py). But launchers deliver it to whole process trees: torchrun
forwards a signal with ``killpg`` to each worker's process group, and Slurm
signals every process of the job. Reward and environment workers share the
trainer's group, so with the default action (terminate) a SIGUSR1 or SIGTERM
killed them mid-step; the items they held scored as crashes and the step, and
every later one, differed from an uninterrupted run.

So workers ignore SIGTERM, SIGUSR1 and SIGINT (the parent still stops them: a
``None`` message, then SIGKILL; torchrun's and Slurm's final SIGKILL reach them
too). To leave no window between ``Process.start()`` and the worker's first line
(a spawned interpreter starts and imports for a while), the parent blocks the
three signals around ``start()``: the child inherits the blocked mask, sets them
to SIG_IGN, then unblocks them, which discards any that arrived meanwhile. In
the parent a signal that arrives during ``start()`` is only delayed by it.
Ignored dispositions are inherited across ``exec``, so programs a worker starts
ignore these signals too (SIGKILL still stops them).
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing import resource_tracker
from typing import Any

STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


@contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Parent side, around ``Process.start()``: the new worker starts with them blocked."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        # "spawn" and "forkserver" start multiprocessing's resource tracker on first use,
        # in the trainer's process group, and it ignores only SIGINT/SIGTERM. Started
        # here it keeps SIGUSR1 blocked for good; starting it unblocks SIGINT/SIGTERM
        # in this thread, hence the second block.
        resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def ignore_stop_signals() -> None:
    """Worker side, its first call: ignore them from now on, then unblock them."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def stop_workers(workers: list) -> None:
    """Stop pool workers (each with ``.conn`` and ``.proc``): ask them to exit (a ``None``
    message), kill stragglers after 2 s, and always join them (no zombies). A worker that has
    not said it is ready holds no work: it is killed at once rather than waited for (it would
    read the message only after its imports). Shared by the reward and environment pools."""
    import pickle
    import time

    for w in workers:
        try:
            w.conn.send_bytes(pickle.dumps(None))
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + 2.0
    for w in workers:
        if not w.ready and not _said_anything(w.conn):  # still starting
            w.proc.kill()
        w.proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if w.proc.is_alive():
            w.proc.kill()
            w.proc.join(timeout=5.0)
        w.conn.close()
    workers.clear()


def _said_anything(conn: Any) -> bool:
    try:
        return conn.poll()
    except (OSError, ValueError):  # a broken pipe: the worker is gone
        return False
