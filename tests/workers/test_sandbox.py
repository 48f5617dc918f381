"""Tests for rl/workers/sandbox.py: each hostile program is stopped, leaves nothing behind and
leaves the trainer (this pytest process) as it was."""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rl.workers.env_pool import EnvPool
from rl.workers.sandbox import (
    SandboxError,
    SandboxLimits,
    SandboxResult,
    processes_of_uid,
    run_python,
    sandbox_capabilities,
)
from tests.fixtures import trainer_unaffected  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("trainer_unaffected")  # tests/fixtures.py
REPO = Path(__file__).resolve().parents[2]
FAST = SandboxLimits(cpu_time_s=1, wall_time_s=3.0)
PRINT_UID = "import os, sys\nprint('uid', os.getuid(), flush=True)\n"


@pytest.fixture
def temp_root() -> Iterator[str]:
    """A world-searchable temp root (a per-run uid must reach its work dir in it);
    the test fails if a run leaves anything in it."""
    root = tempfile.mkdtemp(prefix="tandem-sbx-test-")
    os.chmod(root, 0o711)
    try:
        yield root
        assert os.listdir(root) == [], "sandbox left files in the temp root"
    finally:
        for name in os.listdir(root):
            subprocess.run(["rm", "-rf", os.path.join(root, name)], check=False)
        os.rmdir(root)


def _uid_of(res: SandboxResult) -> int:
    first = res.stdout.splitlines()[0].split()
    assert first[0] == "uid", res
    return int(first[1])


def _assert_no_processes_left(res: SandboxResult) -> None:
    if sandbox_capabilities().privilege_drop:
        assert processes_of_uid(_uid_of(res)) == []


# What each plan leaves out: "no-namespaces" is the fallback of a machine that refuses
# namespaces and cgroups (uid, rlimits and sweeps only), "no-cgroup" one without a
# memory cgroup it may create.
PLANS = {"default": (), "no-cgroup": ("cgroup",),
         "no-namespaces": ("cgroup", "ipc", "mount")}


def _run(code: str, plan: str, **kwargs) -> SandboxResult:
    """run_python on this machine's plan, or on a plan with some mechanisms left out."""
    if plan == "default":
        return run_python(code, **kwargs)
    from rl.workers.sandbox import _plan_without, start_python

    return start_python(code, _plan=_plan_without(*PLANS[plan]), **kwargs).wait()


def test_normal_program_stdout_and_exit_code(temp_root: str) -> None:
    res = run_python("import sys\nprint('hello', 6 * 7)\nsys.exit(3)", temp_dir=temp_root)
    assert res.stdout == "hello 42\n"
    assert res.exit_code == 3
    assert not res.timed_out and res.limit_hit is None
    assert res.duration_s < 5


def test_stderr_and_traceback(temp_root: str) -> None:
    res = run_python("raise ValueError('boom')", temp_dir=temp_root)
    assert res.exit_code == 1 and res.limit_hit is None
    assert "ValueError: boom" in res.stderr


def test_stdin_is_given_and_otherwise_empty(temp_root: str) -> None:
    code = "import sys\ndata = sys.stdin.read()\nprint(len(data), data.upper())"
    assert run_python(code, stdin="abc\nxyz", temp_dir=temp_root).stdout == "7 ABC\nXYZ\n"
    assert run_python(code, temp_dir=temp_root).stdout == "0 \n"


def test_files_are_written_and_importable(temp_root: str) -> None:
    res = run_python("import helper\nprint(helper.X, open('data/in.txt').read())",
                     files={"helper.py": "X = 5\n", "data/in.txt": "payload"},
                     temp_dir=temp_root)
    assert res.stdout == "5 payload\n", res


@pytest.mark.parametrize("name", ["/etc/x", "../x", "a/../../x", "main.py"])
def test_bad_file_names_are_rejected(temp_root: str, name: str) -> None:
    with pytest.raises(ValueError):
        run_python("pass", files={name: ""}, temp_dir=temp_root)


