"""The planner prices a low-bit generation copy (rollout.weight_dtype): each dense projection of
the shard at its format's bytes (values + block scales), by hand for Qwen3-8B, the rest in the
generation dtype; the rollout phase's peak falls by as much; the config's key reaches it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.kernels.weight_quant import FORMATS
from tandem.models.flavors import get_flavor
from tandem.rl.config.schema import load_config
from tandem.rl.plan.cli import format_plan
from tandem.rl.plan.planner import Layout, Planner, Settings

ROOT = Path(__file__).resolve().parents[2]


def _per_layer_projections() -> list[tuple[int, int]]:
    # Qwen3-8B: hidden 4096, 32 query heads and 8 KV heads of 128, MLP 12288
    return [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096)] + [
        (12288, 4096),
        (12288, 4096),
        (4096, 12288),
    ]


@pytest.mark.parametrize(
    "name, per_weight",
    [
        # by hand: e4m3 bytes + one fp32 scale per 128 x 128 block (every dim a multiple of 128)
        ("fp8_block", lambda n, k: n * k + (n // 128) * (k // 128) * 4),
        # e4m3 bytes + one e8m0 byte per 32 inputs
        ("mxfp8", lambda n, k: n * k + n * k // 32),
        # two e2m1 a byte + one e4m3 scale per 16 inputs + the fp32 tensor scale
        ("w4a16", lambda n, k: n * k // 2 + n * k // 16 + 4),
    ],
)
def test_generation_shard_prices_the_projections(name, per_weight) -> None:
    args = get_flavor("qwen3-8b")
    assert args.num_layers == 36 and args.intermediate_size == 12288
    full = Planner(args, Settings(gen_dtype=torch.bfloat16))
    low = Planner(args, Settings(gen_dtype=torch.bfloat16, weight_format=FORMATS[name]))
    saved = 36 * sum(2 * n * k - per_weight(n, k) for n, k in _per_layer_projections())
    assert full.generation_shard(1) - low.generation_shard(1) == saved
    ratio = (
        36
        * sum(2 * n * k for n, k in _per_layer_projections())
        / (36 * sum(per_weight(n, k) for n, k in _per_layer_projections()))
    )
    assert ratio > {"fp8_block": 1.99, "mxfp8": 1.9, "w4a16": 3.5}[name]
    rollout = {p.kind: p.rollout for p in full.plan(Layout())}
    rollout_low = {p.kind: p.rollout for p in low.plan(Layout())}
    for kind, parts in rollout.items():
        assert parts["generation shard"] - rollout_low[kind]["generation shard"] == saved
    # the freed room in full-length sequences: 36 layers x K and V x 8 KV heads x 128 x 2 bytes
    # per token, 2048 tokens -> 128 blocks of 16 (the default max_len and block size)
    per_seq = 36 * 2 * 8 * 128 * 2 * 16 * 128
    assert [p.freed for p in low.plan(Layout())] == [(saved, saved // per_seq)]
    assert [p.freed for p in full.plan(Layout())] == [(0.0, 0)]
    assert "freed by weight_dtype (GB, seqs)" in format_plan(low.plan(Layout()), 80e9)


def test_config_key_reaches_the_planner() -> None:
    cfg = load_config(str(ROOT / "configs" / "quickstart.toml"), ["rollout.weight_dtype=w4a16"])
    assert Settings.from_config(cfg).weight_format is FORMATS["w4a16"]
    assert (
        Settings.from_config(load_config(str(ROOT / "configs" / "quickstart.toml"))).weight_format
        is None
    )
