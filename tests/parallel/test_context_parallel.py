"""Context parallelism (``parallel.cp``) equals cp = 1.

tandem/parallel/cp.py, tandem/parallel/ring_attention.py and tandem/rl/update/cp_batch.py. Two
torchrun launches (2 and 4 CPU processes, gloo) run tests/parallel/cp_worker.py once per
module: cp = 2 (Ulysses, ring, ring without shared prompts, ring under full activation
checkpointing), cp = 2 x dp = 2 (FSDP2 and HSDP) and cp = 4 against a plain one-process
model of the same weights on the same packed variable-length samples; rl.exact's kernels
bitwise; the activation bytes of one long sequence at cp = 1 and 2; and the guard on a
broken split. Single-process checks follow: the split, the KV-head rule, the ring's math
against `DocumentAttention` (fp64, gradients too) and the one-line config errors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.models.attention import DocumentAttention
from tandem.parallel.cp import SequenceSplit, kv_repeats
from tandem.parallel.ring_attention import RingAttention
from tests.fixtures import launch_worker

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "parallel" / "cp_worker.py"
RTOL = 1e-5
TWO = ["cp2_ulysses", "cp2_ring", "cp2_ring_unshared", "cp2_ring_ac_full"]
FOUR = ["cp2_dp2_ulysses", "cp2_dp2_ring", "cp2_hsdp2_ring", "cp4_ulysses", "cp4_ring"]
LOSSES = [
    "ppo_token_mean",
    "gspo_seq_mean_token_mean",
    "dr_grpo_seq_mean_token_sum_norm",
    "reinforce_seq_mean_token_sum",
]


def _launch(nproc: int, names: list[str], out: Path) -> dict:
    return launch_worker(WORKER, nproc, out, "--layouts", ",".join(names), timeout=420)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("cp")
    return {
        **_launch(2, TWO + ["exact", "memory", "guard"], tmp / "two.pt"),
        **_launch(4, FOUR, tmp / "four.pt"),
    }


def _ok(results: dict, name: str) -> dict:
    rec = results[name]
    assert "failure" not in rec, rec.get("failure")
    return rec


@pytest.mark.slow
@pytest.mark.parametrize("layout", TWO + FOUR)
def test_logits_logprobs_entropy_equal_cp1(results: dict, layout: str) -> None:
    rec = _ok(results, layout)
    for key in ("logits", "logprobs", "entropy", "old_logp"):
        assert rec[key] <= RTOL, (key, rec[key])
    cp = 4 if layout.startswith("cp4") else 2
    assert rec["cp_effective"] == cp  # measured by the attention guards, smallest over the ranks


@pytest.mark.slow
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("layout", TWO + FOUR)
def test_loss_and_every_gradient_equal_cp1(results: dict, layout: str, loss: str) -> None:
    """GSPO's sequence ratio, Dr. GRPO's constant normaliser and the token-sum aggregation
    see whole sequences under cp: the step's loss and all 25 gradients are cp = 1's."""
    got = _ok(results, layout)["losses"][loss]
    assert abs(got["loss"] - got["ref_loss"]) <= RTOL * abs(got["ref_loss"]), got
    assert got["grads_checked"] == 25
    assert got["grad"] <= RTOL, got


@pytest.mark.slow
@pytest.mark.parametrize(
    "pair",
    [("cp2_ulysses", "cp2_ring"), ("cp2_dp2_ulysses", "cp2_dp2_ring"), ("cp4_ulysses", "cp4_ring")],
)
def test_ulysses_equals_ring(results: dict, pair: tuple[str, str]) -> None:
    a, b = (_ok(results, p)["logp_values"] for p in pair)
    assert a.shape == b.shape and a.numel() > 50  # rank 0's completion tokens
    torch.testing.assert_close(a, b, rtol=RTOL, atol=1e-6)


@pytest.mark.slow
def test_ulysses_is_bitwise_cp1_under_exact_kernels(results: dict) -> None:
    rec = _ok(results, "exact")
    assert rec["n"] > 100 and rec["equal"], rec


@pytest.mark.slow
def test_activation_bytes_fall_by_cp(results: dict) -> None:
    """One 4096-token sequence: what its forward saves for backward, per rank, measured."""
    from tandem.rl.plan.planner import activation_bytes
    from tests.parallel.cp_worker import ARGS

    rec = _ok(results, "memory")
    for style in ("cp2_ulysses", "cp2_ring"):
        ratio = rec["cp1"] / rec[style]
        assert 1.85 <= ratio <= 2.1, (style, rec)
        # the planner prices a rank's activations as those of its S / cp tokens (long_context.py)
        planned = activation_bytes(
            ARGS, rec[style + "_tokens"] // 2, ARGS.num_layers, torch.float32, "none"
        )
        assert abs(planned - rec[style]) <= 0.05 * rec[style], (style, planned, rec[style])
    planned = activation_bytes(ARGS, rec["cp1_tokens"], ARGS.num_layers, torch.float32, "none")
    assert abs(planned - rec["cp1"]) <= 0.05 * rec["cp1"], (planned, rec["cp1"])


@pytest.mark.slow
def test_guard_fires_on_a_broken_split(results: dict) -> None:
    rec = _ok(results, "guard")
    assert (
        "holds 92 positions of a 92-token row, the whole row: the sequence was not split"
        in rec["unsplit"]
    )
    assert "0 of the model's 2 attention layers ran through the split's backend" in rec["bypassed"]
    assert "\n" not in rec["unsplit"] + rec["bypassed"]


# ---- one process -------------------------------------------------------------------------------


def test_zigzag_split_balances_and_partitions() -> None:
    splits = [SequenceSplit(16, 4, r, zigzag=True) for r in range(4)]
    assert splits[0].chunks() == [(0, 2), (14, 16)] and splits[3].chunks() == [(6, 8), (8, 10)]
    cols = torch.cat([s.index() for s in splits])
    assert sorted(cols.tolist()) == list(range(16))
    # causal work of each rank (keys at or before each of its queries) is the same
    work = [sum(c + 1 for c in s.index().tolist()) for s in splits]
    assert len(set(work)) == 1, work
    x = torch.arange(32).view(2, 16)
    s = splits[1]
    assert s.shard(x).tolist() == [[2, 3, 12, 13], [18, 19, 28, 29]]
    local = s.local_columns()
    assert local[[2, 3, 12, 13]].tolist() == [0, 1, 2, 3] and (local >= 0).sum() == 4
    with pytest.raises(ValueError, match="does not split into 8 equal chunks"):
        SequenceSplit(12, 4, 0, zigzag=True)


@pytest.mark.parametrize(
    "heads, kv, cp, rep",
    [(4, 2, 2, 1), (4, 2, 4, 2), (8, 1, 4, 4), (6, 3, 2, 2), (12, 4, 6, 3), (16, 2, 8, 4)],
)
def test_kv_heads_repeated_so_cp_divides_them(heads: int, kv: int, cp: int, rep: int) -> None:
    assert kv_repeats(heads, kv, cp) == rep
    assert (kv * rep) % cp == 0 and (heads // kv) % rep == 0


def test_kv_repeats_refuses_heads_that_cp_does_not_divide() -> None:
    with pytest.raises(ValueError, match="cp must divide them"):
        kv_repeats(6, 2, 4)


@pytest.mark.parametrize("branches", [False, True])
def test_ring_math_equals_document_attention(branches: bool) -> None:
    """One rank (no ring), tiny tiles: outputs and q/k/v gradients equal DocumentAttention's mask
    (documents, padding, and with shared-prompt branches) in fp64."""
    g = torch.Generator().manual_seed(0)
    b, s, hq, hkv, d = 2, 48, 4, 2, 8
    doc = torch.tensor([[0] * 10 + [1] * 20 + [2] * 14 + [-1] * 4, [0] * 48])
    br = None
    if branches:
        br = torch.zeros_like(doc)
        br[0, 15:22], br[0, 22:30] = 1, 2
    q, k, v = (
        torch.randn(b, s, h, d, generator=g, dtype=torch.float64, requires_grad=True)
        for h in (hq, hkv, hkv)
    )
    ring = RingAttention(None, SequenceSplit(s, 1, 0, zigzag=True), doc, br, tile_q=5, tile_k=7)
    assert any(t.full for t in ring.plan[0]) or branches
    out = ring(0, q, k, v)
    ref = DocumentAttention(doc, br)(0, q, k, v)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    for a, r in zip(
        torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)
    ):
        torch.testing.assert_close(a, r, rtol=0, atol=1e-12)


# ---- what does not compose yet: one line each ------------------------------------------------


def test_ulysses_needs_the_heads_to_divide_and_the_ring_does_not() -> None:
    """What cp composes with is the table's (tests/config/test_composes.py); the head count is
    the layout's own check."""
    from tandem.models.flavors import get_flavor
    from tandem.parallel.mesh import Degrees
    from tandem.rl.config.schema import ConfigError, load_config
    from tandem.rl.update.policy import check_layout

    with pytest.raises(ConfigError) as e:
        check_layout(get_flavor("debug-qwen3"), Degrees(cp=3), "1F1B", "ulysses")
    assert str(e.value) == (
        "parallel.cp: ulysses splits the 4 attention heads over cp = 3 ranks, which must "
        "divide them; set parallel.cp_style = 'ring'"
    )
    check_layout(get_flavor("debug-qwen3"), Degrees(cp=3), "1F1B", "ring")  # no error
    # the sft recipe splits its rows too (tests/recipes/test_long_context.py runs it)
    cfg = load_config(str(ROOT / "configs" / "quickstart_sft.toml"), ["parallel.cp=2"])
    assert cfg.parallel.cp == 2
