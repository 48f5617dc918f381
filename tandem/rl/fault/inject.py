"""Fault drills: kill this rank with SIGKILL at a chosen step, once per dump folder, or
poison a step's loss with NaN.

    TANDEM_INJECT_KILL=<step>:<rank>        (e.g. "3:1": rank 1 dies right after step 3's update)
    TANDEM_INJECT_KILL_SAVE=<step>:<rank>   rank dies inside step N's checkpoint save, after
                                            its shards are written and before the commit
    TANDEM_INJECT_NAN=<step>                the loss of step N's optimizer updates is NaN on
                                            every rank (the NaN/Inf policy then skips or stops)

The kill comes after the step's update and before any checkpoint of that step,
so a restarted job must redo the step from the previous checkpoint. A marker
file ``<dump>/fault/killed-step-<step>-rank-<rank>`` is written first, so the
restarted job (same environment under ``torchrun --max-restarts``) does not
kill itself again. For drills and tests; unset, this does nothing.
"""

from __future__ import annotations

import os
import signal

ENV = "TANDEM_INJECT_KILL"
ENV_SAVE = "TANDEM_INJECT_KILL_SAVE"
ENV_NAN = "TANDEM_INJECT_NAN"


def nan_at(step: int) -> bool:
    """Whether the drill asks for a NaN loss at ``step`` (counted from 1)."""
    spec = os.environ.get(ENV_NAN)
    if not spec:
        return False
    try:
        return int(spec) == step
    except ValueError:
        raise ValueError(f"{ENV_NAN}={spec!r}: expected a step number") from None


def maybe_kill(step: int, rank: int, dump_folder: str, *, in_save: bool = False) -> None:
    name = ENV_SAVE if in_save else ENV
    spec = os.environ.get(name)
    if not spec:
        return
    try:
        at_step, at_rank = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"{name}={spec!r}: expected <step>:<rank>") from None
    if (step, rank) != (at_step, at_rank):
        return
    where = "save" if in_save else "step"
    marker = os.path.join(dump_folder, "fault", f"killed-{where}-{step}-rank-{rank}")
    if os.path.exists(marker):
        return
    os.makedirs(os.path.dirname(marker), exist_ok=True)
    with open(marker, "w") as f:
        f.write(f"pid {os.getpid()}\n")
    os.kill(os.getpid(), signal.SIGKILL)
