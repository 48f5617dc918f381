"""A local stand-in for the JobSet controller and the kubelet (not a test itself).

It runs the ``node`` pods of a JobSet that ``tandem-k8s render`` wrote, one process group per
pod, with the command, arguments and environment of the pod template and what the controller
adds (``JOB_COMPLETION_INDEX``), the leader's address on loopback, one process per pod on CPU,
and the dump folder in a local folder. Deleting a pod is what the kubelet does: SIGTERM to the
container's first process (torchrun), the pod's ``terminationGracePeriodSeconds``, then
SIGKILL to everything left in the group. A pod that exits non-zero is started again while the
Job's ``backoffLimit`` allows (``restartPolicy: OnFailure``); the set succeeds when every pod
exits 0.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_args(args: list[str], dump: Path, port: int) -> list[str]:
    """The pod's torchrun arguments with loopback, one process and a local dump folder."""
    out = []
    for a in args:
        key = a.split("=", 1)[0]
        if key == "--rdzv-endpoint":
            a = f"--rdzv-endpoint=127.0.0.1:{port}"
        elif key == "--nproc-per-node":
            a = "--nproc-per-node=1"
        elif key == "--log-dir":
            a = f"--log-dir={dump}/torchrun"
        elif key == "--job.dump_folder":
            a = f"--job.dump_folder={dump}"
        out.append(a)
    return out


class Pod:
    def __init__(self, index: int, template: dict[str, Any], dump: Path, port: int) -> None:
        (c,) = template["spec"]["containers"]
        self.index, self.grace = index, template["spec"]["terminationGracePeriodSeconds"]
        self.argv = [sys.executable, "-m", "torch.distributed.run"]
        self.argv += local_args(c["args"], dump, port)
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "JOB_COMPLETION_INDEX": str(index)}
        self.env.update({e["name"]: e["value"] for e in c["env"] if "value" in e})
        self.log = dump.parent / f"pod-{index}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        with open(self.log, "ab") as f:
            f.write(f"---- start {self.starts}\n".encode())
            self.proc = subprocess.Popen(
                self.argv,
                cwd=ROOT,
                env=self.env,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, as a container's processes
            )

    def delete(self) -> int:
        """SIGTERM to torchrun, the grace period, then SIGKILL to the group; its exit status."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=self.grace)
        except subprocess.TimeoutExpired:
            rc = -9
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return rc


class JobSetRunner:
    """Plays the controller for the ``node`` replicated job of a rendered JobSet."""

    def __init__(self, jobset: dict[str, Any], dump: Path) -> None:
        (node,) = [j for j in jobset["spec"]["replicatedJobs"] if j["name"] == "node"]
        job = node["template"]["spec"]
        self.backoff = job["backoffLimit"]
        port = free_port()
        self.pods = [Pod(i, job["template"], dump, port) for i in range(job["parallelism"])]
        self.failures = 0

    def start(self) -> None:
        for p in self.pods:
            p.start()

    def wait(self, timeout_s: float) -> None:
        """Until every pod exited 0; a pod that failed is started again (OnFailure)."""
        done: set[int] = set()
        deadline = time.monotonic() + timeout_s
        while len(done) < len(self.pods):
            if time.monotonic() > deadline:
                raise TimeoutError(self.tail())
            for p in self.pods:
                rc = None if p.index in done or p.proc is None else p.proc.poll()
                if rc == 0:
                    done.add(p.index)
                elif rc is not None:
                    self.failures += 1
                    if self.failures > self.backoff:
                        raise RuntimeError(f"backoffLimit {self.backoff} passed:\n{self.tail()}")
                    p.start()
            time.sleep(0.5)

    def stop(self) -> None:
        for p in self.pods:
            if p.proc is not None and p.proc.poll() is None:
                os.killpg(p.proc.pid, signal.SIGKILL)
                p.proc.wait()

    def tail(self) -> str:
        return "\n".join(p.log.read_text()[-3000:] for p in self.pods if p.log.exists())
