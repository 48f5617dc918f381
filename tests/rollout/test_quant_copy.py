"""A low-bit generation copy (rollout.weight_dtype; tandem/parallel/quant_copy.py), one process:
the dense projections become `QuantLinear`s quantized as they land, the copy computes exactly
what the trainer's model computes with those projections fake-quantized (the update's side of
rl.quantize_update), a refill requantizes in place (same tensors), and the resident bytes of the
projections, measured from the copy's buffers, are against a bf16 copy's at least 1.9x smaller
(fp8_block) and 3.5x (w4a16)."""

from __future__ import annotations

import copy as copylib
import weakref

import pytest
import torch

from tandem.kernels.weight_quant import FORMATS, QuantLinear
from tandem.models.args import ModelArgs
from tandem.models.lora import LoraSpec, apply_lora, is_adapter
from tandem.models.quant_linear import (
    QuantLoraLinear,
    fake_quant_linears,
    is_target_weight,
    quantized_linears,
)
from tandem.models.transformer import Transformer
from tandem.parallel.generation_layout import GenerationCopy, GenerationLayout

ARGS = ModelArgs(
    model_type="qwen3",
    vocab_size=64,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
)


def _policy(seed: int = 0) -> Transformer:
    model = Transformer(ARGS)
    model.init_weights(seed)
    return model


def _small_buckets(policy: Transformer, name: str) -> GenerationCopy:
    """A low-bit copy moved in several collectives: each weight is quantized as it lands."""
    dev = torch.device("cpu")
    fmt = FORMATS[name]
    return GenerationCopy(
        policy, ARGS, GenerationLayout(), dev, weight_format=fmt, bucket_bytes=20_000
    )


def _fake_quant_twin(policy: Transformer, name: str) -> Transformer:
    twin = copylib.deepcopy(policy)
    assert fake_quant_linears(twin, FORMATS[name]) == 2 * 7
    return twin


@pytest.mark.parametrize("name", list(FORMATS))
def test_copy_is_the_fake_quantized_policy_and_refills_in_place(name: str) -> None:
    policy = _policy()
    copy = _small_buckets(policy, name)
    gen, first = copy.build()
    assert sorted(gen.quant_linears) == sorted(f"{n}.weight" for n in quantized_linears(policy))
    assert all(isinstance(gen.get_submodule(n[:-7]), QuantLinear) for n in gen.quant_linears)
    assert not quantized_linears(gen)  # no full-precision projection left
    x = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = _fake_quant_twin(policy, name)(x)
        assert torch.equal(gen(x), want)
        assert not torch.equal(policy(x), want)  # the rounding is there
        for p in policy.parameters():  # an optimizer step
            p.add_(0.003 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    buffers = {n: b for n, b in gen.named_buffers()}
    metrics = copy.refill(gen)
    assert all(b is buffers[n] for n, b in gen.named_buffers())  # refilled in place
    assert metrics["reshard/gb"] == first["reshard/gb"]
    with torch.no_grad():
        assert torch.equal(gen(x), _fake_quant_twin(policy, name)(x))


@pytest.mark.parametrize("name, ratio", [("fp8_block", 1.9), ("mxfp8", 1.9), ("w4a16", 3.5)])
def test_resident_bytes_against_bf16(name: str, ratio: float) -> None:
    policy = _policy()
    dev = torch.device("cpu")
    bf16, _ = GenerationCopy(policy, ARGS, GenerationLayout(), dev, torch.bfloat16).build()
    low, metrics = GenerationCopy(
        policy, ARGS, GenerationLayout(), dev, torch.bfloat16, weight_format=FORMATS[name]
    ).build()
    names = [n[: -len(".weight")] for n in low.quant_linears]

    def resident(model: torch.nn.Module) -> int:  # what the projections' modules hold
        return sum(
            t.numel() * t.element_size()
            for n in names
            for k, t in model.get_submodule(n).state_dict().items()
            if k != "bias"
        )

    measured = resident(bf16) / resident(low)
    assert measured >= ratio
    assert round(metrics["reshard/quantized_gb"] * 1e9) == resident(low)
    assert round(metrics["reshard/quantized_full_gb"] * 1e9) == resident(bf16)


def test_lora_on_a_low_bit_base() -> None:
    """LoRA: the base is quantized once, at the first build; later builds move the adapters alone
    (bf16/fp32, checked), and the copy stays the fake-quantized LoRA policy bit for bit."""
    spec = LoraSpec(rank=4, alpha=8)
    policy = _policy()
    apply_lora(policy, spec)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if is_adapter(name):
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    copy = GenerationCopy(
        policy,
        ARGS,
        GenerationLayout(),
        torch.device("cpu"),
        lora=spec,
        weight_format=FORMATS["w4a16"],
    )
    gen, _ = copy.build()
    assert all(isinstance(m, QuantLoraLinear) for m in gen.quant_linears.values())
    x = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(gen(x), _fake_quant_twin(policy, "w4a16")(x))
        for name, p in policy.named_parameters():  # an optimizer step on the adapters
            if is_adapter(name):
                p.add_(0.01)
    again, second = copy.build()
    adapter_bytes = sum(p.numel() * 4 for n, p in policy.named_parameters() if is_adapter(n))
    assert again is gen and round(second["reshard/gb"] * 1e9) == adapter_bytes
    with torch.no_grad():
        assert torch.equal(again(x), _fake_quant_twin(policy, "w4a16")(x))


def test_each_weight_is_quantized_as_it_lands(monkeypatch) -> None:
    """Where the copy quantizes: on the receiving rank, each projection as its last region lands;
    no full-precision projection outlives its own quantization (weak references, at the first
    build and at a refill), so at most a bucket of them is ever held beside the low-bit copy."""
    policy = _policy()
    copy = _small_buckets(policy, "w4a16")
    landed: list[weakref.ref] = []
    alive_before: list[int] = []
    make = GenerationCopy._quantizing

    def spying(self, sink, srcs):  # noqa: ANN001, ANN202
        done = make(self, sink, srcs)

        def spy(name: str, t: torch.Tensor) -> None:
            done(name, t)
            if is_target_weight(name):
                alive_before.append(sum(r() is not None for r in landed))
                landed.append(weakref.ref(t))

        return spy

    monkeypatch.setattr(GenerationCopy, "_quantizing", spying)
    gen, _ = copy.build()
    copy.refill(gen)
    assert len(landed) == 2 * 2 * 7  # every projection, at the build and at the refill
    assert alive_before == [0] * len(landed)  # each earlier one already freed
