"""tandem.rl.fault and tandem-diagnose: hang dumps, agreed preemption, the NaN guard
(the launch scripts: test_launch_scripts.py).

Multi-rank cases run tests/fault/fault_worker.py under torchrun (2 CPU processes, gloo).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tandem import diagnose
from tandem.rl.fault import (
    EXIT_HANG,
    EXIT_NONFINITE,
    NonFiniteError,
    PreemptionHandler,
    Watchdog,
    check_finite,
    enable_flight_recorder,
)
from tests.fault.proc_helpers import catches_usr1

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "fault" / "fault_worker.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _torchrun(scenario: str, dump: Path, timeout: float = 90) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(WORKER),
        scenario,
        "--dump",
        str(dump),
    ]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


# ---- watchdog ---------------------------------------------------------------------------
def test_watchdog_fires_dumps_stack_and_exits_with_hang_status(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, str(WORKER), "hang", "--dump", str(tmp_path)],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == EXIT_HANG, r.stderr
    assert "hang: no progress" in r.stderr
    text = (tmp_path / "hang" / "rank-0.txt").read_text()
    assert "phase: update" in text and "last step: 2" in text
    assert "== faulthandler (all threads) ==" in text
    assert text.count("fake_collective_that_never_returns") >= 2  # faulthandler + formatted stacks
    rec = json.loads((tmp_path / "hang" / "rank-0.json").read_text())
    assert rec["phase"] == "update" and rec["last_step"] == 2 and rec["exit_status"] == EXIT_HANG
    trainer = next(t for t in rec["threads"] if t["trainer"])
    assert trainer["frames"][-1]["function"] == "fake_collective_that_never_returns"


def test_watchdog_in_process_phase_timeouts_and_no_exit(tmp_path: Path) -> None:
    wd = Watchdog(
        str(tmp_path),
        0.3,
        rank=3,
        phase_timeouts={"checkpoint": 30.0},
        exit_on_hang=False,
        poll_s=0.05,
    )
    with wd:
        with wd.phase("checkpoint"):
            time.sleep(0.5)  # long, but within the checkpoint phase's own limit
            assert wd.fired_count == 0
        assert wd.current_phase == "startup"  # restored on exit
        wd.phase("rollout")
        wd.beat(7)
        time.sleep(0.6)
        assert wd.fired_count == 1  # one dump per stall
    rec = json.loads((tmp_path / "hang" / "rank-3.json").read_text())
    assert rec["phase"] == "rollout" and rec["last_step"] == 7 and rec["exit_status"] is None
    assert Watchdog(str(tmp_path), 0, rank=0).start()._thread is None  # timeout 0: disabled


def test_watchdog_dumps_when_a_peer_reports_a_hang(tmp_path: Path) -> None:
    wd = Watchdog(str(tmp_path), 60.0, rank=0, exit_on_hang=False, poll_s=0.05).start()
    try:
        (tmp_path / "hang").mkdir()
        (tmp_path / "hang" / "rank-1.json").write_text(
            json.dumps({"time": time.time(), "reason": "no progress"})
        )
        deadline = time.time() + 5
        while wd.fired_count == 0 and time.time() < deadline:
            time.sleep(0.05)
    finally:
        wd.stop()
    assert (
        json.loads((tmp_path / "hang" / "rank-0.json").read_text())["reason"]
        == "rank 1 reported a hang"
    )


def test_both_ranks_dump_when_one_blocks_before_all_reduce(tmp_path: Path) -> None:
    r = _torchrun("hang-dist", tmp_path)
    assert r.returncode != 0
    text0 = (tmp_path / "hang" / "rank-0.txt").read_text()
    text1 = (tmp_path / "hang" / "rank-1.txt").read_text()
    assert "all_reduce" in text0 and "phase: update" in text0  # rank 0 waits in the collective
    assert "stuck_before_all_reduce" in text1 and "phase: update" in text1
    for rank in (0, 1):
        assert json.loads((tmp_path / "hang" / f"rank-{rank}.json").read_text())["rank"] == rank
    out = subprocess.run(
        [sys.executable, "-m", "tandem.diagnose", str(tmp_path)],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 1
    assert "likely cause: rank(s) [1]" in out.stdout and "stuck_before_all_reduce" in out.stdout


def test_enable_flight_recorder_sets_env_without_overriding(tmp_path: Path, monkeypatch) -> None:
    for k in (
        "TORCH_FR_BUFFER_SIZE",
        "TORCH_NCCL_TRACE_BUFFER_SIZE",
        "TORCH_NCCL_DUMP_ON_TIMEOUT",
        "TORCH_FR_DUMP_TEMP_FILE",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
    ):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "64")
    env = enable_flight_recorder(str(tmp_path))
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "64" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_FR_DUMP_TEMP_FILE"].startswith(str(tmp_path / "flight_recorder"))
    assert (tmp_path / "flight_recorder").is_dir()


# ---- preemption -------------------------------------------------------------------------
def test_preemption_handler_flag_second_signal_and_uninstall(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)
    h = PreemptionHandler(str(tmp_path), rank=0).install()
    try:
        assert not h.should_stop() and not h.should_stop_all(step=1)
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)  # absorbed: the process lives on
        time.sleep(0.05)
        assert h.should_stop() and h.signal_name == "SIGUSR1" and h.count == 2
        assert h.should_stop_all(step=4) and h.stop_step == 4
    finally:
        h.uninstall()
    assert (signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)) == before
    marker = json.loads((tmp_path / "preempt" / "rank-0.json").read_text())
    assert marker["step"] == 4 and marker["signal"] == "SIGUSR1"
    errs: list[BaseException] = []

    def off_main() -> None:
        try:
            PreemptionHandler().install()
        except RuntimeError as e:
            errs.append(e)

    t = threading.Thread(target=off_main)
    t.start()
    t.join()
    assert errs and "main thread" in str(errs[0])


def test_preemption_handler_adopts_a_signal_kept_before_install(tmp_path: Path) -> None:
    class Keep:  # what train.py installs for SIGUSR1 before its slow imports
        received_at = None

        def __call__(self, signum: int, frame: object) -> None:
            self.received_at = self.received_at or time.time()

    keep = Keep()
    before = signal.signal(signal.SIGUSR1, keep)
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        sent_at = keep.received_at
        assert sent_at is not None
        h = PreemptionHandler(str(tmp_path), rank=0).install()
        assert (
            h.should_stop()
            and h.signal_name == "SIGUSR1"
            and h.received_at == sent_at
            and h.count == 1
        )
        assert keep.received_at is None  # handed over once
        h.uninstall()
        assert signal.getsignal(signal.SIGUSR1) is keep
        assert not PreemptionHandler().install().should_stop()  # nothing kept any more
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_train_py_usr1_during_startup_checkpoints_after_the_first_step(tmp_path: Path) -> None:
    """SIGUSR1 while train.py still imports torch: kept, then step 1, a checkpoint, exit 75."""
    dump = tmp_path / "dump"
    proc = subprocess.Popen(
        [
            sys.executable,
            "train.py",
            "--config",
            "configs/quickstart.toml",
            "--training.steps=5",
            f"--job.dump_folder={dump}",
            "--metrics.loggers=[]",
            "--rl.eval_prompts=4",
        ],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.time() + 10
        while not catches_usr1(proc.pid):  # the handler comes before the slow imports
            assert time.time() < deadline and proc.poll() is None
            time.sleep(0.005)
        proc.send_signal(signal.SIGUSR1)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, out[-3000:]
    assert "SIGUSR1 outside the training loop: kept, not fatal" in out
    assert "preempted: checkpointed step 1; exiting with 75" in out
    assert (dump / "checkpoints" / "step-1" / "COMMITTED").exists()
    assert json.loads((dump / "preempt" / "rank-0.json").read_text())["signal"] == "SIGUSR1"


def test_signal_to_one_rank_stops_both_at_the_same_step(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(WORKER),
        "preempt",
        "--dump",
        str(tmp_path),
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.time() + 60
        while not all((tmp_path / f"pid-{r}").exists() for r in (0, 1)) and time.time() < deadline:
            time.sleep(0.1)
        time.sleep(0.3)  # a few steps in
        os.kill(int((tmp_path / "pid-1").read_text()), signal.SIGUSR1)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    steps = [int((tmp_path / f"stopped-{r}").read_text()) for r in (0, 1)]
    assert steps[0] == steps[1], out[-3000:]
    markers = [json.loads((tmp_path / "preempt" / f"rank-{r}.json").read_text()) for r in (0, 1)]
    # rank 0 learnt it from rank 1
    assert markers[1]["signal"] == "SIGUSR1" and markers[0]["signal"] is None
    assert "exitcode  : 75" in out


# ---- NaN / Inf --------------------------------------------------------------------------
def _tiny() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    loss = model(torch.randn(5, 3)).pow(2).mean()
    loss.backward()
    return model, loss


def test_check_finite_skip_and_stop(tmp_path: Path) -> None:
    model, loss = _tiny()
    assert check_finite(loss, model, 0, 0, "skip") is True
    model[2].bias.grad[0] = float("nan")
    assert check_finite(loss, model, 1, 0, "skip") is False
    with pytest.raises(NonFiniteError) as e:
        check_finite(loss, model, 5, 0, "stop", dump_folder=str(tmp_path))
    assert str(e.value) == "step 5: nan in the gradient of 2.bias on rank 0"
    rep = json.loads((tmp_path / "nan" / "rank-0.json").read_text())
    assert (rep["step"], rep["rank"], rep["tensor"], rep["kind"], rep["where"]) == (
        5,
        0,
        "2.bias",
        "nan",
        "grad",
    )

    model[0].weight.grad[1, 1] = float("inf")  # the first offending parameter in order is named
    with pytest.raises(NonFiniteError, match=r"inf in the gradient of 0\.weight"):
        check_finite(loss, model, 6, 0, "stop")
    with pytest.raises(NonFiniteError, match="nan in the loss"):
        check_finite(torch.tensor(float("nan")), model, 7, 0, "stop")
    with pytest.raises(ValueError):
        check_finite(loss, model, 8, 0, "ignore")  # type: ignore[arg-type]


def test_check_finite_accepts_finite_gradients_whose_norm_overflows() -> None:
    """The healthy path checks norms; a finite gradient too large for an fp32 norm is
    still finite."""
    model, loss = _tiny()
    model[0].weight.grad.fill_(3e38)  # every element finite, the sum of squares is not
    assert not torch.isfinite(model[0].weight.grad.norm())
    assert check_finite(loss, model, 0, 0, "skip") is True
    model[0].weight.grad[0, 0] = float("inf")
    assert check_finite(loss, model, 1, 0, "skip") is False
    model[0].weight.grad.fill_(0.0)
    loss64 = loss.detach().double()  # tensors of several dtypes
    assert check_finite(loss64, model, 2, 0, "skip") is True
    model[2].weight.grad[0, 0] = float("nan")
    assert check_finite(loss64, model, 3, 0, "skip") is False


def test_check_finite_reads_dtensor_local_shards() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from tandem.parallel.distributed import init_distributed

    init_distributed(force_cpu=True)
    assert dist.get_world_size() == 1
    mesh = init_device_mesh("cpu", (1,))
    lin = torch.nn.Linear(4, 4, bias=False)
    lin.weight = torch.nn.Parameter(distribute_tensor(lin.weight.detach(), mesh, [Shard(0)]))
    lin.weight.grad = distribute_tensor(torch.zeros(4, 4), mesh, [Shard(0)])
    assert check_finite(None, lin, 0, 0, "skip")
    lin.weight.grad.to_local()[2, 0] = float("-inf")
    assert not check_finite(None, [lin], 1, 0, "skip")  # a list of model parts (pipeline stages)


def test_nan_on_one_rank_all_ranks_agree(tmp_path: Path) -> None:
    r = _torchrun("nan", tmp_path)
    assert [(tmp_path / f"skip-{k}").read_text() for k in (0, 1)] == ["False", "False"], (
        r.stdout + r.stderr
    )
    assert f"exitcode  : {EXIT_NONFINITE}" in r.stderr
    assert (
        "rank 0: step 2: nan in the gradient of 1.weight on rank 1 (seen from rank 0)" in r.stdout
    )
    for k in (0, 1):
        assert json.loads((tmp_path / "nan" / f"rank-{k}.json").read_text())["tensor"] == "1.weight"


# ---- diagnose ---------------------------------------------------------------------------
def _write(path: Path, obj: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj) if not isinstance(obj, str) else obj)


def _frames(*names: str, file: str = "tandem/rl/rollout/sampling.py") -> list[dict]:
    return [{"file": file, "line": 10 + i, "function": n, "code": ""} for i, n in enumerate(names)]


def _clean_run(d: Path) -> None:
    _write(
        d / "metrics.jsonl",
        "".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3)),
    )
    _write(d / "checkpoints" / "step-2" / "COMMITTED", "step=2 world=2\n")
    _write(d / "checkpoints" / "step-3.partial" / "x", "")


def test_diagnose_clean_folder_exits_0(tmp_path: Path, capsys) -> None:
    _clean_run(tmp_path)
    assert diagnose.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert (
        "no failure found" in out
        and "step-2" in out
        and "step-3.partial" in out
        and "last step 3" in out
    )


def test_diagnose_reports_hang_rank_phase_step_and_function(tmp_path: Path, capsys) -> None:
    _clean_run(tmp_path)
    t = time.time() + 5  # after the metrics were written: not recovered
    _write(
        tmp_path / "hang" / "rank-0.json",
        {
            "rank": 0,
            "host": "n0",
            "phase": "update",
            "last_step": 3,
            "time": t,
            "reason": "no progress for 60s",
            "threads": [
                {
                    "name": "MainThread",
                    "trainer": True,
                    "frames": _frames(
                        "main", "all_reduce", file="torch/distributed/distributed_c10d.py"
                    ),
                }
            ],
        },
    )
    _write(
        tmp_path / "hang" / "rank-1.json",
        {
            "rank": 1,
            "host": "n1",
            "phase": "update",
            "last_step": 3,
            "time": t,
            "reason": "no progress for 60s",
            "threads": [
                {"name": "MainThread", "trainer": True, "frames": _frames("main", "score_rewards")}
            ],
        },
    )
    assert diagnose.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "[FAILED] hang" in out and "phase update at step 3" in out
    assert "rank 1 (n1, phase 'update', step 3" in out
    assert "score_rewards (tandem/rl/rollout/sampling.py:11)" in out
    assert "likely cause: rank(s) [1]" in out and "verdict: FAILED: hang" in out


def test_diagnose_nan_preempt_errors_and_recovery(tmp_path: Path, capsys) -> None:
    _clean_run(tmp_path)
    old = time.time() - 100
    os.utime(tmp_path / "metrics.jsonl")
    # A NaN stop at step 1, long before the run logged step 3: recovered (restart), status 0.
    _write(
        tmp_path / "nan" / "rank-0.json",
        {
            "step": 1,
            "rank": 0,
            "time": old,
            "offending_ranks": [0],
            "first": {"rank": 0, "where": "grad", "tensor": "w", "kind": "inf"},
        },
    )
    # Preempted after step 2 with step-2 committed: resumable, not a failure.
    _write(
        tmp_path / "preempt" / "rank-0.json",
        {"rank": 0, "step": 2, "signal": "SIGUSR1", "received_at": old},
    )
    assert diagnose.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "[earlier] nan: non-finite (inf) gradient of w at step 1 on rank 0" in out
    assert "preempted at step 2 (SIGUSR1 on rank 0); checkpoint step-2 covers it" in out
    # A torchrun error file from a crash after the last metrics line: a failure.
    _write(
        tmp_path / "torchrun" / "run_x" / "attempt_0" / "1" / "error.json",
        {
            "message": {
                "message": "RuntimeError: boom",
                "extraInfo": {
                    "py_callstack": "Traceback\n  f()",
                    "timestamp": str(int(time.time()) + 5),
                },
            }
        },
    )
    assert diagnose.main([str(tmp_path)]) == 1
    assert "worker error: RuntimeError: boom" in capsys.readouterr().out


def test_diagnose_missing_folder_exits_2(tmp_path: Path) -> None:
    assert diagnose.main([str(tmp_path / "nope")]) == 2
