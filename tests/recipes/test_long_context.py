"""Context parallelism in the RL recipe, run as a user runs it (2 CPU ranks, torchrun, gloo).

- The quickstart with ``parallel.cp = 2`` (Ulysses and ring) is the same run as FSDP2 over the
  2 ranks: the same samples (rewards, lengths), the same updates up to fp32 reduction order
  (grad norm, KL, exported weights), ``update/cp_effective`` 2 at every step. The PPO quickstart
  (a critic, its values and value loss under cp) likewise.
- configs/quickstart_long.toml, as shipped: the stray "!" goes and held-out accuracy rises.
- On-policy distillation (a teacher scoring under the split) is the FSDP2 run likewise; an FP8
  KV pool under cp keeps the train/generation gap at float noise (the update's K/V rounding
  split with the rows).
- The sft, dpo and reward_model recipes with ``parallel.cp = 2`` are their one-rank runs (the
  same data-parallel degree, 1): the same losses, gradient norms, held-out metrics and
  exported weights up to fp32 reduction order, every row split over the 2 ranks.
"""

from __future__ import annotations

import os
import re

import pytest
from safetensors.torch import load_file

from tests.fixtures import hf_weights, train_run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHORT = ["--training.steps=2", "--rl.prompts_per_step=16", "--rl.eval_prompts=16",
         "--rl.eval_samples=0", "--training.eval_interval=0", "--rl.epochs=2", "--rl.kl_coef=0.01",
         "--rl.kl_mode=reward", "--checkpoint.interval=100"]  # fmt: skip


def _train(
    config: str, dump: str, *extra: str, timeout: int = 900, nproc: int = 2
) -> tuple[list[dict], str]:
    return train_run(
        os.path.join(ROOT, "configs", config),
        dump,
        nproc,
        "--metrics.loggers=[]",
        *extra,
        timeout=timeout,
    )


def _agree(rows: list[dict], ref: list[dict], keys: tuple[str, ...]) -> None:
    for a, b in zip(rows, ref, strict=True):
        assert a["reward/total"] == b["reward/total"]  # the same samples
        assert a["response/length_mean"] == b["response/length_mean"]
        assert a["update/cp_effective"] == 2.0
        for k in keys:
            # kl is a difference of log-probs near 1: its fp32 rounding is ~1e-8 absolute
            assert abs(a[k] - b[k]) <= 1e-4 * abs(b[k]) + 1e-7, (k, a[k], b[k])


@pytest.mark.slow
def test_quickstart_with_cp2_is_the_fsdp2_run(tmp_path):
    ref, _ = _train("quickstart.toml", str(tmp_path / "fsdp2"), *SHORT)
    assert "update/cp_effective" not in ref[0]
    for style in ("ulysses", "ring"):
        dump = str(tmp_path / style)
        rows, _ = _train(
            "quickstart.toml", dump, *SHORT, "--parallel.cp=2", f"--parallel.cp_style={style}"
        )
        _agree(rows, ref, ("grad_norm", "kl", "loss", "entropy"))
        assert (
            rows[-1]["eval/accuracy"] == ref[-1]["eval/accuracy"]
        )  # greedy, from the updated shards
        w, w_ref = hf_weights(dump), hf_weights(str(tmp_path / "fsdp2"))
        assert max(float((w[k] - w_ref[k]).abs().max() / w_ref[k].abs().max()) for k in w) < 1e-4


@pytest.mark.slow
def test_ppo_critic_under_cp2_is_the_fsdp2_run(tmp_path):
    extra = [
        "--training.steps=2",
        "--rl.eval_prompts=8",
        "--rl.eval_samples=0",
        "--checkpoint.enable=false",
    ]
    ref, _ = _train("quickstart_ppo.toml", str(tmp_path / "fsdp2"), *extra)
    rows, _ = _train("quickstart_ppo.toml", str(tmp_path / "cp2"), *extra, "--parallel.cp=2")
    _agree(rows, ref, ("grad_norm", "critic/value_mse", "critic/grad_norm"))


@pytest.mark.slow
def test_long_context_demo_learns_with_cp2(tmp_path):
    """configs/quickstart_long.toml as shipped (about 3.5 minutes on 2 busy cores): every
    micro-batch (a 1082-token prompt and its completions) split over the 2 ranks; the stray "!"
    goes (replies of 2 tokens, the digit and the end, instead of about 2.4) and held-out
    accuracy rises (0.081 -> 0.212 when run for the docs)."""
    rows, out = _train("quickstart_long.toml", str(tmp_path / "long"), timeout=3000)
    start = float(re.search(r"eval accuracy at start: ([0-9.]+)", out).group(1))
    end = rows[-1]["eval/accuracy"]
    assert all(r["update/cp_effective"] == 2.0 for r in rows)
    assert rows[0]["response/length_mean"] > 2.3 and rows[-1]["response/length_mean"] < 2.1
    assert end >= start + 0.1, (start, [r["eval/accuracy"] for r in rows if "eval/accuracy" in r])


