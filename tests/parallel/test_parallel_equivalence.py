"""One GRPO-style update on every parallel layout equals the single-process update.

Two torchrun launches (2 and 4 CPU processes, gloo) run tests/parallel/parallel_worker.py
once per module; each worker runs all its layouts in sequence and rank 0 writes
losses, full gradients and full updated weights, plus a plain single-process
reference of the same step. Tests compare each layout to that reference at
1e-5 relative (max abs error / max abs value per tensor). Cheap single-process
checks of the error messages, the log-prob / entropy math and compile follow.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tandem.models.args import ModelArgs
from tandem.models.transformer import Transformer
from tandem.parallel.ac import apply_ac
from tandem.parallel.compile import apply_compile
from tandem.parallel.expert_parallel import validate_ep
from tandem.parallel.loss import vocab_parallel_entropy, vocab_parallel_token_logprobs
from tandem.parallel.pp import build_pipeline, pipeline_split
from tandem.parallel.tp import validate_tp

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "parallel" / "parallel_worker.py"
RTOL = 1e-5

LAYOUTS_2 = [
    "fsdp2",
    "fsdp2_ac_full",
    "tp2",
    "tp2_ac_selective",
    "tp2_qwen2_entropy",
    "tp2_llama_nosp",
    "tp2_qwen3_tied",
    "pp2_1f1b",
    "pp2_gpipe",
    "pp2_interleaved",
    "pp2_qwen3_tied",
    "fsdp2_moe",
    "fsdp2_ep2_moe",
    "tp2_moe",
    "tp2_qwen2_moe_nosp",
]
LAYOUTS_4 = [
    "fsdp2_tp2",
    "pp2_fsdp2",
    "hsdp2x2",
    "pp2_tp2",
    "fsdp4_ep4_moe",
    "fsdp4_ep2_moe",
    "hsdp2x2_ep2_moe",
    "fsdp2_tp2_qwen2_moe",
    "fsdp2_tp2_ep2_qwen2_moe",
]


def _launch(nproc: int, layouts: list[str], out: Path, errors: bool) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(WORKER),
        "--out",
        str(out),
        "--layouts",
        ",".join(layouts),
    ]
    if errors:
        cmd.append("--errors")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    if proc.returncode != 0:
        raise RuntimeError(
            f"worker failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("parallel")
    two = _launch(2, LAYOUTS_2, tmp / "two.pt", errors=True)
    four = _launch(4, LAYOUTS_4, tmp / "four.pt", errors=False)
    return {
        "layouts": {**two["layouts"], **four["layouts"]},
        "reference": {**two["reference"], **four["reference"]},
        "failures": {**two["failures"], **four["failures"]},
        "errors": two["errors"],
    }


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS_2 + LAYOUTS_4)
def test_layout_matches_single_rank(results: dict, layout: str) -> None:
    assert layout not in results["failures"], results["failures"][layout]
    got = results["layouts"][layout]
    ref = results["reference"][got["reference"]]
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"], strict=True)):
        assert abs(a - b) <= RTOL * abs(b), f"step {step} loss {a} != {b}"
    assert set(got["weights"]) == set(ref["weights"])
    assert set(got["grads"]) == set(ref["grads"])
    bad_g = {k: _rel(got["grads"][k], v) for k, v in ref["grads"].items()}
    bad_w = {k: _rel(got["weights"][k], v) for k, v in ref["weights"].items()}
    assert max(bad_g.values()) <= RTOL, {k: e for k, e in bad_g.items() if e > RTOL}
    assert max(bad_w.values()) <= RTOL, {k: e for k, e in bad_w.items() if e > RTOL}
    # Ranks holding the same parameter agree (replicated norms must not drift apart).
    assert got["rank_mismatch"] <= 1e-6
    # Every DTensor grad has its parameter's placements (no Partial left for the optimizer).
    assert got["grad_placements_ok"]


@pytest.mark.slow
def test_tp_not_dividing_heads_raises_one_line(results: dict) -> None:
    msg = results["errors"]["tp_heads"]
    assert "must divide num_kv_heads=3" in msg and "\n" not in msg


# ------------------------------------------------------------------ single process
def _args(**kw) -> ModelArgs:
    base = dict(
        model_type="qwen3",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
    )
    return ModelArgs(**{**base, **kw})


@pytest.mark.parametrize(
    "tp, needle", [(3, "num_heads=4"), (4, "num_kv_heads=2"), (8, "num_heads=4")]
)
def test_validate_tp_one_line(tp: int, needle: str) -> None:
    with pytest.raises(ValueError) as e:
        validate_tp(_args(), tp)
    assert needle in str(e.value) and "\n" not in str(e.value)
    validate_tp(_args(), 2)


@pytest.mark.parametrize(
    "experts, ep, sizes, needle",
    [
        (0, 2, (2, 1, 1, 1), "dense"),
        (4, 3, (6, 1, 1, 1), "ep=3 must divide num_experts=4"),
        (4, 4, (6, 1, 1, 1), "ep=4 must divide dp_shard=6"),
        (4, 2, (4, 2, 1, 1), "ep=2 with tp=2 needs ep = dp_shard (4)"),
        (4, 2, (2, 2, 1, 2), "no HSDP (dp_replicate=2)"),
        (4, 2, (2, 1, 2, 1), "pp=2"),
    ],
)
def test_validate_ep_one_line(experts: int, ep: int, sizes: tuple, needle: str) -> None:
    """EP groups of any divisor of dp_shard (and the experts) are accepted; the rest
    get one line."""
    moe = _args(
        model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16
    )
    args = moe if experts else _args()
    dp_shard, tp, pp, dp_replicate = sizes
    with pytest.raises(ValueError) as e:
        validate_ep(args, ep, dp_shard=dp_shard, tp=tp, pp=pp, dp_replicate=dp_replicate)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
    for ok in (1, 2, 4):  # 2 groups of 4 ranks or 4 of 2 (or whole-world EP) on 8 FSDP2 ranks
        validate_ep(moe, ok, dp_shard=8, tp=1, pp=1, dp_replicate=1)
    validate_ep(moe, 2, dp_shard=2, tp=1, pp=1, dp_replicate=2)  # HSDP: a group per replica
    validate_ep(moe, 2, dp_shard=2, tp=2, pp=1, dp_replicate=1)  # attention TP, experts EP x TP


def test_pipeline_split_even_and_errors() -> None:
    assert pipeline_split(_args(num_layers=5), 2) == [[0, 1, 2], [3, 4]]
    assert pipeline_split(_args(num_layers=4), 2, stages_per_rank=2) == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match="pp=3 needs at least 3 layers.*num_layers=2"):
        pipeline_split(_args(), 3)
    with pytest.raises(ValueError, match="virtual stages"):
        pipeline_split(_args(num_layers=3), 2, stages_per_rank=2)
    assert pipeline_split(_args(tie_word_embeddings=True), 2) == [[0], [1]]  # tied: synced copies


def test_build_pipeline_rejects_unknown_schedule() -> None:
    with torch.device("meta"):
        model = Transformer(_args())
    with pytest.raises(ValueError, match="unknown pipeline schedule 'ZB'"):
        build_pipeline(model, None, "ZB", 2, lambda o, t: o.sum(), device=torch.device("cpu"))  # type: ignore[arg-type]


def test_plain_logprobs_and_entropy() -> None:
    logits = torch.randn(2, 5, 11, dtype=torch.float64)
    targets = torch.randint(0, 11, (2, 5))
    logp = torch.log_softmax(logits, -1)
    want = logp.gather(-1, targets[..., None])[..., 0]
    torch.testing.assert_close(vocab_parallel_token_logprobs(logits, targets), want.float())
    torch.testing.assert_close(vocab_parallel_entropy(logits), -(logp.exp() * logp).sum(-1).float())


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_ac_matches_no_ac(mode: str) -> None:
    torch.manual_seed(0)
    ref = Transformer(_args())
    ref.init_weights(seed=0)
    ac_model = Transformer(_args())
    ac_model.load_state_dict(ref.state_dict())
    apply_ac(ac_model, mode)
    x = torch.randint(0, 64, (2, 8))
    for m in (ref, ac_model):
        m(x).float().pow(2).mean().backward()
    for (n, p), (_, q) in zip(ref.named_parameters(), ac_model.named_parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=n)
    with pytest.raises(ValueError, match="activation checkpointing mode"):
        apply_ac(ac_model, "some")


def test_compile_smoke() -> None:
    """Per-block compile keeps names and numerics (aot_eager: no C++ toolchain needed)."""
    ref = Transformer(_args(num_layers=1))
    ref.init_weights(seed=0)
    comp = Transformer(_args(num_layers=1))
    comp.load_state_dict(ref.state_dict())
    apply_compile(comp, backend="aot_eager")
    assert [n for n, _ in comp.named_parameters()] == [n for n, _ in ref.named_parameters()]
    x = torch.randint(0, 64, (2, 8))
    torch.testing.assert_close(comp(x), ref(x), rtol=1e-5, atol=1e-6)
