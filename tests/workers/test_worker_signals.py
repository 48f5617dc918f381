"""Reward and environment workers survive the trainer's stop signals
(tandem/rl/workers/stop_signals.py).

torchrun forwards SIGUSR1/SIGTERM to each worker's whole process group and Slurm
signals every process of a job; the pools' workers must keep scoring, unharmed,
while the trainer checkpoints.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from tandem.rl.workers.stop_signals import STOP_SIGNALS, stop_signals_blocked

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def test_stop_signals_blocked_restores_the_mask() -> None:
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    with stop_signals_blocked():
        inside = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    assert set(STOP_SIGNALS) <= inside
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before


def test_pool_workers_survive_signals_to_the_trainers_process_group(tmp_path: Path) -> None:
    """SIGUSR1 and SIGTERM every 20 ms to the trainer's group, from before the pools
    start until it is done: the trainer records them, no worker dies or is replaced,
    and every score and environment result is right."""
    err_path = tmp_path / "stderr.txt"  # a line per signal: a pipe nobody reads would fill up
    with open(err_path, "w") as err_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.workers.pool_signal_trainer"],
            cwd=ROOT,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=err_file,
            text=True,
            start_new_session=True,
        )
    stop = threading.Event()
    sent = [0]

    def storm() -> None:
        sigs = (signal.SIGUSR1, signal.SIGTERM)
        while not stop.wait(0.02):
            try:
                os.killpg(proc.pid, sigs[sent[0] % 2])
            except ProcessLookupError:
                return
            sent[0] += 1

    try:
        assert proc.stdout.readline().strip() == "installed"
        thread = threading.Thread(target=storm, daemon=True)
        thread.start()
        line = proc.stdout.readline()
        stop.set()
        thread.join()
        proc.communicate(timeout=120)
    finally:
        stop.set()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    err = err_path.read_text()
    assert proc.returncode == 0, err[-3000:]
    out = json.loads(line)
    assert sent[0] >= 20  # the storm lasted through the pools' start and the work
    assert out["trainer_signals"] >= 10 and out["trainer_signal"] in ("SIGUSR1", "SIGTERM")
    assert out["total"] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    assert out["failures"] == [0, 0, 0]  # errors, timeouts, crashes
    assert out["reward_pids_kept"] and out["env_pids_kept"]
    assert out["env"] == [
        [0, "ok", 1.0, 1],
        [1, "ok", 2.0, 1],
        [2, "ok", 3.0, 1],
        [3, "ok", 4.0, 1],
    ]
    assert out["env_counts"] == {"crashes": 0, "timeouts": 0, "errors": 0, "restarts": 0}
    assert "died unexpectedly" not in err  # multiprocessing's resource tracker survived too
