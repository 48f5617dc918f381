"""The LoRA quickstart (configs/quickstart_lora.toml, 2 CPU ranks) learns, resumes bit for bit, runs
the same update on every layout, and exports folders transformers and peft load.

One module fixture runs the config for 30 steps (checkpoints at 20 and 30), then from those
checkpoints:

* ``resumed``: steps 21-30 again from the step-20 checkpoint (adapters and AdamW state only);
* ``one_rank`` / ``fsdp2`` / ``tp2`` / ``pp2`` / ``rollout_tp2``: step 31 on 1 rank, 2
  ranks of FSDP2, 2 ranks of TP (adapters split with their projections, tandem/parallel/lora.py), 2
  pipeline stages and FSDP2 with a generation layout of 2 ranks (adapters split there too);
* ``exact``: steps 31-32 on 2 ranks with ``rl.exact``; ``exact_cp2`` the same with
  ``parallel.cp = 2`` (Ulysses: each sequence split over the 2 ranks, adapters and all).

Every adapter move after the first is the adapters alone (``reshard/gb``) and passed the
generation copy's checksum (the run would have stopped otherwise).
"""

from __future__ import annotations

import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tandem.models.hf import load_args
from tests.fixtures import train_run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs", "quickstart_lora.toml")
POLICY = os.path.join(ROOT, "assets", "quickstart-policy")
SHORT = ("--rl.eval_prompts=8", "--rl.eval_samples=0")
# name -> (ranks, extra overrides) of the continuations of step 30
CONTINUE = {
    "one_rank": (1, ()),
    "fsdp2": (2, ()),
    "tp2": (2, ("--parallel.tp=2",)),
    "pp2": (2, ("--parallel.pp=2",)),
    "rollout_tp2": (2, ("--rollout.tp=2",)),
}


def _run(dump, nproc: int, extra: tuple[str, ...] = ()) -> tuple[list[dict], str]:
    return train_run(CONFIG, dump, nproc, "--metrics.loggers=[]", *extra)


def _from(base, name: str, step: int) -> str:
    dump = base / name
    shutil.copytree(
        base / "main" / "checkpoints" / f"step-{step}", dump / "checkpoints" / f"step-{step}"
    )
    return str(dump)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("lora")
    out = {
        "main": _run(
            base / "main",
            2,
            ("--training.steps=30", "--training.eval_interval=0", "--checkpoint.interval=10"),
        )
    }
    out["resumed"] = _run(
        _from(base, "resumed", 20),
        2,
        ("--training.steps=30", "--training.eval_interval=0", "--checkpoint.interval=10"),
    )
    for name, (nproc, extra) in CONTINUE.items():
        out[name] = _run(_from(base, name, 30), nproc, ("--training.steps=31", *SHORT, *extra))
    for name, extra in (("exact", ()), ("exact_cp2", ("--parallel.cp=2",))):
        out[name] = _run(
            _from(base, name, 30), 2, ("--training.steps=32", "--rl.exact=true", *SHORT, *extra)
        )
    return base, out


def _adapter(dump) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(dump, "hf-adapter", "adapter_model.safetensors"))


def _checkpoint(base, step: int) -> dict:
    path = base / f"step-{step}.pt"
    if not path.exists():
        dcp_to_torch_save(os.path.join(base / "main", "checkpoints", f"step-{step}"), path)
    return torch.load(path, weights_only=False)


def _worst_rel(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / a[k].abs().max()) for k in a)


@pytest.mark.slow
def test_lora_quickstart_learns_moving_only_the_adapters(runs):
    base, out = runs
    rows, log = out["main"]
    assert len(rows) == 30
    said = re.search(r"eval accuracy: start ([\d.]+) -> end ([\d.]+)", log)
    assert said, log[-2000:]
    start, end = float(said[1]), float(said[2])
    assert end - start >= 0.3, (start, end)
    # rank 16 on q, k, v, o, gate, up, down: r * (in + out) each, fp32 on the CPU
    args = load_args(POLICY)
    q, kv, d, i = (
        args.num_heads * args.head_dim,
        args.num_kv_heads * args.head_dim,
        args.hidden_size,
        args.intermediate_size,
    )
    adapter_bytes = 4 * 16 * args.num_layers * ((d + q) * 2 + 2 * (d + kv) + 3 * (d + i))
    assert adapter_bytes == sum(t.numel() * 4 for t in _adapter(base / "main").values())
    for r in rows:  # the first copy was the start's evaluation; every step moved the adapters alone
        assert r["reshard/gb"] * 1e9 == pytest.approx(adapter_bytes, rel=1e-9), r["step"]
        assert 0 <= r["lora/adapter_checksum"] < 2**32
        # the same unmerged forward in both phases (fp32)
        assert r["gap/abs_mean"] < 1e-6, r["step"]
    # the adapters changed every step
    assert len({r["lora/adapter_checksum"] for r in rows}) == len(rows)


