"""Run untrusted Python (model completions, tool calls) in a limited child process.

What it is for: the code reward and the ``python`` tool execute text a policy wrote.
One call to :func:`run_python` starts one fresh interpreter and returns its output;
nothing is reused between runs.

Security model (what holds, checked by tests/workers/test_sandbox.py):

* Each run is a new process in its own session, started by a short trusted launcher
  (``_LAUNCHER``, run with ``python -I -S``) that sets the limits and then ``execve``s
  the interpreter on the candidate program. No ``preexec_fn`` is used, so starting a
  run is safe from a trainer that has threads (PyTorch always has).
* rlimits: ``RLIMIT_CPU`` (SIGXCPU, then SIGKILL a second later), ``RLIMIT_AS``
  (allocation beyond it raises MemoryError), ``RLIMIT_NPROC``, ``RLIMIT_FSIZE``
  (a bigger write fails with EFBIG; Python ignores SIGXFSZ), ``RLIMIT_CORE = 0``.
  The wall clock is enforced by the parent with SIGKILL to the process group.
* Run as root (as trainers are), the child drops to a *per-run* uid/gid drawn from
  ``_UID_BASE + [0, 2**24)`` with no supplementary groups, so ``RLIMIT_NPROC`` (which
  root ignores and which counts processes per uid machine-wide) counts only that
  run's processes, and concurrent runs cannot signal or ptrace one another or the
  trainer, nor read ``/proc/<trainer>/environ``. After the run every process of that
  uid is killed (also one that escaped the process group with ``setsid``) and files
  it left in the world-writable ``/tmp``, ``/var/tmp`` and ``/dev/shm`` are removed.
* ``PR_SET_NO_NEW_PRIVS`` is set, so setuid binaries cannot regain privileges.
* Network: the child gets a new, empty network namespace (only a down loopback):
  as root directly, otherwise inside a new user namespace that maps the caller's uid
  to itself. Whether this works is probed once per process and cached; see
  :func:`sandbox_capabilities`. A step that the probe found working and that then
  fails aborts the run with :class:`SandboxError` (fail closed, never silently open).
* Environment: only ``PATH``, ``HOME`` and ``TMPDIR`` (the work dir) and ``LANG``;
  interpreter flags ``-E -s -B -u`` (no ``PYTHON*`` variables, no user site-packages).
  The work dir is a fresh 0700 directory owned by the run's uid, removed afterwards.

Limits, honestly:

* Not a container: there is no mount or PID namespace. The child can *read* every
  world-readable file (the repo, datasets, /etc) and list processes, and while it
  runs it can create files in world-writable directories (each at most
  ``max_file_mb``, their number unbounded within the wall time).
* Without root the uid is the trainer's own: ``RLIMIT_NPROC`` then counts the
  trainer's processes and threads too (outside a user namespace), the child can
  signal the trainer, processes that call ``setsid`` can outlive the run, and files
  in /tmp are not swept. If neither root nor a user namespace is available the
  network is NOT isolated (``sandbox_capabilities().network_isolated`` is False).
* ``RLIMIT_AS`` bounds virtual memory, so libraries that reserve large address
  ranges (some allocators, CUDA) fail early; it is not a cgroup memory limit.
* ``limit_hit`` for "memory", "nproc" and "fsize" is inferred from the exception
  text on stderr, which the child controls; it is a diagnostic, never a reward.
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
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

__all__ = [
    "DEFAULT_LIMITS",
    "SandboxCapabilities",
    "SandboxError",
    "SandboxLimits",
    "SandboxResult",
    "processes_of_uid",
    "run_python",
    "sandbox_capabilities",
]

_UID_BASE = 1_600_000_000  # far above login users, subuid ranges and nobody (65534)
_UID_SPAN = 1 << 24
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_SETUP_FAILED = 125  # launcher exit status when a sandbox step failed
_SWEEP_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
_MAIN = "main.py"
_CHILD_FLAGS = ("-E", "-s", "-B", "-u")
_CHILD_PATH = "/usr/local/bin:/usr/bin:/bin"

# Trusted code, run as ``python -I -S -c _LAUNCHER <json>`` in the child before the
# candidate program: namespaces, rlimits, privilege drop, no_new_privs, execve.
# Any failure is reported on a close-on-exec pipe the candidate can never write to.
_LAUNCHER = r"""
import ctypes, json, os, resource, sys
cfg = json.loads(sys.argv[1])
step = "start"
try:
    libc = ctypes.CDLL(None, use_errno=True)
    def _check(ret, what):
        if ret != 0:
            e = ctypes.get_errno()
            raise OSError(e, what + ": " + os.strerror(e))
    if cfg["netns"]:
        step = "network namespace"
        if cfg["userns"]:
            uid, gid = os.getuid(), os.getgid()
            _check(libc.unshare(cfg["clone_user"] | cfg["clone_net"]), "unshare")
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                               ("gid_map", f"{gid} {gid} 1")):
                with open("/proc/self/" + name, "w") as f:
                    f.write(text)
        else:
            _check(libc.unshare(cfg["clone_net"]), "unshare")
    step = "rlimits"
    for name, value in cfg["rlimits"]:
        soft, hard = value
        resource.setrlimit(getattr(resource, name), (soft, hard))
    if cfg["uid"] is not None:
        step = "privilege drop"
        os.setgroups([])
        os.setresgid(cfg["gid"], cfg["gid"], cfg["gid"])
        os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
        if os.getuid() != cfg["uid"] or os.geteuid() != cfg["uid"]:
            raise OSError("uid did not change")
    step = "no_new_privs"
    _check(libc.prctl(38, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    step = "exec"
    os.set_inheritable(cfg["err_fd"], False)
    os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])
