"""One started sandboxed run: the launcher that hands a plan to the supervisor.

Holds :class:`SandboxRun` (it stages the work dir, starts
tandem/rl/sandbox/supervisor.py with the run's configuration, collects the output and
the supervisor's status and builds the :class:`SandboxResult`) and its helpers: writing
and chowning the program's files, the rlimits a run gets, and how ``limit_hit`` is
inferred. tandem/rl/sandbox/__init__.py validates the arguments and picks the plan; import
from there.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import selectors
import signal
import subprocess
import sys
import tempfile
import time
import warnings

from tandem.rl.sandbox import cleanup as _cleanup
from tandem.rl.sandbox.plan import (
    SandboxError,
    SandboxLimits,
    SandboxResult,
    _Plan,
    _world_searchable,
)

_UID_BASE = 1_600_000_000  # far above login users, subuid ranges and nobody (65534)
_UID_SPAN = 1 << 24
_SUPERVISOR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "supervisor.py")
_SWEEP_DIRS = ["/tmp", "/var/tmp", "/dev/shm", "/run/lock"]
_MAIN = "main.py"
_CHILD_FLAGS = ("-E", "-s", "-B", "-u")
_CHILD_PATH = "/usr/local/bin:/usr/bin:/bin"
_MSGQUEUE_BYTES = 1 << 20
_BACKSTOP_S = 10.0  # past the deadline, the caller stops waiting for a silent supervisor
_NO_REPORT = "no clean-up report from the supervisor"


def _safe_relpath(name: str) -> str:
    norm = os.path.normpath(name)
    if os.path.isabs(norm) or norm.startswith("..") or norm == ".":
        raise ValueError(f"sandbox file name {name!r} must be a relative path inside the work dir")
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

    def __init__(
        self,
        plan: _Plan,
        code: str,
        stdin: str,
        limits: SandboxLimits,
        files: dict[str, str],
        temp_dir: str | None,
        fds: dict[int, int],
        capture_output: bool,
    ) -> None:
        self.limits = limits
        self._uid = _UID_BASE + secrets.randbelow(_UID_SPAN) if plan.root else None
        gid = self._uid if self._uid is not None else os.getgid()
        mount_ns = "mount" in plan.namespaces
        root_dir = temp_dir if temp_dir is not None else tempfile.gettempdir()
        if self._uid is not None and not mount_ns and not _world_searchable(root_dir):
            raise SandboxError(
                f"temp dir {root_dir} is not searchable by the sandbox uid "
                "(needs o+x on it and every parent)"
            )
        self._workdir = tempfile.mkdtemp(prefix="tandem-sbx-", dir=root_dir)
        self._cgroup = (
            None
            if plan.cgroup is None
            else _cleanup.Cgroup(
                plan.cgroup[0], plan.cgroup[1], f"tandem-sbx-{os.getpid()}-{secrets.token_hex(8)}"
            )
        )
        self._child_pid: int | None = None  # the program's, once the supervisor reports it
        self._status_eof = False  # the status pipe closed with no status: the supervisor died
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
            _cleanup.rmtree(self._workdir)
            raise

    def _start(
        self,
        plan: _Plan,
        gid: int,
        cwd: str,
        stdin: str,
        fds: dict[int, int],
        capture_output: bool,
        temp_dir: str | None,
    ) -> None:
        env = {"PATH": _CHILD_PATH, "HOME": cwd, "TMPDIR": cwd, "LANG": "C.UTF-8"}
        ctl_r, self._ctl_w = os.pipe()
        self._status_r, status_w = os.pipe()
        cfg = {
            "namespaces": list(plan.namespaces),
            "bound_ipc": plan.root,
            "cgroup": None
            if self._cgroup is None
            else {
                "version": plan.cgroup[0],
                "parent": plan.cgroup[1],
                "name": os.path.basename(self._cgroup.path),
            },
            "binds": list(plan.binds),
            "rlimits": _rlimits(self.limits),
            "uid": self._uid,
            "gid": gid if self._uid is not None else None,
            "env": env,
            "cwd": cwd,
            "argv": [plan.interpreter, *_CHILD_FLAGS, os.path.join(cwd, _MAIN)],
            "workdir": self._workdir,
            "memory_bytes": self.limits.memory_mb * 1024 * 1024,
            "wall_time_s": self.limits.wall_time_s,
            "sweep_dirs": _SWEEP_DIRS,
            "ctl_fd": ctl_r,
            "status_fd": status_w,
            "fds": {str(t): s for t, s in fds.items()},
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
                stdout=out,
                stderr=out,
                cwd="/",
                env=env,
                pass_fds=(ctl_r, status_w, *fds.values()),
                start_new_session=True,
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
            if self._status is None:  # the supervisor died or fell silent: clean up ourselves
                try:  # a status pipe at EOF: the supervisor has exited, or is about to
                    code = self._proc.wait(timeout=1.0) if self._status_eof else self._proc.poll()
                except subprocess.TimeoutExpired:
                    code = None
                self._clean_up_after_supervisor()
                why = (
                    "did not report the run's end by its deadline"
                    if code is None
                    else f"died ({'signal ' + str(-code) if code < 0 else 'exit ' + str(code)})"
                    " before reporting the run's end"
                )
                raise SandboxError(
                    f"sandbox supervisor {why}; the caller killed the run and "
                    "removed its work dir and cgroup"
                )
            os.close(self._ctl_w)
            self._ctl_w = -1
            problems = self._read_cleanup_report()
            self._proc.wait()
            if problems == [_NO_REPORT]:  # it died after the status: its clean-up did not run
                self._clean_up_after_supervisor()
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
            warnings.warn(f"sandbox clean-up incomplete: {problems}", RuntimeWarning, stacklevel=2)
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
                ended = self._status is not None or self._status_r not in sel.get_map()
                if ended and (not open_outputs or now >= drain_until):
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
                        self._status = self._first_status()
                        if self._status is not None or not chunk:
                            sel.unregister(fd)
                            self._status_eof = self._status is None  # no status: it died
                            # the run is dead by now; a dead supervisor's output is moot
                            drain_until = time.monotonic() + (0.0 if self._status_eof else 1.0)
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

    def _first_status(self) -> dict | None:
        """The first status line on the status pipe (a ``started`` line before it records
        the program's pid), or None while there is none."""
        for line in bytes(self._status_buf).split(b"\n")[:-1]:  # complete lines
            try:
                msg = json.loads(line)
            except ValueError:
                msg = None
            if isinstance(msg, dict) and "started" in msg:
                self._child_pid = int(msg["started"])
                continue
            msg = msg if isinstance(msg, dict) else {}
            if "exit_code" not in msg:
                msg.setdefault("setup_error", f"supervisor: {line[:300]!r}")
            return msg
        return None

    def _read_cleanup_report(self) -> list[str]:
        data = bytes(self._status_buf)
        while chunk := os.read(self._status_r, 65536):  # ends when the supervisor exits
            data += chunk
        for line in data.splitlines():
            msg = json.loads(line)
            if "cleanup_problems" in msg:
                return list(msg["cleanup_problems"])
        return [_NO_REPORT]

    def _clean_up_after_supervisor(self) -> None:
        """What the supervisor does after a run, done here when it died or fell silent:
        kill it, the program's process group, the run's uid and cgroup; remove the work
        dir and the cgroup. The program itself already died with the supervisor
        (PR_SET_PDEATHSIG); its children may not have."""
        _cleanup.killpg(self._proc.pid)
        try:
            self._proc.kill()
        except ProcessLookupError:
            pass
        if self._child_pid is not None:
            _cleanup.killpg(self._child_pid)  # the program called setsid: its group's id
        if self._uid is not None:
            _cleanup.kill_uid(self._uid)
        if self._cgroup is not None:
            self._cgroup.kill()
            self._cgroup.remove()
        _cleanup.rmtree(self._workdir)

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
            stdout=out.decode("utf-8", errors="replace"),
            stderr=stderr,
            exit_code=status,
            timed_out=limit_hit == "wall",
            limit_hit=limit_hit,
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
