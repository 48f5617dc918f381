"""Mixture-of-experts models against transformers, hand-written routing and loss formulas.

Tiny random Qwen3-MoE / Qwen2-MoE folders (written by transformers, fp32) load
with logits within 1e-4 of ``Qwen3MoeForCausalLM`` / ``Qwen2MoeForCausalLM``;
the losses, the dispatch and the DeepSeek-style router are checked against
formulas written out here, independently of tandem/models/moe.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tandem.models import (
    ModelArgs,
    Transformer,
    get_flavor,
    load_model,
    read_hf_state_dict,
    save_hf,
)
from tandem.models.moe import MoE, moe_layers, router_loss, set_token_mask
from tandem.models.tokenizer import build_char_tokenizer
from tests.fixtures import TINY_VOCAB, hf_reference, randomize_

TOL = 1e-4
# qwen3_moe: renormalised top-k, a dense layer (mlp_only_layers), head_dim != hidden/heads.
# qwen2_moe: a gated shared expert, plain top-k probabilities, MoE in every second layer.
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe")


def tiny_moe_config(family: str, **overrides):
    from transformers import Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
        rope_theta=1e6,
        bos_token_id=None,
        eos_token_id=[355, 353],
        tie_word_embeddings=False,
        num_experts=8,
        num_experts_per_tok=2,
        router_aux_loss_coef=0.01,
    )
    if family == "qwen3_moe":
        kwargs, cls = dict(head_dim=32, norm_topk_prob=True, mlp_only_layers=[1]), Qwen3MoeConfig
    elif family == "qwen2_moe":
        kwargs = dict(
            shared_expert_intermediate_size=48, norm_topk_prob=False, decoder_sparse_step=2
        )
        cls = Qwen2MoeConfig
    else:
        raise KeyError(family)
    return cls(**{**common, **kwargs, **overrides})


def write_moe_model(path: Path, family: str, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_moe_config(family), dtype=torch.float32)
    randomize_(model, seed)
    model.save_pretrained(path, safe_serialization=True)
    build_char_tokenizer(path)
    return path


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def moe_folder(request, tmp_path_factory):
    family = request.param
    return family, write_moe_model(tmp_path_factory.mktemp(family), family, seed=4)


def _tokens(b: int, s: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 360, (b, s), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------ transformers parity
@torch.no_grad()
def test_logits_and_routing_match_transformers(moe_folder):
    family, path = moe_folder
    ref, ours = hf_reference(path), load_model(path)
    assert ours.args.model_type == family and ours.args.num_experts == 8
    moe_ids = sorted(int(k) for k in moe_layers(ours))
    # mlp_only_layers / decoder_sparse_step
    assert moe_ids == ([0, 2] if family == "qwen3_moe" else [1])
    assert all(hasattr(ours.layers[str(i)], "feed_forward") for i in range(3) if i not in moe_ids)
    x = _tokens(2, 40)
    out = ref(x, output_router_logits=True)
    got = ours(x)
    assert got.shape == out.logits.shape == (2, 40, TINY_VOCAB)
    assert (got - out.logits).abs().max().item() <= TOL
    # The experts each token went to equal transformers' top-k of its router logits.
    assert len(out.router_logits) == len(moe_ids)
    for layer, hf_logits in zip(moe_ids, out.router_logits, strict=True):
        hf_ids = torch.topk(hf_logits.softmax(-1), 2, dim=-1).indices.sort(-1).values
        assert torch.equal(ours.layers[str(layer)].moe.last_routing.sort(-1).values, hf_ids)
    pos = torch.arange(40).expand(2, 40) + torch.tensor([[3], [11]])
    assert (ours(x, positions=pos) - ref(x, position_ids=pos).logits).abs().max().item() <= TOL


@torch.no_grad()
def test_fused_inference_layout_matches_transformers(moe_folder):
    """`fuse_projections` (the generation copy's layout) fuses attention and the shared
    expert's gate/up; dense layers too; the experts stay stacked."""
    family, path = moe_folder
    ref, ours = hf_reference(path), load_model(path).fuse_projections()
    keys = set(ours.state_dict())
    assert ("layers.1.moe.shared_experts.w13.weight" in keys) == (family == "qwen2_moe")
    assert "layers.0.attention.wqkv.weight" in keys and not any(
        k.endswith("w1.weight") for k in keys
    )
    x = _tokens(2, 24, seed=7)
    assert (ours(x) - ref(x).logits).abs().max().item() <= TOL


def test_export_reload_bit_exact_and_transformers_reads_it(moe_folder, tmp_path):
    family, path = moe_folder
    model = load_model(path)
    assert model.layers[str(sorted(int(k) for k in moe_layers(model))[0])].moe.experts.w1.shape == (
        8,
        32,
        64,
    )
    out = save_hf(model.state_dict(), model.args, tmp_path / "export", max_shard_bytes=200_000)
    original, exported = read_hf_state_dict(path), read_hf_state_dict(out)
    assert sorted(original) == sorted(exported)
    assert any(".mlp.experts.7.up_proj.weight" in n for n in exported)
    for name, t in original.items():
        assert exported[name].dtype == t.dtype and torch.equal(exported[name], t), name
    again = load_model(out)
    assert again.args == model.args
    for name, t in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], t), name
    x = _tokens(2, 24)
    with torch.no_grad():
        assert torch.equal(again(x), model(x))
        assert torch.equal(hf_reference(out)(x).logits, hf_reference(path)(x).logits)


