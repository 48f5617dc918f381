"""Low-bit rollouts on the quickstart, one CPU process each (docs/low-precision.md):

- with rl.exact and rl.quantize_update, the train/generation gap is 0 bit for bit every step
  (gap/abs_max, gap/tokens_differ and gap/k3 all 0) for fp8_block and w4a16, and for fp8_block
  beside an FP8 KV cache: the update multiplies by the very weights the generator dequantizes;
- without rl.quantize_update the same run reports the quantization (gap/abs_mean and gap/k3 > 0
  every step), while the default bf16 copy's gap is 0 under rl.exact;
- the mismatch contract's drill: rl.max_mismatch_kl below that gap stops the run with exit
  status 12 (EXIT_MISMATCH) once the first window of rl.mismatch_window = 2 steps is full,
  with one line naming the steps, the mean and the limit, and a run resumed after step 1 stops
  at the same step (the window is in the checkpoint).

The same holds for LoRA on a w4a16 base (bf16/fp32 adapters on the low-bit projections).

and rollout.tp = 2 on 2 ranks shards the low-bit copy with the whole tensors' scales.

Marked slow: twelve short runs (3 steps of 8 prompts), about 60 s on a busy 2-core machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.rl.core.errors import EXIT_MISMATCH
from tests.fixtures import train_run

ROOT = Path(__file__).resolve().parents[2]
SHORT = (
    "--training.steps=3",
    "--training.eval_interval=0",
    "--rl.prompts_per_step=8",
    "--metrics.loggers=[]",
    "--checkpoint.enable=false",
)


def _run(dump: Path, *extra: str, config: str = "quickstart.toml") -> tuple[int, list[dict], str]:
    cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs" / config)]
    cmd += [f"--job.dump_folder={dump}", *SHORT, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    path = dump / "metrics.jsonl"
    rows = [json.loads(line) for line in open(path)] if path.exists() else []
    return r.returncode, rows, r.stdout + r.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "fmt, smaller, kv",
    [("fp8_block", 3.9, "auto"), ("w4a16", 7.0, "auto"), ("fp8_block", 3.9, "fp8_e4m3")],
)
def test_exact_gap_is_zero_with_the_same_rounding(
    tmp_path: Path, fmt: str, smaller: float, kv: str
) -> None:
    rc, rows, out = _run(
        tmp_path,
        "--rl.exact=true",
        f"--rollout.weight_dtype={fmt}",
        "--rl.quantize_update=true",
        f"--rollout.kv_dtype={kv}",  # with an FP8 KV cache too: both roundings matched
    )
    assert rc == 0, out[-3000:]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["gap/abs_max"] == 0.0 and r["gap/tokens_differ"] == 0.0 and r["gap/k3"] == 0.0
        # the projections' resident bytes against the fp32 copy's
        assert r["reshard/quantized_full_gb"] / r["reshard/quantized_gb"] > smaller


@pytest.mark.slow
def test_lora_on_a_w4a16_base_keeps_the_gap_at_zero(tmp_path: Path) -> None:
    extra = ("--rl.exact=true", "--rollout.weight_dtype=w4a16", "--rl.quantize_update=true")
    rc, rows, out = _run(tmp_path, *extra, config="quickstart_lora.toml")
    assert rc == 0, out[-3000:]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["gap/abs_max"] == 0.0 and r["gap/tokens_differ"] == 0.0 for r in rows)


@pytest.mark.slow
def test_without_the_same_rounding_the_gap_shows_the_quantization(tmp_path: Path) -> None:
    rc, rows, out = _run(tmp_path / "w4", "--rl.exact=true", "--rollout.weight_dtype=w4a16")
    assert rc == 0, out[-3000:]
    assert all(r["gap/abs_mean"] > 1e-3 and r["gap/k3"] > 0 for r in rows)
    rc, rows, out = _run(tmp_path / "bf16", "--rl.exact=true")  # the default copy: no rounding
    assert rc == 0, out[-3000:]
    assert all(r["gap/abs_max"] == 0.0 and r["gap/k3"] == 0.0 for r in rows)


@pytest.mark.slow
def test_mismatch_drill_stops_with_its_status(tmp_path: Path) -> None:
    extra = ("--rollout.weight_dtype=w4a16", "--rl.mismatch_window=2")
    rc, rows, out = _run(tmp_path / "stop", *extra, "--rl.max_mismatch_kl=1e-4")
    assert rc == EXIT_MISMATCH == 12, out[-3000:]
    assert "rl.max_mismatch_kl: the generator/update mismatch (gap/k3) averaged" in out
    assert "over steps 1..2, above the limit 0.0001" in out and "Traceback" not in out
    assert [r["step"] for r in rows] == [1]  # step 2 completed the window and stopped the run
    # a run that stops after step 1 (its checkpoint holds the window), resumed: it stops at step
    # 2 as the uninterrupted run did, which it could not with a fresh window
    tight = (*extra, "--rl.max_mismatch_kl=1e-4", "--checkpoint.enable=true")
    rc, _, out = _run(tmp_path / "resume", *tight, "--checkpoint.interval=1", "--training.steps=1")
    assert rc == 0, out[-3000:]
    rc, _, out = _run(tmp_path / "resume", *tight)
    assert "resumed from" in out and "at step 1" in out, out[-3000:]
    assert rc == EXIT_MISMATCH and "over steps 1..2" in out, out[-3000:]
    rc, rows, out = _run(tmp_path / "go", *extra, "--rl.max_mismatch_kl=10")  # a loose limit
    assert rc == 0 and [r["step"] for r in rows] == [1, 2, 3], out[-3000:]
    means = [r["gap/k3_window_mean"] for r in rows]
    k3 = [r["gap/k3"] for r in rows]
    assert means == [k3[0], (k3[0] + k3[1]) / 2, (k3[1] + k3[2]) / 2]


@pytest.mark.slow
def test_generation_tp2_shards_the_low_bit_copy(tmp_path: Path) -> None:
    """rollout.tp = 2 on 2 ranks: each rank quantizes its own shard of every projection with the
    whole tensor's scale, so the update (rounding whole weights) still computes what the
    generator did: the gap is the float noise of the sharded sums (the bf16 copy's on the same
    layout: abs_mean 1.7e-7 .. 6.3e-7 measured), and each rank holds half the low-bit bytes."""
    extra = ("--rollout.weight_dtype=w4a16", "--rl.quantize_update=true", "--rollout.tp=2")
    rows, out = train_run(ROOT / "configs" / "quickstart.toml", tmp_path / "tp2", 2, *SHORT, *extra)
    assert [r["step"] for r in rows] == [1, 2, 3], out[-3000:]
    assert all(r["gap/abs_mean"] < 5e-6 and r["gap/k3"] < 1e-9 for r in rows)
    _, one, out = _run(tmp_path / "tp1", "--rollout.weight_dtype=w4a16")
    # half each, plus a 4-byte copy of the tensor scale on the second rank for each of the
    # 2 x 7 projections
    two, whole = (round(r[0]["reshard/quantized_gb"] * 1e9) for r in (rows, one))
    assert 2 * two == whole + 14 * 4
