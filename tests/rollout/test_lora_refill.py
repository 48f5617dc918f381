"""The generation copy of a LoRA policy: its base moves once, later builds move the adapters alone
(bytes = the adapters' size), the copy equals the trainer's model, and a copy whose adapters
differ from the trainer's is an error (one process; tests/recipes/test_lora_quickstart.py runs
the same on 1 and 2 ranks, FSDP2, TP and a 2-rank generation layout)."""

from __future__ import annotations

import pytest
import torch

from tandem.models.args import ModelArgs
from tandem.models.lora import LoraSpec, adapters_disabled, apply_lora, is_adapter
from tandem.models.transformer import Transformer
from tandem.parallel.generation_layout import GenerationCopy, GenerationLayout

ARGS = ModelArgs(
    model_type="qwen3",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
)
SPEC = LoraSpec(rank=4, alpha=8)


def _policy() -> Transformer:
    model = Transformer(ARGS)
    model.init_weights(0)
    apply_lora(model, SPEC)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_adapter(name):
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    return model


def test_refill_moves_only_the_adapters_and_checks_them():
    policy = _policy()
    copy = GenerationCopy(policy, ARGS, GenerationLayout(), torch.device("cpu"), lora=SPEC)
    x = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    gen, first = copy.build()
    adapter_bytes = sum(p.numel() * 4 for n, p in policy.named_parameters() if is_adapter(n))
    total_bytes = sum(p.numel() * 4 for p in policy.parameters())  # untied: every tensor once
    assert first["reshard/gb"] * 1e9 == total_bytes
    with torch.no_grad():
        assert torch.equal(gen(x), policy(x))
        for name, p in policy.named_parameters():  # an optimizer step on the adapters
            if is_adapter(name):
                p.add_(0.01)
    base_before = {n: p for n, p in gen.named_parameters() if not is_adapter(n)}
    again, second = copy.build()
    assert again is gen and second["reshard/gb"] * 1e9 == adapter_bytes
    # not re-moved
    assert all(p is base_before[n] for n, p in again.named_parameters() if not is_adapter(n))
    assert second["lora/adapter_checksum"] != first["lora/adapter_checksum"]
    with torch.no_grad():
        assert torch.equal(again(x), policy(x))
        with adapters_disabled(again), adapters_disabled(policy):
            assert torch.equal(again(x), policy(x))
    _, adapters = copy._kept
    srcs = {n: p.detach() for n, p in policy.named_parameters() if is_adapter(n)}
    with torch.no_grad():
        adapters["layers.1.feed_forward.w2.lora_B.weight"].view(-1)[3] += 1e-6  # a copy gone wrong
    with pytest.raises(
        RuntimeError, match=r"adapters \['layers.1.feed_forward.w2.lora_B.weight'\] differ"
    ):
        copy._check(srcs, adapters)