def test_infinite_loop_is_stopped(temp_root: str) -> None:
    res = run_python(PRINT_UID + "while True:\n    pass", limits=FAST, temp_dir=temp_root)
    assert res.limit_hit in ("cpu", "wall")
    assert res.exit_code < 0
    assert res.duration_s < FAST.wall_time_s + 2
    _assert_no_processes_left(res)


def test_sleeping_program_hits_wall_time(temp_root: str) -> None:
    limits = SandboxLimits(cpu_time_s=5, wall_time_s=1.0)
    res = run_python(PRINT_UID + "import time\ntime.sleep(60)", limits=limits,
                     temp_dir=temp_root)
    assert res.timed_out and res.limit_hit == "wall"
    assert res.stdout.startswith("uid ")  # output before the kill is kept
    assert 1.0 <= res.duration_s < 3.0
    _assert_no_processes_left(res)


def test_ignoring_sigxcpu_still_ends_at_hard_cpu_limit(temp_root: str) -> None:
    code = PRINT_UID + "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\n" \
        "while True:\n    pass"
    res = run_python(code, limits=SandboxLimits(cpu_time_s=1, wall_time_s=6.0),
                     temp_dir=temp_root)
    assert res.limit_hit == "cpu" and res.exit_code == -9
    assert res.duration_s < 4


def test_fork_bomb_is_contained(temp_root: str) -> None:
    if not sandbox_capabilities().privilege_drop:
        pytest.skip("not root: RLIMIT_NPROC would count this user's own processes too")
    limits = SandboxLimits(cpu_time_s=2, wall_time_s=4.0, max_processes=16)
    res = run_python(PRINT_UID + "while True:\n    os.fork()", limits=limits,
                     temp_dir=temp_root)
    assert res.limit_hit in ("nproc", "wall", "cpu"), res
    assert res.duration_s < limits.wall_time_s + 2
    _assert_no_processes_left(res)


def test_setsid_escapee_is_killed(temp_root: str) -> None:
    if not sandbox_capabilities().privilege_drop:
        pytest.skip("not root: a child that calls setsid() can outlive the run")
    code = PRINT_UID + (
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    os.closerange(0, 3)\n"
        "    import time\n"
        "    time.sleep(60)\n"
        "print('parent done')\n"
    )
    res = run_python(code, limits=FAST, temp_dir=temp_root)
    assert res.exit_code == 0 and "parent done" in res.stdout
    assert res.duration_s < 2
    _assert_no_processes_left(res)


def test_memory_bomb_hits_memory_limit(temp_root: str) -> None:
    res = run_python(PRINT_UID + "x = bytearray(10 * 1024**3)\nprint('allocated')",
                     limits=FAST, temp_dir=temp_root)
    assert res.limit_hit == "memory", res
    assert "MemoryError" in res.stderr and "allocated" not in res.stdout
    _assert_no_processes_left(res)


def test_huge_file_hits_fsize(temp_root: str) -> None:
    code = PRINT_UID + "with open('big', 'wb') as f:\n    while True:\n" \
        "        f.write(b'x' * 1024 * 1024)"
    res = run_python(code, limits=SandboxLimits(max_file_mb=2, wall_time_s=5.0),
                     temp_dir=temp_root)
    assert res.limit_hit == "fsize", res
    assert "File too large" in res.stderr


def test_output_flood_is_truncated(temp_root: str) -> None:
    limits = SandboxLimits(max_output_bytes=4096, wall_time_s=5.0)
    res = run_python("while True:\n    print('y' * 100)", limits=limits, temp_dir=temp_root)
    assert res.limit_hit == "output"
    assert len(res.stdout.encode()) == 4096
    assert res.duration_s < 3


def test_stderr_flood_is_truncated(temp_root: str) -> None:
    limits = SandboxLimits(max_output_bytes=1000, wall_time_s=5.0)
    res = run_python("import sys\nwhile True:\n    sys.stderr.write('e' * 100)",
                     limits=limits, temp_dir=temp_root)
    assert res.limit_hit == "output" and len(res.stderr) == 1000


