"""Qwen3.5 (gated DeltaNet beside gated full attention) against transformers' Qwen3.5.

A tiny random folder written by transformers' ``Qwen3_5ForCausalLM`` (fp32; four layers:
three gated DeltaNet, 2 key / 4 value heads, a 4-tap convolution, then one gated full-attention
layer with RoPE on a quarter of each head; every norm, ``A_log`` and ``dt_bias`` random) loads
with logits and gradients within 1e-4 of transformers, packed rows equal each sequence alone,
the folder exports bit for bit, and the in-house generator (paged K/V for the full layer, a
per-sequence recurrent state for the others) gives transformers' greedy tokens and the
log-probs of the model's full forward re-run at every step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tandem.models import (
    DocumentAttention,
    SegmentAttention,
    get_flavor,
    load_model,
    tandem_to_hf,
)
from tandem.models.args import ModelArgs
from tandem.models.linear_attention import GatedDeltaNet
from tests.fixtures import TINY_VOCAB, hf_reference
from tests.models.family_checks import (
    assert_export_bit_exact,
    tokens,
    write_random_folder,
)

TOL = 1e-4


def tiny_config(**overrides):
    from transformers import Qwen3_5TextConfig

    kw = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=8,
        linear_value_head_dim=12,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        max_position_embeddings=256,
        eos_token_id=[355],
        pad_token_id=0,
    )
    return Qwen3_5TextConfig(**{**kw, **overrides})


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_random_folder(tmp_path_factory.mktemp("qwen3_5"), tiny_config(), seed=3)


# ------------------------------------------------------------------ transformers parity
@torch.no_grad()
def test_logits_match_transformers(folder):
    ref, ours = hf_reference(folder), load_model(folder)
    a = ours.args
    assert a.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert a.rope_dim == 4 and a.linear.conv_dim == 2 * 16 + 48
    assert isinstance(ours.layers["0"].attention, GatedDeltaNet)
    x = tokens(2, 24)
    want = ref(x).logits
    assert (ours(x) - want).abs().max().item() <= TOL
    # the output gate and the convolution matter: without them the logits differ
    other = load_model(folder)
    other.layers["3"].attention.gated = False
    other.layers["3"].attention.wq.weight.data = other.layers["3"].attention.wq.weight[:64]
    assert (other(x) - want).abs().max().item() > 1e-3
    other = load_model(folder)
    other.layers["0"].attention.conv1d.weight.data[..., :3] = 0
    assert (other(x) - want).abs().max().item() > 1e-3


@torch.no_grad()
def test_packed_rows_equal_separate_sequences(folder):
    """Two documents in one row (the recurrence restarts at the second), and a prompt shared
    by two branches (each branch continues the prompt's state), equal to transformers on each
    sequence alone."""
    ref, ours = hf_reference(folder), load_model(folder)
    a, b = tokens(1, 9, seed=1)[0], tokens(1, 13, seed=2)[0]
    row = torch.cat([a, b])[None]
    pos = torch.cat([torch.arange(9), torch.arange(13)])[None]
    doc = torch.tensor([[0] * 9 + [1] * 13])
    got = ours(row, positions=pos, attn=DocumentAttention(doc))[0]
    assert (got[:9] - ref(a[None]).logits[0]).abs().max() <= TOL
    assert (got[9:] - ref(b[None]).logits[0]).abs().max() <= TOL
    p, c1, c2 = tokens(1, 6, seed=3)[0], tokens(1, 5, seed=4)[0], tokens(1, 7, seed=5)[0]
    row = torch.cat([p, c1, c2])[None]
    pos = torch.cat([torch.arange(6), 6 + torch.arange(5), 6 + torch.arange(7)])[None]
    branch = torch.tensor([[0] * 6 + [1] * 5 + [2] * 7])
    want1 = ref(torch.cat([p, c1])[None]).logits[0]
    want2 = ref(torch.cat([p, c2])[None]).logits[0]
    gather = torch.tensor([list(range(11)) + [10, 10], list(range(6)) + list(range(11, 18))])
    scatter = torch.tensor(list(range(11)) + [13 + 6 + i for i in range(7)])
    for attn in (
        DocumentAttention(torch.zeros_like(branch), branch),
        SegmentAttention(gather, scatter),
    ):
        got = ours(row, positions=pos, attn=attn)[0]
        assert (got[:11] - want1).abs().max() <= TOL, type(attn).__name__
        assert (got[11:] - want2[6:]).abs().max() <= TOL, type(attn).__name__


def test_gradients_match_transformers(folder):
    """The same loss through both models: every parameter's gradient (the convolution,
    ``A_log``, ``dt_bias``, the gated norms, the gated query) equals transformers'."""
    ref, ours = hf_reference(folder), load_model(folder)
    x, y = tokens(2, 12, seed=6), tokens(2, 12, seed=7)

    def loss(logits):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, TINY_VOCAB), y.reshape(-1))

    loss(ref(x).logits).backward()
    loss(ours(x)).backward()
    grads = tandem_to_hf({n: p.grad for n, p in ours.named_parameters()}, ours.args)
    hf = dict(ref.named_parameters())
    assert sorted(grads) == sorted(hf)
    for name, g in grads.items():
        assert (g - hf[name].grad).abs().max() <= TOL, name
    assert grads["model.layers.0.linear_attn.A_log"].abs().sum() > 0


def test_export_bit_exact_and_transformers_reads_it(folder, tmp_path):
    cfg = assert_export_bit_exact(folder, tmp_path / "export", TOL)
    assert cfg["model_type"] == "qwen3_5_text" and cfg["linear_num_value_heads"] == 4
    assert cfg["rope_parameters"]["partial_rotary_factor"] == 0.25


def test_flavors_count_transformers_parameters():
    """debug-qwen3.5 and qwen3.5-9b (8.95 B) count what transformers' model of the same
    config.json holds; the config round-trips; a from-scratch model runs."""
    from transformers import AutoConfig, AutoModelForCausalLM

    for name in ("debug-qwen3.5", "qwen3.5-9b"):
        args = get_flavor(name)
        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**args.to_hf()))
        assert sum(p.numel() for p in hf.parameters()) == args.num_params(), name
        assert ModelArgs.from_hf(args.to_hf()) == args
    from tandem.models import Transformer

    model = Transformer(get_flavor("debug-qwen3.5"))
    model.init_weights(seed=0)
    assert model(tokens(1, 5)).isfinite().all()


def test_refuses_foreign_switches(folder):
    cfg = json.loads((folder / "config.json").read_text())
    with pytest.raises(ValueError, match="attention_bias=True"):
        ModelArgs.from_hf({**cfg, "attention_bias": True})
    with pytest.raises(ValueError, match="no linear-attention layers"):
        get_flavor("debug-qwen3").replace(layer_types=["linear_attention"] * 2)
    with pytest.raises(ValueError, match="cannot run linear-attention layers"):
        load_model(folder)(tokens(1, 4), attn=lambda *a, **k: None)
