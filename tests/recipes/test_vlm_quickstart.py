"""The VLM quickstart learns: configs/quickstart_vlm.toml on 2 CPU ranks raises held-out
accuracy (new pictures) by at least 0.3, with the tower run once per image prompt group and
moved into the generation copy once; configs/quickstart_vlm_sft.toml, which made its starting
policy, starts and trains the README's way.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(config: str, dump, nproc: int, *extra: str) -> tuple[list[dict], str]:
    launch = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
    ]
    cmd = [
        *launch,
        os.path.join(ROOT, "train.py"),
        "--config",
        os.path.join(ROOT, "configs", config),
        f"--job.dump_folder={dump}",
        "--metrics.loggers=[]",
        *extra,
    ]
    r = subprocess.run(
        cmd,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [json.loads(line) for line in open(dump / "metrics.jsonl")], r.stdout


@pytest.mark.slow
def test_vlm_quickstart_learns(tmp_path):
    rows, out = _run("quickstart_vlm.toml", tmp_path / "rl", 2)
    start, end = map(
        float, re.search(r"eval accuracy: start ([\d.]+) -> end ([\d.]+)", out).groups()
    )
    assert end - start >= 0.3, (start, end)
    steps = [r for r in rows if "rollout/vision_tower_runs" in r]
    assert len(steps) == 40
    # rank 0's 8 pictures, 8 samples each
    assert all(r["rollout/vision_tower_runs"] == 8.0 for r in steps)
    # the frozen tower moved once, at the first evaluation
    assert all(r["reshard/kept_gb"] > 0 for r in steps)


@pytest.mark.slow
def test_vlm_sft_config_trains(tmp_path):
    rows, _ = _run(
        "quickstart_vlm_sft.toml",
        tmp_path / "sft",
        1,
        "--training.steps=2",
        "--data.synthetic_rows=64",
        "--metrics.log_interval=1",
        "--checkpoint.enable=false",
    )
    assert len(rows) == 2 and rows[1]["loss"] < rows[0]["loss"]
    assert (tmp_path / "sft" / "hf" / "preprocessor_config.json").is_file()
