"""The planner with LoRA: gradients and AdamW moments of the adapters alone, against a hand count
at 8B and against the bytes a CPU run of a small flavor holds after one optimizer step."""

from __future__ import annotations

import torch

from tandem.models.flavors import get_flavor
from tandem.models.lora import LoraSpec, adapter_shapes, apply_lora, init_adapter_state
from tandem.models.transformer import Transformer
from tandem.rl.core.optim import build_optimizer
from tandem.rl.plan.planner import Layout, Planner, Settings

LORA = LoraSpec(rank=16, alpha=32)


def test_8b_rank_16_hand_count():
    """Qwen3-8B (36 layers, hidden 4096, q 32 x 128, kv 8 x 128, MLP 12288), rank 16 on q, k, v, o,
    gate, up, down: r * (in + out) per projection, FSDP2 over 8 ranks."""
    args = get_flavor("qwen3-8b")
    d, q, kv, i = 4096, 4096, 1024, 12288
    adapters = 36 * 16 * ((d + q) * 2 + (d + kv) * 2 + (d + i) * 3)
    assert adapters == 43_646_976
    lay = Layout(dp_shard=8)
    full = Planner(args, Settings(reference=True)).plan(lay)[0].update
    lora = Planner(args, Settings(lora=LORA)).plan(lay)[0].update
    assert lora["gradients"] == 4 * adapters / 8 and lora["optimizer state"] == 8 * adapters / 8
    assert (
        abs(lora["parameters"] - full["parameters"] - 4 * adapters / 8) <= 1e-6 * full["parameters"]
    )
    # the base with adapters off
    assert "reference / critic" in full and "reference / critic" not in lora
    saved = (
        full["gradients"] + full["optimizer state"] - lora["gradients"] - lora["optimizer state"]
    )
    assert saved > 12e9  # of 16.4 GB per rank for fp32 gradients and moments of 8.19 B parameters
    # the price: the bf16 copy stays between rollouts
    assert lora["generation copy (kept, LoRA)"] > 16e9


def test_state_bytes_match_a_cpu_run():
    """One process, tiny-qwen3 with rank-16 adapters: parameters, gradients and AdamW state after
    one step equal the plan (within 5 %), and are what full weights would hold minus the base's
    gradients and moments."""
    args = get_flavor("tiny-qwen3")
    model = Transformer(args)
    model.init_weights(0)
    apply_lora(model, LORA)
    model.load_state_dict(init_adapter_state(adapter_shapes(model), 0), strict=False)
    opt = build_optimizer(model, lr=1e-3, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.0)
    x = torch.randint(0, args.vocab_size, (2, 32))
    model(x).float().square().mean().backward()
    opt.step()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(
        p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None
    )
    state = sum(
        v.numel() * v.element_size()
        for st in opt.state.values()
        for v in st.values()
        if v.dim() > 0
    )
    plan = Planner(
        args, Settings(compute_dtype=torch.float32, gen_dtype=torch.float32, lora=LORA)
    ).plan(Layout())[0]
    for what, planned, got in (
        ("parameters", plan.update["parameters"], params),
        ("gradients", plan.update["gradients"], grads),
        ("optimizer state", plan.update["optimizer state"], state),
    ):
        assert abs(planned - got) <= 0.05 * got, (what, planned, got)
    base = 4 * args.num_params()
    assert grads == params - base and state == 2 * grads  # adapters only
    d, q, kv, i = (
        args.hidden_size,
        args.num_heads * args.head_dim,
        args.num_kv_heads * args.head_dim,
        args.intermediate_size,
    )
    # the hand count
    assert grads == 4 * args.num_layers * 16 * ((d + q) * 2 + (d + kv) * 2 + (d + i) * 3)
