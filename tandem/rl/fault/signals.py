"""Preemption: turn SIGTERM / SIGUSR1 into a checkpoint at the same step on every rank.

Schedulers warn before they kill: Slurm sends SIGUSR1 ahead of the time limit
(``--signal=B:USR1@120``, forwarded by the batch script), and SIGTERM when it
preempts or cancels; Kubernetes sends SIGTERM on eviction. The signal may
reach only some ranks, or reach them a step apart. So the handler only sets a
flag, and the trainer asks at one safe point per step::

    if handler.should_stop_all(step=done):   # one tiny all-reduce (MAX)
        ckpt.save(done, ...)
        return EXIT_PREEMPTED                # 75: requeue me

Every rank takes the same answer at the same step, so the checkpoint
collectives line up. The first time the answer is yes, each rank writes
``<dump>/preempt/rank-<r>.json`` (step, signal, times) for ``tandem-diagnose``.

Repeated signals are absorbed: once a stop is requested, further SIGTERM /
SIGUSR1 only print a line, so a second SIGTERM (a second ``scancel``, or the
launcher's forward arriving twice) cannot kill a checkpoint half-way. A save
can still be cut short by SIGKILL, which the scheduler sends after its grace
period (Slurm KillWait, torchrun --shutdown-timeout, k8s
terminationGracePeriodSeconds); the checkpoint commit is atomic, so that only
loses the new checkpoint, never the previous one.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from tandem import device as seam

DEFAULT_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1)


def _say(line: str) -> None:
    """One line to stderr with os.write: a print() here could re-enter a buffered write
    in progress."""
    try:
        os.write(sys.stderr.fileno(), (line + "\n").encode())
    except (OSError, ValueError, AttributeError):
        pass


class PreemptionHandler:
    """Record stop signals; agree on stopping across ranks. See the module docstring."""

    def __init__(
        self,
        dump_folder: str | None = None,
        rank: int = 0,
        *,
        signals: Iterable[signal.Signals] = DEFAULT_SIGNALS,
    ) -> None:
        self.dump_folder = dump_folder
        self.rank = rank
        self.signals = tuple(signals)
        self.signal_name: str | None = None  # the first signal this rank received
        self.received_at: float | None = None
        self.count = 0
        self.stop_step: int | None = None  # the step all ranks agreed to stop at
        self._previous: dict[signal.Signals, Any] = {}
        self._requested = False

    # ---- install / uninstall ------------------------------------------------------
    def install(self) -> PreemptionHandler:
        """Install the handlers (main thread only); remembers the previous ones.

        A previous handler that kept a signal (a ``received_at`` time that is not
        None: train.py's start-up handler for SIGUSR1) hands it over: it counts as
        received now, and its ``received_at`` is cleared.
        """
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "PreemptionHandler.install: signal handlers can only be installed "
                "from the main thread"
            )
        for sig in self.signals:
            if sig not in self._previous:
                prev = self._previous[sig] = signal.signal(sig, self._on_signal)
                kept = getattr(prev, "received_at", None)
                if kept is not None:  # as if it came now, dated when it came
                    prev.received_at = None
                    self._on_signal(sig, None)
                    self.received_at = kept
        return self

    def uninstall(self) -> None:
        """Put back the handlers that were there before `install`."""
        for sig, prev in self._previous.items():
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()

    def __enter__(self) -> PreemptionHandler:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Runs in the main thread between bytecodes: set the flag, write one line, nothing else.
        self.count += 1
        name = signal.Signals(signum).name
        if not self._requested:
            self._requested = True
            self.signal_name = name
            self.received_at = time.time()
            _say(f"[rank {self.rank}] {name}: will checkpoint and stop at the end of this step")
        else:
            _say(
                f"[rank {self.rank}] {name} again: already stopping; ignored so the "
                "checkpoint can finish"
            )

    # ---- queries ------------------------------------------------------------------
    def request(self, reason: str = "request") -> None:
        """Ask for a stop from code (same effect as a signal); e.g. a wall-clock budget."""
        if not self._requested:
            self._requested = True
            self.signal_name = reason
            self.received_at = time.time()

    def should_stop(self) -> bool:
        """This rank's flag only: not safe to branch a collective on it; use `should_stop_all`."""
        return self._requested

    def should_stop_all(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        step: int | None = None,
        device: torch.device | None = None,
    ) -> bool:
        """Collective: True on every rank of ``group`` iff any rank has the flag.

        Call at the same point of every step on every rank (it is one
        all-reduce of one int). ``device`` defaults to the current accelerator
        for groups of its collective library (NCCL, HCCL, ...) and CPU otherwise
        (`tandem.device.collective_device`). ``step`` goes into the
        preempt marker.
        """
        agreed = self._requested
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            if device is None:
                device = seam.collective_device(group)
            flag = torch.tensor([1 if self._requested else 0], dtype=torch.int32, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            agreed = bool(flag.item())  # deliberate host sync: we branch on it
        if agreed and self.stop_step is None:
            self.stop_step = step if step is not None else -1
            self._write_marker(step)
        return agreed

    def _write_marker(self, step: int | None) -> None:
        if self.dump_folder is None:
            return
        folder = os.path.join(self.dump_folder, "preempt")
        os.makedirs(folder, exist_ok=True)
        now = time.time()
        # None: a peer got it
        record = {
            "rank": self.rank,
            "step": step,
            "signal": self.signal_name,
            "received_at": self.received_at,
            "agreed_at": now,
            "pid": os.getpid(),
            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        }
        tmp = os.path.join(folder, f".rank-{self.rank}.json.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(record, f)
        os.replace(tmp, os.path.join(folder, f"rank-{self.rank}.json"))
