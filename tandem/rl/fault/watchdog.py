"""Hang detection: a per-rank watchdog thread that dumps every Python stack and exits.

NCCL's own timeout says which collective stalled, not what the Python code was doing. Each
rank's `Watchdog` thread expects `beat(step)` within the current `phase(name)`'s timeout;
when none comes it writes ``<dump>/hang/rank-<r>.txt`` / ``.json`` (every thread's stack)
and ends the process with `EXIT_HANG`; its peers dump too when they see that file, so
``tandem-diagnose DUMP`` shows the stuck rank and the collective the others wait in.
`enable_flight_recorder` sets the NCCL flight-recorder variables. Details:
docs/fault-tolerance.md.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import json
import os
import re
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from types import FrameType
from typing import Any

# Exit status of a rank whose watchdog fired (the lead mirrors it in tandem/rl/core/errors.py).
from tandem.rl.core.errors import EXIT_HANG  # noqa: E402
from tandem.rl.core.health import PhaseClock

FR_SUBDIR = "flight_recorder"
_RANK_JSON = re.compile(r"^rank-(\d+)\.json$")
_CLOCK_SLACK_S = 2.0  # hosts' clocks and a shared file system's mtimes differ by about this much


def enable_flight_recorder(dump_folder: str, buffer_size: int = 2000) -> dict[str, str]:
    """Ask torch's (NCCL) flight recorder to keep a ring of collectives and dump it on timeout.

    Call before ``init_process_group``. Values already set in the environment
    win (``setdefault``), so a user can override any of them. Returns the
    variables as they now are. Dumps land in ``<dump>/flight_recorder/rank-<r>``;
    read them with ``python -m torch.distributed.flight_recorder.fr_trace``.
    """
    folder = os.path.join(dump_folder, FR_SUBDIR)
    os.makedirs(folder, exist_ok=True)
    prefix = os.path.join(folder, "rank-")
    wanted = {
        "TORCH_FR_BUFFER_SIZE": str(buffer_size),  # current name
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(buffer_size),  # older name, same meaning
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": prefix,  # the rank number is appended
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,  # older name
    }
    for key, value in wanted.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in wanted}


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, tz=datetime.timezone.utc).isoformat(
        timespec="seconds"
    )


def _frames(frame: FrameType | None) -> list[dict[str, Any]]:
    """Outermost-first frames of one thread as dicts (file, line, function, code)."""
    return [
        {"file": fs.filename, "line": fs.lineno, "function": fs.name, "code": fs.line or ""}
        for fs in traceback.extract_stack(frame)
    ]


class Watchdog:
    """Per-rank hang detector; see the module docstring.

    ``timeout_s <= 0`` disables it (`start` does nothing), so a config can turn
    it off without branches in the trainer. ``phase_timeouts`` gives phases
    that legitimately run long (``{"checkpoint": 1800, "startup": 1200}``)
    their own limit. Entering a phase counts as progress. With
    ``exit_on_hang=False`` the watchdog dumps once per stall and lets the
    process run on (for debugging a slow job without killing it).
    """

    def __init__(
        self,
        dump_folder: str,
        timeout_s: float,
        rank: int,
        *,
        phase_timeouts: dict[str, float] | None = None,
        exit_status: int = EXIT_HANG,
        exit_on_hang: bool = True,
        poll_s: float | None = None,
    ) -> None:
        self.dump_folder = dump_folder
        self.timeout_s = float(timeout_s)
        self.rank = rank
        self.phase_timeouts = dict(phase_timeouts or {})
        self.exit_status = exit_status
        self.exit_on_hang = exit_on_hang
        self.poll_s = poll_s if poll_s is not None else min(max(self.timeout_s / 10, 0.05), 5.0)
        self.current_phase = "startup"
        self.clock = (
            PhaseClock()
        )  # seconds per phase and collective wait (tandem/rl/core/health.py)
        self.last_step: int | None = None
        self._last_beat = time.monotonic()
        self._last_beat_wall = time.time()
        self._trainer_thread = threading.get_ident()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.exit_grace_s = min(2 * self.poll_s + 1.0, 10.0)
        self._started_wall = time.time()
        self._peers_seen: set[str] = set()
        self._fired = False  # one dump per stall (exit_on_hang=False)
        self.fired_count = 0

    # ---- trainer side -------------------------------------------------------------
    def beat(self, step: int | None = None) -> None:
        """Record progress (cheap: two clock reads). ``step`` is the last step
        completed or begun."""
        if step is not None:
            self.last_step = step
        self._last_beat = time.monotonic()
        self._last_beat_wall = time.time()
        self._trainer_thread = threading.get_ident()
        self._fired = False

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Enter phase ``name`` now; usable as a plain call or as ``with wd.phase(name):``.

        Used as a context manager, the previous phase is restored on exit.
        """
        previous = self.current_phase
        self.current_phase = name
        self.clock.switch(name)
        self.beat()
        return self._restore(previous)

    @contextlib.contextmanager
    def _restore(self, previous: str) -> Iterator[None]:
        try:
            yield
        finally:
            self.current_phase = previous
            self.clock.switch(previous)
            self.beat()

    def current_timeout(self) -> float:
        return float(self.phase_timeouts.get(self.current_phase, self.timeout_s))

    # ---- lifecycle ----------------------------------------------------------------
    def start(self) -> Watchdog:
        if self.timeout_s <= 0 or self._thread is not None:
            return self
        self.beat()
        self._started_wall = time.time()
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._run, name=f"tandem-watchdog-rank{self.rank}", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(self.poll_s * 4, 1.0))
            self._thread = None

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- watchdog thread ----------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            idle = time.monotonic() - self._last_beat
            if self._fired:
                continue
            if idle > self.current_timeout():
                self._fire(idle, f"no progress for {idle:.1f}s in phase '{self.current_phase}'")
            elif (peer := self._peer_dump()) is not None:
                self._fire(idle, f"rank {peer} reported a hang")

    def _fire(self, idle: float, reason: str) -> None:
        self._fired = True
        self.fired_count += 1
        try:
            path = self.dump(idle, reason=reason)
            msg = (
                f"[rank {self.rank}] hang: {reason} (last step {self.last_step}); stacks in {path}"
            )
        except Exception as e:  # a full disk must not keep a hung job alive
            msg = f"[rank {self.rank}] hang: {reason}; writing the dump failed: {e!r}"
        print(msg, file=sys.stderr, flush=True)
        if self.exit_on_hang:
            sys.stdout.flush()
            # Give peers time to see our dump (they poll hang/) and write theirs before
            # the launcher tears the job down on our exit.
            if int(os.environ.get("WORLD_SIZE", "1")) > 1:
                time.sleep(self.exit_grace_s)
            os._exit(self.exit_status)

    def _peer_dump(self) -> int | None:
        """A rank whose hang dump is newer than our start (one stat per poll while
        there is none)."""
        folder = os.path.join(self.dump_folder, "hang")
        try:
            if os.stat(folder).st_mtime < self._started_wall - _CLOCK_SLACK_S:
                return None
            names = os.listdir(folder)
        except OSError:
            return None
        for name in names:
            m = _RANK_JSON.match(name)
            if not m or int(m.group(1)) == self.rank or name in self._peers_seen:
                continue
            try:
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    rec = json.load(f)
            except (OSError, ValueError):
                continue
            if rec.get("time", 0) >= self._started_wall - _CLOCK_SLACK_S and rec.get(
                "reason", ""
            ).startswith("no progress"):
                self._peers_seen.add(name)
                return int(m.group(1))
        return None

    def dump(self, idle_s: float | None = None, *, reason: str = "requested") -> str:
        """Write ``hang/rank-<r>.txt`` and ``.json`` now; returns the text file's path."""
        idle_s = time.monotonic() - self._last_beat if idle_s is None else idle_s
        folder = os.path.join(self.dump_folder, "hang")
        os.makedirs(folder, exist_ok=True)
        now = time.time()
        names = {t.ident: t.name for t in threading.enumerate()}
        frames = sys._current_frames()
        record: dict[str, Any] = {
            "rank": self.rank,
            "world_size": int(os.environ.get("WORLD_SIZE", "1")),
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "reason": reason,
            "phase": self.current_phase,
            "last_step": self.last_step,
            # the collective Tandem issued that this rank waits in (None: not in one of those)
            "collective": self.clock.collective,
            "collective_since_iso": _iso(self.clock.collective_since)
            if self.clock.collective
            else None,
            "idle_s": round(idle_s, 3),
            "timeout_s": self.current_timeout(),
            "time": now,
            "time_iso": _iso(now),
            "last_beat_iso": _iso(self._last_beat_wall),
            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "exit_status": self.exit_status if self.exit_on_hang else None,
            "trainer_thread": names.get(self._trainer_thread, str(self._trainer_thread)),
            "threads": [
                {
                    "name": names.get(ident, str(ident)),
                    "ident": ident,
                    "trainer": ident == self._trainer_thread,
                    "frames": _frames(frame),
                }
                for ident, frame in frames.items()
                if ident != threading.get_ident()
            ],
        }
        txt = os.path.join(folder, f"rank-{self.rank}.txt")
        with open(txt, "w", encoding="utf-8") as f:
            f.write(
                f"rank {self.rank} pid {record['pid']} host {record['host']} restart "
                f"{record['restart']}\nreason: {reason}\nphase: {self.current_phase}\nlast "
                f"step: {self.last_step}\ncollective: {record['collective']}\n"
                f"no progress for {idle_s:.1f}s (timeout "
                f"{self.current_timeout():g}s)\ntime: {record['time_iso']} (last beat "
                f"{record['last_beat_iso']})\n\n== faulthandler (all threads) ==\n"
            )
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
            f.write("\n== Python stacks (sys._current_frames) ==\n")
            for ident, frame in frames.items():
                tag = " (trainer)" if ident == self._trainer_thread else ""
                tag += " (watchdog)" if ident == threading.get_ident() else ""
                f.write(f"\nThread {names.get(ident, ident)}{tag}:\n")
                f.write("".join(traceback.format_stack(frame)))
        fr = self._dump_flight_recorder(folder)
        if fr:
            record["flight_recorder"] = fr
        tmp = os.path.join(folder, f".rank-{self.rank}.json.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
        os.replace(tmp, os.path.join(folder, f"rank-{self.rank}.json"))
        return txt

    def _dump_flight_recorder(self, folder: str) -> str | None:
        """Best effort: write torch's flight-recorder ring, when one is being kept."""
        if (
            int(
                os.environ.get(
                    "TORCH_FR_BUFFER_SIZE", os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "0")
                )
                or 0
            )
            <= 0
        ):
            return None
        out: list[bytes] = []

        def grab() -> None:
            try:
                from torch._C._distributed_c10d import _dump_fr_trace

                out.append(_dump_fr_trace())
            except Exception:
                pass

        # In a thread with a deadline: the recorder's lock may be held by the stuck thread.
        t = threading.Thread(target=grab, daemon=True)
        t.start()
        t.join(timeout=10.0)
        if not out or not out[0]:
            return None
        data = out[0]
        path = os.path.join(folder, f"fr-rank-{self.rank}.pkl")
        with open(path, "wb") as f:
            f.write(data)
        return path
