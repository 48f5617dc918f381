"""The trusted supervisor of one sandboxed run (its clean-up helpers: tandem/rl/sandbox/cleanup.py).

tandem/rl/sandbox/run.py (``SandboxRun``, behind tandem/rl/sandbox/__init__.py) starts this
file as ``python -I -S supervisor.py CONFIG`` (stdlib only, so it needs no
site-packages and no repo on ``sys.path``), in a session of its own. The supervisor

1. creates the run's memory cgroup (when the probe found one it may create),
2. forks the child, which joins the cgroup, enters new user/network/IPC/mount
   namespaces, builds a minimal root on a size-capped tmpfs and chroots into it, sets
   rlimits, drops to the run's uid, sets no_new_privs and ``execve``s the program;
3. reports the program's pid on the status pipe, then waits for the program's exit,
   the wall-clock deadline, a kill request from the caller on the control pipe, or the
   control pipe's EOF (the caller died: an env worker killed for a slow step), and then
   kills every process of the run (process group, uid, cgroup);
4. reports the exit status on the status pipe, removes the work dir (iteratively:
   the program may have made a tree thousands of levels deep), sweeps what the uid
   left in shared directories and SysV IPC when there was no namespace to drop it
   with, removes the cgroup, and reports the clean-up.

Because the supervisor, not the caller, holds the deadline, a run ends on time and
leaves nothing behind even when the process that started it is killed. The other way
round, the program dies with its supervisor (``PR_SET_PDEATHSIG``: SIGKILL, as the OOM
killer would send it, or SIGKILL from the caller's backstop), and the caller, whose
status pipe then closes without a status, kills the run's uid and process group and
removes the work dir and the cgroup itself (tandem/rl/sandbox/run.py).
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import select
import signal
import sys
import time

if __package__:  # imported by the trainer's side (SandboxRun, the probe, tests)
    from tandem.rl.sandbox.cleanup import (
        Cgroup,
        kill_uid,
        killpg,
        rmtree,
        sweep_dirs,
        sweep_sysv_ipc,
    )
else:  # run as `python -I -S supervisor.py`: -I leaves this file's folder off sys.path
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from cleanup import Cgroup, kill_uid, killpg, rmtree, sweep_dirs, sweep_sysv_ipc

_MS_RDONLY, _MS_NOSUID, _MS_NODEV = 0x1, 0x2, 0x4
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
_CLONE = {"user": 0x10000000, "net": 0x40000000, "ipc": 0x08000000, "mount": 0x00020000}
_SETUP_FAILED = 125
_DEVICES = ("null", "zero", "full", "random", "urandom")
_LOW_FDS = 64  # extra fds for the program go to numbers 3.._LOW_FDS-1

# ---- the child: namespaces, root, limits, exec ----------------------------------------


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def _mount(
    libc, src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None
) -> None:
    def enc(text: str | None) -> bytes | None:
        return None if text is None else text.encode()

    _check(
        libc.mount(enc(src), enc(dst), enc(fstype), ctypes.c_ulong(flags), enc(data)),
        f"mount {src or fstype} on {dst}",
    )


def _write_proc(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _bound_ipc(memory_bytes: int) -> None:
    """Per-namespace SysV limits: shared memory totals at most the run's memory."""
    page = os.sysconf("SC_PAGE_SIZE")
    for name, value in (
        ("kernel/shmmax", memory_bytes),
        ("kernel/shmall", memory_bytes // page),
        ("kernel/shmmni", 64),
        ("kernel/msgmni", 16),
        ("fs/mqueue/queues_max", 16),
    ):
        _write_proc("/proc/sys/" + name, str(value))


def _build_root(libc, cfg: dict) -> str:
    """A tmpfs root with the interpreter's directories read-only, private /tmp and
    /dev/shm, a few device nodes and the run's files in /work; returns its path."""
    root = os.path.join(cfg["workdir"], ".root")
    os.mkdir(root, 0o700)
    _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE)
    _mount(
        libc, "tmpfs", root, "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={cfg['memory_bytes']},mode=755"
    )
    for path in cfg["binds"]:
        inside = root + path
        os.makedirs(os.path.dirname(inside), 0o755, exist_ok=True)
        if os.path.islink(path):
            os.symlink(os.readlink(path), inside)
            continue
        if not os.path.isdir(path):
            continue
        os.makedirs(inside, 0o755, exist_ok=True)
        _mount(libc, path, inside, None, _MS_BIND | _MS_REC)
        _mount(
            libc, None, inside, None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV
        )
    os.makedirs(root + "/dev", 0o755, exist_ok=True)
    for dev in _DEVICES:
        open(f"{root}/dev/{dev}", "w").close()
        _mount(libc, f"/dev/{dev}", f"{root}/dev/{dev}", None, _MS_BIND)
    for d in ("/tmp", "/dev/shm"):
        os.mkdir(root + d)
        os.chmod(root + d, 0o1777)
    os.makedirs(root + "/var", 0o755, exist_ok=True)
    os.symlink("../tmp", root + "/var/tmp")
    os.makedirs(root + "/etc", 0o755, exist_ok=True)
    uid = cfg["uid"] if cfg["uid"] is not None else os.getuid()
    gid = cfg["gid"] if cfg["gid"] is not None else os.getgid()
    for name, text in (
        ("passwd", f"root:x:0:0::/:/bin/false\nsandbox:x:{uid}:{gid}::/work:/bin/false\n"),
        ("group", f"root:x:0:\nsandbox:x:{gid}:\n"),
        ("hosts", "127.0.0.1 localhost\n"),
    ):
        with open(f"{root}/etc/{name}", "w") as f:
            f.write(text)
    work = root + "/work"
    os.mkdir(work, 0o700)
    _copy_tree(os.path.join(cfg["workdir"], "files"), work, uid, gid)
    return root


