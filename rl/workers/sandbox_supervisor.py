"""The trusted supervisor of one sandboxed run, and the clean-up helpers it shares.

rl/workers/sandbox_run.py (``SandboxRun``, behind rl/workers/sandbox.py) starts this
file as ``python -I -S sandbox_supervisor.py CONFIG`` (stdlib only, so it needs no
site-packages and no repo on ``sys.path``), in a session of its own. The supervisor

1. creates the run's memory cgroup (when the probe found one it may create),
2. forks the child, which joins the cgroup, enters new user/network/IPC/mount
   namespaces, builds a minimal root on a size-capped tmpfs and chroots into it, sets
   rlimits, drops to the run's uid, sets no_new_privs and ``execve``s the program;
3. waits for the program's exit, the wall-clock deadline, a kill request from the
   caller on the control pipe, or the control pipe's EOF (the caller died: an env
   worker killed for a slow step), and then kills every process of the run (process
   group, uid, cgroup);
4. reports the exit status on the status pipe, removes the work dir (iteratively:
   the program may have made a tree thousands of levels deep), sweeps what the uid
   left in shared directories and SysV IPC when there was no namespace to drop it
   with, removes the cgroup, and reports the clean-up.

Because the supervisor, not the caller, holds the deadline, a run ends on time and
leaves nothing behind even when the process that started it is killed.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import re
import select
import signal
import sys
import time

_MS_RDONLY, _MS_NOSUID, _MS_NODEV = 0x1, 0x2, 0x4
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
_CLONE = {"user": 0x10000000, "net": 0x40000000, "ipc": 0x08000000, "mount": 0x00020000}
_SETUP_FAILED = 125
_DEVICES = ("null", "zero", "full", "random", "urandom")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_IPC_RMID = 0
_LOW_FDS = 64  # extra fds for the program go to numbers 3.._LOW_FDS-1

# ---- finding and killing a run's processes ----------------------------------------


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


def _kill_all(list_pids, what: str) -> None:
    """SIGKILL the pids ``list_pids()`` returns until it returns none."""
    for _ in range(400):
        pids = list_pids()
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.005)
    raise RuntimeError(f"could not kill the processes of {what}")


def kill_uid(uid: int) -> None:
    """SIGKILL every process of the run's uid until none is left (it cannot change uid)."""
    _kill_all(lambda: processes_of_uid(uid), f"sandbox uid {uid}")


def killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# ---- removing what a run left --------------------------------------------------------


def _clear_dir(fd: int) -> list[str]:
    """Unlink every non-directory in the open directory ``fd``; return its subdirectories."""
    try:
        os.fchmod(fd, 0o700)  # the program may have taken away our write/search bits
    except OSError:
        pass
    subdirs = []
    with os.scandir(fd) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                subdirs.append(entry.name)
                continue
            try:
                os.unlink(entry.name, dir_fd=fd)
            except FileNotFoundError:
                pass
    return subdirs


def _open_dir(name: str, dir_fd: int | None) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except PermissionError:
        os.chmod(name, 0o700, dir_fd=dir_fd)  # a directory (lstat said so), ours or we are root
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)