def test_cannot_write_outside_work_dir(temp_root: str) -> None:
    if not sandbox_capabilities().privilege_drop:
        pytest.skip("not root: the child runs as the trainer's own uid and may write "
                    "where the trainer may")
    targets = [os.getcwd(), str(REPO), str(REPO / "rl"), "/root", "/etc", "/usr/lib",
               temp_root]
    code = (
        "import os, sys\n"
        f"targets = {targets!r}\n"
        "for d in targets:\n"
        "    p = os.path.join(d, 'tandem_sandbox_escape.txt')\n"
        "    try:\n"
        "        open(p, 'w').write('x')\n"
        "        print('WROTE', p)\n"
        "    except OSError:  # PermissionError, or FileNotFoundError in a minimal root\n"
        "        print('denied', d)\n"
        "open('inside.txt', 'w').write('ok')\n"
        "print('inside', open('inside.txt').read())\n"
    )
    res = run_python(code, limits=FAST, temp_dir=temp_root)
    assert "WROTE" not in res.stdout, res.stdout
    assert res.stdout.count("denied") == len(targets)
    assert "inside ok" in res.stdout
    for d in targets:
        assert not os.path.exists(os.path.join(d, "tandem_sandbox_escape.txt"))


def test_files_left_in_tmp_are_swept(temp_root: str) -> None:
    if not sandbox_capabilities().privilege_drop:
        pytest.skip("not root: files in /tmp cannot be told apart from the trainer's")
    res = run_python(PRINT_UID + "import os\nname = f'/tmp/tandem-litter-{os.getuid()}'\n"
                     "open(name, 'w').write('x')\nos.mkdir(name + '.d')\nprint(name)",
                     limits=FAST, temp_dir=temp_root)
    name = res.stdout.split()[-1]
    assert name.startswith("/tmp/tandem-litter-")
    assert not os.path.exists(name) and not os.path.exists(name + ".d")


def test_parent_environment_is_not_visible(temp_root: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_TEST_SECRET", "hunter2-do-not-leak")
    code = (
        "import os\n"
        "print(sorted(os.environ))\n"
        "print('SECRET' if 'hunter2' in repr(dict(os.environ)) else 'clean')\n"
        "try:\n"
        "    data = open(f'/proc/{os.getppid()}/environ', 'rb').read()\n"
        "    print('PARENT-ENV-SECRET' if b'hunter2' in data else 'parent-env-readable')\n"
        "except OSError as e:\n"
        "    print('parent-env-denied')\n"
    )
    res = run_python(code, limits=FAST, temp_dir=temp_root)
    lines = res.stdout.splitlines()
    assert lines[0] == "['HOME', 'LANG', 'PATH', 'TMPDIR']", res
    assert lines[1] == "clean"
    if sandbox_capabilities().privilege_drop:
        assert lines[2] == "parent-env-denied"


def _require_network_isolation() -> None:
    caps = sandbox_capabilities()
    if not caps.network_isolated:
        pytest.skip("no network namespace here: " + "; ".join(caps.notes))


def test_cannot_connect_to_parent_on_loopback(temp_root: str) -> None:
    _require_network_isolation()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.setblocking(False)
        port = server.getsockname()[1]
        code = (
            "import socket\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "    print('CONNECTED')\n"
            "except OSError as e:\n"
            "    print('blocked', e.errno)\n"
        )
        res = run_python(code, limits=FAST, temp_dir=temp_root)
        assert res.stdout.startswith("blocked"), res
        with pytest.raises(BlockingIOError):
            server.accept()


def test_cannot_reach_public_network(temp_root: str) -> None:
    _require_network_isolation()
    code = (
        "import socket\n"
        "for host in ('1.1.1.1', '8.8.8.8'):\n"
        "    try:\n"
        "        socket.create_connection((host, 53), timeout=1)\n"
        "        print('CONNECTED', host)\n"
        "    except OSError as e:\n"
        "        print('blocked', host)\n"
        "print(socket.if_nameindex())\n"
    )
    res = run_python(code, limits=FAST, temp_dir=temp_root)
    assert "CONNECTED" not in res.stdout
    assert res.stdout.count("blocked") == 2
    assert "'lo'" in res.stdout and "eth" not in res.stdout


def test_concurrent_runs_from_threads(temp_root: str) -> None:
    results: list[SandboxResult] = []

    def work(i: int) -> None:
        results.append(run_python(PRINT_UID + f"print({i} * 2)", limits=FAST,
                                  temp_dir=temp_root))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.stdout.splitlines()[1] for r in results) == ["0", "2", "4", "6"]
    if sandbox_capabilities().privilege_drop:
        assert len({_uid_of(r) for r in results}) == 4  # one uid per run


