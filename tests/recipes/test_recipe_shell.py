"""The same fault drills for every recipe: they all run in one shell (tandem/rl/recipes/loop.py).

For each of sft, dpo, reward_model and rl (tiny CPU configs, 4 steps):
- SIGTERM mid-run -> a checkpoint, exit 75; the next launch resumes and ends
  bit for bit where an uninterrupted run ends (weights, optimizer, trainer state);
- kill -9 of one rank under ``torchrun --max-restarts`` -> torchrun restarts the
  job, it resumes from the last checkpoint and ends bit for bit like an
  uninterrupted 2-rank run, every step in the ledger once;
- a NaN loss (TANDEM_INJECT_NAN) -> with ``fault.on_nonfinite = "skip"`` the
  update is skipped and counted, and the learning rate of every later step is
  that of the uninterrupted run (the schedule advances on a skipped update);
  with "stop" the run exits 7.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
COMMON = [
    "--training.steps=4",
    "--training.eval_interval=0",
    "--metrics.loggers=[]",
    "--metrics.log_interval=1",
    "--checkpoint.export_hf_at_end=false",
]
RECIPES = {
    "sft": (
        "quickstart_sft.toml",
        [
            "--data.synthetic_rows=64",
            "--data.max_length=96",
            "--training.batch_size=4",
            "--training.micro_batch_size=2",
            "--data.eval_fraction=0.1",
        ],
    ),
    "dpo": (
        "dpo.toml",
        ["--data.synthetic_rows=64", "--training.batch_size=8", "--training.micro_batch_size=4"],
    ),
    "reward_model": (
        "reward_model.toml",
        ["--data.synthetic_rows=64", "--training.batch_size=8", "--training.micro_batch_size=4"],
    ),
    "rl": (
        "quickstart.toml",
        [
            "--rl.prompts_per_step=4",
            "--rl.num_samples=4",
            "--rl.eval_prompts=4",
            "--reward.num_workers=0",
        ],
    ),
}
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _cmd(recipe: str, dump: Path, *extra: str, nproc: int = 1, restarts: int = 0) -> list[str]:
    config, fast = RECIPES[recipe]
    args = [
        str(ROOT / "train.py"),
        "--config",
        str(ROOT / "configs" / config),
        f"--job.dump_folder={dump}",
        *COMMON,
        *fast,
        *extra,
    ]
    if nproc == 1:
        return [sys.executable, *args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={restarts}",
        *args,
    ]


def _run(
    recipe: str, dump: Path, *extra: str, env: dict | None = None, status: int = 0, **kw
) -> str:
    r = subprocess.run(
        _cmd(recipe, dump, *extra, **kw),
        cwd=ROOT,
        env={**ENV, **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = r.stdout + r.stderr
    assert r.returncode == status, out[-3000:]
    return out


def _flat(path: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(path), str(path) + ".pt")
    return torch.load(str(path) + ".pt", weights_only=False)


def _same(a, b, key=""):  # noqa: ANN001
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), key
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), key
        for k in a:
            _same(a[k], b[k], f"{key}.{k}")
    else:
        assert a == b, (key, a, b)


def _same_end(a: Path, b: Path) -> None:
    """The step-4 checkpoints hold the same tensors and the same trainer state."""
    _same(_flat(a / "checkpoints" / "step-4"), _flat(b / "checkpoints" / "step-4"))
    ta, tb = (
        json.loads((d / "checkpoints" / "step-4" / "trainer.json").read_text()) for d in (a, b)
    )
    assert ta == tb


def _rows(dump: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(line) for line in (dump / name).read_text().splitlines()]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """Uninterrupted runs per (recipe, ranks), made once and shared (read-only)."""
    made: dict[tuple[str, int], Path] = {}

    def get(recipe: str, nproc: int) -> Path:
        if (recipe, nproc) not in made:
            dump = tmp_path_factory.mktemp(f"clean-{recipe}-{nproc}") / "run"
            _run(recipe, dump, "--checkpoint.interval=2", nproc=nproc)
            made[recipe, nproc] = dump
        return made[recipe, nproc]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_sigterm_checkpoints_exits_75_and_resumes_to_the_same_end(recipe, tmp_path, clean):
    dump = tmp_path / "run"
    p = subprocess.Popen(
        _cmd(recipe, dump, "--checkpoint.interval=2"),
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    for line in p.stdout:
        lines.append(line)
        if line.startswith("step 1/4"):
            p.send_signal(signal.SIGTERM)
    p.wait(timeout=600)
    out = "".join(lines)
    assert p.returncode == 75, out[-3000:]  # EXIT_PREEMPTED
    assert "preempted: checkpointed step" in out
    stopped = int(out.split("preempted: checkpointed step ")[1].split(";")[0])
    assert 1 <= stopped < 4 and (dump / "checkpoints" / f"step-{stopped}" / "COMMITTED").is_file()
    out = _run(recipe, dump, "--checkpoint.interval=2")
    assert f"at step {stopped}" in out, out[-2000:]
    _same_end(clean(recipe, 1), dump)
    assert [r["step"] for r in _rows(dump, "ledger.jsonl")] == [1, 2, 3, 4]
    assert [r["step"] for r in _rows(dump)] == [1, 2, 3, 4]
    if recipe == "rl":
        # the sample log is cut back on resume like the metrics, and holds real values
        logged = _rows(dump, "samples.jsonl")
        assert [r["step"] for r in logged] == [1, 2, 3, 4]
        for rec in (x for r in logged for x in r["samples"]):
            assert rec["reward"] == rec["rewards"]["exact_match"] and rec["prompt"].endswith(
                "<|im_start|>assistant\n"
            )
        first = logged[0]["samples"]  # one GRPO group: above-mean rewards get positive advantages
        mean = sum(x["reward"] for x in first) / len(first)
        assert all(
            (x["advantage"] > 0) == (x["reward"] > mean) for x in first if x["reward"] != mean
        )


@pytest.mark.slow
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_kill_9_under_torchrun_restarts_and_ends_bit_exact(recipe, tmp_path, clean):
    dump = tmp_path / "run"
    out = _run(
        recipe,
        dump,
        "--checkpoint.interval=2",
        nproc=2,
        restarts=2,
        env={"TANDEM_INJECT_KILL": "3:1"},
    )
    assert (dump / "fault" / "killed-step-3-rank-1").is_file()  # it really died once
    assert "at step 2" in out, out[-2000:]  # and resumed from the step-2 checkpoint
    ref = clean(recipe, 2)
    _same_end(ref, dump)
    assert _rows(ref, "ledger.jsonl") == _rows(dump, "ledger.jsonl")
    # the lost step 3 was redone, logged once
    assert [r["step"] for r in _rows(dump)] == [1, 2, 3, 4]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_nan_skip_keeps_the_lr_schedule_and_stop_exits_7(recipe, tmp_path, clean):
    dump = tmp_path / "skip"
    _run(
        recipe,
        dump,
        "--fault.on_nonfinite=skip",
        "--checkpoint.enable=false",
        env={"TANDEM_INJECT_NAN": "2"},
    )
    rows, ref = _rows(dump), _rows(clean(recipe, 1))
    assert [r["fault/skipped_updates"] for r in rows] == [0, 1, 1, 1]
    assert [r["lr"] for r in rows] == [r["lr"] for r in ref]  # the same schedule, step for step
    # step 2 really changed nothing
    assert rows[0]["loss"] == ref[0]["loss"] and rows[2]["loss"] != ref[2]["loss"]
    out = _run(
        recipe,
        tmp_path / "stop",
        "--checkpoint.enable=false",
        env={"TANDEM_INJECT_NAN": "2"},
        status=7,
    )
    assert "error:" in out and "step 2" in out, out[-2000:]