def rmtree(path: str) -> None:
    """Remove ``path`` and everything under it, without recursion or following symlinks.

    One directory is open at a time and the way back up is ``..``, checked against the
    (device, inode) seen on the way down, so a tree deeper than the recursion limit,
    ``PATH_MAX`` or the open-file limit goes like any other. Call it once nothing
    writes into the tree any more (the run's processes are dead).
    """
    try:
        fd = _open_dir(path, None)
    except FileNotFoundError:
        return
    except (NotADirectoryError, OSError) as exc:
        if os.path.islink(path) or not os.path.isdir(path):
            os.unlink(path)
            return
        raise exc
    # frames: (device and inode of the directory, its name in its parent, subdirs left)
    frames: list[tuple[tuple[int, int], str, list[str]]] = []
    try:
        st = os.fstat(fd)
        frames.append(((st.st_dev, st.st_ino), path, _clear_dir(fd)))
        while True:
            ident, name, pending = frames[-1]
            if pending:
                sub = pending.pop()
                try:
                    child = _open_dir(sub, fd)
                except FileNotFoundError:
                    continue
                except (NotADirectoryError, OSError):  # became a file or a symlink
                    os.unlink(sub, dir_fd=fd)
                    continue
                os.close(fd)
                fd = child
                st = os.fstat(fd)
                frames.append(((st.st_dev, st.st_ino), sub, _clear_dir(fd)))
                continue
            if len(frames) == 1:
                break
            parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
            st = os.fstat(parent)
            os.close(fd)
            fd = parent
            if (st.st_dev, st.st_ino) != frames[-2][0]:
                raise OSError(f"{path}: the tree changed while it was being removed")
            frames.pop()
            os.rmdir(name, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(path)


def sweep_dirs(uid: int, dirs: list[str]) -> None:
    """Remove what ``uid`` left at the top of the world-writable directories ``dirs``."""
    for top in dirs:
        try:
            entries = list(os.scandir(top))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    rmtree(entry.path)
                else:
                    os.unlink(entry.path)
            except OSError:
                pass


def sweep_sysv_ipc(uid: int) -> int:
    """Remove the SysV shared memory segments, message queues and semaphore sets that
    ``uid`` owns or created (for runs without an IPC namespace); returns how many."""
    libc = ctypes.CDLL(None, use_errno=True)
    removed = 0
    for kind, call in (("shm", libc.shmctl), ("msg", libc.msgctl), ("sem", libc.semctl)):
        try:
            with open(f"/proc/sysvipc/{kind}", encoding="ascii") as f:
                header, *rows = f.read().splitlines()
        except OSError:
            continue
        cols = header.split()
        for row in rows:
            fields = dict(zip(cols, row.split()))
            if uid in (int(fields.get("uid", -1)), int(fields.get("cuid", -1))):
                ipc_id = int(fields.get("shmid", fields.get("msqid", fields.get("semid", -1))))
                if kind == "sem":
                    ok = call(ipc_id, 0, _IPC_RMID) == 0
                else:
                    ok = call(ipc_id, _IPC_RMID, None) == 0
                removed += ok
    return removed


# ---- memory cgroups -------------------------------------------------------------------


class Cgroup:
    """One run's memory cgroup (v1 memory controller or v2), created under ``parent``."""

    def __init__(self, version: int, parent: str, name: str) -> None:
        self.version = version
        self.path = os.path.join(parent, name)

    def create(self, limit_bytes: int) -> None:
        os.mkdir(self.path, 0o755)
        if self.version == 2:
            self._write("memory.max", limit_bytes)
            self._write("memory.swap.max", 0, optional=True)
            self._write("memory.oom.group", 1, optional=True)
        else:
            self._write("memory.limit_in_bytes", limit_bytes)
            self._write("memory.memsw.limit_in_bytes", limit_bytes, optional=True)  # no swap

    def _write(self, name: str, value: int | str, optional: bool = False) -> None:
        try:
            with open(os.path.join(self.path, name), "w") as f:
                f.write(str(value))
        except FileNotFoundError:
            if not optional:
                raise

    def join(self, pid: int) -> None:
        self._write("cgroup.procs", pid)

    def pids(self) -> list[int]:
        try:
            with open(os.path.join(self.path, "cgroup.procs")) as f:
                return [int(line) for line in f if line.strip()]
        except FileNotFoundError:
            return []

    def kill(self) -> None:
        if self.version == 2 and os.path.exists(os.path.join(self.path, "cgroup.kill")):
            self._write("cgroup.kill", 1)
        _kill_all(self.pids, f"cgroup {self.path}")

    def oom_kills(self) -> int:
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            with open(os.path.join(self.path, name)) as f:
                m = re.search(r"^oom_kill (\d+)", f.read(), re.M)
        except OSError:
            return 0
        return int(m.group(1)) if m else 0

    def remove(self) -> None:
        for _ in range(200):  # the last task's exit is seen a moment after it is reaped
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.005)
        os.rmdir(self.path)