def test_args_round_trip_and_errors():
    cfg = tiny_moe_config("qwen3_moe").to_dict()
    args = ModelArgs.from_hf(cfg)
    assert (args.num_experts, args.num_experts_per_tok, args.moe_intermediate_size) == (8, 2, 32)
    assert args.norm_topk_prob and args.mlp_only_layers == [1] and args.router_aux_loss_coef == 0.01
    assert ModelArgs.from_hf(args.to_hf()) == args
    q2 = ModelArgs.from_hf(tiny_moe_config("qwen2_moe").to_dict())
    assert q2.shared_expert_intermediate_size == 48 and q2.shared_expert_gated and q2.qkv_bias
    assert [q2.is_moe_layer(i) for i in range(3)] == [False, True, False]
    with pytest.raises(ValueError, match="no Hugging Face layout"):
        get_flavor("debug-dsv3-moe").to_hf()
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelArgs(
            model_type="qwen3_moe", num_experts=4, num_experts_per_tok=5, moe_intermediate_size=8
        )
    with pytest.raises(ValueError, match="dense"):
        ModelArgs(model_type="qwen3", num_experts=4)
    with pytest.raises(ValueError, match="shared expert"):
        ModelArgs(
            model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8
        )


def test_num_params_and_active_flops():
    args = get_flavor("debug-qwen3-moe")
    model = Transformer(args)
    assert args.num_params() == sum(p.numel() for p in model.parameters())
    d, i, e, k = (
        args.hidden_size,
        args.moe_intermediate_size,
        args.num_experts,
        args.num_experts_per_tok,
    )
    dense = args.replace(model_type="qwen3", num_experts=0, intermediate_size=k * i)
    # A token meets k experts and the router: the dense twin with k*I hidden units, plus D*E.
    per_layer_router = d * e
    assert (
        args.flops_per_token(64)
        == dense.flops_per_token(64) + 6 * args.num_layers * per_layer_router
    )


# ------------------------------------------------------------------ losses
def _hand_aux_loss(logits: torch.Tensor, k: int) -> torch.Tensor:
    """E * sum_e (top-k hits of e / T) * mean_t softmax(logits)[t, e], float64."""
    t, e = logits.shape
    p = torch.exp(logits.double() - logits.double().max(-1, keepdim=True).values)
    p = p / p.sum(-1, keepdim=True)
    hits = torch.zeros(e, dtype=torch.float64)
    for row in p:
        for j in torch.topk(row, k).indices.tolist():
            hits[j] += 1
    return e * sum(hits[j] / t * p[:, j].mean() for j in range(e))


def _hand_z_loss(logits: torch.Tensor) -> torch.Tensor:
    return torch.stack([torch.log(torch.exp(row.double()).sum()) ** 2 for row in logits]).mean()


