"""One sweep trial as a process: where it runs, the command, its metrics, how it is stopped.

A trial is ``train.py --config <trial>/config.toml`` (under ``torchrun
--standalone`` when it has several ranks), started in its own session with its
output in ``<trial>/train.log``. ``--parallel K`` gives each of the K trials
running at once a `Slot`: a disjoint share of this process's CPU cores (CPU
affinity and OMP_NUM_THREADS) and, on a CUDA machine, of the visible GPUs
(CUDA_VISIBLE_DEVICES).

Stopping is always SIGTERM to the trial's own process (train.py checkpoints and
exits 75; torchrun forwards it to its ranks), never to its process group: the
reward and sandbox workers belong to the trainer, which closes them. On Linux a
trial also gets SIGTERM when the sweep process dies (PR_SET_PDEATHSIG), so a
killed sweep leaves checkpointed trials rather than orphans that train on.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from tandem.rl.core.metrics import parse_rows
from tandem.rl.core.metrics import read_rows as metric_rows
from tandem.sweep import EXIT_USAGE, SweepError

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Slot:
    """The CPU cores (and GPUs) one running trial may use."""

    index: int
    cpus: tuple[int, ...]
    gpus: tuple[str, ...] = ()

    def env(self, ranks: int) -> dict[str, str]:
        env = {"OMP_NUM_THREADS": str(max(1, len(self.cpus) // ranks))}
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpus)
        return env

    def describe(self) -> str:
        cpus = (
            f"cpus {self.cpus[0]}-{self.cpus[-1]}" if len(self.cpus) > 1 else f"cpu {self.cpus[0]}"
        )
        return cpus + (f", gpus {','.join(self.gpus)}" if self.gpus else "")


def visible_gpus() -> list[str]:
    """CUDA device ids this process may hand out ([] without CUDA)."""
    from tandem import device as seam

    count = seam.device_count()
    if count == 0:
        return []
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (
        [d.strip() for d in listed.split(",") if d.strip()][:count]
        if listed
        else [str(i) for i in range(count)]
    )


def plan_slots(parallel: int, ranks: int, cpus: list[int], gpus: list[str]) -> list[Slot]:
    """``parallel`` disjoint slots; one GPU per rank when there are GPUs. Too few:
    SweepError (2)."""
    if gpus and parallel * ranks > len(gpus):
        raise SweepError(
            EXIT_USAGE,
            f"--parallel {parallel} with {ranks} rank(s) per trial needs "
            f"{parallel * ranks} GPUs; {len(gpus)} visible "
            f"({','.join(gpus)})",
        )
    if parallel > len(cpus):
        raise SweepError(
            EXIT_USAGE,
            f"--parallel {parallel} needs {parallel} CPU cores; this process may use {len(cpus)}",
        )
    per = len(cpus) // parallel
    return [
        Slot(
            i,
            tuple(cpus[i * per : (i + 1) * per]),
            tuple(gpus[i * ranks : (i + 1) * ranks]) if gpus else (),
        )
        for i in range(parallel)
    ]


def ranks_wanted(parallel_cfg: Any) -> int:
    """Ranks a config's mesh asks for: dp_replicate * tp * pp, times dp_shard when it is fixed."""
    p = parallel_cfg
    fixed = p.dp_replicate * p.tp * p.pp
    return fixed * p.dp_shard if p.dp_shard > 0 else fixed


def command(config_path: str, ranks: int) -> list[str]:
    """The trial's launch: the installed package's entry point, so no repository checkout
    is needed."""
    if ranks == 1:
        return [sys.executable, "-m", "tandem.train", "--config", config_path]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        "-m",
        "tandem.train",
        "--config",
        config_path,
    ]


def shown(cmd: list[str]) -> str:
    """The command as a person would type it: ``python -m tandem.train ...`` / ``torchrun ... -m
    tandem.train ...``."""
    out = list(cmd)
    if out[1:3] == ["-m", "torch.distributed.run"]:
        out = ["torchrun", *out[3:]]
    elif shutil.which("python") and os.path.realpath(shutil.which("python")) == os.path.realpath(
        sys.executable
    ):
        out[0] = "python"
    return shlex.join(out)


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks (/proc/<pid>/stat field 22), to tell a reused
    pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def alive(pid: int, ticks: int | None) -> bool:
    now = _start_ticks(pid)
    return now is not None and (ticks is None or now == ticks)