@pytest.mark.slow
def test_distillation_teacher_under_cp2_is_the_fsdp2_run(tmp_path):
    """On-policy distillation with cp = 2: the teacher scores each packed row split over the 2
    ranks as the student does; the same samples, reverse KL, loss and gradient norm as FSDP2
    over the same ranks (measured: 2e-7 relative)."""
    extra = ["--training.steps=2", "--rl.eval_prompts=8", "--rl.eval_samples=0",
             "--training.eval_interval=0", "--checkpoint.enable=false"]  # fmt: skip
    ref, _ = _train("quickstart_opd.toml", str(tmp_path / "fsdp2"), *extra)
    rows, _ = _train("quickstart_opd.toml", str(tmp_path / "cp2"), *extra, "--parallel.cp=2")
    assert all(r["distill/reverse_kl"] > 1.0 for r in ref)  # the teacher disagrees: a signal
    _agree(rows, ref, ("distill/reverse_kl", "loss", "grad_norm"))


@pytest.mark.slow
def test_fp8_kv_under_cp2_keeps_the_gap_at_float_noise(tmp_path):
    """An FP8 KV pool with cp = 2: each rank rounds the K and V of its own positions as the pool
    did, before the all-to-all or the ring moves them (tandem/rl/update/cp_batch.py), for the
    policy and the KL reference. The train/generation gap stays at float noise, measured with
    these flags: mean 4.7e-7, largest 1.1e-4 (ring, run here); Ulysses 2.9e-7 and 2.7e-5; FSDP2
    over the same ranks 5.9e-7 to 6.7e-7; with rollout.kv_quantize_update = false under cp
    0.083 (largest 4.9). The ring is the one run: its backend replaces the unsplit one, so a
    rounding wrapped inside it would be lost, not misapplied."""
    style = "ring"
    rows, _ = _train(
        "quickstart.toml",
        str(tmp_path / style),
        *SHORT[:-1],
        "--checkpoint.enable=false",
        "--rollout.kv_dtype=fp8_e4m3",
        "--parallel.cp=2",
        f"--parallel.cp_style={style}",
    )
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["update/cp_effective"] == 2.0 and r["kv/amax_mean"] > 0
        assert r["gap/abs_mean"] < 2e-6 and r["gap/abs_max"] < 1e-3, r


OFFLINE = ["--training.steps=2", "--metrics.log_interval=1", "--training.eval_interval=2",
           "--checkpoint.interval=100"]  # fmt: skip
# recipe -> (config, cp style, overrides, exported folder, metrics that must agree, weights' bound)
RECIPES = {
    "sft": (  # packed rows of several documents (DocumentAttention under the split)
        "quickstart_sft.toml",
        "ulysses",
        ["--data.synthetic_rows=400", "--data.eval_fraction=0.05"],
        "hf",
        ("loss", "grad_norm", "eval/loss"),
        1e-5,
    ),
    "dpo": (  # the precomputed reference table, gathered once per data-parallel rank
        "dpo.toml",
        "ring",
        ["--data.synthetic_rows=64"],
        "hf",
        ("loss", "grad_norm", "margin", "eval/loss", "eval/margin"),
        1e-3,
    ),
    "reward_model": (  # each score from the rank holding the row's last token
        "reward_model.toml",
        "ulysses",
        ["--data.synthetic_rows=64"],
        "reward_model",
        ("loss", "grad_norm", "margin", "eval/loss", "eval/margin"),
        2e-3,
    ),
}


def _weights(folder: str) -> dict:
    out: dict = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, f)))
    assert out, folder
    return out


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_offline_recipe_with_cp2_is_the_one_rank_run(tmp_path, recipe):
    """Metrics within 1e-5 of the larger of the value and the loss (measured: losses 2e-7,
    gradient norms and held-out metrics 5.3e-6). Weights, of each tensor's largest entry: sft
    9.8e-7; dpo 2.7e-4 and reward_model 7.4e-4, the order of their one-rank runs against
    FSDP2 over 2 ranks without cp (9.2e-5 and 5.6e-4): from the first step, where the loss
    sits at log 2, AdamW turns the gradients' rounding into steps of up to lr. The reward model's
    ``score.bias`` is left out: its gradient is 0 in exact arithmetic (the loss reads score
    differences), so AdamW moves it by its rounding noise alone."""
    config, style, extra, out, keys, bound = RECIPES[recipe]
    ref, _ = _train(config, str(tmp_path / "one"), *OFFLINE, *extra, nproc=1)
    rows, _ = _train(
        config,
        str(tmp_path / "cp2"),
        *OFFLINE,
        *extra,
        "--parallel.cp=2",
        f"--parallel.cp_style={style}",
    )
    assert [r["step"] for r in rows] == [1, 2] and "update/cp_effective" not in ref[0]
    for a, b in zip(rows, ref, strict=True):
        assert a["update/cp_effective"] == 2.0
        for k in (k for k in keys if k in b):
            scale = max(abs(b[k]), abs(b["loss"]))
            assert abs(a[k] - b[k]) <= 1e-5 * scale, (recipe, a["step"], k, a[k], b[k])
    assert "eval/loss" in rows[-1]
    w, w_ref = _weights(str(tmp_path / "cp2" / out)), _weights(str(tmp_path / "one" / out))
    assert w.keys() == w_ref.keys()
    worst = max(
        float((w[k] - w_ref[k]).abs().max() / w_ref[k].abs().max()) for k in w if k != "score.bias"
    )
    assert worst < bound, (recipe, worst)
