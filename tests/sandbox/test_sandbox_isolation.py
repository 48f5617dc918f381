"""Tests for tandem/rl/sandbox/__init__.py: what a run cannot see or reach. Files outside its
work dir, the trainer's environment, the network, the trainer's unix sockets, and a
staging dir the sandbox uid cannot reach (refused, not run unprotected)."""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

import pytest

from tandem.rl.sandbox import SandboxError, run_python, sandbox_capabilities
from tests.fixtures import trainer_unaffected  # noqa: F401  (a fixture)
from tests.sandbox.sandbox_helpers import FAST, _run

pytestmark = pytest.mark.usefixtures("trainer_unaffected")  # tests/fixtures.py
REPO = Path(__file__).resolve().parents[2]


def test_cannot_write_outside_work_dir(temp_root: str) -> None:
    if not sandbox_capabilities().privilege_drop:
        pytest.skip(
            "not root: the child runs as the trainer's own uid and may write where the trainer may"
        )
    targets = [os.getcwd(), str(REPO), str(REPO / "tandem"), "/root", "/etc", "/usr/lib", temp_root]
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


def test_parent_environment_is_not_visible(temp_root: str, monkeypatch: pytest.MonkeyPatch) -> None:
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
