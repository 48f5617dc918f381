"""What a sandboxed run is given and returns, and the host checks a plan is built from.

Holds the public data types (:class:`SandboxLimits`, :class:`SandboxResult`,
:class:`SandboxCapabilities`, :class:`SandboxError`), ``_Plan`` (the mechanisms the probe
in tandem/rl/sandbox/__init__.py found working here) and the host inspection the probe uses to
fill it in: which interpreter the sandbox uid can run and which host directories the
minimal root binds. Import the public names from tandem.rl.sandbox.
"""

from __future__ import annotations

import os
import stat
import sys
from dataclasses import dataclass, field

_BINDS = ["/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32"]


class SandboxError(RuntimeError):
    """The sandbox could not be set up as promised; nothing was run unprotected."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run resource limits; ``max_output_bytes`` applies to stdout and stderr each."""

    cpu_time_s: int = 5
    wall_time_s: float = 10.0
    memory_mb: int = 512
    max_processes: int = 32
    max_file_mb: int = 16
    max_output_bytes: int = 64 * 1024

    def __post_init__(self) -> None:
        for name in (
            "cpu_time_s",
            "wall_time_s",
            "memory_mb",
            "max_processes",
            "max_file_mb",
            "max_output_bytes",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)}")


DEFAULT_LIMITS = SandboxLimits()


@dataclass(frozen=True)
class SandboxResult:
    """What a run produced. ``exit_code`` < 0 means killed by signal ``-exit_code``."""

    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool
    limit_hit: str | None  # "cpu" | "wall" | "memory" | "nproc" | "fsize" | "output"
    duration_s: float


@dataclass(frozen=True)
class SandboxCapabilities:
    """Which isolation mechanisms this process's runs get, found by a probe run."""

    running_as_root: bool
    privilege_drop: bool  # per-run unprivileged uid (root only)
    user_namespace: bool  # used to get the other namespaces without root
    network_namespace: bool
    network_isolated: bool
    no_new_privs: bool
    interpreter: str
    ipc_namespace: bool = False
    mount_namespace: bool = False  # minimal root: the trainer's files are not visible
    memory_cgroup: bool = False  # memory_mb bounds everything the run's processes use
    notes: tuple[str, ...] = field(default=())


@dataclass(frozen=True)
class _Plan:
    root: bool
    namespaces: tuple[str, ...]  # of "user", "net", "ipc", "mount"
    cgroup: tuple[int, str] | None  # (version, parent directory)
    interpreter: str
    binds: tuple[str, ...]


def _world_executable(path: str) -> bool:
    """True when a uid with no groups can execute ``path`` (every parent searchable)."""
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
        if not (st.st_mode & stat.S_IXOTH and st.st_mode & stat.S_IROTH):
            return False
        return _world_searchable(os.path.dirname(real))
    except OSError:
        return False


def _world_searchable(directory: str) -> bool:
    """True when a uid with no groups can reach ``directory`` (o+x on it and each parent)."""
    parent = os.path.realpath(directory)
    try:
        while True:
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                return False
            if parent == "/":
                return True
            parent = os.path.dirname(parent)
    except OSError:
        return False


def _pick_interpreter(need_world: bool) -> str:
    if not need_world:
        return sys.executable
    for cand in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        if cand and _world_executable(cand):
            return cand
    raise SandboxError(
        f"no Python interpreter executable by an unprivileged uid ({sys.executable} is not)"
    )


def _binds_for(interpreter: str) -> tuple[str, ...]:
    """Host directories the minimal root needs: the system's, plus the interpreter's
    prefix when it lives elsewhere (a venv or conda under /opt)."""
    binds = list(_BINDS)
    if interpreter == sys.executable:
        prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix}
    else:
        prefixes = {os.path.dirname(os.path.dirname(os.path.realpath(interpreter)))}
    for prefix in sorted(os.path.realpath(p) for p in prefixes):
        if not any(prefix == b or prefix.startswith(b + "/") for b in binds):
            binds.append(prefix)
    return tuple(binds)