def test_aux_and_z_loss_equal_the_formulas_and_transformers(moe_folder):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    family, path = moe_folder
    ref, ours = hf_reference(path), load_model(path)
    ours.args.router_z_loss_coef = 0.5
    x = _tokens(2, 32, seed=5)
    with torch.no_grad():
        out = ref(x, output_router_logits=True, labels=x)
    ours(x)
    layers = moe_layers(ours)
    for (key, moe), hf_logits in zip(layers.items(), out.router_logits, strict=True):
        assert moe.aux_loss.requires_grad and moe.z_loss.requires_grad
        hand = _hand_aux_loss(hf_logits, 2)
        assert abs(moe.aux_loss.item() - hand.item()) <= 1e-5, key
        assert (
            abs(moe.aux_loss.item() - load_balancing_loss_func((hf_logits,), 8, 2).item()) <= 1e-5
        )
        assert (
            abs(moe.z_loss.item() - _hand_z_loss(hf_logits).item())
            <= 1e-4 * _hand_z_loss(hf_logits).item()
        )
        assert moe.tokens_per_expert.sum().item() == 64 * 2
    if len(layers) == 1:  # transformers pools layers first; equal for one layer
        assert abs(list(layers.values())[0].aux_loss.item() - out.aux_loss.item()) <= 1e-5
    want = sum(
        0.01 * _hand_aux_loss(h, 2) + 0.5 * _hand_z_loss(h) for h in out.router_logits
    ) / len(layers)
    total = router_loss(ours)
    assert abs(total.item() - want.item()) <= 1e-5 * want.item()
    total.backward()  # the losses reach the routers (and nothing past them needs them)
    assert all(m.gate.weight.grad.abs().sum() > 0 for m in layers.values())


