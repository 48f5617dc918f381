"""LoRA's math and files against peft (the reference) and a per-expert loop.

* An adapter peft trains (random non-zero A and B on every linear PEFT targets) loaded into our
  model gives peft's logits; our export of it loads back into peft with the same logits, and
  `merge_state` equals peft's ``merge_and_unload`` (every family of tests/fixtures.py).
* Grouped-expert adapters equal ``x (W_e + s B_e A_e)^T`` computed expert by expert.
* The checksum the generation copy uses is the same over any tiling and sees a flipped bit.
"""

from __future__ import annotations

import json

import pytest
import torch

from tandem.models.args import ModelArgs
from tandem.models.hf import load_model
from tandem.models.hf_adapter import load_adapter, read_adapter_config, save_adapter
from tandem.models.lora import (
    LoraGroupedExperts,
    LoraSpec,
    adapter_shapes,
    adapters_disabled,
    apply_lora,
    init_adapter_state,
    merge_state,
)
from tandem.models.moe import GroupedExperts
from tandem.models.transformer import Transformer
from tandem.parallel.checksum import box_checksum
from tandem.parallel.reshard import Box
from tests.fixtures import FAMILIES, hf_reference, write_hf_model

PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft_adapter(base_dir, out_dir, seed: int, r: int = 4, alpha: int = 8, targets=PEFT_TARGETS):
    """A PEFT LoRA folder with random (non-zero) A and B, written by peft itself."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        hf_reference(base_dir), LoraConfig(r=r, lora_alpha=alpha, target_modules=targets)
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out_dir)
    return out_dir


@pytest.mark.parametrize("family", FAMILIES)
def test_adapters_equal_peft_and_round_trip(tmp_path, family):
    from peft import PeftModel

    base = write_hf_model(tmp_path / "base", family, seed=3)
    folder = _peft_adapter(base, tmp_path / "peft", seed=4)
    cfg = read_adapter_config(folder)
    spec = LoraSpec(rank=cfg["r"], alpha=cfg["lora_alpha"], targets=tuple(cfg["tandem_targets"]))
    ours = load_model(base)
    apply_lora(ours, spec)
    ours.load_state_dict(load_adapter(folder, adapter_shapes(ours)), strict=False)
    x = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        peft = PeftModel.from_pretrained(hf_reference(base), folder).eval()
        want = peft(x).logits
        got = ours(x)
        with adapters_disabled(ours):
            plain = ours(x)
        base_logits = hf_reference(base)(x).logits
    scale = max(1.0, want.abs().max().item())
    assert (got - want).abs().max() <= 1e-5 * scale
    # adapters matter
    assert (plain - base_logits).abs().max() <= 1e-5 * scale and (got - plain).abs().max() > 1e-2
    # our export of the same adapters: peft reads it and gives the same logits
    adapters = {k: v for k, v in ours.state_dict().items() if "lora_" in k}
    save_adapter(adapters, spec, tmp_path / "ours", base_model=str(base))
    config = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert (
        config["r"] == 4
        and config["lora_alpha"] == 8
        and sorted(config["target_modules"]) == sorted(PEFT_TARGETS)
    )
    with torch.no_grad():
        again = PeftModel.from_pretrained(hf_reference(base), tmp_path / "ours").eval()(x).logits
    assert (again - want).abs().max() <= 1e-5 * scale
    merged = merge_state(ours.state_dict(), spec.scale)
    reference = peft.merge_and_unload().state_dict()
    from tandem.models.hf import tandem_to_hf

    for name, t in tandem_to_hf(merged, ours.args).items():
        torch.testing.assert_close(t, reference[name], rtol=1e-6, atol=1e-7)


def test_an_adapter_of_another_model_is_refused(tmp_path):
    base = write_hf_model(tmp_path / "base", "qwen3", seed=3)
    folder = _peft_adapter(base, tmp_path / "peft", seed=4, targets=["q_proj", "v_proj"])
    ours = load_model(base)
    apply_lora(ours, LoraSpec(rank=4, alpha=8))  # every projection: the file lacks k, o and the MLP
    with pytest.raises(KeyError, match=r"no tensor for the model's adapters .*\(20 of 28\)"):
        load_adapter(folder, adapter_shapes(ours))
    ours = load_model(base)
    apply_lora(ours, LoraSpec(rank=2, alpha=8, targets=("q", "v")))
    with pytest.raises(
        ValueError,
        match=r"q_proj.lora_A.weight has shape \[4, 64\], the model's "
        r"adapter \[2, 64\]",
    ):
        load_adapter(folder, adapter_shapes(ours))


def test_fresh_adapters_start_as_the_base_and_only_they_train():
    args = ModelArgs(
        model_type="qwen3",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
    )
    model = Transformer(args)
    model.init_weights(0)
    x = torch.randint(0, 64, (2, 10))
    before = model(x).detach()
    n = apply_lora(model, LoraSpec(rank=4, alpha=8))
    assert n == 2 * 7
    model.load_state_dict(init_adapter_state(adapter_shapes(model), seed=0), strict=False)
    assert torch.equal(model(x), before)  # B = 0
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    a = model.layers["0"].attention.wq.lora_A.weight
    assert 0 < a.abs().max() <= 1 / 32**0.5 and a.std() > 0.1 / 32**0.5
    with pytest.raises(ValueError, match="match no module"):
        apply_lora(Transformer(args), LoraSpec(targets=("experts",)))


def test_grouped_expert_adapters_equal_a_loop_over_experts():
    gen = torch.Generator().manual_seed(0)
    e, d, i, r, scale = 4, 16, 24, 3, 0.5
    base = GroupedExperts(e, d, i)
    base.init_weights(0.1, gen)
    lora = LoraGroupedExperts(base, r, scale)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    counts = [5, 0, 7, 3]  # an expert with no rows too
    x = torch.randn(sum(counts), d, generator=gen)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    got = lora(x, offsets)
    want, at = [], 0
    for k, n in enumerate(counts):
        w = {
            p: getattr(lora, p)[k]
            + scale * getattr(lora, f"{p}_lora_B")[k] @ getattr(lora, f"{p}_lora_A")[k]
            for p in ("w1", "w2", "w3")
        }
        xe = x[at : at + n]
        want.append((torch.nn.functional.silu(xe @ w["w1"].T) * (xe @ w["w3"].T)) @ w["w2"].T)
        at += n
    torch.testing.assert_close(got, torch.cat(want), rtol=1e-5, atol=1e-6)
    state = {f"experts.{k}": v for k, v in lora.state_dict().items()}
    merged = merge_state(state, scale)
    assert sorted(merged) == ["experts.w1", "experts.w2", "experts.w3"]
    torch.testing.assert_close(
        merged["experts.w2"][2], lora.w2[2] + scale * lora.w2_lora_B[2] @ lora.w2_lora_A[2]
    )


def test_checksum_is_tiling_free_and_sees_one_flipped_bit():
    t = torch.randn(6, 10, generator=torch.Generator().manual_seed(0))
    whole = box_checksum("w", t, (0, 0), (6, 10))
    tiles = [((0, 0), t[:4, :3]), ((0, 3), t[:4, 3:]), ((4, 0), t[4:, :])]
    assert sum(box_checksum("w", data, off, (6, 10)) for off, data in tiles) % 2**32 == whole
    assert box_checksum("v", t, (0, 0), (6, 10)) != whole  # the name takes part
    for flat in (0, 37, 59):
        for bit in (0, 22, 30, 31):  # the lowest mantissa bit ... the sign bit of one element
            bad = t.clone()
            bad.view(-1).view(torch.int32)[flat] ^= (1 << bit) if bit < 31 else -(1 << 31)
            assert box_checksum("w", bad, (0, 0), (6, 10)) != whole, (flat, bit)
    swapped = t.clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert box_checksum("w", swapped, (0, 0), (6, 10)) != whole
    assert box_checksum("w", t.to(torch.bfloat16), (0, 0), (6, 10)) != whole
    assert Box((0, 0), (6, 10)).numel == 60


BAD_CONFIGS = [
    ({}, "r must be an integer >= 1 (the LoRA rank), got None"),
    ({"r": "8"}, "r must be an integer >= 1 (the LoRA rank), got '8'"),
    ({"r": 0}, "r must be an integer >= 1"),
    ({"r": 4.5}, "r must be an integer >= 1"),
    ({"r": 4, "lora_alpha": float("nan")}, "lora_alpha must be a number > 0, got nan"),
]


@pytest.mark.parametrize("fields, why", BAD_CONFIGS)
def test_a_bad_or_missing_r_is_one_config_line(tmp_path, fields, why):
    """read_adapter_config -> ValueError -> lora.adapter_path: one ConfigError line (exit 2)."""
    from tandem.rl.core.configlib import ConfigError
    from tandem.rl.core.lora import LoraConfig

    cfg = {"peft_type": "LORA", "lora_alpha": 8, "target_modules": ["q_proj"], **fields}
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=why.replace("(", r"\(").replace(")", r"\)")):
        read_adapter_config(tmp_path)
    with pytest.raises(ConfigError) as e:
        LoraConfig(rank=4, adapter_path=str(tmp_path)).validate()
    assert str(e.value).startswith("lora.adapter_path: ") and why in str(e.value)


def test_garbage_adapter_weights_are_one_model_line(tmp_path):
    """Not a safetensors file: ValueError naming it, a ModelSetupError line (exit 4) in a run."""
    from tandem.models.lora import LoraSpec as Spec
    from tandem.rl.core.lora import LoraSetup
    from tandem.rl.core.modeling import ModelSetupError, with_adapters

    (tmp_path / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage")
    with pytest.raises(ValueError, match="adapter_model.safetensors: not a readable safetensors"):
        load_adapter(tmp_path, {"x": (1, 1)})
    setup = LoraSetup(Spec(rank=4, alpha=8), 0, str(tmp_path))
    with pytest.raises(ModelSetupError, match="^lora.adapter_path: .*not a readable safetensors"):
        with_adapters({}, setup, {"x": (1, 1)})