def wait_gone(pid: int, ticks: int | None, timeout_s: float) -> bool:
    """Wait for a trial process of an earlier sweep to exit; SIGTERM, then SIGKILL, if
    it will not."""
    deadline = time.monotonic() + timeout_s
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None and alive(pid, ticks):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                return True
            deadline = time.monotonic() + (timeout_s if sig == signal.SIGTERM else 10)
        while alive(pid, ticks) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not alive(pid, ticks):
            return True
    return False


def _child_setup(cpus: tuple[int, ...], parent: int) -> None:
    """In the child before exec: our cores, and SIGTERM when the sweep dies (Linux)."""
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the sweep died before prctl took effect
        os._exit(75)


class TrialProcess:
    """A started trial: its process, its log, and a reader of its metrics.jsonl."""

    def __init__(self, cmd: list[str], folder: str, slot: Slot, ranks: int, steps: int) -> None:
        self.folder = folder
        self.steps = steps  # training.steps: a value logged at the last step is no reason to prune
        self.slot = slot
        self.log_path = os.path.join(folder, "train.log")
        self.metrics = MetricsTail(os.path.join(folder, "metrics.jsonl"))
        self.started = time.monotonic()
        env = {**os.environ, **slot.env(ranks)}
        with open(self.log_path, "ab") as log:
            log.write(f"# tandem-sweep: {shown(cmd)}\n".encode())
            log.flush()
            parent = os.getpid()
            self.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                # a Ctrl-C at the sweep's terminal is ours to forward
                start_new_session=True,
                preexec_fn=lambda: _child_setup(slot.cpus, parent),
            )
        self.pid = self.proc.pid
        self.ticks = _start_ticks(self.pid)
        self.stop_reason: str | None = None  # "prune" | "interrupt" once we sent SIGTERM

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self, reason: str) -> None:
        """SIGTERM once: the trainer checkpoints at its next step and exits 75."""
        if self.stop_reason is None and self.proc.poll() is None:
            self.stop_reason = reason
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.started


class MetricsTail:
    """New complete rows of a growing metrics.jsonl; starts over when the file is replaced
    (a resumed run truncates it to its checkpoint)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._offset = 0
        self._inode: int | None = None

    def new_rows(self) -> list[dict[str, Any]]:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return []
        if st.st_ino != self._inode or st.st_size < self._offset:
            self._inode, self._offset = st.st_ino, 0
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        done = data.rfind(b"\n") + 1
        self._offset += done
        return parse_rows(data[:done].decode("utf-8", "replace").splitlines())


def read_rows(folder: str) -> list[dict[str, Any]]:
    """The complete rows of a run folder's metrics.jsonl."""
    return metric_rows(os.path.join(folder, "metrics.jsonl"))


def keep_rows(folder: str, last_step: int) -> list[dict[str, Any]]:
    """Cut ``folder/metrics.jsonl`` to the rows with ``step <= last_step`` (atomically);
    returns them."""
    path = os.path.join(folder, "metrics.jsonl")
    rows = [r for r in read_rows(folder) if r["step"] <= last_step]
    if os.path.exists(path):
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        os.replace(path + ".tmp", path)
    return rows


def metric_points(rows: list[dict[str, Any]], metric: str) -> list[tuple[int, float]]:
    """(step, value) for each step with a finite number under ``metric``, in step order (a step
    logged twice: the later row wins)."""
    by_step = {}
    for r in rows:
        v = r.get(metric)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            by_step[r["step"]] = float(v)
    return sorted(by_step.items())


def objective_value(
    rows: list[dict[str, Any]], metric: str, mode: str, direction: str
) -> float | None:
    """The value at the last logged step (mode "last") or the best one (mode "best"); None if
    never logged."""
    points = metric_points(rows, metric)
    if not points:
        return None
    if mode == "last":
        return points[-1][1]
    values = [v for _, v in points]
    return max(values) if direction == "maximize" else min(values)


def last_error(log_path: str) -> str:
    """The line that says why a trial failed: its last ``error:`` line, else its last line."""
    try:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        return "no log"
    errors = [line for line in lines if "error:" in line.lower()]
    return (errors or lines or ["empty log"])[-1][:300]


def latest_checkpoint(folder: str, sub: str = "checkpoints") -> str | None:
    """The name of the newest committed checkpoint (``step-N``) under ``folder/sub``, or None."""
    ckpts = os.path.join(folder, sub)
    names = (
        [n for n in os.listdir(ckpts) if n.startswith("step-") and n[5:].isdigit()]
        if os.path.isdir(ckpts)
        else []
    )
    return max(names, key=lambda n: int(n[5:])) if names else None
