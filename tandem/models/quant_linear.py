"""Which linear layers of a model hold low-bit weights, and the swaps that make them so
(docs/low-precision.md).

The projections of every dense block (attention q/k/v/o, the MLP's gate/up/down) are
quantized; embeddings, the LM head, norms, a mixture of experts' experts and router, and a
vision tower stay in the model's dtype. The generation copy's targets become
`tandem.kernels.weight_quant.QuantLinear` (``rollout.weight_dtype``), or `QuantLoraLinear` under
LoRA (the adapters in the copy's dtype on the low-bit base: QLoRA's arrangement); the update's
become `FakeQuantLinear` / `FakeQuantLoraLinear` with the same format (``rl.quantize_update``),
so both sides round the same weights the same way and add the adapters in the same order.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from tandem.kernels.weight_quant import (
    QuantizedWeight,
    QuantLinear,
    WeightFormat,
    fake_quant,
    fake_quant_linear,
    quantize,
)
from tandem.models.lora import LoraLinear

TARGETS = re.compile(r"(^|\.)layers\.\d+\.(attention\.w[qkvo]|feed_forward\.w[123])$")


class QuantLoraLinear(QuantLinear):
    """A `QuantLinear` base plus a LoRA adapter (``lora_A`` / ``lora_B`` under `LoraLinear`'s
    names, so the adapter-only refill finds them): ``F.linear(x, base) + lora_B(lora_A(x) * s)``,
    `LoraLinear`'s arithmetic without dropout (the rl recipe refuses lora.dropout > 0)."""

    def __init__(self, q: QuantizedWeight, bias: torch.Tensor | None, lora: LoraLinear) -> None:
        super().__init__(q, bias)
        self.lora_A, self.lora_B, self.scale = lora.lora_A, lora.lora_B, lora.scale
        self.lora_enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)  # [..., out]
        if not self.lora_enabled:
            return y
        return y + self.lora_B(self.lora_A(x) * self.scale)


class FakeQuantLoraLinear(LoraLinear):
    """A `LoraLinear` whose base weight goes through `fake_quant` (the update's side)."""

    fmt: WeightFormat

    def base_weight(self) -> torch.Tensor:
        return fake_quant(self.weight, self.fmt)


def quantized_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The plain ``nn.Linear`` (or `LoraLinear`) modules of ``model`` that a weight format
    applies to, by name."""
    return {
        name: m
        for name, m in model.named_modules()
        if type(m) in (nn.Linear, LoraLinear) and TARGETS.search(name)
    }


def quantize_linears(model: nn.Module, fmt: WeightFormat) -> dict[str, QuantLinear]:
    """Replace the target linears by `QuantLinear`s of ``fmt`` (their weights quantized),
    in place; returns them by the name of the weight they stand for (``...wq.weight``)."""
    weights = {
        f"{name}.weight": quantize(lin.weight.detach(), fmt)
        for name, lin in quantized_linears(model).items()
    }
    return install_quantized(model, weights)


def fake_quant_linears(model: nn.Module, fmt: WeightFormat) -> int:
    """Make the target linears round their weights as ``fmt`` in every forward (a straight-
    through gradient), in place, parameters and names unchanged; returns how many."""
    targets = quantized_linears(model)
    for lin in targets.values():
        if type(lin) is LoraLinear:
            lin.__class__ = FakeQuantLoraLinear
            lin.fmt = fmt
        else:
            fake_quant_linear(lin, fmt)
    return len(targets)


def is_target_weight(name: str) -> bool:
    """Whether a state-dict name is a target linear's weight (``layers.0.attention.wq.weight``)."""
    return name.endswith(".weight") and TARGETS.search(name[: -len(".weight")]) is not None


def install_quantized(
    model: nn.Module, weights: dict[str, QuantizedWeight]
) -> dict[str, QuantLinear]:
    """Put a `QuantLinear` (a `QuantLoraLinear` in place of a `LoraLinear`, its adapter kept)
    holding ``weights[name]`` (keyed by weight name) in place of each target linear (its bias
    kept, e.g. a meta one a later ``load_state_dict(assign=True)`` fills); returns them by
    weight name."""
    out: dict[str, QuantLinear] = {}
    for name, q in weights.items():
        path = name[: -len(".weight")]
        parent_name, _, attr = path.rpartition(".")
        lin = model.get_submodule(path)
        assert type(lin) in (nn.Linear, LoraLinear), (name, type(lin))
        assert tuple(lin.weight.shape) == q.shape, (name, q.shape)
        if type(lin) is LoraLinear:
            out[name] = QuantLoraLinear(q, lin.bias, lin)
        else:
            out[name] = QuantLinear(q, lin.bias)
        setattr(model.get_submodule(parent_name), attr, out[name])
    return out
