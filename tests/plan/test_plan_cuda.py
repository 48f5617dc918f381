"""The planner's predicted peak per phase against ``torch.cuda.max_memory_allocated`` (GPU only).

Three layouts that fit one device, activation checkpointing none / selective / full, of a
Qwen3-0.6B-shaped model (hidden 1024 x 28 layers, vocabulary 151,936, random weights) on
bench/grpo_step.py's workload: each trains 2 RL steps with ``train.py``, which logs
``memory/update_peak_gb`` and ``memory/rollout_peak_gb`` (the allocator's peak since the
phase began), and the planner (tandem/rl/plan/planner.py) predicts both from the same
config. Each phase must be within 25 % (issue 42's bound for activations; the state
components it asks within 5 % are in every peak). The table it prints goes to
docs/performance.md; scripts/gpu_check.sh runs it as the part ``planner``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import grpo_step
from tandem.rl.config.schema import parse_args as parse_train_args
from tandem.rl.plan.cli import plan_args
from tandem.rl.plan.planner import Layout, Planner, Settings

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
ROOT = Path(__file__).resolve().parents[2]
TOL = 0.25
WORKLOAD = dict(
    shape="small",
    hidden=1024,
    layers=28,
    vocab=151936,
    device="cuda",
    prompts=8,
    samples=8,
    max_tokens=128,
    steps=2,
    kv_cache_gb=4.0,
    lr=1e-6,
    threads=2,
)


@pytest.fixture(scope="module")
def workload(tmp_path_factory) -> tuple[str, str, Path]:
    folder = tmp_path_factory.mktemp("plan_cuda")
    model_dir, data = grpo_step.write_workload(str(folder), argparse.Namespace(**WORKLOAD))
    return model_dir, data, folder


@pytest.mark.parametrize("ac", ["none", "selective", "full"])
def test_planned_peak_matches_cuda_peak(workload, ac: str):
    model_dir, data, folder = workload
    args = argparse.Namespace(**WORKLOAD, activation_checkpoint=ac)
    dump = folder / f"run-{ac}"
    argv = grpo_step.tandem_argv(model_dir, data, str(dump), args)
    cfg = parse_train_args(argv)[0]
    model_args, _ = plan_args(cfg)
    (plan,) = Planner(model_args, Settings.from_config(cfg)).plan(Layout(dp_shard=1))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))),
    }
    r = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in open(dump / "metrics.jsonl")]
    print(
        f"\nactivation_checkpoint={ac}: phase, planned GB, measured GB (max over {len(rows)} steps)"
    )
    for phase, parts in (("update", plan.update), ("rollout", plan.rollout)):
        planned = sum(parts.values()) / 1e9
        measured = max(x[f"memory/{phase}_peak_gb"] for x in rows)
        each = ", ".join(f"{k} {v / 1e9:.2f}" for k, v in parts.items())
        print(f"  {phase:<8}{planned:>8.2f}{measured:>8.2f}  ({each})")
        assert abs(planned - measured) <= TOL * measured, (
            f"{ac} {phase}: planned {planned:.2f} GB, measured {measured:.2f}"
        )