except BaseException as exc:
    os.write(cfg["err_fd"], f"{step}: {exc!r}".encode())
    os._exit(125)
"""


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
    user_namespace: bool  # used to get a network namespace without root
    network_namespace: bool
    network_isolated: bool
    no_new_privs: bool
    interpreter: str
    notes: tuple[str, ...] = field(default=())


_caps: SandboxCapabilities | None = None
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


def sandbox_capabilities() -> SandboxCapabilities:
    """Probe (once per process, then cached) which isolation mechanisms work here."""
    global _caps
    with _caps_lock:
        if _caps is None:
            _caps = _probe()
        return _caps


def _probe() -> SandboxCapabilities:
    root = os.geteuid() == 0
    notes: list[str] = []
    interpreter = _pick_interpreter(need_world=root)
    if interpreter != sys.executable:
        notes.append(f"sandbox interpreter {interpreter} (trainer's {sys.executable} "
                     "is not executable by the sandbox uid)")
    check = "import os, socket; print(os.getuid(), len(socket.if_nameindex()))"
    limits = SandboxLimits(wall_time_s=20.0)
    for netns, userns in ((True, not root), (False, False)):
        plan = _Plan(root, netns, userns, interpreter)
        try:
            res = _run(plan, check, "", limits, None, None)
        except SandboxError as exc:
            notes.append(f"{'network namespace' if netns else 'base sandbox'} refused: {exc}")
            continue
        fields = res.stdout.split()
        if res.exit_code != 0 or len(fields) != 2:
            notes.append(f"probe run failed (exit {res.exit_code}): {res.stderr.strip()[-300:]}")
            continue
        n_ifaces = int(fields[1])
        if netns and n_ifaces != 1:
            notes.append(f"new network namespace shows {n_ifaces} interfaces; not trusted")
            continue
        if not netns:
            notes.append("network is NOT isolated: no network namespace could be created")
        return SandboxCapabilities(
            running_as_root=root, privilege_drop=root, user_namespace=netns and userns,
            network_namespace=netns, network_isolated=netns, no_new_privs=True,
            interpreter=interpreter, notes=tuple(notes),
        )
    raise SandboxError("sandbox unusable on this machine: " + "; ".join(notes))


@dataclass(frozen=True)
class _Plan:
    root: bool
    netns: bool
    userns: bool
    interpreter: str


def run_python(
    code: str,
    *,
    stdin: str = "",
    limits: SandboxLimits = DEFAULT_LIMITS,
    files: dict[str, str] | None = None,
    temp_dir: str | None = None,
) -> SandboxResult:
    """Run ``code`` as ``main.py`` in a fresh sandboxed interpreter and return its output.

    ``files`` maps relative paths to text written into the work dir first (importable,
    since the work dir is the script's directory). ``temp_dir`` is where the work dir
    is created (default: the system temp dir). Raises :class:`SandboxError` only when
    the sandbox itself could not be set up; anything the code does is in the result.
    """
    caps = sandbox_capabilities()
    plan = _Plan(caps.running_as_root, caps.network_namespace, caps.user_namespace,
                 caps.interpreter)
    return _run(plan, code, stdin, limits, files, temp_dir)


def _safe_relpath(name: str) -> str:
    norm = os.path.normpath(name)
    if os.path.isabs(norm) or norm.startswith("..") or norm == ".":
        raise ValueError(f"sandbox file name {name!r} must be a relative path inside "
                         "the work dir")
    return norm


def _write_files(workdir: str, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = os.path.join(workdir, _safe_relpath(name))
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)


def _chown_tree(top: str, uid: int, gid: int) -> None:
    for dirpath, _, filenames in os.walk(top):
        os.chown(dirpath, uid, gid)
        for name in filenames:
            os.chown(os.path.join(dirpath, name), uid, gid)


def _run(
    plan: _Plan,
    code: str,
    stdin: str,
    limits: SandboxLimits,
    files: dict[str, str] | None,
    temp_dir: str | None,
) -> SandboxResult:
    if any(os.path.normpath(name) == _MAIN for name in files or {}):
        raise ValueError(f"sandbox file name {_MAIN!r} is reserved for the program")
    uid = _UID_BASE + secrets.randbelow(_UID_SPAN) if plan.root else None
    gid = uid if uid is not None else os.getgid()
    root_dir = temp_dir if temp_dir is not None else tempfile.gettempdir()
    if uid is not None and not _world_searchable(root_dir):
        raise SandboxError(f"temp dir {root_dir} is not searchable by the sandbox uid "
                           "(needs o+x on it and every parent)")
    workdir = tempfile.mkdtemp(prefix="tandem-sbx-", dir=root_dir)
    try:
        _write_files(workdir, {**(files or {}), _MAIN: code})
        if uid is not None:
            _chown_tree(workdir, uid, gid)
        return _spawn_and_wait(plan, uid, gid, workdir, stdin, limits, temp_dir)
    finally:
        try:
            if uid is not None:
                _kill_uid(uid)
                _sweep_shared_dirs(uid)
        finally:
            _rmtree(workdir)


def _rlimits(limits: SandboxLimits) -> list[tuple[str, tuple[int, int]]]:
    mem = limits.memory_mb * 1024 * 1024
    fsize = limits.max_file_mb * 1024 * 1024
    return [
        ("RLIMIT_CORE", (0, 0)),
        ("RLIMIT_CPU", (limits.cpu_time_s, limits.cpu_time_s + 1)),
        ("RLIMIT_FSIZE", (fsize, fsize)),
        ("RLIMIT_AS", (mem, mem)),
        ("RLIMIT_NPROC", (limits.max_processes, limits.max_processes)),
    ]


def _spawn_and_wait(
    plan: _Plan,
    uid: int | None,
    gid: int,
    workdir: str,
    stdin: str,
    limits: SandboxLimits,
    temp_dir: str | None,
) -> SandboxResult:
    env = {"PATH": _CHILD_PATH, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
    err_r, err_w = os.pipe()
    cfg = {
        "netns": plan.netns, "userns": plan.userns, "clone_user": _CLONE_NEWUSER,
        "clone_net": _CLONE_NEWNET, "rlimits": _rlimits(limits), "uid": uid, "gid": gid,
        "err_fd": err_w, "env": env,
        "argv": [plan.interpreter, *_CHILD_FLAGS, os.path.join(workdir, _MAIN)],
    }
    # stdin comes from an unlinked temp file: no pipe to feed, no name to find later.
    stdin_file = tempfile.TemporaryFile(dir=temp_dir) if stdin else None
    start = time.monotonic()
    try:
        if stdin_file is not None:
            stdin_file.write(stdin.encode("utf-8"))
            stdin_file.seek(0)
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _LAUNCHER, json.dumps(cfg)],
            stdin=stdin_file if stdin_file is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=workdir, env=env,
            pass_fds=(err_w,), start_new_session=True,
        )
    finally:
        os.close(err_w)
        if stdin_file is not None:
            stdin_file.close()
    try:
        setup_error = _read_all(err_r)
    finally:
        os.close(err_r)
    if setup_error:
        _reap(proc)
        raise SandboxError(f"sandbox setup failed at {setup_error.decode(errors='replace')}")
    return _collect(proc, uid, limits, start)


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 4096):
        chunks.append(chunk)
    return b"".join(chunks)


def _reap(proc: subprocess.Popen[bytes]) -> None:
    _killpg(proc.pid)
    proc.wait()
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _collect(
    proc: subprocess.Popen[bytes], uid: int | None, limits: SandboxLimits, start: float
) -> SandboxResult:
    assert proc.stdout is not None and proc.stderr is not None
    deadline = start + limits.wall_time_s
    bufs: dict[int, bytearray] = {proc.stdout.fileno(): bytearray(),
                                  proc.stderr.fileno(): bytearray()}
    sel = selectors.DefaultSelector()
    for stream in (proc.stdout, proc.stderr):
        os.set_blocking(stream.fileno(), False)
        sel.register(stream.fileno(), selectors.EVENT_READ)
    limit_hit: str | None = None
    exited = False
    drain_until: float | None = None
    try:
        while sel.get_map():
            now = time.monotonic()
            if not exited and now >= deadline:
                limit_hit = "wall"
                _kill_run(proc.pid, uid)
                exited, drain_until = True, now + 1.0
            if drain_until is not None and now >= drain_until:
                break
            until = drain_until if drain_until is not None else deadline
            for key, _ in sel.select(timeout=max(0.0, min(0.05, until - now))):
                fd = int(key.fd)
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(fd)
                    continue
                buf = bufs[fd]
                room = limits.max_output_bytes - len(buf)
                buf += chunk[:room]
                if len(chunk) > room and limit_hit is None:
                    limit_hit = "output"
                    _kill_run(proc.pid, uid)
                    exited, drain_until = True, time.monotonic() + 1.0
            if not exited and _has_exited(proc.pid):
                # The main process is done: end stragglers holding the pipes, then drain.
                _kill_run(proc.pid, uid)
                exited, drain_until = True, time.monotonic() + 1.0
    finally:
        sel.close()
        if not exited:
            _kill_run(proc.pid, uid)
        status = proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    duration = time.monotonic() - start
    out_b, err_b = (bytes(b) for b in bufs.values())  # insertion order: stdout, stderr
    stderr = err_b.decode("utf-8", errors="replace")
    if limit_hit is None:
        limit_hit = _classify(status, stderr)
    return SandboxResult(
        stdout=out_b.decode("utf-8", errors="replace"), stderr=stderr, exit_code=status,
        timed_out=limit_hit == "wall", limit_hit=limit_hit, duration_s=duration,
    )


def _has_exited(pid: int) -> bool:
    """Has ``pid`` exited? Does not reap it, so its pid (= process group id) stays ours."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return info is not None


def _kill_run(pgid: int, uid: int | None) -> None:
    _killpg(pgid)
    if uid is not None:
        _kill_uid(uid)


_MEMORY_RE = re.compile(r"^MemoryError\b", re.M)
_NPROC_RE = re.compile(r"\[Errno 11\] Resource temporarily unavailable")
_FSIZE_RE = re.compile(r"\[Errno 27\] File too large")


def _classify(status: int, stderr: str) -> str | None:
    if status == -signal.SIGXCPU:
        return "cpu"
    if status == -signal.SIGKILL:
        # Not sent by us (wall and output kills are labelled before this): the hard
        # RLIMIT_CPU sends SIGKILL when SIGXCPU was ignored. A kernel OOM kill would
        # look the same; RLIMIT_AS normally fires long before one.
        return "cpu"
    if status == -signal.SIGXFSZ or _FSIZE_RE.search(stderr):
        return "fsize"
    if _MEMORY_RE.search(stderr):
        return "memory"
    if _NPROC_RE.search(stderr):
        return "nproc"
    return None


def processes_of_uid(uid: int) -> list[int]:
    """Live (non-zombie) pids whose real uid is ``uid``, from /proc."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status", encoding="ascii", errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        uid_line = re.search(r"^Uid:\s+(\d+)", text, re.M)
        state = re.search(r"^State:\s+(\S)", text, re.M)
        if uid_line and int(uid_line.group(1)) == uid and not (state and state.group(1) == "Z"):
            pids.append(int(entry))
    return pids


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of the run's uid until none is left (it cannot change uid)."""
    for _ in range(200):
        pids = processes_of_uid(uid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.005)
    raise SandboxError(f"could not kill the processes of sandbox uid {uid}")


def _sweep_shared_dirs(uid: int) -> None:
    """Remove what the run's uid left at the top of the world-writable temp dirs."""
    for top in _SWEEP_DIRS:
        try:
            entries = list(os.scandir(top))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    _rmtree(entry.path)
                else:
                    os.unlink(entry.path)
            except OSError:
                pass


def _rmtree(path: str) -> None:
    def onerror(func: object, p: str, exc: object) -> None:
        try:  # the child may have removed write/search permission; we own or are root
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
        except OSError:
            pass

    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, onerror=onerror)
        if os.path.exists(path):
            shutil.rmtree(path, ignore_errors=True)
