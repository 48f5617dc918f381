"""Run untrusted Python (model completions, tool calls) in a limited child process.

What it is for: the code reward and the ``python`` tool execute text a policy wrote.
One call to :func:`run_python` starts one fresh interpreter and returns its output;
nothing is reused between runs. docs/fault-tolerance.md, "What the sandbox bounds",
lists what is bounded with and without root, namespaces and cgroups.

Security model (what holds, checked by tests/workers/test_sandbox.py):

* Each run has a trusted supervisor (rl/workers/sandbox_supervisor.py, started with
  ``python -I -S`` in a session of its own; no ``preexec_fn``, so starting a run is safe
  from a trainer that has threads). It forks the program's process, which sets up the
  isolation below and ``execve``s the interpreter on the program, and it holds the
  wall-clock deadline itself: when the caller dies (an env worker killed for a slow
  step, a reward call cut by its timeout) the control pipe reaches EOF and the run is
  killed and cleaned at once.
* rlimits: ``RLIMIT_CPU`` (SIGXCPU, then SIGKILL a second later), ``RLIMIT_AS`` and
  ``RLIMIT_DATA`` (allocation beyond them raises MemoryError), ``RLIMIT_NPROC``,
  ``RLIMIT_FSIZE`` (a bigger write fails with EFBIG; Python ignores SIGXFSZ),
  ``RLIMIT_MSGQUEUE`` (POSIX message-queue bytes), ``RLIMIT_CORE = 0``.
* Run as root (as trainers are), the child drops to a *per-run* uid/gid drawn from
  ``_UID_BASE + [0, 2**24)`` with no supplementary groups, so ``RLIMIT_NPROC`` counts
  only that run's processes, and concurrent runs cannot signal or ptrace one another or
  the trainer. After the run every process of that uid is killed (also one that
  escaped the process group with ``setsid``).
* Namespaces, each used when the probe found it works here (root directly, otherwise
  inside a new user namespace that maps the caller's uid to itself):
  - network: a new, empty network namespace (only a down loopback);
  - IPC: SysV shared memory, message queues, semaphores and POSIX message queues made
    in the run die with it; as root its SysV shared memory is capped at ``memory_mb``;
  - mount: the program sees a minimal root on a tmpfs of ``memory_mb`` (``/usr`` and
    the interpreter's directories read-only, ``/dev/{null,zero,full,random,urandom}``,
    private ``/tmp`` and ``/dev/shm``, its files in ``/work``), not the trainer's files,
    sockets or ``/proc``. Everything it writes lives in that tmpfs and dies with it.
* Memory cgroup (as root, where this process's cgroup lets it make a child with a memory
  limit, v1 or v2): the run's processes are charged there, page cache, tmpfs and memfd
  pages included, and the cgroup's OOM killer stops them at ``memory_mb``.
* Without a mount namespace, files the run's uid left at the top of ``/tmp``,
  ``/var/tmp``, ``/dev/shm`` and ``/run/lock`` are removed; without an IPC namespace,
  SysV objects the uid owns are removed.
* ``PR_SET_NO_NEW_PRIVS`` is set, so setuid binaries cannot regain privileges.
* Environment: only ``PATH``, ``HOME`` and ``TMPDIR`` (the work dir) and ``LANG``;
  interpreter flags ``-E -s -B -u`` (no ``PYTHON*`` variables, no user site-packages).
  A step that the probe found working and that then fails aborts the run with
  :class:`SandboxError` (fail closed, never silently open).

Limits, honestly:

* Without a mount namespace the child can *read* every world-readable file and list
  processes. Without a memory cgroup, ``memfd`` pages are not bounded (RLIMIT_AS only
  counts what is mapped). There is no PID namespace and no seccomp filter.
* Without root the uid is the trainer's own: ``RLIMIT_NPROC`` then counts the
  trainer's processes too (outside a user namespace), the child can signal the
  trainer, processes that call ``setsid`` can outlive the run, and files in /tmp are
  not swept. If neither root nor a user namespace is available the network is NOT
  isolated (``sandbox_capabilities().network_isolated`` is False).
* ``limit_hit`` for "memory", "nproc" and "fsize" is inferred from the exception
  text on stderr, which the child controls (a cgroup OOM kill is counted by the
  kernel); it is a diagnostic, never a reward.
* The child runs a world-executable interpreter: ``sys.executable`` when the sandbox
  uid can run it, else ``/usr/bin/python3`` (may be another version; see
  ``sandbox_capabilities().interpreter``).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import selectors
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from rl.workers import sandbox_supervisor as _sup
from rl.workers.sandbox_supervisor import processes_of_uid

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

_UID_BASE = 1_600_000_000  # far above login users, subuid ranges and nobody (65534)
_UID_SPAN = 1 << 24
_SUPERVISOR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_supervisor.py")
_SWEEP_DIRS = ["/tmp", "/var/tmp", "/dev/shm", "/run/lock"]
_BINDS = ["/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32"]
_MAIN = "main.py"
_CHILD_FLAGS = ("-E", "-s", "-B", "-u")
_CHILD_PATH = "/usr/local/bin:/usr/bin:/bin"
_MSGQUEUE_BYTES = 1 << 20
_BACKSTOP_S = 10.0  # past the deadline, the caller stops waiting for a silent supervisor


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
        for name in ("cpu_time_s", "wall_time_s", "memory_mb", "max_processes",
                     "max_file_mb", "max_output_bytes"):
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


_caps: SandboxCapabilities | None = None
_machine_plan: _Plan | None = None  # what the probe found works, used by every run
_caps_lock = threading.Lock()


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


def sandbox_capabilities() -> SandboxCapabilities:
    """Probe (once per process, then cached) which isolation mechanisms work here."""
    global _caps, _machine_plan
    with _caps_lock:
        if _caps is None:
            _caps, _machine_plan = _probe()
        return _caps


_FEATURE_OF_STEP = {"network namespace": "net", "ipc namespace": "ipc",
                    "mount namespace": "mount", "user namespace": "user",
                    "memory cgroup": "cgroup"}


def _probe() -> tuple[SandboxCapabilities, _Plan]:
    """Try every mechanism; drop the one whose set-up step fails and try again."""
    root = os.geteuid() == 0
    notes: list[str] = []
    interpreter = _pick_interpreter(need_world=root)
    if interpreter != sys.executable:
        notes.append(f"sandbox interpreter {interpreter} (trainer's {sys.executable} "
                     "is not executable by the sandbox uid)")
    features = {"net", "ipc", "mount"} | (set() if root else {"user"})
    cgroup = None
    if root:
        version, where = _sup.find_memory_cgroup()
        if version is None:
            notes.append(f"no memory cgroup: {where}")
        else:
            cgroup = (version, where)
    check = ("import os, socket; print(os.getuid(), len(socket.if_nameindex()), os.getcwd(),"
             " os.path.exists(" + repr(_SUPERVISOR) + "))")
    limits = SandboxLimits(wall_time_s=20.0)
    while True:
        plan = _Plan(root, tuple(sorted(features)), cgroup, interpreter, _binds_for(interpreter))
        try:
            res = start_python(check, limits=limits, _plan=plan).wait()
        except SandboxError as exc:
            step = str(exc).removeprefix("sandbox setup failed at ").split(":")[0]
            feature = _FEATURE_OF_STEP.get(step)
            if feature is None or (feature != "cgroup" and feature not in features):
                raise SandboxError(f"sandbox unusable on this machine: {exc}; "
                                   + "; ".join(notes)) from None
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
            raise SandboxError(f"sandbox probe run failed (exit {res.exit_code}): "
                               f"{res.stderr.strip()[-300:]}")
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
        running_as_root=root, privilege_drop=root, user_namespace="user" in features,
        network_namespace="net" in features, network_isolated="net" in features,
        no_new_privs=True, interpreter=interpreter, ipc_namespace="ipc" in features,
        mount_namespace="mount" in features, memory_cgroup=cgroup is not None,
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
    return start_python(code, stdin=stdin, limits=limits, files=files, temp_dir=temp_dir,
                        fds=fds).wait()


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


def _safe_relpath(name: str) -> str:
    norm = os.path.normpath(name)
    if os.path.isabs(norm) or norm.startswith("..") or norm == ".":
        raise ValueError(f"sandbox file name {name!r} must be a relative path inside "
                         "the work dir")
    return norm


def _write_files(directory: str, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = os.path.join(directory, _safe_relpath(name))
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)


def _chown_tree(top: str, uid: int, gid: int) -> None:
    for dirpath, _, filenames in os.walk(top):
        os.chown(dirpath, uid, gid)
        for name in filenames:
            os.chown(os.path.join(dirpath, name), uid, gid)


def _rlimits(limits: SandboxLimits) -> list[tuple[str, tuple[int, int]]]:
    mem = limits.memory_mb * 1024 * 1024
    fsize = limits.max_file_mb * 1024 * 1024
    return [
        ("RLIMIT_CORE", (0, 0)),
        ("RLIMIT_CPU", (limits.cpu_time_s, limits.cpu_time_s + 1)),
        ("RLIMIT_FSIZE", (fsize, fsize)),
        ("RLIMIT_AS", (mem, mem)),
        ("RLIMIT_DATA", (mem, mem)),
        ("RLIMIT_MSGQUEUE", (_MSGQUEUE_BYTES, _MSGQUEUE_BYTES)),
        ("RLIMIT_NPROC", (limits.max_processes, limits.max_processes)),
    ]


class SandboxRun:
    """One started run: its supervisor, output pipes and control/status pipes."""

    def __init__(self, plan: _Plan, code: str, stdin: str, limits: SandboxLimits,
                 files: dict[str, str], temp_dir: str | None, fds: dict[int, int],
                 capture_output: bool) -> None:
        self.limits = limits
        self._uid = _UID_BASE + secrets.randbelow(_UID_SPAN) if plan.root else None
        gid = self._uid if self._uid is not None else os.getgid()
        mount_ns = "mount" in plan.namespaces
        root_dir = temp_dir if temp_dir is not None else tempfile.gettempdir()
        if self._uid is not None and not mount_ns and not _world_searchable(root_dir):
            raise SandboxError(f"temp dir {root_dir} is not searchable by the sandbox uid "
                               "(needs o+x on it and every parent)")
        self._workdir = tempfile.mkdtemp(prefix="tandem-sbx-", dir=root_dir)
        self._status: dict | None = None
        self._status_buf = bytearray()
        self._ctl_w = -1
        self._finished: SandboxResult | None = None
        try:
            files_dir = os.path.join(self._workdir, "files")
            os.mkdir(files_dir, 0o700)
            _write_files(files_dir, {**files, _MAIN: code})
            if self._uid is not None and not mount_ns:
                _chown_tree(self._workdir, self._uid, gid)
            cwd = "/work" if mount_ns else files_dir
            self._start(plan, gid, cwd, stdin, fds, capture_output, temp_dir)
        except BaseException:
            _sup.rmtree(self._workdir)
            raise

    def _start(self, plan: _Plan, gid: int, cwd: str, stdin: str, fds: dict[int, int],
               capture_output: bool, temp_dir: str | None) -> None:
        env = {"PATH": _CHILD_PATH, "HOME": cwd, "TMPDIR": cwd, "LANG": "C.UTF-8"}
        ctl_r, self._ctl_w = os.pipe()
        self._status_r, status_w = os.pipe()
        cfg = {
            "namespaces": list(plan.namespaces), "bound_ipc": plan.root,
            "cgroup": None if plan.cgroup is None else
            {"version": plan.cgroup[0], "parent": plan.cgroup[1]},
            "binds": list(plan.binds), "rlimits": _rlimits(self.limits), "uid": self._uid,
            "gid": gid if self._uid is not None else None, "env": env, "cwd": cwd,
            "argv": [plan.interpreter, *_CHILD_FLAGS, os.path.join(cwd, _MAIN)],
            "workdir": self._workdir, "memory_bytes": self.limits.memory_mb * 1024 * 1024,
            "wall_time_s": self.limits.wall_time_s, "sweep_dirs": _SWEEP_DIRS,
            "ctl_fd": ctl_r, "status_fd": status_w, "fds": {str(t): s for t, s in fds.items()},
        }
        # stdin comes from an unlinked temp file: no pipe to feed, no name to find later.
        stdin_file = tempfile.TemporaryFile(dir=temp_dir) if stdin else None
        out = subprocess.PIPE if capture_output else subprocess.DEVNULL
        self._start_time = time.monotonic()
        try:
            if stdin_file is not None:
                stdin_file.write(stdin.encode("utf-8"))
                stdin_file.seek(0)
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", _SUPERVISOR, json.dumps(cfg)],
                stdin=stdin_file if stdin_file is not None else subprocess.DEVNULL,
                stdout=out, stderr=out, cwd="/", env=env,
                pass_fds=(ctl_r, status_w, *fds.values()), start_new_session=True,
            )
        except BaseException:
            os.close(self._ctl_w)
            os.close(self._status_r)
            raise
        finally:
            os.close(ctl_r)
            os.close(status_w)
            if stdin_file is not None:
                stdin_file.close()

    def kill(self) -> None:
        """Ask the supervisor to end the run now (``wait`` still collects it)."""
        try:
            if self._ctl_w >= 0:
                os.write(self._ctl_w, b"k")
        except OSError:
            pass

    def wait(self) -> SandboxResult:
        """Collect output until the run ends; always leaves the supervisor reaped."""
        if self._finished is not None:
            return self._finished
        try:
            out, err, output_cut = self._collect()
            if self._status is None:  # the supervisor fell silent: end the run ourselves
                self._backstop()
                raise SandboxError("sandbox supervisor did not report the run's end")
            os.close(self._ctl_w)
            self._ctl_w = -1
            problems = self._read_cleanup_report()
            self._proc.wait()
        except BaseException:  # e.g. a reward timeout: EOF on the control pipe ends the run
            if self._ctl_w >= 0:
                os.close(self._ctl_w)
                self._ctl_w = -1
            try:
                self._proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                pass
            raise
        finally:
            os.close(self._status_r)
            for stream in (self._proc.stdout, self._proc.stderr):
                if stream is not None:
                    stream.close()
        if "setup_error" in self._status:
            raise SandboxError(f"sandbox setup failed at {self._status['setup_error']}")
        if problems:
            warnings.warn(f"sandbox clean-up incomplete: {problems}", RuntimeWarning,
                          stacklevel=2)
        self._finished = self._result(out, err, output_cut)
        return self._finished

    def _collect(self) -> tuple[bytes, bytes, bool]:
        """Read stdout/stderr and the supervisor's first status line; kill on a flood."""
        streams = [s for s in (self._proc.stdout, self._proc.stderr) if s is not None]
        bufs = {s.fileno(): bytearray() for s in streams}
        sel = selectors.DefaultSelector()
        for fd in [*bufs, self._status_r]:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        backstop = self._start_time + self.limits.wall_time_s + _BACKSTOP_S
        drain_until = 0.0
        output_cut = False
        try:
            while True:
                now = time.monotonic()
                open_outputs = [fd for fd in sel.get_map() if fd in bufs]
                if self._status is not None and (not open_outputs or now >= drain_until):
                    break
                if self._status is None and now >= backstop:
                    break
                until = backstop if self._status is None else drain_until
                for key, _ in sel.select(timeout=max(0.0, min(0.5, until - now))):
                    fd = int(key.fd)
                    try:
                        chunk = os.read(fd, 65536)
                    except BlockingIOError:
                        continue
                    if fd == self._status_r:
                        self._status_buf += chunk
                        if not chunk or b"\n" in self._status_buf:
                            sel.unregister(fd)
                            line = bytes(self._status_buf).partition(b"\n")[0]
                            self._status = json.loads(line) if line else {}
                            if "exit_code" not in self._status:
                                self._status.setdefault("setup_error",
                                                        f"supervisor: {line[:300]!r}")
                            drain_until = time.monotonic() + 1.0  # the run is dead by now
                        continue
                    if not chunk:
                        sel.unregister(fd)
                        continue
                    buf = bufs[fd]
                    room = self.limits.max_output_bytes - len(buf)
                    buf += chunk[:room]
                    if len(chunk) > room and not output_cut:
                        output_cut = True
                        self.kill()
        finally:
            sel.close()
        os.set_blocking(self._status_r, True)
        out = [bytes(bufs[s.fileno()]) for s in streams] or [b"", b""]
        return out[0], out[-1], output_cut

    def _read_cleanup_report(self) -> list[str]:
        data = bytes(self._status_buf)
        while chunk := os.read(self._status_r, 65536):  # ends when the supervisor exits
            data += chunk
        for line in data.splitlines():
            msg = json.loads(line)
            if "cleanup_problems" in msg:
                return list(msg["cleanup_problems"])
        return ["no clean-up report from the supervisor"]

    def _backstop(self) -> None:
        _sup.killpg(self._proc.pid)
        try:
            self._proc.kill()
        except ProcessLookupError:
            pass
        if self._uid is not None:
            _sup.kill_uid(self._uid)
        _sup.rmtree(self._workdir)

    def _result(self, out: bytes, err: bytes, output_cut: bool) -> SandboxResult:
        st = self._status or {}
        stderr = err.decode("utf-8", errors="replace")
        status = int(st["exit_code"])
        if output_cut:
            limit_hit: str | None = "output"
        elif st.get("cut") == "wall":
            limit_hit = "wall"
        elif st.get("cut") is not None:  # kill(), or the supervisor was told to stop
            limit_hit = None
        elif st.get("oom_kills", 0) > 0:
            limit_hit = "memory"
        else:
            limit_hit = _classify(status, stderr)
        return SandboxResult(
            stdout=out.decode("utf-8", errors="replace"), stderr=stderr, exit_code=status,
            timed_out=limit_hit == "wall", limit_hit=limit_hit,
            duration_s=float(st.get("duration_s", time.monotonic() - self._start_time)),
        )


