"""LoRA and an FP8 KV cache in both streaming rollout modes, end to end (torchrun, CPU, the
quickstart policy with rank-4 adapters on every projection and an e4m3 KV pool with calibrated
scales, 2 steps; one run of each mode carries both pairs).

At ``max_staleness = 0`` with ``rl.exact``, colocated async (2 ranks: the generation copy's
refill moves the adapters alone, the pool takes each version's scales) and split mode (3 ranks,
1 generator: each bridge sync after the first moves the adapters alone, with their checksum,
and the trainers' FP8 scales travel with it; stopped after step 1 and resumed from its
checkpoint) equal the 2-rank synchronous run: the same samples token for token with the same
log-probs, the same losses and the same scales, bit for bit, with the train/generation gap 0.
Split mode's later syncs move the adapters' bytes, counted here from the policy's config.json
(tests/parallel/test_split_bridge.py: a corrupted adapter fails the checksum;
tests/generator/test_fp8_kv_rescale.py: kept KV re-quantised to new scales).
"""

import json
import os

import pytest

from tests.fixtures import assert_same_as_synchronous
from tests.recipes.test_split_rl import _run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLAGS = ("--rl.exact=true", "--lora.rank=4", "--rollout.kv_dtype=fp8_e4m3", "--rl.num_samples=4")
KEYS = ("loss", "grad_norm", "entropy", "reward/total", "gap/abs_mean", "kv/amax_mean")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The synchronous run, colocated async, and split mode stopped by its step limit after step 1
    and resumed from that checkpoint (adapters and FP8 scales from it) for step 2."""
    base = tmp_path_factory.mktemp("async-lora-fp8")
    out = {
        "sync": (base / "sync", _run(base / "sync", *FLAGS, steps=2, nproc=2)),
        "colocated": (
            base / "colocated",
            _run(base / "colocated", *FLAGS, "--rollout.mode=colocated_async", steps=2, nproc=2),
        ),
    }
    split = (*FLAGS, "--rollout.mode=split", "--rollout.gen_ranks=1", "--checkpoint.interval=1")
    _run(base / "split", *split, steps=1, nproc=3)
    assert (base / "split" / "checkpoints" / "step-1").is_dir()
    out["split"] = (base / "split", _run(base / "split", *split, steps=2, nproc=3))
    return out


def _adapter_bytes() -> int:
    """Rank-4 adapters on q, k, v, o, gate, up and down of every layer: r (in + out) fp32 each."""
    with open(os.path.join(ROOT, "assets", "quickstart-policy", "config.json")) as f:
        c = json.load(f)
    d, ff, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    per_layer = (d + q) + 2 * (d + kv) + (q + d) + 3 * (d + ff)
    return 4 * per_layer * c["num_hidden_layers"] * 4


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["colocated", "split"])
def test_lora_and_fp8_kv_at_staleness_zero_equal_the_synchronous_run(runs, mode):
    assert_same_as_synchronous(runs["sync"], runs[mode], 2 * 16 * 4, KEYS)
    rows = runs[mode][1]
    assert all(r["gap/abs_max"] == 0.0 and r["kv/scale_age"] == 0.0 for r in rows)
    assert all(r["kv/requantized_heads"] == 0.0 for r in rows)  # nothing kept through a sync


@pytest.mark.slow
def test_split_syncs_after_the_first_move_the_adapters_alone(runs):
    rows = runs["split"][1]
    assert [r["split/sync_gb"] * 1e9 for r in rows] == [_adapter_bytes()] * 2
    # the adapters changed, and so did the checksum of what the generator holds
    assert rows[0]["split/sync_checksum"] != rows[1]["split/sync_checksum"]
    colocated = runs["colocated"][1]
    assert [r["reshard/gb"] * 1e9 for r in colocated] == [_adapter_bytes()] * 2