def test_unreachable_temp_dir_is_refused(tmp_path: Path) -> None:
    if not sandbox_capabilities().privilege_drop:
        pytest.skip("not root: no uid change, so the work dir is always reachable")
    hidden = tmp_path / "hidden"
    hidden.mkdir(mode=0o700)
    with pytest.raises(SandboxError, match="not searchable"):
        _run("pass", "no-namespaces", temp_dir=str(hidden))
    if sandbox_capabilities().mount_namespace:  # the program never sees the staging dir
        assert run_python("print(6 * 7)", temp_dir=str(hidden)).stdout == "42\n"
    assert os.listdir(hidden) == []


@pytest.mark.parametrize("plan", ["default", "no-namespaces"])
@pytest.mark.parametrize("numbers", ["low", "swapped"])
def test_extra_fds_reach_the_program_at_their_numbers(temp_root: str, plan: str,
                                                      numbers: str) -> None:
    to_child_r, to_child_w = os.pipe()
    from_child_r, from_child_w = os.pipe()
    os.write(to_child_w, b"ping")
    os.close(to_child_w)
    # "low": the numbers the code reward uses; "swapped": each target is the number of
    # the other source in the caller
    out_fd, in_fd = (3, 4) if numbers == "low" else (to_child_r, from_child_w)
    assert max(out_fd, in_fd) < 64
    code = f"import os\nos.write({out_fd}, os.read({in_fd}, 10).upper())"
    res = _run(code, plan, limits=FAST, temp_dir=temp_root,
               fds={out_fd: from_child_w, in_fd: to_child_r})
    os.close(from_child_w)
    os.close(to_child_r)
    assert os.read(from_child_r, 10) == b"PING", res
    os.close(from_child_r)
    with pytest.raises(ValueError, match="3..63"):
        run_python("pass", fds={1: from_child_r})


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="wall_time_s"):
        SandboxLimits(wall_time_s=0)


# ---- nothing outlives a run; memory is bounded (issue 29) ---------------------------

_IPC_LITTER = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
print('shm', libc.shmget({key}, 64 << 20, 0o1000 | 0o666))  # IPC_CREAT
print('mq', libc.mq_open({mq!r}.encode(), os.O_CREAT | os.O_RDWR, 0o666, None))
try:
    open({lock!r}, 'w').write('x')
    print('lock written')
except OSError as e:
    print('no lock dir', e.errno)
"""


@pytest.mark.parametrize("plan", ["default", "no-namespaces"])
def test_ipc_objects_and_lock_files_do_not_outlive_the_run(temp_root: str, plan: str) -> None:
    if not sandbox_capabilities().privilege_drop:
        pytest.skip("not root: the run's objects cannot be told apart from the trainer's")
    libc = ctypes.CDLL(None, use_errno=True)
    key = secrets.randbelow(1 << 30) + 1
    tag = secrets.token_hex(6)
    mq, lock = f"/tandem-test-{tag}", f"/run/lock/tandem-test-{tag}"
    res = _run(_IPC_LITTER.format(key=key, mq=mq, lock=lock), plan, limits=FAST,
               temp_dir=temp_root)
    assert int(res.stdout.split("shm ")[1].split()[0]) >= 0, res  # the run did make them
    assert int(res.stdout.split("mq ")[1].split()[0]) >= 0, res
    left = []
    shmid = libc.shmget(key, 0, 0)
    if shmid >= 0:
        left.append("SysV shm segment")
        libc.shmctl(shmid, 0, None)  # IPC_RMID
    if os.path.exists(lock):
        left.append(lock)
        os.unlink(lock)
    mqd = libc.mq_open(mq.encode(), os.O_RDONLY)
    if mqd >= 0:
        libc.mq_close(mqd)
        libc.mq_unlink(mq.encode())
        if plan == "default" and sandbox_capabilities().ipc_namespace:
            left.append("POSIX message queue")  # without an IPC namespace: not swept
    assert left == [], f"outlived the run: {left}"


_FILL = """
import ctypes, os
chunk = b'x' * (16 << 20)
{setup}
written = 0
try:
    while written < (1 << 30):
        grow()
        written += len(chunk)
        print(written >> 20, flush=True)
