"""Run untrusted Python (model completions, tool calls) in a limited child process.

The code reward and the ``python`` tool execute text a policy wrote. One call to
:func:`run_python` starts one fresh interpreter under a supervisor of its own
(tandem/rl/sandbox/supervisor.py) and returns its output; nothing is reused between runs.
Each run gets rlimits, a per-run uid when root, and network, IPC and mount namespaces and a
memory cgroup where the probe found them working; a step that was found working and then
fails aborts the run (fail closed). This module is the entry point (the probe,
:func:`run_python`, :func:`start_python`); the run itself is tandem/rl/sandbox/run.py, the
types and host checks tandem/rl/sandbox/plan.py. The security model and its limits:
docs/fault-tolerance.md.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Mapping
from dataclasses import replace

from tandem.rl.sandbox import supervisor as _sup
from tandem.rl.sandbox.cleanup import find_memory_cgroup, processes_of_uid
from tandem.rl.sandbox.plan import (
    DEFAULT_LIMITS,
    SandboxCapabilities,
    SandboxError,
    SandboxLimits,
    SandboxResult,
    _binds_for,
    _pick_interpreter,
    _Plan,
)
from tandem.rl.sandbox.run import _MAIN, _SUPERVISOR, SandboxRun, _safe_relpath

__all__ = [
    "DEFAULT_LIMITS",
    "SandboxCapabilities",
    "SandboxError",
    "SandboxLimits",
    "SandboxResult",
    "SandboxRun",
    "processes_of_uid",
    "run_python",
    "sandbox_capabilities",
    "start_python",
]

_caps: SandboxCapabilities | None = None
_machine_plan: _Plan | None = None  # what the probe found works, used by every run
_caps_lock = threading.Lock()


def sandbox_capabilities() -> SandboxCapabilities:
    """Probe (once per process, then cached) which isolation mechanisms work here."""
    global _caps, _machine_plan
    with _caps_lock:
        if _caps is None:
            _caps, _machine_plan = _probe()
        return _caps


_FEATURE_OF_STEP = {
    "network namespace": "net",
    "ipc namespace": "ipc",
    "mount namespace": "mount",
    "user namespace": "user",
    "memory cgroup": "cgroup",
}


def _probe() -> tuple[SandboxCapabilities, _Plan]:
    """Try every mechanism; drop the one whose set-up step fails and try again."""
    root = os.geteuid() == 0
    notes: list[str] = []
    interpreter = _pick_interpreter(need_world=root)
    if interpreter != sys.executable:
        notes.append(
            f"sandbox interpreter {interpreter} (trainer's {sys.executable} "
            "is not executable by the sandbox uid)"
        )
    features = {"net", "ipc", "mount"} | (set() if root else {"user"})
    cgroup = None
    if root:
        version, where = find_memory_cgroup()
        if version is None:
            notes.append(f"no memory cgroup: {where}")
        else:
            cgroup = (version, where)
    check = (
        "import os, socket; print(os.getuid(), len(socket.if_nameindex()), os.getcwd(),"
        " os.path.exists(" + repr(_SUPERVISOR) + "))"
    )
    limits = SandboxLimits(wall_time_s=20.0)
    while True:
        plan = _Plan(root, tuple(sorted(features)), cgroup, interpreter, _binds_for(interpreter))
        try:
            res = start_python(check, limits=limits, _plan=plan).wait()
        except SandboxError as exc:
            step = str(exc).removeprefix("sandbox setup failed at ").split(":")[0]
            feature = _FEATURE_OF_STEP.get(step)
            if feature is None or (feature != "cgroup" and feature not in features):
                raise SandboxError(
                    f"sandbox unusable on this machine: {exc}; " + "; ".join(notes)
                ) from None
            notes.append(f"{step} refused: {exc}")
            if feature == "cgroup":
                cgroup = None
            elif feature == "user":
                features.clear()  # without root, every namespace needs the user namespace
            else:
                features.discard(feature)
            continue
        fields = res.stdout.split()
        if res.exit_code != 0 or len(fields) != 4:
            raise SandboxError(
                f"sandbox probe run failed (exit {res.exit_code}): {res.stderr.strip()[-300:]}"
            )
        if "net" in features and fields[1] != "1":
            notes.append(f"new network namespace shows {fields[1]} interfaces; not trusted")
            features.discard("net")
            continue
        if "mount" in features and (fields[2] != "/work" or fields[3] != "False"):
            notes.append("mount namespace set up but the host is still visible; not trusted")
            features.discard("mount")
            continue
        break
    if "net" not in features:
        notes.append("network is NOT isolated: no network namespace could be created")
    caps = SandboxCapabilities(
        running_as_root=root,
        privilege_drop=root,
        user_namespace="user" in features,
        network_namespace="net" in features,
        network_isolated="net" in features,
        no_new_privs=True,
        interpreter=interpreter,
        ipc_namespace="ipc" in features,
        mount_namespace="mount" in features,
        memory_cgroup=cgroup is not None,
        notes=tuple(notes),
    )
    return caps, plan


def run_python(
    code: str,
    *,
    stdin: str = "",
    limits: SandboxLimits = DEFAULT_LIMITS,
    files: dict[str, str] | None = None,
    temp_dir: str | None = None,
    fds: Mapping[int, int] | None = None,
) -> SandboxResult:
    """Run ``code`` as ``main.py`` in a fresh sandboxed interpreter and return its output.

    ``files`` maps relative paths to text written into the work dir first (importable,
    since the work dir is the script's directory). ``temp_dir`` is where the work dir
    is staged (default: the system temp dir). ``fds`` maps a descriptor number the
    program gets (3..63) to one of the caller's, e.g. a pipe only the caller reads.
    Raises :class:`SandboxError` only when the sandbox itself could not be set up;
    anything the code does is in the result.
    """
    return start_python(
        code, stdin=stdin, limits=limits, files=files, temp_dir=temp_dir, fds=fds
    ).wait()


def start_python(
    code: str,
    *,
    stdin: str = "",
    limits: SandboxLimits = DEFAULT_LIMITS,
    files: dict[str, str] | None = None,
    temp_dir: str | None = None,
    fds: Mapping[int, int] | None = None,
    capture_output: bool = True,
    _plan: _Plan | None = None,
) -> SandboxRun:
    """Start a run as :func:`run_python` does and return at once; ``wait()`` collects it.

    With ``capture_output=False`` the program's stdout and stderr go to /dev/null (for
    a run whose output nobody reads while another run is being waited on).
    """
    if _plan is None:
        sandbox_capabilities()
        _plan = _machine_plan
        assert _plan is not None
    fds = dict(fds or {})
    if any(not 3 <= target < _sup._LOW_FDS for target in fds):
        raise ValueError(f"sandbox fds must be numbered 3..{_sup._LOW_FDS - 1}, got {sorted(fds)}")
    if any(os.path.normpath(name) == _MAIN for name in files or {}):
        raise ValueError(f"sandbox file name {_MAIN!r} is reserved for the program")
    for name in files or {}:
        _safe_relpath(name)
    return SandboxRun(_plan, code, stdin, limits, files or {}, temp_dir, fds, capture_output)


def _plan_without(*features: str) -> _Plan:
    """This machine's plan minus some mechanisms ("net", "ipc", "mount", "cgroup"): for
    tests of the fallbacks, which must hold where the kernel refuses them."""
    sandbox_capabilities()
    plan = _machine_plan
    assert plan is not None
    return replace(
        plan,
        namespaces=tuple(n for n in plan.namespaces if n not in features),
        cgroup=None if "cgroup" in features else plan.cgroup,
    )