_MEMORY_RE = re.compile(r"^MemoryError\b", re.M)
_NPROC_RE = re.compile(r"\[Errno 11\] Resource temporarily unavailable")
_FSIZE_RE = re.compile(r"\[Errno 27\] File too large")


def _classify(status: int, stderr: str) -> str | None:
    if status == -signal.SIGXCPU:
        return "cpu"
    if status == -signal.SIGKILL:
        # Not sent by us (wall and output kills are labelled before this) nor by the
        # cgroup's OOM killer (counted): the hard RLIMIT_CPU sends SIGKILL when SIGXCPU
        # was ignored.
        return "cpu"
    if status == -signal.SIGXFSZ or _FSIZE_RE.search(stderr):
        return "fsize"
    if _MEMORY_RE.search(stderr):
        return "memory"
    if _NPROC_RE.search(stderr):
        return "nproc"
    return None


def _plan_without(*features: str) -> _Plan:
    """This machine's plan minus some mechanisms ("net", "ipc", "mount", "cgroup"): for
    tests of the fallbacks, which must hold where the kernel refuses them."""
    sandbox_capabilities()
    plan = _machine_plan
    assert plan is not None
    return replace(plan, namespaces=tuple(n for n in plan.namespaces if n not in features),
                   cgroup=None if "cgroup" in features else plan.cgroup)