except OSError as e:
    print('stopped', e.errno, flush=True)
"""
_WRITE_FD = "fd = {}\ngrow = lambda: os.write(fd, chunk)"
_FILL_KINDS = {
    "dev-shm": _WRITE_FD.format("os.open('/dev/shm/fill', os.O_CREAT | os.O_WRONLY, 0o600)"),
    "tmp": _WRITE_FD.format("os.open('/tmp/fill', os.O_CREAT | os.O_WRONLY, 0o600)"),
    "memfd": _WRITE_FD.format("os.memfd_create('fill')"),
    "sysv-shm": (  # segments written and detached: they stay until IPC_RMID or the namespace ends
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "libc.shmat.restype = ctypes.c_void_p\n"
        "def grow():\n"
        "    sid = libc.shmget(0, len(chunk), 0o1000 | 0o600)\n"
        "    if sid < 0:\n"
        "        raise OSError(ctypes.get_errno(), 'shmget')\n"
        "    addr = libc.shmat(sid, None, 0)\n"
        "    ctypes.memmove(addr, chunk, len(chunk))\n"
        "    libc.shmdt(ctypes.c_void_p(addr))\n"),
}


@pytest.mark.parametrize("kind", list(_FILL_KINDS))
@pytest.mark.parametrize("plan", ["default", "no-cgroup"])
def test_shared_memory_files_and_memfd_are_bounded(temp_root: str, plan: str, kind: str) -> None:
    caps = sandbox_capabilities()
    cgroup = plan == "default" and caps.memory_cgroup
    if kind == "memfd" and not cgroup:
        pytest.skip("memfd pages are bounded only by a memory cgroup")
    if kind in ("dev-shm", "tmp") and not (caps.mount_namespace or cgroup):
        pytest.skip("needs a private tmpfs (mount namespace) or a memory cgroup")
    if kind == "sysv-shm" and not ((caps.ipc_namespace and caps.running_as_root) or cgroup):
        pytest.skip("needs an IPC namespace as root (capped shmall) or a memory cgroup")
    limits = SandboxLimits(memory_mb=256, max_file_mb=4096, wall_time_s=20.0)
    res = _run(_FILL.format(setup=_FILL_KINDS[kind]), plan, limits=limits, temp_dir=temp_root)
    sizes = [int(line) for line in res.stdout.split() if line.isdigit()]
    assert sizes and max(sizes) <= 256, (max(sizes, default=0), res.stderr[-300:])
    assert res.limit_hit == "memory" or "stopped 28" in res.stdout, res  # OOM kill or ENOSPC


def _descendants(pid: int) -> dict[int, str]:
    """pid -> start time of every live descendant of ``pid``."""
    children: dict[int, list[int]] = {}
    starts: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(entry))
                starts[int(entry)] = fields[19]
    out, todo = {}, [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out[child] = starts[child]
            todo.append(child)
    return out


def _alive(pids: dict[int, str]) -> list[int]:
    return [pid for pid, start in pids.items() if _start_time(pid) == start]


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]


def _start_long_run_and_report(report: str, temp_root: str) -> None:
    """An env-pool task: start a 600 s run, write its processes' pids, then wait on it."""
    limits = SandboxLimits(cpu_time_s=5, wall_time_s=120.0)
    sandbox_capabilities()  # the probe's runs are over before the run to watch starts
    threading.Thread(target=run_python, args=("import time\ntime.sleep(600)",),
                     kwargs={"limits": limits, "temp_dir": temp_root}, daemon=True).start()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        procs = _descendants(os.getpid())
        if any(os.stat(f"/proc/{p}").st_uid >= 1_600_000_000 for p in procs
               if os.path.exists(f"/proc/{p}")):
            with open(report, "w") as f:
                json.dump(procs, f)
            break
        time.sleep(0.05)
    time.sleep(600)


