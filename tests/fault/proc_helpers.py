"""Helpers the fault tests share."""

from __future__ import annotations

import signal
from pathlib import Path


def catches_usr1(pid: int) -> bool:
    """Whether process ``pid`` has a handler installed for SIGUSR1 (from /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGUSR1 - 1) & 1)
    return False
