"""SFT end to end under torchrun: loss falls on 2 ranks, and resume is exact."""

import json
import os
import random
import shutil
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _write_data(path):
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(48):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            msgs = [
                {"role": "user", "content": f"{a}+{b}="},
                {"role": "assistant", "content": str(a + b)},
            ]
            f.write(json.dumps({"messages": msgs}) + "\n")


def _train(dump, data, nproc=2, extra=()):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        os.path.join(ROOT, "train.py"),
        "--model.flavor=debug-qwen3",
        "--model.tokenizer=builtin:char",
        f"--data.path={data}",
        "--data.max_length=128",
        "--training.steps=6",
        "--training.batch_size=4",
        "--training.micro_batch_size=1",
        "--optimizer.lr=3e-3",
        "--lr_schedule.warmup_steps=2",
        "--checkpoint.interval=3",
        "--checkpoint.keep_last=2",
        "--metrics.loggers=[]",
        f"--job.dump_folder={dump}",
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r.stdout


def _flat(path):
    out = path + ".pt"
    dcp_to_torch_save(path, out)
    return torch.load(out, weights_only=False)


def _assert_equal_trees(a, b, where=""):
    if isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            _assert_equal_trees(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


@pytest.mark.slow
def test_sft_two_ranks_learns_and_resumes_exactly(tmp_path):
    data = str(tmp_path / "d.jsonl")
    _write_data(data)
    full = str(tmp_path / "full")
    _train(full, data)
    losses = [json.loads(line)["loss"] for line in open(os.path.join(full, "metrics.jsonl"))]
    assert len(losses) == 6
    assert losses[-1] < 0.8 * losses[0], losses

    # Resume: the same run, restarted from its step-3 checkpoint.
    resumed = str(tmp_path / "resumed")
    shutil.copytree(full, resumed)
    shutil.rmtree(os.path.join(resumed, "checkpoints", "step-6"))
    shutil.rmtree(os.path.join(resumed, "hf"))
    out = _train(resumed, data)
    assert "resumed from" in out and "at step 3" in out
    a = _flat(os.path.join(full, "checkpoints", "step-6"))
    b = _flat(os.path.join(resumed, "checkpoints", "step-6"))
    assert any(k.startswith("optim") for k in a)
    _assert_equal_trees(a, b)  # weights and optimizer state, bit for bit
    from safetensors.torch import load_file

    ha = load_file(os.path.join(full, "hf", "model.safetensors"))
    hb = load_file(os.path.join(resumed, "hf", "model.safetensors"))
    assert ha.keys() == hb.keys() and all(torch.equal(ha[k], hb[k]) for k in ha)
