"""The Slurm launch scripts (scripts/slurm/*.sbatch, common.sh) run with stub srun, scontrol and
torchrun: their syntax and directives, signals reaching torchrun and requeues, CPU threads, and
bad setups as one line with exit 2. tests/fault/test_slurm.py runs them on a real Slurm.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

from tests.fault.proc_helpers import catches_usr1

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "fault" / "fault_worker.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


# Run with stub srun/scontrol/torchrun; tests/fault/test_slurm.py runs them on a real Slurm.
SCRIPTS = [
    ROOT / "scripts" / "slurm" / "train.sbatch",
    ROOT / "scripts" / "slurm" / "train_single_node.sbatch",
]
COMMON = ROOT / "scripts" / "slurm" / "common.sh"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_sbatch_syntax_and_directives(script: Path) -> None:
    for path in (script, COMMON, ROOT / "scripts" / "slurm" / "node.sh"):
        subprocess.run(["bash", "-n", str(path)], check=True)
    text = script.read_text()
    for needle in (
        "#SBATCH --requeue",
        "#SBATCH --signal=B:USR1@120",
        "--max-restarts",
        "tandem_batch_traps",
        "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
        "bash scripts/slurm/node.sh torchrun",
        "tandem_finish",
    ):
        assert needle in text, needle
    for needle in ("trap on_usr1 USR1", "scontrol requeue", "Reason=TimeLimit", "PreemptTime="):
        assert needle in COMMON.read_text(), needle
    if script.name == "train.sbatch":
        for needle in (
            "--rdzv-backend=c10d",
            '--rdzv-id="${SLURM_JOB_ID}"',
            '--nnodes="${SLURM_NNODES}"',
            "#SBATCH --ntasks-per-node=1",
        ):
            assert needle in text, needle
    else:
        assert "--standalone" in text


def _stub(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _launch(
    script: Path,
    tmp_path: Path,
    *,
    job_line: str = "JobId=123 JobState=RUNNING Reason=None Restarts=0",
    trap_delay: float = 0.0,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen, Path]:
    """Start ``script`` with stubs: scontrol answers ``show job`` with ``job_line``; the
    torchrun stand-in notes its arguments and OMP_NUM_THREADS, says it started, handles
    USR1 and TERM only after ``trap_delay`` s (as torchrun does once its workers start),
    then "checkpoints" on either (a preempt marker) and exits 1, as torchrun does."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    dump = tmp_path / "dump"
    _stub(
        bin_dir,
        "scontrol",
        f'echo "scontrol $*" >> {log}\n'
        f'case "$1 $2" in "show hostnames") echo node-a;; "show job") echo "{job_line}";; '
        "esac\nexit 0\n",
    )
    _stub(
        bin_dir,
        "srun",
        f'echo "srun $*" >> {log}\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n',
    )
    stop = (
        f"echo got-$1 >> {log}; mkdir -p {dump}/preempt; echo {{}} > "
        f"{dump}/preempt/rank-0.json; exit 1"
    )
    _stub(
        bin_dir,
        "torchrun",
        f'echo "torchrun $* OMP_NUM_THREADS=$OMP_NUM_THREADS" >> {log}\n'
        f"touch {tmp_path}/started\nsleep {trap_delay}\n"
        f"trap '{stop.replace('$1', 'usr1')}' USR1\ntrap '{stop.replace('$1', 'term')}' TERM\n"
        f"touch {tmp_path}/ready\nwhile true; do sleep 0.05; done\n",
    )
    full_env = {
        **ENV,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "123",
        "SLURM_NNODES": "1",
        "SLURM_JOB_NODELIST": "node-a",
        "SLURM_GPUS_ON_NODE": "2",
        "SLURM_CPUS_PER_TASK": "8",
        "TANDEM_DUMP_FOLDER": str(dump),
        **(env or {}),
    }
    proc = subprocess.Popen(
        ["bash", str(script), "configs/grpo.toml", "--training.steps=9"],
        cwd=ROOT,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return proc, log


def _cmdline(proc_dir: Path) -> bytes:
    try:
        return (proc_dir / "cmdline").read_bytes()
    except OSError:  # gone meanwhile
        return b""


def _wait_for(path: Path, timeout: float = 20) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def _finish(proc: subprocess.Popen) -> str:
    try:
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    return out


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_sbatch_usr1_reaches_torchrun_and_requeues(script: Path, tmp_path: Path) -> None:
    proc, log = _launch(script, tmp_path)
    _wait_for(tmp_path / "ready")
    proc.send_signal(signal.SIGUSR1)
    out = _finish(proc)
    calls = log.read_text()
    assert proc.returncode == 75, out
    assert "got-usr1" in calls and "scontrol requeue 123" in calls
    assert (
        f"--config configs/grpo.toml --job.dump_folder={tmp_path / 'dump'} "
        "--training.steps=9" in calls
    )
    assert "--nproc-per-node=2 " in calls and "OMP_NUM_THREADS=4" in calls  # 8 CPUs / 2 GPUs
    assert "processes on 2 GPUs, OMP_NUM_THREADS=4" in out
    if script.name == "train.sbatch":
        assert (
            "srun --kill-on-bad-exit=1 --ntasks-per-node=1 --cpus-per-task=8 bash "
            "scripts/slurm/node.sh" in calls
        )


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_sbatch_usr1_during_torchrun_startup_waits_for_its_handler(
    script: Path, tmp_path: Path
) -> None:
    """A USR1 before torchrun can take one (it would die: status 138) is held, then sent."""
    proc, log = _launch(script, tmp_path, trap_delay=2.0)
    _wait_for(tmp_path / "started")
    proc.send_signal(signal.SIGUSR1)
    out = _finish(proc)
    assert proc.returncode == 75, out
    assert "got-usr1" in log.read_text()  # torchrun handled it, after its handler was in place
    assert "status 1" in out and "status 138" not in out


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_sbatch_usr1_before_torchrun_starts_is_kept(script: Path, tmp_path: Path) -> None:
    """A USR1 during the batch shell's own set-up is kept and reaches torchrun later."""
    proc, log = _launch(script, tmp_path)
    deadline = time.time() + 10
    while not catches_usr1(proc.pid):
        # the script's first line traps it; bash's own start-up is not covered
        assert time.time() < deadline
        time.sleep(0.001)
    proc.send_signal(signal.SIGUSR1)
    out = _finish(proc)
    assert proc.returncode == 75, out
    assert "got-usr1" in log.read_text()


@pytest.mark.parametrize(
    ("job_line", "then"),
    [
        # scancel
        ("JobState=COMPLETING Reason=None Restarts=0 PreemptTime=None", "cancelled"),
        ("JobState=CANCELLED Reason=None Restarts=0", "cancelled"),
        # time limit
        ("JobState=COMPLETING Reason=TimeLimit Restarts=0", "requeue"),
        # preemption
        ("JobState=COMPLETING Reason=None Restarts=0 PreemptTime=2026-01-01T00:00:00", "requeue"),
        # a TERM, no cancel
        ("JobState=RUNNING Reason=None Restarts=0", "requeue"),
        # scontrol requeue
        ("JobState=COMPLETING Reason=None Restarts=1", "slurm"),
    ],
    ids=["scancel", "cancelled", "time-limit", "preempted", "running", "scontrol-requeue"],
)
def test_sbatch_term_requeues_unless_cancelled(job_line: str, then: str, tmp_path: Path) -> None:
    proc, log = _launch(SCRIPTS[1], tmp_path, job_line=f"JobId=123 {job_line}")
    _wait_for(tmp_path / "ready")
    # Slurm signals every process of the job: the batch shell, node.sh and torchrun
    stub = str(tmp_path / "bin" / "torchrun").encode()
    pids = [
        int(d.name)
        for d in Path("/proc").iterdir()
        if d.name.isdigit() and _cmdline(d).startswith(b"/bin/bash\0" + stub)
    ]
    assert len(pids) == 1
    proc.send_signal(signal.SIGTERM)
    os.kill(pids[0], signal.SIGTERM)
    out = _finish(proc)
    calls = log.read_text()
    assert "got-term" in calls and "scontrol show job -o 123" in calls
    assert ("scontrol requeue 123" in calls) == (then == "requeue"), out
    assert proc.returncode == (1 if then == "cancelled" else 75), out
    assert ("job 123 was cancelled: not requeueing" in out) == (then == "cancelled")
    assert ("Slurm is requeueing job 123 itself" in out) == (then == "slurm")


def test_sbatch_cpu_node_threads_follow_the_allocation(tmp_path: Path) -> None:
    env = {"SLURM_GPUS_ON_NODE": "", "SLURM_CPUS_PER_TASK": "6", "TANDEM_NPROC_PER_NODE": "2"}
    proc, log = _launch(SCRIPTS[1], tmp_path, env=env)
    _wait_for(tmp_path / "ready")
    proc.send_signal(signal.SIGUSR1)
    out = _finish(proc)
    calls = log.read_text()
    assert "--nproc-per-node=2 " in calls and "OMP_NUM_THREADS=3" in calls
    assert "2 processes on CPU, OMP_NUM_THREADS=3" in out and "GPU" not in out


@pytest.mark.parametrize(
    ("env", "cwd", "message"),
    [
        (
            {"TANDEM_NPROC_PER_NODE": "two"},
            ROOT,
            "error: TANDEM_NPROC_PER_NODE must be a positive integer, got 'two'",
        ),
        (
            {"TANDEM_THREADS_PER_PROC": "0"},
            ROOT,
            "error: TANDEM_THREADS_PER_PROC must be a positive integer, got '0'",
        ),
        (
            {"TANDEM_GPUS_PER_NODE": "2"},
            ROOT,
            "error: TANDEM_GPUS_PER_NODE was renamed: set TANDEM_NPROC_PER_NODE",
        ),
        ({}, Path("/"), "error: submit from the Tandem repository root"),
    ],
    ids=["nproc", "threads", "old-name", "not-repo-root"],
)
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_sbatch_bad_setup_is_one_line_and_exit_2(
    script: Path, env: dict[str, str], cwd: Path, message: str, tmp_path: Path
) -> None:
    full_env = {
        **ENV,
        "SLURM_JOB_ID": "5",
        "SLURM_NNODES": "1",
        "SLURM_JOB_NODELIST": "node-a",
        "TANDEM_DUMP_FOLDER": str(tmp_path / "dump"),
        **env,
    }
    r = subprocess.run(
        ["bash", str(script), "configs/grpo.toml"],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2
    assert r.stderr.startswith(message) and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "dump").exists()
