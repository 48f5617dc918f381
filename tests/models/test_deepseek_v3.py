"""DeepSeek-V3 (multi-head latent attention, grouped sigmoid routing) against transformers.

A tiny random folder written by transformers' ``DeepseekV3ForCausalLM`` (fp32; low-rank q and
kv, 8 rotary of 24 key dims, values of 12, interleaved RoPE pairs, YaRN with DeepSeek's
``mscale_all_dim``; a dense first layer, then 8 experts in 4 groups, 2 groups and 2 experts
per token, a shared expert, a random correction bias) loads with logits and gradients within
1e-4 of transformers and the same experts per token, exports bit for bit, and the in-house
generator (decompressed K/V in the paged pool) gives transformers' greedy tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tandem.models import get_flavor, load_model, read_hf_state_dict, tandem_to_hf
from tandem.models.args import ModelArgs
from tandem.models.mla import MLAttention
from tests.fixtures import TINY_VOCAB, hf_reference
from tests.models.family_checks import (
    assert_export_bit_exact,
    assert_greedy_equals_generate,
    exact_quickstart_unchanged,
    tokens,
    write_random_folder,
)

TOL = 1e-4


def tiny_config(**overrides):
    from transformers import DeepseekV3Config

    kw = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        routed_scaling_factor=2.5,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        v_head_dim=12,
        qk_nope_head_dim=16,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        max_position_embeddings=256,
        rope_interleave=True,
        num_mtp_layers=0,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        eos_token_id=[355],
        bos_token_id=None,
        pad_token_id=0,
    )
    return DeepseekV3Config(**{**kw, **overrides})


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_random_folder(tmp_path_factory.mktemp("deepseek_v3"), tiny_config(), seed=5)


@torch.no_grad()
def test_logits_and_routing_match_transformers(folder):
    ref, ours = hf_reference(folder), load_model(folder)
    a = ours.args
    assert a.is_mla and a.head_dim == 24 and a.mlp_only_layers == [0] and a.moe_n_group == 4
    assert isinstance(ours.layers["0"].attention, MLAttention)
    assert not hasattr(ours.layers["0"], "moe") and hasattr(ours.layers["1"], "moe")
    assert ours.layers["1"].moe.expert_bias.abs().sum() > 0  # the random correction bias
    chosen = {}  # transformers' router: (logits, weights, indices) per MoE layer
    hooks = [
        ref.model.layers[i].mlp.gate.register_forward_hook(
            lambda m, i_, out, i=i: chosen.__setitem__(i, out[2])
        )
        for i in (1, 2)
    ]
    x = tokens(2, 24)
    want = ref(x).logits
    for h in hooks:
        h.remove()
    assert (ours(x) - want).abs().max().item() <= TOL
    for i in (1, 2):
        got = ours.layers[str(i)].moe.last_routing.sort(-1).values
        assert torch.equal(got, chosen[i].sort(-1).values), i
    # the group limit and the interleaved RoPE matter: without them the logits differ
    for switch in ("group", "interleave"):
        other = load_model(folder)
        for block in other.layers.values():
            if switch == "group" and hasattr(block, "moe"):
                block.moe.n_group = 1
            if switch == "interleave":
                block.attention.interleave = False
        assert (other(x) - want).abs().max().item() > 1e-4, switch


@torch.no_grad()
def test_full_q_projection_and_plain_rope_variant(tmp_path):
    """q_lora_rank null (one q projection), RoPE halves instead of pairs, no expert groups,
    default RoPE: logits within 1e-4 of transformers too."""
    cfg = tiny_config(
        q_lora_rank=None,
        rope_interleave=False,
        n_group=1,
        topk_group=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    path = write_random_folder(tmp_path, cfg, seed=2)
    ref, ours = hf_reference(path), load_model(path)
    assert ours.layers["0"].attention.wq is not None and not ours.args.rope_interleave
    x = tokens(2, 20)
    assert (ref(x).logits - ours(x)).abs().max().item() <= TOL


def test_gradients_match_transformers(folder):
    ref, ours = hf_reference(folder), load_model(folder)
    x, y = tokens(2, 12, seed=6), tokens(2, 12, seed=7)

    def loss(logits):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, TINY_VOCAB), y.reshape(-1))

    loss(ref(x).logits).backward()
    loss(ours(x)).backward()
    named = {n: p.grad for n, p in ours.named_parameters() if ".moe.experts." not in n}
    named.update({n: torch.zeros_like(b) for n, b in ours.named_buffers() if "expert_bias" in n})
    grads = tandem_to_hf(named, ours.args)
    for i in (1, 2):  # transformers 5 holds each layer's experts fused in memory
        e = ours.layers[str(i)].moe.experts
        grads[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.cat([e.w1.grad, e.w3.grad], 1)
        grads[f"model.layers.{i}.mlp.experts.down_proj"] = e.w2.grad
    hf = dict(ref.named_parameters())
    assert sorted(hf) == sorted(n for n in grads if "e_score_correction_bias" not in n)
    for name, p in hf.items():
        assert (grads[name] - p.grad).abs().max() <= TOL, name
    assert grads["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"].abs().sum() > 0


def test_export_bit_exact_and_transformers_reads_it(folder, tmp_path):
    cfg = assert_export_bit_exact(folder, tmp_path / "export", TOL)
    assert cfg["first_k_dense_replace"] == 1 and cfg["n_group"] == 4


def test_multi_token_prediction_layers_are_skipped(folder, tmp_path):
    """A checkpoint's MTP layer (index num_hidden_layers) loads as if absent."""
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "with_mtp"
    copy.mkdir()
    for f in folder.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    sd = load_file(str(copy / "model.safetensors"))
    sd["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(sd, str(copy / "model.safetensors"), metadata={"format": "pt"})
    x = tokens(1, 10, seed=9)
    with torch.no_grad():
        assert torch.equal(load_model(copy)(x), load_model(folder)(x))


def test_generator_greedy_equals_transformers_generate(folder):
    """MLA's decompressed K/V through the paged pool, the decode mirror and chunked prefill."""
    assert_greedy_equals_generate(folder, [[5, 9, 2], [7], list(range(10, 29)), [3] * 9])


@pytest.mark.slow  # a train.py subprocess under rl.exact
def test_quickstart_rl_steps_train_deepseek_tensors_with_gap_zero(folder, tmp_path):
    """Two GRPO steps with rl.exact: every sampled token's rollout log-prob equals the update's
    recomputation bitwise (gap 0), routing agrees, and every attention, norm, router and
    shared-expert tensor moved (routed experts move when chosen; the correction bias is a
    buffer no gradient step changes)."""
    still = exact_quickstart_unchanged(folder, tmp_path)
    assert all(".mlp.experts." in n or "e_score_correction_bias" in n for n in still), still
    experts = sum(".mlp.experts." in n for n in read_hf_state_dict(folder))
    assert sum(".mlp.experts." in n for n in still) < experts / 2


def test_flavors_count_transformers_parameters():
    """deepseek-v3's parameter count (671.03 B without its MTP layer) equals transformers'
    model of the same config.json, built on the meta device; the config round-trips."""
    from transformers import AutoConfig, AutoModelForCausalLM

    for name in ("debug-deepseek-v3", "deepseek-v3"):
        args = get_flavor(name)
        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**args.to_hf()))
        assert sum(p.numel() for p in hf.parameters()) == args.num_params(), name
        assert ModelArgs.from_hf(args.to_hf()) == args


def test_refuses_what_it_does_not_implement(folder):
    cfg = json.loads((folder / "config.json").read_text())
    with pytest.raises(ValueError, match="topk_method 'greedy'"):
        ModelArgs.from_hf({**cfg, "topk_method": "greedy"})
    with pytest.raises(ValueError, match="quantized with 'fp8'"):
        ModelArgs.from_hf({**cfg, "quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(ValueError, match="n_group 3 must divide"):
        get_flavor("debug-deepseek-v3").replace(moe_n_group=3)
