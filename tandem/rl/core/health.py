"""Per-rank health, nearly free: where each rank's time went, and who made the others wait.

`PhaseClock` splits a rank's wall time into the phases the watchdog marks (rollout, update,
sync, checkpoint, eval; "step" is what a step spends outside them) and, inside each, the time
spent waiting in the collectives Tandem issues itself (`waiting`: the NaN check's flag, the
metrics reduction, the step-end gather, a policy's loss sums). A phase switch or a wait costs
two clock reads. The shell gathers every rank's `take()` with the step's ledger gather (no
extra collective) and `summarize` names the slowest rank: the one with the most *own* time
(phase time minus collective wait), against the median of all ranks.

What it sees and what it does not: a rank that is slow between two of the collectives above
(a slow backward before the NaN check, a slow generator before the rollout's metrics) has the
largest own time, and the ranks waiting for it have theirs in ``wait``. Time the others lose
inside a collective Tandem does not issue itself (FSDP's all-gathers and reduce-scatters, DCP's
barriers) is counted as their own, so a delay that ends at such a collective shows as a longer
phase on every rank, not as a straggler. docs/fault-tolerance.md, "What the doctor tells you".

`waiting` reaches the process's clock through one module-level slot (`install`), as the
logging module reaches its root logger: the collectives it wraps are issued deep in code that
holds no handle on the watchdog, and a process has one trainer thread. No torch here, so
tandem-diagnose imports it on a login node.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

_CLOCK: PhaseClock | None = None


class PhaseClock:
    """Seconds per phase (exclusive: a nested phase's time is not its parent's) and seconds
    waited in collectives, since the last `take`; and the collective this rank is in now."""

    def __init__(self) -> None:
        self.phase = "startup"
        self._since = time.monotonic()
        self.seconds: dict[str, float] = {}
        self.waits: dict[str, float] = {}
        self.collective: str | None = None  # the one this rank waits in now (hang dumps read it)
        self.collective_since: float | None = None  # wall clock
        self._owner = threading.get_ident()

    def switch(self, phase: str) -> None:
        """Charge the time since the last switch to the current phase and enter ``phase``."""
        now = time.monotonic()
        self.seconds[self.phase] = self.seconds.get(self.phase, 0.0) + now - self._since
        self.phase, self._since = phase, now

    @contextlib.contextmanager
    def wait(self, name: str) -> Iterator[None]:
        if threading.get_ident() != self._owner:  # a background thread's collectives
            yield
            return
        outer = self.collective
        self.collective, self.collective_since = name, time.time()
        t0 = time.monotonic()
        try:
            yield
        finally:
            dt = time.monotonic() - t0
            if outer is None:  # an inner wait is already counted in the outer one
                self.waits[self.phase] = self.waits.get(self.phase, 0.0) + dt
            self.collective = outer

    def take(self) -> dict[str, Any]:
        """This rank's row since the last call (phase seconds, waits, own time), and reset."""
        self.switch(self.phase)
        row = {
            "phases": {k: round(v, 6) for k, v in sorted(self.seconds.items())},
            "waits": {k: round(v, 6) for k, v in sorted(self.waits.items())},
            "own_s": round(sum(self.seconds.values()) - sum(self.waits.values()), 6),
            "wait_s": round(sum(self.waits.values()), 6),
        }
        self.seconds, self.waits = {}, {}
        return row


def install(clock: PhaseClock | None) -> None:
    """Make ``clock`` the one `waiting` charges (the watchdog installs its own)."""
    global _CLOCK
    _CLOCK = clock


def current() -> PhaseClock | None:
    return _CLOCK


def waiting(name: str) -> contextlib.AbstractContextManager[None]:
    """``with waiting("all_reduce:nonfinite"):`` around a collective Tandem issues: its time is
    collective wait, and a hang dump taken meanwhile names it."""
    return _CLOCK.wait(name) if _CLOCK is not None else contextlib.nullcontext()


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Every rank's row (index = rank) -> the slowest rank by own time, its ratio to the median
    of its group (rows' ``group``: split mode's generators and trainers are compared among
    themselves), the phase where it lost most against that median, and the largest wait. With
    several groups, ``groups`` holds each one's slowest rank and ratio; the top level is the
    group with the largest ratio."""
    names = sorted({str(r.get("group", "")) for r in rows})
    per = {
        g: _summarize([i for i, r in enumerate(rows) if r.get("group", "") == g], rows)
        for g in names
    }
    top = max(per.values(), key=lambda s: s["straggler_ratio"])
    out = {**top, "wait_max_s": max(float(r["wait_s"]) for r in rows)}
    if len(per) > 1:
        out["groups"] = {
            g: {"slowest_rank": s["slowest_rank"], "straggler_ratio": s["straggler_ratio"]}
            for g, s in per.items()
        }
    return out


def _summarize(ranks: list[int], rows: list[dict[str, Any]]) -> dict[str, Any]:
    own = {r: float(rows[r]["own_s"]) for r in ranks}
    median = statistics.median(own.values())
    slowest = max(ranks, key=lambda r: own[r])
    phases = rows[slowest]["phases"]

    def own_in(row: dict[str, Any], p: str) -> float:
        return row["phases"].get(p, 0.0) - row["waits"].get(p, 0.0)

    def lost(p: str) -> float:
        return own_in(rows[slowest], p) - statistics.median(own_in(rows[r], p) for r in ranks)

    return {
        "slowest_rank": slowest,
        "straggler_ratio": own[slowest] / median if median > 0 else 1.0,
        "median_own_s": median,
        "slowest_phase": max(phases, key=lost) if phases else None,
    }


class StragglerWatch:
    """Names a rank slower than the median by ``ratio`` for ``steps`` steps in a row (the same
    rank each step), once per streak; ``ratio <= 0`` turns it off."""

    def __init__(self, ratio: float, steps: int) -> None:
        self.ratio, self.steps = ratio, steps
        self.rank: int | None = None
        self.streak = 0

    def observe(self, step: int, summary: dict[str, Any], hosts: list[str]) -> str | None:
        if self.ratio <= 0 or summary["straggler_ratio"] < self.ratio:
            self.rank, self.streak = None, 0
            return None
        rank = summary["slowest_rank"]
        self.streak = self.streak + 1 if rank == self.rank else 1
        self.rank = rank
        if self.streak != self.steps:
            return None
        return (
            f"straggler: rank {rank} on {hosts[rank]} has been {summary['straggler_ratio']:.2f}x "
            f"the median rank's own time for {self.steps} steps (steps {step - self.steps + 1}-"
            f"{step}; most of it in phase '{summary['slowest_phase']}'; "
            f"fault.straggler_ratio = {self.ratio:g})"
        )
