"""The lines every bench prints before its table: the command, the date, the commit, the machine.

A figure copied into docs/performance.md carries these lines with it, so a reader can rerun
the same command at the same commit and tell whether the machine is of the same kind (CPU
model and cores, or the GPU) and how loaded it was (the load average, for the shared CPU
machines). Not a bench itself.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV_SHOWN = (
    "OMP_NUM_THREADS",
    "TRITON_INTERPRET",
)  # variables that change a timing


def command(module: str, argv: list[str] | None = None) -> str:
    """The shell command that ran this bench, as it can be pasted (``torchrun`` where it ran)."""
    args = sys.argv[1:] if argv is None else argv
    env = " ".join(f"{k}={shlex.quote(os.environ[k])}" for k in ENV_SHOWN if os.environ.get(k))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    launcher = f"torchrun --nproc-per-node {world} -m" if world > 1 else "python -m"
    return " ".join(filter(None, (env, launcher, module, shlex.join(args))))


def commit() -> str:
    """The checkout's commit, with "+changes" where tracked files differ from it."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", ROOT, *args], capture_output=True, text=True, timeout=30
        ).stdout.strip()

    try:
        head = git("rev-parse", "--short=10", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    return (head or "unknown") + (" +changes" if dirty else "")


def machine(device: str = "cpu") -> str:
    """CPU model, cores this process may use, memory; the accelerator where ``device`` is one."""
    from tandem import device as seam

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(
                line.split(":", 1)[1].strip() for line in f if line.startswith("model name")
            )
    except (OSError, StopIteration):
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        mem = float("nan")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    out = f"{model}, {cores} cores, {mem:.0f} GiB, load average {load:.1f}"
    if not str(device).startswith("cpu") and seam.device_count():
        out += f"; GPU {seam.device_name(device)} x{seam.device_count()}"
    return out


def header(module: str, argv: list[str] | None = None, device: str = "cpu") -> str:
    """The header lines (each starting with ``#``); `print_header` prints them."""
    import torch

    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return "\n".join(
        [
            f"# command: {command(module, argv)}",
            f"# date: {date}; commit: {commit()}",
            f"# machine: {machine(device)}",
            f"# torch {torch.__version__}, Python {platform.python_version()}",
        ]
    )


def print_header(module: str, argv: list[str] | None = None, device: str = "cpu") -> None:
    print(header(module, argv, device), flush=True)
