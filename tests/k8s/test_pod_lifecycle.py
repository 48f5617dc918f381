"""A rendered JobSet's pods, run by a local stand-in for the controller (pod_harness.py): a pod
deleted mid-run (SIGTERM, the grace period, SIGKILL) is restarted by the manifest's policy and
the run ends with the weights of an uninterrupted one, every prompt trained once."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tandem.k8s.cli import render_documents
from tests.fixtures import assert_same_tree, flat_checkpoint
from tests.k8s.pod_harness import JobSetRunner

RUN = (
    "--k8s.gpus_per_node=1",  # one torchrun process per pod (the harness runs them on CPU)
    "--k8s.grace_s=120",
    "--k8s.max_restarts=6",  # room for the rendezvous to settle on a loaded machine
    "--training.steps=6",
    "--checkpoint.interval=2",
    "--rl.prompts_per_step=16",
    "--rl.eval_prompts=8",
    "--training.eval_interval=0",
    "--metrics.loggers=[]",
    "--reward.num_workers=0",
    "--checkpoint.export_hf_at_end=false",
)


def _jobset() -> dict:
    docs, _ = render_documents("configs/quickstart.toml", 2, "jobset", None, list(RUN))
    return docs[1]


def _steps(dump: Path) -> int:
    path = dump / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.slow
def test_a_deleted_pod_restarts_and_the_run_matches_an_uninterrupted_one(tmp_path: Path) -> None:
    clean = tmp_path / "clean" / "dump"
    clean.mkdir(parents=True)
    runner = JobSetRunner(_jobset(), clean)
    try:
        runner.start()
        runner.wait(900)
    finally:
        runner.stop()
    assert runner.failures == 0

    dump = tmp_path / "deleted" / "dump"
    dump.mkdir(parents=True)
    runner = JobSetRunner(_jobset(), dump)
    try:
        runner.start()
        deadline = time.monotonic() + 600
        while _steps(dump) < 3:  # mid-run: after step 3, before the end
            assert time.monotonic() < deadline, runner.tail()
            time.sleep(0.2)
        rc = runner.pods[1].delete()
        assert rc != 0  # it stopped for the deletion (75 from the workers, or the signal)
        runner.wait(900)
    finally:
        runner.stop()
    assert runner.pods[1].starts >= 2 and runner.failures >= 1, runner.tail()
    assert (dump / "preempt").is_dir()  # the SIGTERM path: every rank checkpointed and stopped
    assert_same_tree(
        flat_checkpoint(clean / "checkpoints" / "step-6"),
        flat_checkpoint(dump / "checkpoints" / "step-6"),
    )
    ledger = [json.loads(line) for line in open(clean / "ledger.jsonl")]
    assert ledger == [json.loads(line) for line in open(dump / "ledger.jsonl")]
    ids = [i for row in ledger for i in row["ids"]]
    assert len(ids) == len(set(ids)) == 6 * 16  # every prompt trained exactly once
