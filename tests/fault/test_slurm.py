"""The sbatch scripts on a real Slurm: a one-node cluster started by the test.

    python -m pytest tests/fault/test_slurm.py --slurm

Opt-in (skipped without ``--slurm``: it takes minutes). It needs Linux, root (slurmd
starts jobs as their user) and Slurm with MUNGE (Debian: ``apt-get install slurm-wlm
munge``); it skips, saying which, when one is missing or the daemons do not start.
The cluster lives in a temporary folder: its own MUNGE key and socket, slurm.conf,
ports, state and logs; nothing of a system Slurm is used or changed.

Every job is the CPU quickstart on this node (``--gpus-per-node=0``, all its CPUs,
two torchrun processes) and is checked against one uninterrupted run: the same
final weights, bit for bit, after ``scancel --signal=USR1 --batch`` mid-run and
during torchrun's start-up, and after ``scontrol requeue`` (checkpoint, requeue,
resume); a plain ``scancel`` ends the job for good.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts" / "slurm"
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "scancel", "sinfo")
CRED_EXPIRE_S = 10  # a requeued job waits this long before it starts again (Slurm's default: 120)
JOB_TIMEOUT_S = 900


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return f"({path} not written)"


class Cluster:
    """munged + slurmctld + slurmd on localhost, configured and kept under ``home``."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMP_"))}
        self.env.update(SLURM_CONF=str(home / "slurm.conf"), PYTHONPATH=str(ROOT))
        self.cpus = 0

    def _run(
        self, *cmd: str, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            cmd, env=self.env, capture_output=True, text=True, timeout=timeout, check=check
        )

    def start(self) -> None:
        h = self.home
        (h / "munge.key").write_bytes(os.urandom(1024))
        (h / "munge.key").chmod(0o600)
        r = self._run(
            "munged",
            "--force",
            f"--socket={h / 'munge.sock'}",
            f"--key-file={h / 'munge.key'}",
            f"--log-file={h / 'munged.log'}",
            f"--pid-file={h / 'munged.pid'}",
            f"--seed-file={h / 'munged.seed'}",
            check=False,
        )
        if r.returncode != 0:
            raise RuntimeError(
                f"munged did not start: {r.stderr.strip() or _tail(h / 'munged.log')}"
            )
        # NodeName=... CPUs=... RealMemory=...
        node = self._run("slurmd", "-C").stdout.splitlines()[0]
        fields = dict(kv.split("=", 1) for kv in node.split())
        self.cpus, self.node = int(fields["CPUs"]), fields["NodeName"]
        for d in ("state", "spool"):
            (h / d).mkdir()
        (h / "slurm.conf").write_text(f"""\
ClusterName=tandemtest
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={h / "munge.sock"},cred_expire={CRED_EXPIRE_S}
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
ReturnToService=2
SlurmctldPidFile={h / "slurmctld.pid"}
SlurmdPidFile={h / "slurmd.pid"}
StateSaveLocation={h / "state"}
SlurmdSpoolDir={h / "spool"}
SlurmctldLogFile={h / "slurmctld.log"}
SlurmdLogFile={h / "slurmd.log"}
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc={h / "jobcomp.log"}
MinJobAge=3600
KillWait=30
JobRequeue=1
{node} NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
""")
        for daemon, args in (("slurmctld", ("-i",)), ("slurmd", ())):
            r = self._run(daemon, *args, check=False)
            if r.returncode != 0:
                raise RuntimeError(
                    f"{daemon} did not start: {r.stderr.strip() or _tail(h / f'{daemon}.log')}"
                )
        deadline = time.time() + 60
        while self._run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.strip() != "idle":
            if time.time() > deadline:
                raise RuntimeError(
                    f"the node never became idle:\n{_tail(h / 'slurmctld.log')}"
                    f"\n{_tail(h / 'slurmd.log')}"
                )
            time.sleep(0.5)

    def stop(self) -> None:
        self._run("scancel", "--user", "root", check=False)
        self._run("scontrol", "shutdown", check=False)
        for name in ("slurmd", "slurmctld", "munged"):
            pid_file = self.home / f"{name}.pid"
            if not pid_file.exists():
                continue
            pid = int(pid_file.read_text().split()[0])
            for _ in range(100):
                try:
                    os.kill(pid, signal.SIGTERM if name == "munged" else 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            else:
                os.kill(pid, signal.SIGKILL)

    # ---- jobs -------------------------------------------------------------------------
    def submit(
        self, script: str, name: str, *overrides: str, dump: Path | None = None
    ) -> tuple[str, Path, Path]:
        """The CPU form of the README: -> (job id, its output file, its dump folder)."""
        out, dump = self.home / f"{name}.out", dump or self.home / f"dump-{name}"
        r = self._run(
            "sbatch",
            "--parsable",
            f"--job-name={name}",
            f"--chdir={ROOT}",
            f"--output={out}",
            "--nodes=1",
            "--gpus-per-node=0",
            f"--cpus-per-task={self.cpus}",
            f"--export=ALL,TANDEM_NPROC_PER_NODE=2,TANDEM_DUMP_FOLDER={dump},"
            f"TANDEM_RDZV_PORT={_free_port()}",
            str(SCRIPTS / script),
            "configs/quickstart.toml",
            *overrides,
        )
        return r.stdout.strip().split(";")[0], out, dump

    def job(self, job_id: str) -> dict[str, str]:
        line = self._run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(kv.split("=", 1) for kv in line.split() if "=" in kv)

    def wait(self, job_id: str, until, what: str, timeout: float = JOB_TIMEOUT_S) -> dict[str, str]:
        deadline = time.time() + timeout
        while True:
            info = self.job(job_id)
            if until(info):
                return info
            if time.time() > deadline:
                raise AssertionError(f"job {job_id}: {what} not reached in {timeout:.0f} s: {info}")
            time.sleep(1)

    def wait_done(self, job_id: str) -> dict[str, str]:
        """Until the job has ended for good: a final state, nothing left to kill or requeue."""
        final = (
            "COMPLETED",
            "FAILED",
            "CANCELLED",
            "TIMEOUT",
            "NODE_FAIL",
            "PREEMPTED",
            "OUT_OF_MEMORY",
        )
        return self.wait(job_id, lambda j: j["JobState"] in final, "the end")

    def scancel(self, *args: str) -> None:
        self._run("scancel", *args)

    def requeue(self, job_id: str) -> None:
        self._run("scontrol", "requeue", job_id)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if not sys.platform.startswith("linux"):
        pytest.skip("the local Slurm needs Linux")
    missing = [
        t
        for t in DAEMONS + CLIENTS
        if shutil.which(t) is None and not Path("/usr/sbin", t).exists()
    ]
    if missing:
        pytest.skip(
            f"Slurm/MUNGE not installed (missing {', '.join(missing)}): apt-get install "
            "slurm-wlm munge"
        )
    if os.geteuid() != 0:
        pytest.skip("the local Slurm needs root: slurmd starts jobs as their user")
    home = tmp_path_factory.mktemp("slurm")
    c = Cluster(home)
    c.env["PATH"] = f"{c.env.get('PATH', '')}:/usr/sbin"
    try:
        c.start()
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        c.stop()
        pytest.skip(f"the local Slurm did not start: {e}")
    yield c
    c.stop()


def _weights(dump: Path) -> dict[str, torch.Tensor]:
    return load_file(str(dump / "hf" / "model.safetensors"))


def _rows(dump: Path) -> list[dict]:
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def _steps_done(dump: Path) -> int:
    try:
        return len((dump / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


def _banner(log: str, job: str) -> str:
    """The script's first line about the job; asserts it does not speak of GPUs."""
    line = next((ln for ln in log.splitlines() if f"job {job} (requeue 0)" in ln), "")
    assert line and "GPU" not in line, line
    return line


def _assert_same_run(dump: Path, ref: Path) -> None:
    """Bit-identical final weights, and the same per-step rewards and gradient norms."""
    got, want = _weights(dump), _weights(ref)
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want), [
        k for k in want if not torch.equal(got[k], want[k])
    ]
    rows, ref_rows = _rows(dump), _rows(ref)
    assert [r["step"] for r in rows] == [r["step"] for r in ref_rows] == list(range(1, 61))
    for key in ("reward/total", "loss", "grad_norm", "reward/exact_match/crashes"):
        assert [r[key] for r in rows] == [r[key] for r in ref_rows], key
    assert all(r["reward/exact_match/crashes"] == 0 for r in rows)


@pytest.fixture(scope="module")
def reference(cluster: Cluster) -> Path:
    """train_single_node.sbatch, the CPU quickstart, never interrupted."""
    job, out, dump = cluster.submit("train_single_node.sbatch", "reference")
    info = cluster.wait_done(job)
    log = out.read_text()
    assert (
        info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0" and info["Restarts"] == "0"
    ), log[-3000:]
    assert "1 node, 2 processes on CPU, OMP_NUM_THREADS=1" in _banner(log, job), log[:3000]
    assert re.search(r"eval accuracy: start 0\.\d+ -> end 0\.\d+", log), log[-3000:]
    return dump


def test_single_node_script_completes_with_accuracy(reference: Path) -> None:
    assert len(_rows(reference)) == 60 and (reference / "hf" / "model.safetensors").exists()


def test_multi_node_script_completes_with_accuracy(cluster: Cluster, reference: Path) -> None:
    job, out, dump = cluster.submit("train.sbatch", "multi")
    info = cluster.wait_done(job)
    log = out.read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log[-3000:]
    assert "1 nodes x 2 processes on CPU, OMP_NUM_THREADS=1" in _banner(log, job), log[:3000]
    assert re.search(r"eval accuracy: start 0\.\d+ -> end 0\.\d+", log), log[-3000:]
    _assert_same_run(dump, reference)


def test_usr1_mid_run_checkpoints_requeues_and_ends_like_the_reference(
    cluster: Cluster, reference: Path
) -> None:
    """The srun path: batch shell -> stop file -> node.sh -> torchrun -> workers."""
    job, out, dump = cluster.submit("train.sbatch", "usr1")
    cluster.wait(job, lambda j: _steps_done(dump) >= 15, "step 15", timeout=600)
    cluster.scancel("--signal=USR1", "--batch", job)
    info = cluster.wait_done(job)
    log = out.read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log[-4000:]
    stopped = re.search(r"preempted: checkpointed step (\d+)", log)
    assert stopped and 15 <= int(stopped.group(1)) < 60, log[-4000:]
    assert "sent USR1 to torchrun" in log and f"requeueing job {job}" in log
    assert f"resumed from {dump}/checkpoints/step-{stopped.group(1)}" in log
    assert "eval accuracy: start n/a (resumed) -> end" in log
    _assert_same_run(dump, reference)


def test_usr1_while_torchrun_starts_requeues_and_ends_like_the_reference(
    cluster: Cluster, reference: Path
) -> None:
    """The warning comes right after the script printed its banner: torchrun is still
    importing, far from installing its signal handlers."""
    job, out, dump = cluster.submit("train_single_node.sbatch", "startup")
    cluster.wait(
        job, lambda j: out.exists() and "(requeue 0)" in out.read_text(), "the banner", timeout=600
    )
    cluster.scancel("--signal=USR1", "--batch", job)
    info = cluster.wait_done(job)
    log = out.read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log[-4000:]
    first = log.split("(requeue 1)")[0]
    assert "batch shell got USR1" in first and "sent USR1 to torchrun" in first
    assert "status 138" not in log and f"requeueing job {job}" in first
    _assert_same_run(dump, reference)


def test_scontrol_requeue_resumes_like_the_reference(cluster: Cluster, reference: Path) -> None:
    """An operator's requeue: Slurm requeues the job itself (SIGTERM to every process);
    the script sees Restarts already raised, does not requeue again, and the job resumes."""
    job, out, dump = cluster.submit("train_single_node.sbatch", "requeue")
    cluster.wait(job, lambda j: _steps_done(dump) >= 10, "step 10", timeout=600)
    cluster.requeue(job)
    info = cluster.wait_done(job)
    log = out.read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log[-4000:]
    assert f"Slurm is requeueing job {job} itself" in log and "was cancelled" not in log, log[
        -4000:
    ]
    stopped = re.search(r"preempted: checkpointed step (\d+)", log)
    assert stopped and f"resumed from {dump}/checkpoints/step-{stopped.group(1)}" in log, log[
        -4000:
    ]
    _assert_same_run(dump, reference)


@pytest.mark.parametrize("script", ["train_single_node.sbatch", "train.sbatch"])
def test_plain_scancel_ends_the_job_for_good(
    cluster: Cluster, reference: Path, script: str
) -> None:
    """The job checkpoints (SIGTERM), ends CANCELLED and stays so; a new job given its
    dump folder resumes it and ends like the reference."""
    job, out, dump = cluster.submit(script, f"cancel-{script.split('.')[0]}")
    cluster.wait(job, lambda j: _steps_done(dump) >= 5, "step 5", timeout=600)
    cluster.scancel(job)
    info = cluster.wait_done(job)
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0"
    time.sleep(CRED_EXPIRE_S + 5)  # a requeued job would be back by now
    info = cluster.job(job)
    log = out.read_text()
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", log[-3000:]
    assert f"job {job} was cancelled: not requeueing" in log and "requeueing job" not in log, log[
        -3000:
    ]
    assert "(requeue 1)" not in log
    stopped = re.search(r"preempted: checkpointed step (\d+)", log)
    assert stopped, log[-3000:]
    if script == "train_single_node.sbatch":
        again, out2, _ = cluster.submit(script, "cancel-resumed", dump=dump)
        info = cluster.wait_done(again)
        log2 = out2.read_text()
        assert info["JobState"] == "COMPLETED", log2[-3000:]
        assert f"resumed from {dump}/checkpoints/step-{stopped.group(1)}" in log2
        _assert_same_run(dump, reference)
