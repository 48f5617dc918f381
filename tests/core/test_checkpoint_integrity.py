"""Checkpoints are never resumed from, kept over good ones, or committed when corrupt
(world of one).

Each damage below is done to the newest checkpoint on disk after a clean save;
`resume_step` must pass it over for the older one, with one line naming it, and
`Checkpointer.load` must refuse it. The end-to-end tests run train.py (SFT, a
debug model, a few seconds each) and check exit statuses and what is left on disk.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from tandem.parallel.distributed import init_distributed
from tandem.rl.config.schema import CheckpointConfig, ConfigError
from tandem.rl.core.checkpoint import (
    Checkpointer,
    CheckpointError,
    committed_steps,
    resume_step,
)
from tandem.rl.core.checkpoint_sums import MARKER, SUMS
from tandem.rl.core.errors import EXIT_CHECKPOINT
from tandem.rl.fault import NonFiniteError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _model_and_opt(seed):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 2))
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.randn(5, 64)).sum().backward()
    opt.step()
    return m, opt


def _two_checkpoints(tmp_path, keep_last=2):
    """step-2 and step-4 of one model, saved by a Checkpointer that is then dropped."""
    init_distributed(force_cpu=True)
    ck = Checkpointer(str(tmp_path), keep_last=keep_last)
    m, opt = _model_and_opt(0)
    ck.save(2, m, opt, {"step": 2})
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)
    ck.save(4, m, opt, {"step": 4})
    return {k: v.clone() for k, v in m.state_dict().items()}


def _shard(path):
    return next(os.path.join(path, n) for n in sorted(os.listdir(path)) if n.endswith(".distcp"))


def _overwrite_middle(path, n=4096):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 2 - n // 2)
        f.write(b"\xff" * n)


DAMAGE = {
    "shard_middle_overwritten": lambda d: _overwrite_middle(_shard(d)),
    "shard_truncated": lambda d: os.truncate(_shard(d), os.path.getsize(_shard(d)) // 2),
    "shard_zeroed": lambda d: open(_shard(d), "r+b").write(bytes(os.path.getsize(_shard(d)))),
    "metadata_garbage": lambda d: open(os.path.join(d, ".metadata"), "wb").write(b"garbage"),
    "trainer_json_garbage": lambda d: open(os.path.join(d, "trainer.json"), "w").write("{not json"),
    "marker_garbage": lambda d: open(os.path.join(d, MARKER), "wb").write(b"\x00\x01garbage"),
    "rng_garbage": lambda d: open(os.path.join(d, "rng", "rank-0.pt"), "wb").write(b"garbage"),
    "sums_missing": lambda d: os.remove(os.path.join(d, SUMS)),
    "empty_but_committed": lambda d: [
        os.remove(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs if f != MARKER
    ],
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_newest_checkpoint_falls_back_to_the_older_one(tmp_path, damage, capsys):
    _two_checkpoints(tmp_path)
    DAMAGE[damage](str(tmp_path / "step-4"))
    ck = Checkpointer(str(tmp_path), keep_last=2)
    assert resume_step(ck, CheckpointConfig(), total_steps=10, is_main=True) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1 and "step-4" in err[0] and "resuming from" in err[0] and "step-2" in err[0]
    ), err
    with pytest.raises(CheckpointError, match="step-4"):
        Checkpointer(str(tmp_path)).load(4, *_model_and_opt(1))
    m, opt = _model_and_opt(1)
    assert ck.load(2, m, opt)["step"] == 2


def test_corrupt_newest_is_named_and_good_older_is_never_pruned(tmp_path, capsys):
    at_step_4 = _two_checkpoints(tmp_path)
    _overwrite_middle(_shard(str(tmp_path / "step-4")))
    ck = Checkpointer(str(tmp_path), keep_last=2)
    assert resume_step(ck, CheckpointConfig(), total_steps=10, is_main=True) == 2
    assert "step-4: __0_0.distcp differs from its sha256" in capsys.readouterr().err
    m, opt = _model_and_opt(1)
    ck.load(2, m, opt)
    ck.save(3, m, opt, {"step": 3})
    # the newest (step-4) is damaged: keep_last=2 must not delete the good step-2
    assert committed_steps(str(tmp_path)) == [2, 3, 4]
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)
    ck.save(4, m, opt, {"step": 4})  # replaces the damaged step-4, then prunes as usual
    assert committed_steps(str(tmp_path)) == [3, 4]
    assert Checkpointer(str(tmp_path)).verify(4) is None
    m2, opt2 = _model_and_opt(2)
    Checkpointer(str(tmp_path)).load(4, m2, opt2)
    for k, v in m2.state_dict().items():
        assert torch.equal(v, at_step_4[k]), k


def test_sums_file_is_sha256sum_format(tmp_path):
    _two_checkpoints(tmp_path)
    r = subprocess.run(
        ["sha256sum", "-c", SUMS], cwd=tmp_path / "step-4", capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr
    listed = sorted(
        line.split("  ", 1)[1] for line in (tmp_path / "step-4" / SUMS).read_text().splitlines()
    )
    assert listed == [".metadata", "__0_0.distcp", "rng/rank-0.pt", "trainer.json"]


def test_no_marker_anywhere_refuses_a_fresh_start_unless_overwrite(tmp_path):
    _two_checkpoints(tmp_path)
    for s in (2, 4):
        os.remove(tmp_path / f"step-{s}" / MARKER)
    ck = Checkpointer(str(tmp_path))
    with pytest.raises(
        CheckpointError,
        match=r"step-2, step-4\) and none verifies "
        r".*checkpoint.overwrite=true",
    ) as e:
        resume_step(ck, CheckpointConfig(), total_steps=10, is_main=True)
    assert e.value.exit_status == EXIT_CHECKPOINT == 8
    assert "\n" not in str(e.value)
    assert sorted(os.listdir(tmp_path)) == ["step-2", "step-4"]  # nothing touched
    assert resume_step(ck, CheckpointConfig(overwrite=True), total_steps=10, is_main=True) is None
    assert os.listdir(tmp_path) == []


def test_resume_false_over_existing_checkpoints_refuses_and_overwrite_empties_the_logs(
    tmp_path, capsys
):
    _two_checkpoints(tmp_path / "ck")
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3, 4)))
    ck = Checkpointer(str(tmp_path / "ck"))
    with pytest.raises(CheckpointError, match="checkpoint.resume = false"):
        resume_step(
            ck, CheckpointConfig(resume=False), total_steps=10, is_main=True, logs=[str(log)]
        )
    assert (
        committed_steps(str(tmp_path / "ck")) == [2, 4] and len(log.read_text().splitlines()) == 4
    )
    assert (
        resume_step(ck, CheckpointConfig(resume=False, overwrite=True), 10, True, logs=[str(log)])
        is None
    )
    assert committed_steps(str(tmp_path / "ck")) == [] and log.read_text() == ""
    assert "deleted the earlier run's checkpoints (step-2, step-4)" in capsys.readouterr().err
    # an interrupted first save (a torchrun restart finds only step-N.partial) is no earlier run
    os.makedirs(tmp_path / "ck" / "step-2.partial" / "rng")
    assert resume_step(ck, CheckpointConfig(resume=False), total_steps=10, is_main=True) is None
    assert resume_step(ck, CheckpointConfig(), total_steps=10, is_main=True) is None


def test_resume_cuts_logs_back_and_a_disabled_checkpoint_touches_nothing(tmp_path):
    _two_checkpoints(tmp_path / "ck")
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 7)))
    ck = Checkpointer(str(tmp_path / "ck"))
    assert resume_step(ck, CheckpointConfig(enable=False), 10, True, logs=[str(log)]) is None
    assert len(log.read_text().splitlines()) == 6
    assert resume_step(ck, CheckpointConfig(), 10, True, logs=[str(log)]) == 4
    assert [json.loads(x)["step"] for x in log.read_text().splitlines()] == [1, 2, 3, 4]


def test_training_steps_below_the_checkpoint_is_a_config_error(tmp_path):
    _two_checkpoints(tmp_path)
    ck = Checkpointer(str(tmp_path))
    with pytest.raises(
        ConfigError,
        match=r"training.steps: 3 is below the step of the checkpoint "
        r"to resume .*step-4",
    ):
        resume_step(ck, CheckpointConfig(), total_steps=3, is_main=True)
    # a finished run, launched again
    assert resume_step(ck, CheckpointConfig(), total_steps=4, is_main=True) == 4


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_save_refuses_non_finite_weights_and_keeps_what_was_committed(tmp_path, bad):
    _two_checkpoints(tmp_path)
    ck = Checkpointer(str(tmp_path))
    m, opt = _model_and_opt(0)
    with torch.no_grad():
        m[1].weight[0, 3] = bad
    with pytest.raises(
        NonFiniteError,
        match=r"checkpoint step-6: refusing to save non-finite "
        r"weights \(1.weight on rank 0\)",
    ):
        ck.save(6, m, opt, {"step": 6})
    assert sorted(os.listdir(tmp_path)) == ["step-2", "step-4"]
    assert ck.verify(2) is None and ck.verify(4) is None
    with torch.no_grad():  # finite values whose norm overflows float32 are still saved
        m[1].weight.fill_(3e38)
    ck.save(6, m, opt, {"step": 6})
    assert committed_steps(str(tmp_path)) == [4, 6] and ck.verify(6) is None


def _train(dump, *extra):
    cmd = [
        sys.executable,
        os.path.join(ROOT, "train.py"),
        "--model.flavor=debug-qwen3",
        "--model.tokenizer=builtin:char",
        "--data.path=synthetic:addition_small",
        "--data.synthetic_rows=64",
        "--data.max_length=64",
        "--training.steps=4",
        "--training.batch_size=4",
        "--checkpoint.interval=2",
        "--metrics.loggers=[]",
        "--optimizer.lr=1e-3",
        f"--job.dump_folder={dump}",
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_train_resumes_past_a_corrupt_newest_checkpoint_and_keeps_the_good_one(tmp_path):
    dump = tmp_path / "run"
    assert _train(dump).returncode == 0
    ckpts = dump / "checkpoints"
    _overwrite_middle(_shard(str(ckpts / "step-4")))
    for name in ("ledger.jsonl", "metrics.jsonl"):  # a crash in the middle of the last append
        text = (dump / name).read_text()
        (dump / name).write_text(text[: len(text) - len(text.splitlines()[-1]) // 2 - 1])
    r = _train(dump, "--training.steps=5", "--checkpoint.interval=1")
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"resumed from {ckpts / 'step-2'} at step 2" in r.stdout
    assert "__0_0.distcp differs from its sha256" in r.stderr
    for name in ("ledger.jsonl", "metrics.jsonl"):
        assert r.stderr.count(f"{dump / name}:4: the last line is cut short") == 1, r.stderr
    # step-4 saved again, over the damaged one
    assert sorted(os.listdir(ckpts)) == ["step-4", "step-5"]
    for name in ("ledger.jsonl", "metrics.jsonl"):  # every step once (the ledger check: rc 0)
        steps = [json.loads(line)["step"] for line in (dump / name).read_text().splitlines()]
        assert steps == [1, 2, 3, 4, 5], name


def test_train_refuses_to_start_over_existing_checkpoints(tmp_path):
    dump = tmp_path / "run"
    assert _train(dump).returncode == 0
    before = {n: (dump / "checkpoints" / n / SUMS).read_text() for n in ("step-2", "step-4")}
    r = _train(dump, "--checkpoint.resume=false")
    assert r.returncode == 8, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert (
        len(lines) == 1 and "checkpoint.overwrite=true" in lines[0] and "Traceback" not in r.stderr
    )
    assert {n: (dump / "checkpoints" / n / SUMS).read_text() for n in before} == before
    r = _train(
        dump, "--checkpoint.resume=false", "--checkpoint.overwrite=true", "--training.steps=2"
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(os.listdir(dump / "checkpoints")) == ["step-2"]
    assert [json.loads(x)["step"] for x in (dump / "metrics.jsonl").read_text().splitlines()] == [
        1,
        2,
    ]
