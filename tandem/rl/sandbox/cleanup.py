"""Finding, killing and cleaning up after a sandboxed run's processes, and its memory cgroup.

Stdlib only: the trusted supervisor (tandem/rl/sandbox/supervisor.py, run as
``python -I -S`` with no site-packages) imports this file from its own folder, and the
trainer's side (the probe in tandem/rl/sandbox/__init__.py, `SandboxRun`) imports it as a
package module for the same clean-up.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import time

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_IPC_RMID = 0


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
            if (
                found
                and os.access(found, os.W_OK)
                and os.path.exists(os.path.join(found, "memory.limit_in_bytes"))
            ):
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
            rel = path if root == "/" else path[len(root) :]
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
