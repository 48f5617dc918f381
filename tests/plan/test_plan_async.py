"""The planner prices the asynchronous modes (tandem/rl/plan/async_modes.py), by hand:

- colocated_async: each rank's KV pool holds its share of the P (S + 1) groups in flight (the
  streaming generator's ``max_num_seqs``), and ``suspended_kv = "keep"`` keeps that pool on the
  device through the update (offload and recompute do not);
- split: a generator holds the whole bf16 model, its pool and one bucket, no training state; a
  trainer holds fp32 weights, gradients and AdamW moments sharded over the trainers alone.
And ``train.py --plan`` prints both for the shipped 8B configs."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tandem.models.flavors import get_flavor
from tandem.rl.generator.kv_cache import KVCache
from tandem.rl.plan.async_modes import async_plans
from tandem.rl.plan.planner import Layout, Planner, Settings

ROOT = Path(__file__).resolve().parents[2]
ARGS = get_flavor("qwen3-8b")
GB = 1e9


def _planner(**kw):
    base = dict(
        gen_dtype=torch.bfloat16,
        kv_cache_gb=30.0,
        max_len=9217,
        prompts_per_step=32,
        num_samples=8,
        max_num_seqs=4096,
        block_size=16,
    )
    return Planner(ARGS, Settings(**{**base, **kw}))


def _pool_by_hand(prompts_per_generator, kv_gb=30.0):
    per_block = KVCache.bytes_per_block(ARGS, 16, torch.bfloat16, None)
    per_seq = math.ceil(9217 / 16)
    blocks = min(int(kv_gb * GB) // per_block, prompts_per_generator * 8 * per_seq)
    return blocks * per_block, blocks // per_seq


@pytest.mark.parametrize("kv, s", [("keep", 1), ("offload", 1), ("recompute", 2), ("keep", 0)])
def test_colocated_async_prices_the_flight_and_the_suspended_kv(kv, s):
    planner, lay = _planner(kv_cache_gb=4.0), Layout(dp_shard=8)
    ro = SimpleNamespace(mode="colocated_async", max_staleness=s, suspended_kv=kv, gen_ranks=0)
    plan = async_plans(SimpleNamespace(rollout=ro), planner, lay, planner.plan(lay))[0]
    nbytes, seqs = _pool_by_hand(math.ceil(32 * (s + 1) / 8), kv_gb=4.0)
    assert (plan.rollout["KV pool"], plan.kv_sequences) == (nbytes, seqs)
    assert plan.update.get("suspended KV (keep)", 0) == (nbytes if kv == "keep" else 0)
    sync = planner.plan(lay)[0]
    assert {k: v for k, v in plan.update.items() if k != "suspended KV (keep)"} == sync.update


def test_split_prices_a_generator_and_a_trainer():
    planner, trainers = _planner(), Layout(dp_shard=6)
    ro = SimpleNamespace(mode="split", max_staleness=1, suspended_kv="keep", gen_ranks=2)
    gen, trainer = async_plans(
        SimpleNamespace(rollout=ro), planner, trainers, planner.plan(trainers)
    )
    n = sum(p.numel() for p in _meta_params())
    assert gen.kind == "generator" and sum(gen.update.values()) == 0
    assert gen.rollout["generation copy (whole)"] == 2 * n  # bf16, tied weights once
    assert (gen.rollout["KV pool"], gen.kv_sequences) == _pool_by_hand(32 * 2 // 2)
    assert gen.rollout["bridge receive buffers (at most)"] == 256 << 20
    assert trainer.kind == "trainer" and "generation shard" not in trainer.rollout
    assert trainer.update["parameters"] == pytest.approx(4 * n / 6, rel=1e-3)
    assert trainer.update["optimizer state"] == pytest.approx(8 * n / 6, rel=1e-3)
    assert trainer.rollout["resident training state"] == pytest.approx(12 * n / 6, rel=1e-3)


def _meta_params():
    from tandem.models.vlm import make_model

    with torch.device("meta"):
        return list(make_model(ARGS).parameters())


@pytest.mark.parametrize(
    "config, needle",
    [("grpo_8b_async", "suspended KV (keep)"), ("grpo_8b_split", "generator         trainer")],
)
def test_the_8b_configs_plan(config, needle):
    r = subprocess.run(
        [sys.executable, "train.py", "--config", f"configs/{config}.toml", "--plan"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert needle in r.stdout and "fits: peak" in r.stdout
