"""The planner prices an FP8 KV pool (rollout.kv_dtype): the generator's own sizing rule
(`KVCache.bytes_per_block`, one byte an entry, plus 4 bytes per slot and KV head with per-token
scales), so a budget that binds holds about twice bf16's full-length sequences; and
``train.py --plan`` reads the setting."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from tandem.kernels.kv_quant import FORMATS
from tandem.models.flavors import get_flavor
from tandem.rl.generator.kv_cache import KVQuant
from tandem.rl.plan.planner import Layout, Planner, Settings

ROOT = Path(__file__).resolve().parents[2]


def test_fp8_pool_holds_twice_the_sequences_of_bf16():
    args = get_flavor("qwen3-8b")  # 36 layers, 8 KV heads of 128
    base = dict(
        kv_cache_gb=20.0, max_len=16385, prompts_per_step=1024, num_samples=8, max_num_seqs=4096
    )
    seqs = {}
    for name, quant in {
        "bf16": None,
        **{k: KVQuant(v) for k, v in FORMATS.items()},
        "per_token": KVQuant(FORMATS["fp8_e4m3"], per_token=True),
    }.items():
        nbytes, seqs[name] = Planner(
            args, Settings(gen_dtype=torch.bfloat16, kv_quant=quant, **base)
        ).kv_pool(Layout())
        # by hand: 36 layers x K and V x 8 heads x (128 entries x bytes + scale bytes) per token
        per_token = (
            36 * 2 * 8 * (128 * (2 if quant is None else 1) + (4 if name == "per_token" else 0))
        )
        assert seqs[name] == int(20e9 // (per_token * 16)) // (16385 // 16 + 1)
        assert nbytes <= 20e9
    assert seqs["fp8_e4m3"] == seqs["fp8_e5m2"] >= 2 * seqs["bf16"] - 1
    assert seqs["per_token"] >= 1.9 * seqs["bf16"]


def test_plan_command_reads_kv_dtype():
    out = {}
    for kv in ("auto", "fp8_e4m3"):
        r = subprocess.run(
            [
                sys.executable,
                "train.py",
                "--config",
                "configs/grpo.toml",
                "--plan",
                f"--rollout.kv_dtype={kv}",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""},
        )
        assert r.returncode == 0, r.stderr
        out[kv] = int(re.search(r"full-length sequences in the pool\s+(\d+)", r.stdout).group(1))
    # configs/grpo.toml: a 40 GB pool per rank of 4096-token sequences holds 65 in bf16; in FP8 the
    # rollout's 128 sequences per rank (16 prompts x 8 samples) fit, the cap of what it needs
    assert out == {"auto": 65, "fp8_e4m3": 128}