def test_run_ends_when_the_env_worker_running_it_is_killed(temp_root: str,
                                                           tmp_path: Path) -> None:
    if not sandbox_capabilities().privilege_drop:
        pytest.skip("not root: the test finds the run by its uid")
    report = tmp_path / "pids.json"
    pids: dict[int, str] = {}
    try:
        with EnvPool(1, step_timeout_s=4.0) as pool:
            pool.wait_ready()
            pool.submit(_start_long_run_and_report, str(report), temp_root)
            (out,) = pool.poll(None)
            assert out.status == "timeout"
            pids = {int(p): s for p, s in json.loads(report.read_text()).items()}
            deadline = time.monotonic() + 5.0
            while _alive(pids) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _alive(pids) == [], "the run outlived the worker that started it"
            while os.listdir(temp_root) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert os.listdir(temp_root) == [], "the work dir outlived the worker"
    finally:
        for pid in _alive(pids):
            os.kill(pid, signal.SIGKILL)


_DEEP_TREE = """
import os
for top in ('.', '/tmp'):
    os.chdir(top)
    for _ in range(1500):  # deeper than the recursion limit and (3 bytes a level) PATH_MAX
        os.mkdir('dd')
        os.chdir('dd')
    open('leaf', 'w').write('x')
print('deep')
"""


@pytest.mark.parametrize("plan", ["default", "no-namespaces"])
def test_deep_directory_tree_is_removed(temp_root: str, plan: str) -> None:
    res = _run(_DEEP_TREE, plan, limits=SandboxLimits(wall_time_s=20.0), temp_dir=temp_root)
    assert res.stdout == "deep\n", res
    # temp_root's teardown checks that the work dir is gone; and /tmp/d is swept:
    if sandbox_capabilities().privilege_drop and os.path.exists("/tmp/dd"):
        assert os.stat("/tmp/dd").st_uid < 1_600_000_000, "/tmp/dd outlived the run"


def test_rmtree_is_iterative(tmp_path: Path) -> None:
    from rl.workers.sandbox_supervisor import rmtree

    top = tmp_path / "top"
    top.mkdir()
    fd = os.open(top, os.O_RDONLY)
    for i in range(1500):  # deeper than the recursion limit and (3 bytes a level) PATH_MAX
        os.mkdir("dd", dir_fd=fd)
        if i % 100 == 0:
            os.mkdir("side", dir_fd=fd)
            os.symlink("/etc", "link", dir_fd=fd)
        if i == 1200:  # a directory the program made unreadable, with a file inside
            os.mkdir("locked", dir_fd=fd)
            os.close(os.open("locked/f", os.O_CREAT | os.O_WRONLY, dir_fd=fd))
            os.chmod("locked", 0, dir_fd=fd)
        nxt = os.open("dd", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = nxt
    os.close(fd)
    rmtree(str(top))
    assert not top.exists() and os.path.exists("/etc/passwd")


def test_trainer_unix_socket_is_not_reachable(temp_root: str) -> None:
    if not sandbox_capabilities().mount_namespace:
        pytest.skip("no mount namespace here: the program sees the trainer's files")
    public = tempfile.mkdtemp(prefix="tandem-sock-")  # every parent searchable
    os.chmod(public, 0o755)
    path = os.path.join(public, "trainer.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(path)
        os.chmod(path, 0o777)
        server.listen(1)
        server.setblocking(False)
        code = (
            "import os, socket\n"
            "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
            "try:\n"
            f"    s.connect({path!r})\n"
            "    print('CONNECTED')\n"
            "except OSError as e:\n"
            "    print('blocked', e.errno)\n"
            f"print(sorted(os.listdir('/')))\n"
        )
        try:
            res = run_python(code, limits=FAST, temp_dir=temp_root)
        finally:
            os.unlink(path)
            os.rmdir(public)
        assert res.stdout.startswith("blocked"), res
        assert "'root'" not in res.stdout and "'work'" in res.stdout
        with pytest.raises(BlockingIOError):
            server.accept()
