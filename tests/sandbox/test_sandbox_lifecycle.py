"""Tests for tandem/rl/sandbox/__init__.py: nothing outlives a run (issue 29). Processes (a
``setsid`` escapee, a run whose env worker is killed), files left in /tmp, IPC objects and
lock files, and directory trees deeper than the recursion limit."""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import signal
import threading
import time
from pathlib import Path

import pytest

from tandem.rl.sandbox import SandboxLimits, run_python, sandbox_capabilities
from tandem.rl.workers.env_pool import EnvPool
from tests.fixtures import trainer_unaffected  # noqa: F401  (a fixture)
from tests.sandbox.sandbox_helpers import FAST, PRINT_UID, _assert_no_processes_left, _run

pytestmark = pytest.mark.usefixtures("trainer_unaffected")  # tests/fixtures.py


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


def test_files_left_in_tmp_are_swept(temp_root: str) -> None:
    if not sandbox_capabilities().privilege_drop:
        pytest.skip("not root: files in /tmp cannot be told apart from the trainer's")
    res = run_python(
        PRINT_UID + "import os\nname = f'/tmp/tandem-litter-{os.getuid()}'\n"
        "open(name, 'w').write('x')\nos.mkdir(name + '.d')\nprint(name)",
        limits=FAST,
        temp_dir=temp_root,
    )
    name = res.stdout.split()[-1]
    assert name.startswith("/tmp/tandem-litter-")
    assert not os.path.exists(name) and not os.path.exists(name + ".d")


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
    res = _run(_IPC_LITTER.format(key=key, mq=mq, lock=lock), plan, limits=FAST, temp_dir=temp_root)
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
    threading.Thread(
        target=run_python,
        args=("import time\ntime.sleep(600)",),
        kwargs={"limits": limits, "temp_dir": temp_root},
        daemon=True,
    ).start()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        procs = _descendants(os.getpid())
        if any(
            os.stat(f"/proc/{p}").st_uid >= 1_600_000_000
            for p in procs
            if os.path.exists(f"/proc/{p}")
        ):
            with open(report, "w") as f:
                json.dump(procs, f)
            break
        time.sleep(0.05)
    time.sleep(600)


def test_run_ends_when_the_env_worker_running_it_is_killed(temp_root: str, tmp_path: Path) -> None:
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
    from tandem.rl.sandbox.cleanup import rmtree

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


# The program and a child of its own report their pids on fd 3, then sleep past any deadline.
_SLEEPER = (
    "import os, time\n"
    "child = os.fork()\n"
    "if child == 0:\n    time.sleep(60)\n    os._exit(0)\n"
    "os.write(3, f'{os.getpid()} {child}\\n'.encode())\n"
    "time.sleep(60)\n"
)


@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_a_killed_or_frozen_supervisor_leaves_nothing(
    temp_root: str, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILL of the supervisor (as the OOM killer would): its program dies with it
    (PR_SET_PDEATHSIG) and the caller, whose status pipe closed without a status, kills the
    run's uid and removes the work dir and the cgroup; no process, work dir or cgroup is left
    a second after the kill. A frozen (SIGSTOP) supervisor: the caller's backstop does the
    same at the deadline."""
    from tandem.rl import sandbox
    from tandem.rl.sandbox import SandboxError, processes_of_uid, start_python
    from tandem.rl.sandbox import run as run_mod

    if not sandbox_capabilities().privilege_drop:
        pytest.skip("not root: the test finds the run by its uid")
    monkeypatch.setattr(run_mod, "_BACKSTOP_S", 0.5)
    wall = 30.0 if how == "killed" else 1.0
    plan = sandbox._machine_plan

    def cgroups() -> set[str]:
        return (
            set()
            if plan.cgroup is None
            else {e.path for e in os.scandir(plan.cgroup[1]) if e.name.startswith("tandem-sbx-")}
        )

    before = cgroups()
    r, w = os.pipe()
    run = start_python(
        _SLEEPER,
        limits=SandboxLimits(cpu_time_s=5, wall_time_s=wall),
        temp_dir=temp_root,
        fds={3: w},
    )
    os.close(w)
    pids = [int(p) for p in os.read(r, 100).split()]  # the program and its child are running
    os.close(r)
    starts = {pid: _start_time(pid) for pid in pids}
    ours = sorted(cgroups() - before)
    assert len(ours) == (plan.cgroup is not None)
    os.kill(run._proc.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    t0 = time.monotonic()
    if how == "killed":  # the program dies with its supervisor, before the caller looks
        program = {pids[0]: starts[pids[0]]}
        while _alive(program) and time.monotonic() < t0 + 1.0:
            time.sleep(0.01)
        assert _alive(program) == [], "the program outlived its supervisor"
    with pytest.raises(SandboxError, match="sandbox supervisor (died|did not report)"):
        run.wait()
    if how == "frozen":
        assert time.monotonic() - t0 < wall + 0.5 + 2.0
        t0 = time.monotonic()
    left: list[str] = []
    while time.monotonic() < t0 + 1.0:
        left = (
            [f"pid {p}" for p in _alive(starts)]
            + [f"uid process {p}" for p in processes_of_uid(run._uid)]
            + [p for p in [run._workdir, *ours] if os.path.exists(p)]
        )
        if not left:
            break
        time.sleep(0.02)
    assert left == [], f"left a second after the supervisor {how}: {left}"
