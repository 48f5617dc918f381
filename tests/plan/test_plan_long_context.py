"""The planner's long-context terms (tandem/rl/plan/long_context.py): context parallelism prices a
rank's activations by its share of the longest sequence, the smallest-layout search takes cp when a
sequence outgrows a rank, and the rollout's KV room is counted for each offload choice.
(The activation count at cp = 2 is checked against a CPU run in
tests/parallel/test_context_parallel.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tandem.models.flavors import get_flavor
from tandem.rl.plan.long_context import kv_choices, tokens_per_rank
from tandem.rl.plan.planner import Layout, Planner, Settings

ROOT = Path(__file__).resolve().parents[2]
ARGS = get_flavor("qwen3-8b")


def _planner(seq_len: int, **kw) -> Planner:
    return Planner(
        ARGS,
        Settings(
            tokens=16384,
            seq_len=seq_len,
            max_len=seq_len + 1,
            ac="full",
            kv_cache_gb=1.0,
            prompts_per_step=32,
            **kw,
        ),
    )


def test_a_rank_holds_its_share_of_the_longest_sequence():
    assert tokens_per_rank(16384, 65536, 1) == 65536  # the packer gives it a micro-batch of its own
    assert tokens_per_rank(16384, 65536, 4) == 16384 == tokens_per_rank(16384, 4096, 1)
    assert tokens_per_rank(16384, 65536, 8) == 16384  # never below the micro-batch budget
    p = _planner(65536)
    one, four = (
        p.plan(Layout(dp_shard=8, rollout_tp=1))[0],
        p.plan(Layout(dp_shard=2, cp=4, rollout_tp=1))[0],
    )
    assert one.update["activations"] == 4 * four.update["activations"]  # 65536 tokens against 16384
    assert (
        one.update["recomputed block (transient)"]
        == 4 * four.update["recomputed block (transient)"]
    )
    # FSDP2 shards over dp_shard x cp: the same 8-way state
    for key in ("parameters", "gradients", "optimizer state"):
        assert one.update[key] == four.update[key]
    assert (
        "cp attention (transient)" in four.update and "cp attention (transient)" not in one.update
    )


def test_smallest_layout_takes_cp_when_the_sequence_outgrows_a_rank():
    """qwen3-8b at 64k tokens, 8 x 80 GB: on 4 ranks without cp one rank holds a whole 65536-token
    sequence (its checkpointed inputs and one recomputed block) beside a quarter of the state and
    does not fit; split over cp = 2 it does, so the search returns dp_shard = 2 x cp = 2. At 4k
    tokens nothing is split."""
    p = _planner(65536)
    lay, _ = p.smallest(nodes=1, devices_per_node=8, device_bytes=80e9)
    assert (lay.world, lay.dp_shard, lay.cp, lay.tp, lay.pp) == (4, 2, 2, 1, 1), lay
    no_cp = p.plan(Layout(dp_shard=4, rollout_tp=lay.rollout_tp))[0]
    assert no_cp.peak > 0.9 * 80e9 and no_cp.peak_phase() == "update"
    short, _ = _planner(4096).smallest(nodes=1, devices_per_node=8, device_bytes=80e9)
    assert short.cp == 1
    # Ulysses needs cp to divide the 32 query heads: cp candidates are powers of two up to the node
    assert sorted({x.cp for x in p.candidates(8, 8)}) == [1, 2, 4, 8]


def test_kv_room_of_each_offload_choice_by_hand():
    """72 GB usable, 4 GB of fp32 parameters, a 16 GB generation shard and its buffers (fixed 16.5),
    0.5 GB per full-length sequence: resident 12 GB leaves 43.5 GB (87 sequences); offloading the
    moments leaves 4 GB resident (103); the parameters too, none (111)."""
    rows = kv_choices(72e9, 4e9, 0, 0, 16.5e9, 0.5e9, offload_optimizer=False, cpu_offload=False)
    assert [(r.name, r.resident, r.sequences) for r in rows] == [
        ("as configured", 12e9, 87),
        ("rl.offload_optimizer = true", 4e9, 103),
        ("+ parallel.cpu_offload = true", 0.0, 111),
    ]
    assert (
        len(kv_choices(72e9, 4e9, 0, 0, 16.5e9, 0.5e9, offload_optimizer=True, cpu_offload=False))
        == 2
    )


def test_plan_prints_the_kv_room_and_the_cp_layout():
    r = subprocess.run(
        [sys.executable, "train.py", "--config", "configs/grpo_8b_64k.toml", "--plan"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "layout: 8 ranks: pp=1 dp_shard=2 cp=4 tp=1" in r.stdout
    assert (
        "rollout KV room (full-length sequences of 65536 tokens, rollout.max_tokens = 64512):"
        in r.stdout
    )
    assert "smallest layout that fits: 4 ranks: pp=1 dp_shard=2 cp=2 tp=1" in r.stdout
