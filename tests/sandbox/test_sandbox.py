"""Tests for tandem/rl/sandbox/__init__.py: a program's input and output, its limits (CPU and
wall time, processes, memory, file size, output) and the validation of what a run is
given. Each hostile program is stopped, leaves nothing behind and leaves the trainer (this
pytest process) as it was. What a run cannot reach: test_sandbox_isolation.py; what must
not outlive it: test_sandbox_lifecycle.py."""

from __future__ import annotations

import os
import threading

import pytest

from tandem.rl.sandbox import SandboxLimits, SandboxResult, run_python, sandbox_capabilities
from tests.fixtures import trainer_unaffected  # noqa: F401  (a fixture)
from tests.sandbox.sandbox_helpers import FAST, PRINT_UID, _assert_no_processes_left, _run, _uid_of

pytestmark = pytest.mark.usefixtures("trainer_unaffected")  # tests/fixtures.py


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
    res = run_python(
        "import helper\nprint(helper.X, open('data/in.txt').read())",
        files={"helper.py": "X = 5\n", "data/in.txt": "payload"},
        temp_dir=temp_root,
    )
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
    res = run_python(PRINT_UID + "import time\ntime.sleep(60)", limits=limits, temp_dir=temp_root)
    assert res.timed_out and res.limit_hit == "wall"
    assert res.stdout.startswith("uid ")  # output before the kill is kept
    assert 1.0 <= res.duration_s < 3.0
    _assert_no_processes_left(res)


def test_ignoring_sigxcpu_still_ends_at_hard_cpu_limit(temp_root: str) -> None:
    code = (
        PRINT_UID + "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\n"
        "while True:\n    pass"
    )
    res = run_python(code, limits=SandboxLimits(cpu_time_s=1, wall_time_s=6.0), temp_dir=temp_root)
    assert res.limit_hit == "cpu" and res.exit_code == -9
    assert res.duration_s < 4


def test_fork_bomb_is_contained(temp_root: str) -> None:
    if not sandbox_capabilities().privilege_drop:
        pytest.skip("not root: RLIMIT_NPROC would count this user's own processes too")
    limits = SandboxLimits(cpu_time_s=2, wall_time_s=4.0, max_processes=16)
    res = run_python(PRINT_UID + "while True:\n    os.fork()", limits=limits, temp_dir=temp_root)
    assert res.limit_hit in ("nproc", "wall", "cpu"), res
    assert res.duration_s < limits.wall_time_s + 2
    _assert_no_processes_left(res)


def test_memory_bomb_hits_memory_limit(temp_root: str) -> None:
    res = run_python(
        PRINT_UID + "x = bytearray(10 * 1024**3)\nprint('allocated')",
        limits=FAST,
        temp_dir=temp_root,
    )
    assert res.limit_hit == "memory", res
    assert "MemoryError" in res.stderr and "allocated" not in res.stdout
    _assert_no_processes_left(res)


def test_huge_file_hits_fsize(temp_root: str) -> None:
    code = (
        PRINT_UID + "with open('big', 'wb') as f:\n    while True:\n"
        "        f.write(b'x' * 1024 * 1024)"
    )
    res = run_python(code, limits=SandboxLimits(max_file_mb=2, wall_time_s=5.0), temp_dir=temp_root)
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
    res = run_python(
        "import sys\nwhile True:\n    sys.stderr.write('e' * 100)",
        limits=limits,
        temp_dir=temp_root,
    )
    assert res.limit_hit == "output" and len(res.stderr) == 1000


def test_concurrent_runs_from_threads(temp_root: str) -> None:
    results: list[SandboxResult] = []

    def work(i: int) -> None:
        results.append(run_python(PRINT_UID + f"print({i} * 2)", limits=FAST, temp_dir=temp_root))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.stdout.splitlines()[1] for r in results) == ["0", "2", "4", "6"]
    if sandbox_capabilities().privilege_drop:
        assert len({_uid_of(r) for r in results}) == 4  # one uid per run


@pytest.mark.parametrize("plan", ["default", "no-namespaces"])
@pytest.mark.parametrize("numbers", ["low", "swapped"])
def test_extra_fds_reach_the_program_at_their_numbers(
    temp_root: str, plan: str, numbers: str
) -> None:
    to_child_r, to_child_w = os.pipe()
    from_child_r, from_child_w = os.pipe()
    os.write(to_child_w, b"ping")
    os.close(to_child_w)
    # "low": the numbers the code reward uses; "swapped": each target is the number of
    # the other source in the caller
    out_fd, in_fd = (3, 4) if numbers == "low" else (to_child_r, from_child_w)
    assert max(out_fd, in_fd) < 64
    code = f"import os\nos.write({out_fd}, os.read({in_fd}, 10).upper())"
    res = _run(
        code, plan, limits=FAST, temp_dir=temp_root, fds={out_fd: from_child_w, in_fd: to_child_r}
    )
    os.close(from_child_w)
    os.close(to_child_r)
    assert os.read(from_child_r, 10) == b"PING", res
    os.close(from_child_r)
    with pytest.raises(ValueError, match="3..63"):
        run_python("pass", fds={1: from_child_r})


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="wall_time_s"):
        SandboxLimits(wall_time_s=0)


# ---- memory is bounded (issue 29) ---------------------------------------------

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
        "    libc.shmdt(ctypes.c_void_p(addr))\n"
    ),
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