def find_memory_cgroup() -> tuple[int, str] | tuple[None, str]:
    """(version, directory) of this process's memory cgroup when a child can be made
    there with a memory limit, else (None, why not)."""
    try:
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f]
        with open("/proc/self/cgroup") as f:
            memberships = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError as exc:
        return None, f"cannot read /proc: {exc}"
    reasons = []
    for _, controllers, path in memberships:  # v1 first: on a hybrid host v2 has no memory
        if "memory" in controllers.split(","):
            found = _mounted_at(mounts, "cgroup", path, "memory")
            if found and os.access(found, os.W_OK) and \
                    os.path.exists(os.path.join(found, "memory.limit_in_bytes")):
                return 1, found
            reasons.append(f"cgroup v1 memory {found or path}: not writable")
    for _, controllers, path in memberships:
        if controllers == "":
            found = _mounted_at(mounts, "cgroup2", path, None)
            if found is None:
                continue
            why = _v2_memory_delegated(found)
            if why is None:
                return 2, found
            reasons.append(f"cgroup v2 {found}: {why}")
    return None, "; ".join(reasons) or "no memory cgroup mounted"


def _mounted_at(mounts: list[list[str]], fstype: str, path: str, option: str | None) -> str | None:
    for fields in mounts:
        sep = fields.index("-")
        if fields[sep + 1] != fstype:
            continue
        if option is not None and option not in fields[sep + 3].split(","):
            continue
        root, point = fields[3], fields[4]
        if root == "/" or path == root or path.startswith(root.rstrip("/") + "/"):
            rel = path if root == "/" else path[len(root):]
            return os.path.normpath(point + "/" + rel.lstrip("/"))
    return None


def _v2_memory_delegated(path: str) -> str | None:
    """None when children of ``path`` get the memory controller, else why not."""
    try:
        with open(os.path.join(path, "cgroup.subtree_control")) as f:
            if "memory" in f.read().split():
                return None if os.access(path, os.W_OK) else "not writable"
        with open(os.path.join(path, "cgroup.subtree_control"), "w") as f:
            f.write("+memory")  # refused (EBUSY) while this cgroup holds processes
        return None
    except OSError as exc:
        return f"cannot enable the memory controller for children ({exc.strerror})"


# ---- the child: namespaces, root, limits, exec ----------------------------------------


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def _mount(libc, src: str | None, dst: str, fstype: str | None, flags: int,
           data: str | None = None) -> None:
    def enc(text: str | None) -> bytes | None:
        return None if text is None else text.encode()

    _check(libc.mount(enc(src), enc(dst), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {src or fstype} on {dst}")


def _write_proc(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _bound_ipc(memory_bytes: int) -> None:
    """Per-namespace SysV limits: shared memory totals at most the run's memory."""
    page = os.sysconf("SC_PAGE_SIZE")
    for name, value in (("kernel/shmmax", memory_bytes), ("kernel/shmall", memory_bytes // page),
                        ("kernel/shmmni", 64), ("kernel/msgmni", 16),
                        ("fs/mqueue/queues_max", 16)):
        _write_proc("/proc/sys/" + name, str(value))


def _build_root(libc, cfg: dict) -> str:
    """A tmpfs root with the interpreter's directories read-only, private /tmp and
    /dev/shm, a few device nodes and the run's files in /work; returns its path."""
    root = os.path.join(cfg["workdir"], ".root")
    os.mkdir(root, 0o700)
    _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE)
    _mount(libc, "tmpfs", root, "tmpfs", _MS_NOSUID | _MS_NODEV,
           f"size={cfg['memory_bytes']},mode=755")
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
        _mount(libc, None, inside, None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID
               | _MS_NODEV)
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
    for name, text in (("passwd", f"root:x:0:0::/:/bin/false\nsandbox:x:{uid}:{gid}::/work:"
                                  "/bin/false\n"),
                       ("group", f"root:x:0:\nsandbox:x:{gid}:\n"),
                       ("hosts", "127.0.0.1 localhost\n")):
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
            with open(os.path.join(dirpath, name), "rb") as fin, \
                    open(os.path.join(target, name), "wb") as fout:
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
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                               ("gid_map", f"{gid} {gid} 1")):
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
            ready, _, _ = select.select(watch, [], [], left if pidfd is not None else
                                        min(left, 0.02))
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
        cgroup = Cgroup(cfg["cgroup"]["version"], cfg["cgroup"]["parent"],
                        f"tandem-sbx-{os.getpid()}-{uid or 0}")
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
        _send(status_fd, {"exit_code": _exit_code(status), "cut": cut, "oom_kills": oom,
                          "duration_s": duration})
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