def _copy_tree(src: str, dst: str, uid: int, gid: int) -> None:
    for dirpath, _, filenames in os.walk(src):
        target = os.path.join(dst, os.path.relpath(dirpath, src))
        os.makedirs(target, 0o700, exist_ok=True)
        os.chown(target, uid, gid)
        for name in filenames:
            with (
                open(os.path.join(dirpath, name), "rb") as fin,
                open(os.path.join(target, name), "wb") as fout,
            ):
                fout.write(fin.read())
            os.chown(os.path.join(target, name), uid, gid)


def _place_fds(fds: dict[str, int], keep: set[int]) -> None:
    """Move the extra fds to their target numbers; close every other fd above 2."""
    # copies above every target first, so no target is overwritten before it is moved
    moved = {int(t): fcntl.fcntl(src, fcntl.F_DUPFD_CLOEXEC, _LOW_FDS) for t, src in fds.items()}
    for target, fd in moved.items():
        os.dup2(fd, target, inheritable=True)
        os.set_inheritable(target, True)
    keep = keep | set(moved)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def _child(cfg: dict, err_fd: int, cgroup: Cgroup | None) -> None:
    """Set up and exec the program; on any failure report the step on ``err_fd``."""
    import resource

    step = "start"
    supervisor = os.getppid()
    try:
        err_fd = fcntl.fcntl(err_fd, fcntl.F_DUPFD_CLOEXEC, _LOW_FDS)  # out of the targets' way
        libc = _libc()
        os.setsid()
        if cgroup is not None:
            step = "memory cgroup"
            cgroup.join(os.getpid())
        ns = cfg["namespaces"]
        if "user" in ns:
            step = "user namespace"
            uid, gid = os.getuid(), os.getgid()
            _check(libc.unshare(_CLONE["user"]), "unshare")
            for name, text in (
                ("setgroups", "deny"),
                ("uid_map", f"{uid} {uid} 1"),
                ("gid_map", f"{gid} {gid} 1"),
            ):
                _write_proc("/proc/self/" + name, text)
        for kind in ("net", "ipc", "mount"):
            if kind in ns:
                step = f"{'network' if kind == 'net' else kind} namespace"
                _check(libc.unshare(_CLONE[kind]), "unshare")
                if kind == "ipc" and cfg["bound_ipc"]:
                    _bound_ipc(cfg["memory_bytes"])
        root = None
        if "mount" in ns:
            step = "mount namespace"
            root = _build_root(libc, cfg)
        step = "file descriptors"
        _place_fds(cfg["fds"], {err_fd})
        step = "rlimits"
        for name, (soft, hard) in cfg["rlimits"]:
            res = getattr(resource, name)
            cap = resource.getrlimit(res)[1]  # lowering only (no CAP_SYS_RESOURCE needed)
            if cap != resource.RLIM_INFINITY:
                soft, hard = min(soft, cap), min(hard, cap)
            resource.setrlimit(res, (soft, hard))
        if root is not None:
            step = "chroot"
            os.chroot(root)
        os.chdir(cfg["cwd"])
        if cfg["uid"] is not None:
            step = "privilege drop"
            os.setgroups([])
            os.setresgid(cfg["gid"], cfg["gid"], cfg["gid"])
            os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
            if os.getuid() != cfg["uid"] or os.geteuid() != cfg["uid"]:
                raise OSError("uid did not change")
        step = "no_new_privs"
        _check(libc.prctl(38, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
        step = "parent-death signal"  # after the uid change, which clears it
        _check(libc.prctl(1, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
        if os.getppid() != supervisor:  # the supervisor died before the prctl
            os._exit(_SETUP_FAILED)
        step = "exec"
        os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])
    except BaseException as exc:
        os.write(err_fd, f"{step}: {exc!r}".encode())
    finally:
        os._exit(_SETUP_FAILED)


# ---- the supervisor ---------------------------------------------------------------------


def _send(fd: int, msg: dict) -> None:
    try:
        os.write(fd, (json.dumps(msg) + "\n").encode())
    except OSError:  # the caller is gone; the clean-up still happens
        pass


class _Terminated(Exception):
    """SIGTERM or SIGHUP reached the supervisor: end the run and clean up, as on EOF."""


def _on_terminate(signum: int, frame: object) -> None:
    raise _Terminated()


def _wait(pid: int, ctl_fd: int, deadline: float) -> tuple[int | None, str | None]:
    """Wait for the program's exit; (wait status or None, why it was cut short or None)."""
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return status, None
            left = deadline - time.monotonic()
            if left <= 0:
                return None, "wall"
            watch = [ctl_fd] + ([pidfd] if pidfd is not None else [])
            ready, _, _ = select.select(
                watch, [], [], left if pidfd is not None else min(left, 0.02)
            )
            if ctl_fd in ready:
                msg = os.read(ctl_fd, 64)
                return None, "killed" if msg else "caller gone"
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _exit_code(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _kill_run(pid: int, uid: int | None, cgroup: Cgroup | None) -> None:
    killpg(pid)
    if uid is not None:
        kill_uid(uid)
    if cgroup is not None:
        cgroup.kill()


def supervise(cfg: dict) -> int:
    status_fd, ctl_fd = cfg["status_fd"], cfg["ctl_fd"]
    uid = cfg["uid"]
    cgroup = None
    if cfg["cgroup"] is not None:
        cgroup = Cgroup(cfg["cgroup"]["version"], cfg["cgroup"]["parent"], cfg["cgroup"]["name"])
    problems: list[str] = []
    try:
        if cgroup is not None:
            try:
                cgroup.create(cfg["memory_bytes"])
            except OSError as exc:
                _send(status_fd, {"setup_error": f"memory cgroup: {exc!r}"})
                if os.path.isdir(cgroup.path):
                    cgroup.remove()
                cgroup = None
                return 0
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:
            os.close(err_r)
            _child(cfg, err_w, cgroup)
        os.close(err_w)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):  # the program holds the output pipes now, not us
            os.dup2(null, fd)
        os.close(null)
        for fd in cfg["fds"].values():
            os.close(fd)
        chunks = []
        while chunk := os.read(err_r, 4096):
            chunks.append(chunk)
        os.close(err_r)
        if chunks:
            os.waitpid(pid, 0)
            _send(status_fd, {"setup_error": b"".join(chunks).decode(errors="replace")})
            return 0
        _send(status_fd, {"started": pid})  # the caller's clean-up should this process die
        try:
            status, cut = _wait(pid, ctl_fd, start + cfg["wall_time_s"])
        except _Terminated:
            status, cut = None, "terminated"
        for sig in (signal.SIGTERM, signal.SIGHUP):  # from here on, finish the clean-up
            signal.signal(sig, signal.SIG_IGN)
        _kill_run(pid, uid, cgroup)
        if status is None:
            _, status = os.waitpid(pid, 0)
        duration = time.monotonic() - start
        oom = cgroup.oom_kills() if cgroup is not None else 0
        _send(
            status_fd,
            {"exit_code": _exit_code(status), "cut": cut, "oom_kills": oom, "duration_s": duration},
        )
    except Exception as exc:  # report it; the clean-up below still runs
        problems.append(f"supervisor: {exc!r}")
    finally:
        problems += _clean_up(cfg, uid, cgroup)
        _send(status_fd, {"cleanup_problems": problems})
    return 0


def _clean_up(cfg: dict, uid: int | None, cgroup: Cgroup | None) -> list[str]:
    problems = []
    steps = []
    if uid is not None:
        steps.append(("kill uid", lambda: kill_uid(uid)))
        if "mount" not in cfg["namespaces"]:
            steps.append(("sweep", lambda: sweep_dirs(uid, cfg["sweep_dirs"])))
        if "ipc" not in cfg["namespaces"]:
            steps.append(("sysv ipc", lambda: sweep_sysv_ipc(uid)))
    steps.append(("work dir", lambda: rmtree(cfg["workdir"])))
    if cgroup is not None:
        steps.append(("cgroup", cgroup.remove))
    for what, step in steps:
        try:
            step()
        except Exception as exc:
            problems.append(f"{what}: {exc!r}")
    return problems


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C to the trainer's group is not ours
    signal.signal(signal.SIGTERM, _on_terminate)
    signal.signal(signal.SIGHUP, _on_terminate)
    sys.exit(supervise(json.loads(sys.argv[1])))
