"""Misbehaving reward functions for the RewardPool tests (not tests themselves).

They live in an importable module, not in a test file, because spawned workers
receive reward functions by reference and must import them. Importing this module
registers them under names starting with ``test_``.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping
from typing import Any

from tandem.rl.rewards.registry import register_reward


@register_reward("test_len")
def length_reward(completion: str, sample: Mapping[str, Any], *, scale: float = 1.0) -> float:
    """A well-behaved reward: scale * len(completion)."""
    return scale * len(completion)


@register_reward("test_raise")
def raise_reward(completion: str, sample: Mapping[str, Any]) -> float:
    """Raises when the sample has "bad" set, else 1.0."""
    if sample.get("bad", True):
        raise ValueError("bad sample")
    return 1.0


@register_reward("test_hang")
def hang_reward(completion: str, sample: Mapping[str, Any]) -> float:
    """Sleeps 100 s when the sample has "hang" set (interruptible by SIGALRM), else 1.0."""
    if sample.get("hang", True):
        time.sleep(100)
    return 1.0


@register_reward("test_stubborn_hang")
def stubborn_hang_reward(completion: str, sample: Mapping[str, Any]) -> float:
    """Blocks SIGALRM, then sleeps 100 s: only killing the worker stops it."""
    if sample.get("hang", True):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(100)
    return 1.0


@register_reward("test_crash")
def crash_reward(completion: str, sample: Mapping[str, Any]) -> float:
    """Kills its own process (os._exit(1)) when the sample has "crash" set, else 1.0."""
    if sample.get("crash", True):
        os._exit(1)
    return 1.0


@register_reward("test_kill9")
def kill9_reward(completion: str, sample: Mapping[str, Any]) -> float:
    """SIGKILLs its own process when the sample has "crash" set, else 1.0."""
    if sample.get("crash", True):
        os.kill(os.getpid(), signal.SIGKILL)
    return 1.0


@register_reward("test_nan")
def nan_reward(completion: str, sample: Mapping[str, Any]) -> float:
    """Returns NaN (counted as an error)."""
    return float("nan")


@register_reward("test_alloc")
def alloc_reward(completion: str, sample: Mapping[str, Any]) -> float:
    """Allocates ``sample["mb"]`` MB (untouched pages: cheap unless capped), returns 1.0."""
    block = bytearray(sample["mb"] * 1024 * 1024)
    return float(len(block) > 0)


@register_reward("test_slow_len")
def slow_len_reward(completion: str, sample: Mapping[str, Any]) -> float:
    """Sleeps ``sample["sleep"]`` seconds (default 0.1), then returns len(completion)."""
    time.sleep(sample.get("sleep", 0.1))
    return float(len(completion))