def test_router_losses_count_only_the_masked_in_tokens(moe_folder):
    """With `set_token_mask` (right padding: a row's first n tokens real), the aux loss equals
    transformers' ``load_balancing_loss_func`` given that attention mask, the z-loss the formula
    over the real tokens' logits, and the expert counts cover the real tokens only."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    _, path = moe_folder
    ref, ours = hf_reference(path), load_model(path)
    x = _tokens(2, 32, seed=7)
    mask = torch.zeros(2, 32, dtype=torch.bool)
    # pads after the real tokens: causal attention never sees them
    mask[0, :20], mask[1, :9] = True, True
    with torch.no_grad():
        out = ref(x, output_router_logits=True)
    set_token_mask(ours, mask)
    ours(x)
    set_token_mask(ours, None)
    for (key, moe), hf_logits in zip(moe_layers(ours).items(), out.router_logits, strict=True):
        want = load_balancing_loss_func((hf_logits,), 8, 2, attention_mask=mask.long())
        assert abs(moe.aux_loss.item() - want.item()) <= 1e-5, key
        unmasked = _hand_aux_loss(hf_logits, 2)
        assert abs(unmasked.item() - want.item()) > 1e-3, key  # the mask matters on this batch
        z = _hand_z_loss(hf_logits[mask.reshape(-1)])
        assert abs(moe.z_loss.item() - z.item()) <= 1e-4 * z.item(), key
        assert moe.tokens_per_expert.sum().item() == 29 * 2 and moe.token_mask is None


# ------------------------------------------------------------------ dispatch
def _naive_moe(
    block: MoE,
    x: torch.Tensor,
    scores_fn,
    bias: torch.Tensor | None,
    k: int,
    norm: bool,
    scale: float,
) -> torch.Tensor:
    """Per token, per chosen expert, in plain Python: route, run the expert, weight, add."""
    out = []
    for xt in x:  # [D]
        logits = block.gate.weight @ xt  # [E]
        scores = scores_fn(logits)
        choice = scores if bias is None else scores + bias
        ids = sorted(range(len(scores)), key=lambda j: -choice[j].item())[:k]
        w = torch.stack([scores[j] for j in ids])
        if norm:
            w = w / w.sum()
        y = torch.zeros_like(xt)
        for wj, j in zip(w * scale, ids, strict=True):
            ex = block.experts
            y = y + wj * (ex.w2[j] @ (F.silu(ex.w1[j] @ xt) * (ex.w3[j] @ xt)))
        if block.shared_experts is not None:
            s = block.shared_experts(xt)
            if block.shared_expert_gate is not None:
                s = torch.sigmoid(block.shared_expert_gate.weight @ xt) * s
            y = y + s
        out.append(y)
    return torch.stack(out)


def _block(flavor: str, seed: int = 0, **changes) -> MoE:
    torch.manual_seed(seed)
    block = MoE(get_flavor(flavor).replace(**changes))
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
    return block


@pytest.mark.parametrize("case", ["qwen3", "qwen2-shared", "k1-unnormalised"])
def test_dispatch_equals_a_per_token_loop(case):
    changes = {
        "qwen3": {},
        "qwen2-shared": dict(
            model_type="qwen2_moe",
            qk_norm=None,
            qkv_bias=None,
            norm_topk_prob=False,
            shared_expert_intermediate_size=24,
        ),
        "k1-unnormalised": dict(num_experts_per_tok=1, norm_topk_prob=False),
    }[case]
    block = _block("debug-qwen3-moe", **changes)
    k = block.top_k
    x = torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    got = block(x)
    want = _naive_moe(
        block, x.reshape(-1, 64), lambda z: torch.softmax(z, -1), None, k, block.norm_topk_prob, 1.0
    ).view(3, 7, 64)
    assert (got - want).abs().max().item() <= 1e-5
    assert block.last_routing.shape == (21, k)
    params = [x, *block.parameters()]
    g = torch.randn_like(got)
    grads = torch.autograd.grad(got, params, g)
    want_grads = torch.autograd.grad(want, params, g)
    for a, b in zip(grads, want_grads, strict=True):
        assert (a - b).abs().max().item() <= 1e-4


def test_sigmoid_router_picks_by_score_plus_bias_weights_by_score():
    """DeepSeek-V3 routing: the bias moves the choice, never the weights."""
    block = _block("debug-dsv3-moe", seed=2)
    assert block.expert_bias is not None and block.shared_experts is not None
    assert block.shared_expert_gate is None and block.route_scale == 2.5
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    block.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 5.0, 0.0, 0.0, -5.0, 0.0]))
    _, scores, ids, weights = block.route(x)
    with torch.no_grad():
        s = torch.sigmoid(x @ block.gate.weight.T)  # [T, E] by hand
    assert torch.allclose(scores, s, atol=1e-6)
    for t in range(16):
        chosen = ids[t].tolist()
        assert 3 in chosen and 6 not in chosen  # +5 always wins a slot, -5 never does
        other = max((j for j in range(8) if j not in (3, 6)), key=lambda j: s[t, j].item())
        assert sorted(chosen) == sorted([3, other])
        want = torch.stack([s[t, j] for j in chosen])
        assert torch.allclose(weights[t], 2.5 * want / want.sum(), atol=1e-6)
    # Expert 3 is not the unbiased favourite everywhere, so the bias changed choices.
    assert (s.argmax(-1) != 3).any()
    with torch.no_grad():
        got = block(x.view(2, 8, 64))
        want = _naive_moe(block, x, torch.sigmoid, block.expert_bias, 2, True, 2.5)
    assert (got.view(16, 64) - want).abs().max().item() <= 1e-5
    # The sigmoid aux loss uses scores normalised per token.
    p = s / s.sum(-1, keepdim=True)
    f = torch.zeros(8)
    for row in ids.tolist():
        for j in row:
            f[j] += 1 / 16
    assert abs(block.aux_loss.item() - 8 * (f * p.mean(0)).sum().item()) <= 1e-5


def test_from_scratch_init_and_meta_materialisation():
    args = get_flavor("debug-dsv3-moe")
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    moe = model.layers["1"].moe
    assert torch.equal(moe.expert_bias, torch.zeros(8))
    assert abs(moe.experts.w2.std().item() - 0.02) < 0.002
    assert "layers.1.moe.expert_bias" in model.state_dict()
    other = Transformer(args)
    other.init_weights(seed=0)
    for name, t in model.state_dict().items():
        assert torch.equal(other.state_dict()[name], t), name
    logits = model(_tokens(1, 9))
    assert torch.isfinite(logits).all() and math.isfinite(router_loss(model).item())