@pytest.mark.slow
def test_lora_checkpoint_holds_the_adapters_and_resumes_bit_for_bit(runs):
    base, out = runs
    saved = _checkpoint(base, 30)
    names = set(saved["model"])
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)  # no frozen base weight
    assert {
        k.rsplit(".", 1)[0].removeprefix("state.") for k in saved["optim"] if k.startswith("state.")
    } == names
    rows, log = out["resumed"]
    assert "resumed from" in log and [r["step"] for r in rows] == list(range(21, 31))
    main = {r["step"]: r for r in out["main"][0]}
    for r in rows:
        for key in ("reward/total", "loss", "grad_norm", "lora/adapter_checksum"):
            assert r[key] == main[r["step"]][key], (key, r["step"])
    got, ref = _adapter(base / "resumed"), _adapter(base / "main")
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)


@pytest.mark.slow
def test_one_lora_step_agrees_on_one_rank_fsdp2_and_tp2(runs):
    base, out = runs
    ref_rows, _ = out["fsdp2"]
    ref = _adapter(base / "fsdp2")
    assert _worst_rel(ref, _adapter(base / "main")) > 1e-3  # step 31 moved the adapters
    for name in ("one_rank", "tp2", "pp2", "rollout_tp2"):
        (row,) = out[name][0]
        assert row["step"] == 31 and row["reward/total"] == ref_rows[0]["reward/total"], name
        assert (
            abs(row["grad_norm"] - ref_rows[0]["grad_norm"]) <= 1e-4 * ref_rows[0]["grad_norm"]
        ), name
        assert _worst_rel(_adapter(base / name), ref) < 1e-4, name


@pytest.mark.slow
def test_lora_exact_mode_is_bitwise_on_policy(runs):
    rows, _ = runs[1]["exact"]
    assert [r["step"] for r in rows] == [31, 32]
    for r in rows:
        assert r["gap/abs_max"] == 0.0 and r["gap/tokens_differ"] == 0.0, r["step"]


@pytest.mark.slow
def test_lora_with_cp2_is_the_fsdp2_run(runs):
    """LoRA under context parallelism: two exact steps with every sequence split over the 2 ranks
    (Ulysses) sample what the FSDP2 run samples, keep the gap at 0 bit for bit, and move the
    adapters as it does up to the fp32 order of the gradient sums (1.1e-7 relative measured
    on a 2-core CPU machine; 1e-4 allowed, as for the other layouts above)."""
    base, out = runs
    ref, _ = out["exact"]
    rows, _ = out["exact_cp2"]
    assert [r["step"] for r in rows] == [31, 32]
    for a, b in zip(rows, ref, strict=True):
        assert a["update/cp_effective"] == 2.0 and "update/cp_effective" not in b
        assert a["reward/total"] == b["reward/total"]  # the same samples
        assert a["gap/abs_max"] == 0.0 and a["gap/tokens_differ"] == 0.0, a["step"]
        for k in ("loss", "grad_norm"):
            assert abs(a[k] - b[k]) <= 1e-5 * abs(b[k]), (a["step"], k, a[k], b[k])
    assert _worst_rel(_adapter(base / "exact"), _adapter(base / "main")) > 1e-3  # they moved
    assert _worst_rel(_adapter(base / "exact_cp2"), _adapter(base / "exact")) < 1e-4


@pytest.mark.slow
def test_peft_loads_the_adapter_and_hf_is_the_merged_model(runs):
    """peft's PeftModel on the transformers base gives Tandem's logits with the checkpoint's
    adapters (fp32, 1e-5); hf/ is peft's merge_and_unload() of it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tandem.models.hf import load_model
    from tandem.models.lora import LoraSpec, apply_lora

    base, _ = runs
    dump = base / "main"
    saved = _checkpoint(base, 30)
    ours = load_model(POLICY)
    apply_lora(ours, LoraSpec(rank=16, alpha=32))
    ours.load_state_dict(saved["model"], strict=False)
    hf = AutoModelForCausalLM.from_pretrained(
        POLICY, dtype=torch.float32, attn_implementation="eager"
    )
    peft = PeftModel.from_pretrained(hf, os.path.join(dump, "hf-adapter")).eval()
    x = torch.randint(0, ours.args.vocab_size, (3, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(x), peft(x).logits
    assert (a - b).abs().max() <= 1e-5 * max(1.0, b.abs().max().item()), (a - b).abs().max()
    merged = peft.merge_and_unload().state_dict()
    exported = load_file(os.path.join(dump, "hf", "model.safetensors"))
    assert exported.keys() <= merged.keys()
    for k, v in exported.items():
        torch.testing.assert_close(v, merged[k], rtol=1e-6, atol=1e-7)
    assert not any("lora" in k for k in exported)
