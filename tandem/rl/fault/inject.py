"""Fault drills: kill this rank with SIGKILL at a chosen step, once per dump folder, or
poison a step's loss with NaN.

    TANDEM_INJECT_KILL=<step>:<rank>        (e.g. "3:1": rank 1 dies right after step 3's update)
    TANDEM_INJECT_KILL_SAVE=<step>:<rank>   rank dies inside step N's checkpoint save, after
                                            its shards are written and before the commit
    TANDEM_INJECT_NAN=<step>[,<step>...]    the loss of step N's optimizer updates is NaN on
                                            every rank (the NaN/Inf policy then skips or stops)
    TANDEM_INJECT_SPIKE=<step>[,<step>...]  step N's gradients are multiplied by 1000 before the
                                            check (a gradient-norm spike for fault.spike_zscore)
    TANDEM_INJECT_LENGTHS=<alpha>:<lo>:<hi> every prompt group samples a length drawn from a
                                            Pareto(alpha) above lo, capped at hi, ignoring EOS:
                                            the long-tail workload (bench/async_modes.py)
    TANDEM_INJECT_GEN_DELAY=<rank>:<s>      a slow generator: rank sleeps s seconds per step
    TANDEM_INJECT_TOOL_DELAY=<alpha>:<lo>:<hi>
                                            slow tools: every environment step sleeps a time
                                            (seconds) drawn from Pareto(alpha) above lo, capped
                                            at hi, keyed by the assistant turn's text
    TANDEM_INJECT_SLOW=<rank>:<s>           a straggler: rank sleeps s seconds in every update,
                                            after its backward, before the gradient check (and
                                            in each pre-flight matmul)
    TANDEM_INJECT_FLIP=<step>:<rank>        silent corruption: at step N's replica check, rank
                                            first flips the lowest bit of the first element of
                                            its first replicated parameter shard
    TANDEM_INJECT_STOP=<step>:<rank>        a frozen rank: rank sends itself SIGSTOP at the same
                                            place in step N's update (a hang the others wait in)

The kill comes after the step's update and before any checkpoint of that step,
so a restarted job must redo the step from the previous checkpoint. A marker
file ``<dump>/fault/killed-step-<step>-rank-<rank>`` is written first, so the
restarted job (same environment under ``torchrun --max-restarts``) does not
kill itself again. For drills and tests; unset, this does nothing.
"""

from __future__ import annotations

import os
import signal
from typing import Any

ENV = "TANDEM_INJECT_KILL"
ENV_SAVE = "TANDEM_INJECT_KILL_SAVE"
ENV_NAN = "TANDEM_INJECT_NAN"
ENV_LENGTHS = "TANDEM_INJECT_LENGTHS"
ENV_GEN_DELAY = "TANDEM_INJECT_GEN_DELAY"
ENV_TOOL_DELAY = "TANDEM_INJECT_TOOL_DELAY"
ENV_SLOW = "TANDEM_INJECT_SLOW"
ENV_STOP = "TANDEM_INJECT_STOP"
ENV_FLIP = "TANDEM_INJECT_FLIP"
ENV_SPIKE = "TANDEM_INJECT_SPIKE"


def forced_length(seed: int) -> int | None:
    """The drill's completion length for the group sampled with ``seed`` (None: no drill):
    ``lo * u ** (-1 / alpha)`` capped at ``hi``, ``u`` uniform in (0, 1] from a hash of the
    seed, so a group has the same length in every mode and on every layout."""
    x = _pareto(ENV_LENGTHS, seed.to_bytes(8, "little", signed=False))
    return None if x is None else int(x)


def tool_delay(assistant_text: str) -> float:
    """Seconds the slow-tools drill holds an environment step whose turn is ``assistant_text``
    (0: no drill): a Pareto draw keyed by the text, so a turn waits the same in every mode."""
    return _pareto(ENV_TOOL_DELAY, assistant_text.encode()) or 0.0


def _pareto(name: str, key: bytes) -> float | None:
    """``lo * u ** (-1 / alpha)`` capped at ``hi`` (the variable ``name`` = alpha:lo:hi), ``u``
    uniform in (0, 1] from a hash of ``key``; None when ``name`` is unset."""
    spec = os.environ.get(name)
    if not spec:
        return None
    try:
        alpha, lo, hi = (float(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"{name}={spec!r}: expected <alpha>:<lo>:<hi>") from None
    import hashlib

    h = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    u = ((h >> 11) + 1) / 2.0**53  # (0, 1]
    return min(hi, lo * u ** (-1.0 / alpha))


def generator_delay(rank: int) -> float:
    """Seconds the drill makes ``rank``'s generator sleep after each step (0: none)."""
    spec = os.environ.get(ENV_GEN_DELAY)
    if not spec:
        return 0.0
    try:
        at, secs = spec.split(":")
        return float(secs) if int(at) == rank else 0.0
    except ValueError:
        raise ValueError(f"{ENV_GEN_DELAY}={spec!r}: expected <rank>:<seconds>") from None


def _pair(name: str, form: str) -> tuple[float, float] | None:
    spec = os.environ.get(name)
    if not spec:
        return None
    try:
        a, b = (float(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"{name}={spec!r}: expected {form}") from None
    return a, b


def slow_seconds(rank: int) -> float:
    """The straggler drill's delay for ``rank`` (TANDEM_INJECT_SLOW; 0: none)."""
    slow = _pair(ENV_SLOW, "<rank>:<seconds>")
    return slow[1] if slow and int(slow[0]) == rank else 0.0


def in_update(step: int, rank: int) -> None:
    """The update drills, called once per optimizer update before the gradient check:
    TANDEM_INJECT_SLOW sleeps, TANDEM_INJECT_STOP stops this process (SIGSTOP) at its step."""
    if delay := slow_seconds(rank):
        import time

        time.sleep(delay)
    stop = _pair(ENV_STOP, "<step>:<rank>")
    if stop and (int(stop[0]), int(stop[1])) == (step, rank):
        os.kill(os.getpid(), signal.SIGSTOP)


def flip_bit(step: int, rank: int, params: list[tuple[str, Any]]) -> str | None:
    """The TANDEM_INJECT_FLIP drill on (name, local tensor) ``params``: the name of the tensor
    whose bit it flipped on this rank, or None."""
    at = _pair(ENV_FLIP, "<step>:<rank>")
    if not at or (int(at[0]), int(at[1])) != (step, rank):
        return None
    import torch

    name, t = next((n, t) for n, t in params if t.numel())
    flat = t.view(-1)
    view = {4: torch.int32, 2: torch.int16}[flat.element_size()]
    flat[:1].view(view).bitwise_xor_(1)
    print(f"fault drill: flipped the lowest bit of {name}[0] on rank {rank}", flush=True)
    return name


def _steps(name: str) -> set[int]:
    spec = os.environ.get(name)
    if not spec:
        return set()
    try:
        return {int(x) for x in spec.split(",")}
    except ValueError:
        raise ValueError(f"{name}={spec!r}: expected step numbers, e.g. 5 or 5,7") from None


def nan_at(step: int) -> bool:
    """Whether the drill asks for a NaN loss at ``step`` (counted from 1)."""
    return step in _steps(ENV_NAN)


def spike_at(step: int) -> bool:
    """Whether the drill asks for 1000x gradients (a gradient-norm spike) at ``step``."""
    return step in _steps(ENV_SPIKE)


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
