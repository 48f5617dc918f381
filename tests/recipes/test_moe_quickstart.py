"""The MoE quickstart (configs/quickstart_moe.toml, 2 CPU ranks, EP = 2) learns with exact
routing parity, and its DCP checkpoint resumes on other expert-parallel degrees.

One module fixture runs the quickstart once; its step-60 checkpoint (experts saved as
``Shard(0)`` DTensors over the 2 EP ranks) is then

* loaded with nothing left to train on 1 rank and on 2 ranks of plain FSDP2 (ep = 1): the
  HF export equals the EP = 2 run's bit for bit;
* continued for one step (61) on 2 ranks EP = 2 (the reference), 1 rank and 2 ranks
  FSDP2 (ep = 1), and 4 ranks of HSDP (2 replicas of 2 FSDP2 shards) with an EP = 2 group
  in each replica (experts ``[Replicate, Shard(0)]`` on a 2 x 2 mesh), 2 ranks of TP
  (experts split by hidden features, tandem/parallel/moe_tp.py) and 4 ranks of TP 2 x EP 2
  (attention TP, experts split both ways), each with one sample per micro-batch, so the router
  losses (a mean over each micro-batch's tokens) see the same token sets on every layout:
  the step-61 weights and AdamW moments agree to float tolerance (a fresh optimizer would be O(1)
  off: Adam's first step is about ``lr * sign(g)``).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs", "quickstart_moe.toml")
# name -> (ranks, parallel.ep, parallel.dp_replicate, parallel.tp); the continuations of step 60 to
# 61
CONTINUE = {
    "ep2": (2, 2, 1, 1),
    "one_rank": (1, 1, 1, 1),
    "fsdp2": (2, 1, 1, 1),
    "hsdp_ep2": (4, 2, 2, 1),
    "tp2": (2, 1, 1, 2),
    "tp2_ep2": (4, 2, 1, 2),
}


def _run(dump: str, nproc: int, extra: tuple[str, ...] = ()) -> tuple[list[dict], str]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        os.path.join(ROOT, "train.py"),
        "--config",
        CONFIG,
        f"--job.dump_folder={dump}",
        "--metrics.loggers=[]",
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    path = os.path.join(dump, "metrics.jsonl")  # none when a resumed run had no step left
    return (
        ([json.loads(line) for line in open(path)] if os.path.exists(path) else []),
        r.stdout + r.stderr,
    )


def _resume_from(base, name: str, step: int) -> str:
    dump = base / name
    shutil.copytree(
        base / "quickstart" / "checkpoints" / f"step-{step}", dump / "checkpoints" / f"step-{step}"
    )
    return str(dump)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("moe")
    out = {"quickstart": _run(str(base / "quickstart"), 2)}  # checkpoints at 20, 40, 60 (keep 2)
    for name, nproc in (("load_one_rank", 1), ("load_fsdp2", 2)):
        out[name] = _run(_resume_from(base, name, 60), nproc, ("--parallel.ep=1",))
    for name, (nproc, ep, replicas, tp) in CONTINUE.items():
        out[name] = _run(
            _resume_from(base, name, 60),
            nproc,
            (
                f"--parallel.ep={ep}",
                f"--parallel.dp_replicate={replicas}",
                f"--parallel.tp={tp}",
                "--training.steps=61",
                "--checkpoint.interval=1",
                "--rl.micro_batch_tokens=1",
            ),
        )
    return base, out


def _hf(dump) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in glob.glob(os.path.join(dump, "hf", "*.safetensors")):
        out.update(load_file(f))
    assert out, dump
    return out


def _checkpoint(dump, step: int) -> dict:
    path = os.path.join(dump, f"step-{step}.pt")
    dcp_to_torch_save(os.path.join(dump, "checkpoints", f"step-{step}"), path)
    return torch.load(path, weights_only=False)


def _worst_rel(a: dict, b: dict) -> tuple[float, str]:
    assert a.keys() == b.keys()
    return max(
        (float((a[k] - b[k]).abs().max() / a[k].abs().max().clamp(min=1e-30)), k)
        for k in a
        if torch.is_tensor(a[k]) and a[k].is_floating_point()
    )


@pytest.mark.slow
def test_moe_quickstart_learns_with_exact_routing_parity(runs):
    _, out = runs
    rows, log = out["quickstart"]
    assert len(rows) == 60
    said = re.search(r"eval accuracy: start ([\d.]+) -> end ([\d.]+)", log)
    assert said, log[-2000:]
    start, end = float(said[1]), float(said[2])
    assert end - start >= 0.2, (start, end)  # 0.527 -> 0.973 measured
    for r in rows:
        # every (token, layer) the update recomputed with the rollout's weights chose the experts
        # the generator chose (fp32 CPU, EP = 2 in both phases)
        assert r["moe/routing_mismatch"] == 0.0 and r["moe/routing_compared"] > 500, r["step"]
        for layer in ("0", "1"):  # 4 experts, 2 per token: the load ratio lies in [1, E / k]
            assert 1.0 <= r[f"moe/expert_load_max_over_mean/{layer}"] <= 2.0, r["step"]
        assert r["moe/aux_loss"] > 0 and r["moe/z_loss"] > 0, r["step"]
    for name in CONTINUE:
        # the continuations (1, 2 and 4 ranks, ep 1 and 2, HSDP, TP) compare routing too
        (row,) = out[name][0]
        assert (
            row["step"] == 61
            and row["moe/routing_mismatch"] == 0.0
            and row["moe/routing_compared"] > 500
        ), name


@pytest.mark.slow
def test_ep2_checkpoint_loads_bit_for_bit_without_ep(runs):
    base, out = runs
    ref = _hf(base / "quickstart")
    for name in ("load_one_rank", "load_fsdp2"):
        assert out[name][0] == [] and "resumed from" in out[name][1], name  # nothing left to train
        got = _hf(base / name)
        assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref), name


@pytest.mark.slow
def test_ep2_checkpoint_continues_with_its_optimizer_state_on_other_layouts(runs):
    base, out = runs
    ref = _checkpoint(base / "ep2", 61)
    saved = _checkpoint(base / "quickstart", 60)
    # an expert tensor sharded over the EP ranks at save
    key = "state.layers.1.moe.experts.w2.exp_avg"
    # step 61 moved it
    assert _worst_rel({key: saved["optim"][key]}, {key: ref["optim"][key]})[0] > 1e-2
    for name in ("one_rank", "fsdp2", "hsdp_ep2", "tp2", "tp2_ep2"):
        got = _checkpoint(base / name, 61)
        steps = {float(v) for k, v in got["optim"].items() if k.endswith(".step")}
        assert steps == {61.0}, (name, steps)  # AdamW's step counts went on from 60
        # measured: weights 5e-8, moments 2.6e-6 (one rank vs EP = 2; float order of the sums)
        assert _worst_rel(ref["model"], got["model"])[0] < 1e-6, name
        assert _worst_rel(ref["optim"], got["optim"])[0] < 1e-4, name
        (a,), (b,) = out["ep2"][0], out[name][0]
        # the same samples from the loaded weights
        assert a["reward/total"] == b["reward/total"], name
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (name, a["loss"], b["loss"])
